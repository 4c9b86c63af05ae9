"""Tests' access to the default `Tuner`: the suite's is deterministic (conftest sets
SSD_JAX_DETERMINISTIC_AUTO=1 before it is made); a test that measures installs a tuner of its own
as the default for its duration."""

from __future__ import annotations

from ssd_jax.tuning import tuner as tuner_module
from ssd_jax.tuning.tuner import Tuner


def use_tuner(monkeypatch, tuner: Tuner) -> Tuner:
    """Makes `tuner` the default tuner (`ssd_jax.default_tuner()`) until the test ends; returns it."""
    monkeypatch.setattr(tuner_module, "_default", tuner)
    return tuner


def measuring(monkeypatch) -> Tuner:
    """A new measuring Tuner as the default for the test (what unsetting SSD_JAX_DETERMINISTIC_AUTO did)."""
    return use_tuner(monkeypatch, Tuner())


def deterministic(monkeypatch) -> Tuner:
    """A new deterministic Tuner as the default for the test (what SSD_JAX_DETERMINISTIC_AUTO=1 did)."""
    return use_tuner(monkeypatch, Tuner(deterministic=True))
