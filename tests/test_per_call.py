"""draft_len="auto" chosen per call among fixed programs (`ssd_jax.engine.per_call`, the GPU policy
at one row): exact (each call runs a fixed program or AR's), the choice from the remembered
acceptance and the programs' measured prices, probes while AR's program wins."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.engine import adaptive, per_call
from ssd_jax.engine.adaptive import StepCosts
from spec_models import pair

PROMPTS = [[5, 9, 3, 7, 2, 11, 4]]
COSTS = StepCosts(target_fixed=1.0, target_per_token=0.05, draft=0.1)
KEY = ("program",)


@pytest.fixture(autouse=True)
def fresh_memories():
    """No remembered acceptance, prices or probe counts from other tests."""
    adaptive.ACCEPTANCE.clear()
    per_call.forget()
    yield
    adaptive.ACCEPTANCE.clear()
    per_call.forget()


@pytest.fixture
def per_call_policy(monkeypatch):
    """This backend's policy with per-call choice below 2 rows (the GPU's)."""
    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here,
                        dataclasses.replace(backend.POLICIES[here], adaptive_per_call_below_rows=2))


@pytest.fixture(scope="module")
def models():
    return pair(noise=0.3)


def test_per_call_auto_is_exact_and_remembers_what_it_ran(models, per_call_policy, monkeypatch):
    """Greedy: every call gives AR's tokens and runs one fixed program (its stats say which);
    with timings allowed its acceptance and seconds are remembered. Sampled: the tokens of the
    fixed program of the chosen length with the same key (whose law the fixed-length tests
    check). Two rows keep the adaptive loop."""
    monkeypatch.delenv("SSD_JAX_DETERMINISTIC_AUTO", raising=False)
    # This pair's draft is the target's size, so its measured costs would rightly choose AR's
    # program every call: priced with a draft a tenth of the target, the calls speculate.
    monkeypatch.setattr(adaptive, "measure_costs", lambda *args, **kwargs: dataclasses.replace(COSTS))
    target, draft = models
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method="ar")
    method = ssd_jax.SD(draft_len="auto", max_draft_len=4)
    lengths = []
    for _ in range(3):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=method, draft=draft)
        assert out.tokens == reference.tokens
        assert out.stats["per_call"] and out.stats["adaptive"] and out.stats["method"] == "sd"
        length = out.stats["planned_draft_len"]
        lengths.append(length)
        assert 0 <= length <= 4
        if length:
            assert out.stats["mean_draft_len"] == length and out.stats["observed_acceptance"] is not None
        else:
            assert out.stats["plain_from_start"] and out.stats["ar_fallback_share"] == 1.0
    assert lengths[0] > 0   # the prior acceptance at these prices speculates
    memory_key = adaptive.acceptance_key(target, draft, method, ssd_jax.SamplingParams())
    assert adaptive.ACCEPTANCE.known(memory_key) is not None
    assert any(key[1] == length for key in per_call._PRICES._values)

    key = jax.random.PRNGKey(7)
    sampled = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=method, draft=draft, temperature=1.0,
                               key=key)
    length = sampled.stats["planned_draft_len"]
    fixed = ssd_jax.SD(draft_len=length) if length else ssd_jax.AR()
    again = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=fixed, draft=draft if length else None,
                             temperature=1.0, key=key)
    assert sampled.tokens == again.tokens

    monkeypatch.setenv("SSD_JAX_DETERMINISTIC_AUTO", "1")   # no calibration of the loop's program
    two_rows = ssd_jax.generate(target, PROMPTS * 2, max_new_tokens=24, method=method, draft=draft)
    assert "per_call" not in two_rows.stats and two_rows.tokens == reference.tokens * 2


def test_bv_runs_per_call_too_and_other_methods_keep_the_loop(models, per_call_policy):
    target, draft = models
    bv = ssd_jax.generate(target, PROMPTS, max_new_tokens=16, method=ssd_jax.BV(draft_len="auto"), draft=draft)
    assert bv.stats["per_call"] and bv.stats["method"] == "bv"
    pld = ssd_jax.generate(target, PROMPTS, max_new_tokens=16, method=ssd_jax.PLD(draft_len="auto"))
    assert "per_call" not in pld.stats
    fixed = ssd_jax.generate(target, PROMPTS, max_new_tokens=16, method=ssd_jax.SD(draft_len=3), draft=draft)
    assert "per_call" not in fixed.stats


def test_choice_follows_the_acceptance_and_the_measured_prices(monkeypatch):
    """High acceptance: a long draft; none: AR's program. A length whose program measured slower
    than the model prices it carries its surplus to the lengths nearest it (AR's program too,
    until measured), which favours longer drafts; AR's program measured cheap wins."""
    monkeypatch.delenv("SSD_JAX_DETERMINISTIC_AUTO", raising=False)
    long = per_call.choose(KEY, COSTS, 0.95, 8)
    short = per_call.choose(KEY, COSTS, 0.6, 8)
    assert long > short >= 1
    assert per_call.choose(KEY, COSTS, 0.0, 8) == 0
    per_call.forget()
    # length `short` measured at twice the model's step: its neighbours carry the same surplus
    surplus = per_call.model_seconds(COSTS, short)
    per_call.record(KEY, short, seconds=2 * surplus * 10, target_calls=10)
    price = per_call.prices(KEY, COSTS, 8)
    assert price[short] == pytest.approx(2 * surplus)
    assert price[short + 1] == pytest.approx(per_call.model_seconds(COSTS, short + 1) + surplus)
    assert price[0] == pytest.approx(COSTS.target(1) + surplus)   # not measured: the nearest's surplus
    assert per_call.choose(KEY, COSTS, 0.6, 8) > short          # a fixed surplus favours longer drafts
    per_call.record(KEY, 0, seconds=0.5 * COSTS.target(1) * 10, target_calls=10)   # AR measured cheap
    assert per_call.predicted_speedups(KEY, COSTS, 0.6, 8)[short] < 1.0 and per_call.choose(KEY, COSTS, 0.6, 8) == 0


def test_ar_wins_but_every_probe_every_th_call_speculates(monkeypatch):
    monkeypatch.delenv("SSD_JAX_DETERMINISTIC_AUTO", raising=False)
    choices = [per_call.choose(KEY, COSTS, 0.0, 8) for _ in range(2 * per_call.PROBE_EVERY)]
    probes = [i for i, length in enumerate(choices) if length]
    assert probes == [per_call.PROBE_EVERY - 1, 2 * per_call.PROBE_EVERY - 1] and choices[probes[0]] == 1
    assert per_call.choose(KEY, COSTS, 0.9, 8) > 1      # a gain again: speculation, and the count restarts
    assert per_call.choose(KEY, COSTS, 0.0, 8) == 0


def test_deterministic_auto_neither_measures_nor_probes():
    """Under SSD_JAX_DETERMINISTIC_AUTO=1 (the suite's default) a call does not depend on the ones
    before: no price is recorded and no probe runs."""
    per_call.record(KEY, 2, seconds=5.0, target_calls=10)
    assert per_call.prices(KEY, COSTS, 4)[2] == pytest.approx(per_call.model_seconds(COSTS, 2))
    assert all(per_call.choose(KEY, COSTS, 0.0, 4) == 0 for _ in range(2 * per_call.PROBE_EVERY))
