"""Size-aware shapes under draft_len="auto" (`ssd_jax.tuning.auto_shape`): LogitSpec's node budget
from measured wide forwards, the multi-path methods' path count from the cost model; exactness
with the chosen shapes; the fields' bad input."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.tuning import auto_shape, cost_model, measure
from ssd_jax.errors import InputError
from ssd_jax.sampling import SamplingParams
from spec_models import pair
from tuning_helpers import measuring


@pytest.fixture(scope="module")
def models():
    return pair(vocab=64, seed=0, noise=0.3)


@pytest.fixture
def timed(monkeypatch):
    """Timings allowed (the suite's default tuner is deterministic) and nothing remembered: a fresh
    measuring tuner, the default for the test (returned)."""
    return measuring(monkeypatch)


def _fake_forwards(monkeypatch, seconds_by_width: dict, rows_factor: float = 1.0):
    """forward_seconds answering from a table (width -> seconds, a width not listed costs as one
    token; batch b costs rows_factor^(b-1) more)."""
    def fake(tuner, model, batch, width, context, measure=True):
        return seconds_by_width.get(width, seconds_by_width[1]) * rows_factor ** (batch - 1)

    monkeypatch.setattr(measure, "forward_seconds", fake)


@pytest.mark.parametrize("widths, expected", [
    ({1: 1.0, 8: 1.02, 16: 1.05, 32: 1.09, 64: 1.5}, 32),
    ({1: 1.0, 8: 1.02, 16: 1.2, 32: 1.09, 64: 1.05}, 8),   # stops at the first size past the tolerance
    ({1: 1.0, 8: 1.3, 16: 1.6, 32: 2.2, 64: 3.4}, 8),      # nothing within: the smallest
    ({1: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}, 64),
])
def test_tree_size_is_the_largest_within_the_tolerance(monkeypatch, models, widths, expected):
    _fake_forwards(monkeypatch, widths)
    assert auto_shape.tree_size_for(ssd_jax.default_tuner(), models[0], 1, 64, largest=64) == expected


def test_tree_size_is_capped_by_the_backend_policy(monkeypatch, models):
    """Forwards free at every width: the policy's size (its measured best, the tree's building
    and verification growing with its nodes), or largest's."""
    _fake_forwards(monkeypatch, {1: 1.0})
    tuner = ssd_jax.default_tuner()
    assert auto_shape.tree_size_for(tuner, models[0], 1, 64) == backend.policy_for(models[0].params).logitspec_tree_size
    assert auto_shape.tree_size_for(tuner, models[0], 1, 64, largest=16) == 16
    assert auto_shape.tree_size_for(tuner, models[0], 1, 64, largest=12) == 8


def test_tree_size_is_left_to_the_policy_without_timings(models):
    """The suite's SSD_JAX_DETERMINISTIC_AUTO=1: nothing measured, the backend policy's size."""
    target, _ = models
    tuner = ssd_jax.default_tuner()
    assert auto_shape.tree_size_for(tuner, target, 1, 64) is None
    method = auto_shape.shaped(tuner, ssd_jax.LogitSpec(), target, None, SamplingParams(), 1, 64)
    assert method.tree_size is None
    assert ssd_jax.methods.for_target(method, target).tree_size == 8   # the CPU policy's


def test_a_cheap_wide_forward_gets_a_big_exact_tree(monkeypatch, timed, models):
    """A backend whose policy allows 64 nodes (a TPU's) and a forward as cheap at 64 tokens as
    at one: 64 nodes, the AR tokens."""
    target, _ = models
    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here, dataclasses.replace(backend.POLICIES[here], logitspec_tree_size=64))
    _fake_forwards(monkeypatch, {1: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0})
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [9, 10]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=32)
    out = ssd_jax.generate(target, prompts, max_new_tokens=32, method=ssd_jax.LogitSpec())
    assert out.tokens == ar.tokens
    assert out.stats["tree_nodes"] == 64
    fixed = ssd_jax.generate(target, prompts, max_new_tokens=32, method=ssd_jax.LogitSpec(tree_size=16))
    assert fixed.stats["tree_nodes"] == 16   # a given size is kept


def test_real_measurement_picks_a_listed_size(monkeypatch, timed, models):
    target, _ = models
    size = auto_shape.tree_size_for(timed, target, 1, 64)
    assert size in auto_shape.TREE_SIZES
    assert measure.forward_seconds(timed, target, 1, 1, 64, measure=False) is not None   # remembered
    # What tree_size_for(..., measure=False) was: from the remembered forwards alone.
    monkeypatch.setattr(measure, "forward_seconds", functools.partial(measure.forward_seconds, measure=False))
    assert auto_shape.tree_size_for(timed, target, 1, 64) == size


def _costs(per_token: float, draft: float = 0.05):
    return cost_model.StepCosts(target_fixed=1.0, target_per_token=per_token, draft=draft)


@pytest.mark.parametrize("per_token, expected", [(0.0, 4), (0.3, 1)])
def test_paths_follow_the_cost_of_wide_verification(monkeypatch, timed, models, per_token, expected):
    """Free width: the most paths (their acceptance only grows); dear width: one path."""
    target, draft = models
    monkeypatch.setattr(measure, "measure_costs", lambda *a, **k: _costs(per_token))
    _fake_forwards(monkeypatch, {1: 0.05})
    sampling = SamplingParams(temperature=1.0)
    assert auto_shape.choose_paths(timed, ssd_jax.GBV(), target, draft, sampling, 1, 64) == expected


def test_greedy_needs_one_path(models):
    target, draft = models
    tuner = ssd_jax.default_tuner()
    assert auto_shape.choose_paths(tuner, ssd_jax.SpecTr(), target, draft, SamplingParams(), 1, 64) == 1


def test_remembered_acceptance_of_more_paths_overrides_the_prior(monkeypatch, timed, models):
    """A call with K paths that accepted no better than one path's makes the next call use one."""
    target, draft = models
    monkeypatch.setattr(measure, "measure_costs", lambda *a, **k: _costs(0.0))
    _fake_forwards(monkeypatch, {1: 0.05})
    sampling = SamplingParams(temperature=1.0)
    method = ssd_jax.GBV()
    assert auto_shape.choose_paths(timed, method, target, draft, sampling, 1, 64) == 4
    for k in auto_shape.PATH_CHOICES:
        key = cost_model.acceptance_key(target, draft, ssd_jax.GBV(paths=k), sampling)
        timed.remember_acceptance(key, 0.6)
    assert auto_shape.choose_paths(timed, method, target, draft, sampling, 1, 64) == 1


def test_path_acceptance_prior_and_memory():
    assert auto_shape.path_acceptance({}, 1) == cost_model.PRIOR_ACCEPTANCE
    two = auto_shape.path_acceptance({1: 0.74}, 2)
    assert 0.74 < two < 1 - 0.26 ** 2   # more than one path's, far less than independent guesses'
    assert abs(two - 0.79) < 0.01       # the fit to the embedded pair (module docstring)
    assert auto_shape.path_acceptance({1: 0.74, 2: 0.5}, 2) == 0.5


@pytest.mark.parametrize("method", [pytest.param(ssd_jax.GBV(), marks=pytest.mark.slow), ssd_jax.SpecInfer(max_draft_len=4),
                                    ssd_jax.SpecTr(max_draft_len=4)],
                         ids=["gbv", "specinfer", "spectr"])
def test_chosen_paths_keep_greedy_output(monkeypatch, timed, models, method):
    target, draft = models
    monkeypatch.setattr(measure, "measure_costs", lambda *a, **k: _costs(0.0))
    _fake_forwards(monkeypatch, {1: 0.05})
    prompts = [[3, 4, 5, 6], [9]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=24)
    out = ssd_jax.generate(target, prompts, max_new_tokens=24, method=method, draft=draft)
    assert out.tokens == ar.tokens and out.stats["num_paths"] == 1
    sampled = ssd_jax.generate(target, prompts, max_new_tokens=24, method=method, draft=draft, temperature=1.0)
    assert sampled.stats["num_paths"] == 4


def test_fixed_length_keeps_two_paths_and_given_paths_stay(models):
    target, draft = models
    out = ssd_jax.generate(target, [[3, 4]], max_new_tokens=8, method=ssd_jax.GBV(draft_len=3), draft=draft,
                           temperature=1.0)
    assert out.stats["num_paths"] == ssd_jax.methods.FIXED_PATHS == 2
    out = ssd_jax.generate(target, [[3, 4]], max_new_tokens=8, method=ssd_jax.GBV(paths=3), draft=draft)
    assert out.stats["num_paths"] == 3


@pytest.mark.parametrize("value", [0, -1, "auto", 2.5])
def test_bad_paths_name_the_field_and_value(value):
    with pytest.raises(InputError, match=rf"paths .*{value!r}" if isinstance(value, str) else rf"paths .*{value}"):
        ssd_jax.GBV(paths=value)
