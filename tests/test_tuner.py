"""`ssd_jax.Tuner`: one object owns everything "auto" learns or measures; deterministic tuners
give the same tokens; tuners never share a memory; `reset` forgets; bad arguments are refused."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import ssd_jax
from ssd_jax.errors import InputError
from ssd_jax.tuning import cost_model
from ssd_jax.tuning.tuner import Tuner, default_tuner
from spec_models import pair

PROMPTS = [[3, 4, 5, 3, 4], [9, 2], [7]]


@pytest.fixture(scope="module")
def models():
    return pair(vocab=64, seed=0, noise=0.3, layers=1)


def _memories(tuner: Tuner) -> dict:
    """How many entries each of the tuner's memories holds."""
    per_call = tuner.per_call
    return dict(acceptance=len(tuner.acceptance._means.means()), step_costs=len(tuner.step_costs),
                forward_seconds=len(tuner.forward_seconds), calibrations=len(tuner.calibrations),
                ar_ratios=len(tuner.ar_ratios), prices=len(per_call._prices.means()),
                ssd_ratios=len(tuner.ssd.ratios.means()), verdicts=len(tuner.loop_verdicts._values))


def test_two_deterministic_tuners_give_the_same_sampled_tokens(models):
    target, draft = models
    key = jax.random.PRNGKey(7)
    first, second = Tuner(deterministic=True), Tuner(deterministic=True)
    outs = [ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=ssd_jax.SD(), draft=draft, temperature=1.0,
                             key=key, tuner=tuner) for tuner in (first, second, first)]
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens
    assert outs[0].plan == outs[1].plan
    assert all(count == 0 for count in _memories(first).values())   # measured and remembered nothing
    np.testing.assert_allclose(outs[0].plan.costs[:3], cost_model.UNMEASURED.loop_array(outs[0].plan.loop.draft_len + 1),
                               rtol=1e-6)


def test_a_new_tuner_sees_no_other_tuner_s_memories_and_reset_forgets(models):
    target, draft = models
    key = jax.random.PRNGKey(1)
    learned = Tuner(store=None)
    ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=ssd_jax.SD(), draft=draft, temperature=1.0, key=key,
                     tuner=learned)
    memory_key = ("a pair", "sd", 1, False)   # the call's own acceptance is remembered only if it drafted
    learned.remember_acceptance(memory_key, 0.9)
    kept = _memories(learned)
    assert kept["acceptance"] >= 1 and kept["calibrations"] == 1 and kept["forward_seconds"] >= 2
    assert learned.known_acceptance(memory_key) == pytest.approx(0.9)
    fresh = Tuner(store=None)
    assert fresh.known_acceptance(memory_key) is None
    assert all(count == 0 for count in _memories(fresh).values())
    assert fresh.acceptance is not learned.acceptance and fresh.per_call is not learned.per_call
    assert fresh.ssd is not learned.ssd and fresh.loop_verdicts is not learned.loop_verdicts
    learned.reset()
    assert learned.known_acceptance(memory_key) is None
    assert all(count == 0 for count in _memories(learned).values())


def test_the_default_tuner_is_one_object_and_the_suite_s_is_deterministic():
    assert default_tuner() is default_tuner() is ssd_jax.default_tuner()
    assert default_tuner().deterministic and not default_tuner().measures
    assert not Tuner().deterministic and Tuner(deterministic=True).deterministic


def test_a_store_is_where_measurements_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_JAX_CALIBRATION_DIR", str(tmp_path / "from-env"))
    assert Tuner().store_dir() == str(tmp_path / "from-env")
    assert Tuner(store=tmp_path / "mine").store_dir() == str(tmp_path / "mine")
    assert Tuner(store=None).store_dir() is None


@pytest.mark.parametrize("options, message", [
    (dict(deterministic="yes"), "deterministic=...\\) must be True or False, got 'yes'"),
    (dict(deterministic=1), "must be True or False, got 1"),
    (dict(store=5), "store=...\\) must be a directory path or None, got int"),
])
def test_bad_tuner_arguments(options, message):
    with pytest.raises(InputError, match=message):
        Tuner(**options)


def test_a_tuner_is_not_a_method_nor_a_method_a_tuner(models):
    target, draft = models
    with pytest.raises(InputError, match="got a Tuner; pass it as tuner="):
        ssd_jax.generate(target, PROMPTS, max_new_tokens=4, method=Tuner())
    with pytest.raises(InputError, match="tuner must be an ssd_jax.Tuner or None, got SD"):
        ssd_jax.generate(target, PROMPTS, max_new_tokens=4, tuner=ssd_jax.SD())
    assert dataclasses.is_dataclass(ssd_jax.SD()) and not dataclasses.is_dataclass(Tuner())

