"""Adaptive speculation (draft_len="auto"): exactness of early-stopped drafts and of the loop that
falls back to plain decoding, the stopping rule, the cost model, bad input."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import ssd_jax
from ssd_jax.tuning import cost_model, memory
from ssd_jax.tuning import measure
from ssd_jax.tuning.tuner import Tuner
from tuning_helpers import deterministic, measuring
from ssd_jax.loop import adaptive_loop
from ssd_jax.loop.decoder import decode_arrays
from ssd_jax.runtime.prompts import row_keys
from ssd_jax.errors import InputError
from ssd_jax.metrics import speculative_stats
from ssd_jax.sampling import SamplingParams
from ssd_jax.verify import block_tables, tokenwise_tables
from spec_models import exact_law, law_pair, llama, pair

# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("cls", [ssd_jax.SD, ssd_jax.BV, ssd_jax.GBV, ssd_jax.SpecInfer, ssd_jax.SpecTr])
@pytest.mark.parametrize("options, field, value", [
    (dict(draft_len="automatic"), "draft_len", "'automatic'"),
    (dict(draft_len="auto", max_draft_len=-2), "max_draft_len", "-2"),
    (dict(draft_len="auto", threshold=0.0), "threshold", "0.0"),
    (dict(draft_len="auto", threshold=1.5), "threshold", "1.5"),
])
def test_bad_adaptive_options_name_field_and_value(cls, options, field, value):
    with pytest.raises(InputError, match=rf"{field} .*{value}"):
        cls(**options)


@pytest.mark.parametrize("cls", [ssd_jax.PLD, ssd_jax.LogitSpec])
@pytest.mark.parametrize("options, field, value", [
    (dict(draft_len="automatic"), "draft_len", "'automatic'"),
    (dict(draft_len="auto", max_draft_len=-2), "max_draft_len", "-2"),
    (dict(draft_len="auto", max_draft_len=0), "max_draft_len", "0"),
])
def test_bad_retrieval_auto_options_name_field_and_value(cls, options, field, value):
    with pytest.raises(InputError, match=rf"{field} .*{value}"):
        cls(**options)


def test_auto_is_a_static_hashable_method():
    assert ssd_jax.SD(draft_len="auto") == ssd_jax.SD(draft_len="auto")
    assert ssd_jax.SD(draft_len="auto").adaptive and not ssd_jax.SD(draft_len=4).adaptive
    assert ssd_jax.SD(draft_len="auto", max_draft_len=6).max_len == 6


# --------------------------------------------------- exact law of an early-stopped draft (x64)

V, L = 3, 3


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def _chains(seed):
    rng = np.random.default_rng(seed)
    dist = lambda: (lambda x: x / x.sum())(rng.gamma(0.5, size=V))  # noqa: E731
    prefixes = [pre for n in range(L + 2) for pre in itertools.product(range(V), repeat=n)]
    return {pre: dist() for pre in prefixes}, {pre: dist() for pre in prefixes}


def _emitted_law(tables, P, Q, stop):
    """Law of the first L+1 tokens when a draft of up to L tokens stops at stop(prefix) (True:
    do not draft the next token) and is verified with the length-masked tables, the rest sampled
    from the target: {sequence: probability}."""
    law = {}
    for x in itertools.product(range(V), repeat=L):
        n = next((i for i in range(L) if stop(x[:i], x)), L)
        if any(t != 0 for t in x[n:]):   # tokens past the stop are not drafted: count x once
            continue
        drafted = np.prod([Q[x[:i]][x[i]] for i in range(n)])
        q = np.array([[Q[x[:i]] for i in range(L)]])
        p = np.array([[P[x[:i]] for i in range(L + 1)]])
        first, residual = (np.asarray(a[0]) for a in tables(np.array([x]), q, p, np.array([n])))
        for tau in range(n + 1):
            if tables is block_tables:   # first = h: tau is the last i whose D_i is a token
                p_tau = first[tau] * np.prod(1 - first[tau + 1:])
            else:                        # first = acceptance probabilities
                p_tau = np.prod(first[:tau]) * (1 - first[tau] if tau < n else 1)
            if p_tau <= 0:
                continue
            y_law = residual[tau] / residual[tau].sum()
            for y in range(V):
                head = x[:tau] + (y,)
                for tail in itertools.product(range(V), repeat=L + 1 - len(head)):
                    seq = head + tail
                    rest = np.prod([P[seq[:i]][seq[i]] for i in range(len(head), L + 1)])
                    law[seq] = law.get(seq, 0.0) + drafted * p_tau * y_law[y] * rest
    return law


def _law_error(tables, seed, stop):
    P, Q = _chains(seed)
    law = _emitted_law(tables, P, Q, stop)
    target = {s: np.prod([P[s[:i]][s[i]] for i in range(L + 1)]) for s in itertools.product(range(V), repeat=L + 1)}
    return max(abs(law.get(s, 0.0) - target[s]) for s in target)


@pytest.mark.parametrize("tables", [tokenwise_tables, block_tables], ids=["tokenwise", "block"])
@pytest.mark.parametrize("seed", [0, 1])
def test_early_stopped_draft_keeps_the_target_law(x64, tables, seed):
    """Stopping when the draft's top probability for the next token is low (a stopping time of
    the draft's own process, as in `draft_path_until_unsure`) leaves the law exact."""
    _, Q = _chains(seed)
    unsure = lambda prefix, x: max(Q[prefix]) < 0.6  # noqa: E731  (decided before drawing x[len(prefix)])
    assert _law_error(tables, seed, unsure) < 1e-12


@pytest.mark.parametrize("tables", [tokenwise_tables, block_tables], ids=["tokenwise", "block"])
def test_law_check_has_power_against_a_stop_that_peeks(x64, tables):
    """A stop that looks at the token it would draft (dropping it when it is 0) breaks the law,
    and the same check sees it."""
    peeks = lambda prefix, x: x[len(prefix)] == 0  # noqa: E731
    assert _law_error(tables, 0, peeks) > 1e-3


# ------------------------------------------------------------------- the loop, greedy and sampled


@pytest.fixture(scope="module")
def models():
    # One layer: these tests are about the loop's decisions and their exactness, and its programs
    # compile about a third faster than with two (SD "auto": 9.9 s against 14.5 s); the layered
    # caches are exercised by the other modules' 2-layer pairs and the embedded 6-layer target.
    return pair(vocab=64, seed=0, noise=0.3, layers=1)


@pytest.mark.parametrize("method", [
    ssd_jax.SD(draft_len="auto"), ssd_jax.BV(draft_len="auto", threshold=0.5),
    ssd_jax.GBV(draft_len="auto", max_draft_len=4), ssd_jax.SpecInfer(draft_len="auto", max_draft_len=3),
], ids=["sd", "bv", "gbv", "specinfer"])
def test_auto_greedy_equals_autoregressive(models, method):
    target, draft = models
    prompts = [[3, 4, 5, 6], [9], [10, 11, 12, 13, 14, 15, 16]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=40)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
    assert out.tokens == ar.tokens
    assert out.stats["adaptive"] and 1 <= out.stats["planned_draft_len"] <= method.max_draft_len


@pytest.mark.parametrize("method", [ssd_jax.PLD(draft_len="auto"), ssd_jax.LogitSpec(draft_len="auto", tree_size=8)],
                         ids=["pld", "logitspec"])
def test_retrieval_auto_greedy_equals_autoregressive(models, method):
    target, _ = models
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [9], [10, 11, 12, 13, 14, 15, 16]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=40)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method)
    assert out.tokens == ar.tokens
    assert out.stats["adaptive"] and 1 <= out.stats["planned_draft_len"] <= method.max_draft_len
    assert out.stats["early_stop_threshold"] is None


# Costs that make every step after the first speculative one fall back to plain decoding, and
# costs that always pay: (AR step, speculative step, draft forward, prior acceptance, forced cap).
FALL_BACK = np.asarray([1.0, 100.0, 0.0, 0.5, 0.0], np.float32)
ALWAYS_SPECULATE = cost_model.FORCE_SPECULATION
# Retrieval, and a draft model at T=0 or SD's, learn their acceptance during plain steps (shadow
# evidence, the draft scored when it catches up) and never probe: with a speculative step at 1.2
# plain steps, their drafts pay at first (at the prior acceptance), then after misses not, then
# maybe again.
MARGINAL = np.asarray([1.0, 1.2, 0.1, 0.5, 0.0], np.float32)
# The same for the law tests' batch of 6000 rows (3 tokens), whose unluckiest row sets the batch's
# pace: a prior acceptance (0.9) that makes the first step, at two tokens left, speculative, then
# plain steps where a row has one token left (a step keeps only that one token, and a speculative
# step costs more than a plain one).
CHEAP = np.asarray([1.0, 1.05, 0.05, 0.9, 0.0], np.float32)
# For a draft model there, the same (at a chosen cap below the maximum where the step takes one).
DRAFT_THEN_PLAIN = np.asarray([1.0, 1.05, 0.1, 0.9, 0.0], np.float32)


def _decode_program(target, method, sampling, out_size: int, draft_len=2):
    """The adaptive decode, jitted: (target, draft, tokens, lengths, keys, costs, max_new) -> output,
    one compilation for every max_new up to out_size."""
    single = getattr(method, "paths", None) == 1
    plan = cost_model.AutoPlan(draft_len=draft_len, threshold=method.early_stop(sampling.greedy) if single else None,
                             capped=single or method.name in ("pld", "csd"))
    return jax.jit(lambda t, d, tok, lens, k, c, max_new: decode_arrays(
        t, d, tok, lens, k, max_new, method=method, sampling=sampling,
        eos_ids=tuple(target.config.eos_token_ids or ()), out_size=out_size, plan=plan, costs=c))


def _padded(prompts) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    return tokens, lengths


def _decode(target, draft, prompts, method, costs, sampling, keys, max_new, draft_len=2, out_size=None):
    fn = _decode_program(target, method, sampling, out_size or max_new, draft_len)
    return fn(target, draft, *_padded(prompts), keys, costs, np.int32(max_new))


def test_fallback_to_plain_decoding_is_exact_greedy(models):
    """Speculative steps, then plain steps with the draft left behind, then the draft catching up:
    still the AR tokens."""
    target, draft = models
    prompts = [[3, 4, 5, 6], [9, 2]]
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    ar = ssd_jax.generate(target, prompts, max_new_tokens=60)
    out = _decode(target, draft, prompts, ssd_jax.SD(draft_len="auto"), MARGINAL, SamplingParams(),
                  row_keys(None, 2), 60)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    assert counters.ar_steps.min() > 30 and counters.num_drafts.min() >= 2   # several phases ran
    assert_no_idle_steps(counters)


def assert_no_idle_steps(counters) -> None:
    """Every loop step after the prefill had a running row: blocks of plain steps never decode
    past the last row's end."""
    assert int(counters.target_calls) == 1 + int(np.max(counters.ar_steps + counters.num_drafts))


@pytest.mark.parametrize("method, costs", [(ssd_jax.PLD(draft_len="auto"), MARGINAL),
                                           (ssd_jax.LogitSpec(draft_len="auto", tree_size=8), MARGINAL),
                                           (ssd_jax.CSD(max_draft_tokens="auto"), MARGINAL)],
                         ids=["pld", "logitspec", "csd"])
def test_other_fallbacks_to_plain_decoding_are_exact_greedy(models, method, costs):
    """Retrieval or cascade steps, then plain steps that still extend the context (and
    LogitSpec's last logits) while the cascade's drafters fall behind, then speculation again
    (the drafters catching up): the AR tokens."""
    target, draft = models
    prompts = [[3, 4, 5, 6, 3, 4, 5], [9, 2]]
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    ar = ssd_jax.generate(target, prompts, max_new_tokens=60)
    draft = draft if method.drafts_with_model else None
    out = _decode(target, draft, prompts, method, costs, SamplingParams(), row_keys(None, 2), 60, draft_len=3)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    assert counters.ar_steps.min() > 30 and counters.num_drafts.min() >= 2
    assert_no_idle_steps(counters)


@pytest.mark.parametrize("method", [ssd_jax.PLD(draft_len="auto"), ssd_jax.LogitSpec(draft_len="auto", tree_size=8),
                                    ssd_jax.SD(draft_len="auto"), ssd_jax.SpecInfer(draft_len="auto", paths=2),
                                    ssd_jax.CSD(max_draft_tokens="auto", lenience=1.0)],
                         ids=["pld", "logitspec", "sd", "specinfer", "csd-lenience-1"])
def test_speculation_that_never_pays_never_probes(models, method):
    """Where speculation never pays, retrieval and draft models at T=0 decode every step plainly:
    their acceptance comes from walking each plain block's draft with the block's tokens, or from
    the draft scoring the tokens it missed when it catches up, not from probes (a probe is a whole
    speculative step). CSD only with a strict review: T=0's lenient one keeps its probes."""
    target, draft = models
    draft = draft if method.drafts_with_model else None
    prompts = [[3, 4, 5, 6, 3, 4, 5], [9, 2]]
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    ar = ssd_jax.generate(target, prompts, max_new_tokens=60)
    out = _decode(target, draft, prompts, method, FALL_BACK, SamplingParams(), row_keys(None, 2), 60, draft_len=3)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    assert counters.num_drafts.max() == 0 and counters.ar_steps.min() == 59
    assert_no_idle_steps(counters)


def gpu_adaptive_policy(monkeypatch, steps_per_check: int = 4) -> None:
    """The CPU policy with the GPU's adaptive-loop choices: checks every steps_per_check steps,
    no per-step verification switch, one compiled step per cap from batch 1."""
    from ssd_jax import backend

    monkeypatch.setitem(backend.POLICIES, "cpu", dataclasses.replace(
        backend.POLICIES["cpu"], adaptive_steps_per_check=steps_per_check, adaptive_switch_per_step=False,
        adaptive_scan_from_batch=1))


@pytest.mark.parametrize("method", [ssd_jax.SD(draft_len="auto"), ssd_jax.PLD(draft_len="auto"),
                                    ssd_jax.CSD(max_draft_tokens="auto")], ids=["sd", "pld", "csd"])
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_loop_choices_are_exact_greedy(models, method, rows, monkeypatch):
    """The GPU policy's loop (checks every 4 steps, the widest verification, SD's caps dispatched
    at batch 1): speculative and plain blocks, steps after a row is done, the draft catching up:
    the AR tokens."""
    gpu_adaptive_policy(monkeypatch)
    target, draft = models
    prompts = [[3, 4, 5, 6, 3, 4, 5], [9, 2]][:rows]
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    ar = ssd_jax.generate(target, prompts, max_new_tokens=61)
    draft = draft if method.drafts_with_model else None
    # None of them probes at T=0: costs where their drafts pay at first.
    out = _decode(target, draft, prompts, method, MARGINAL, SamplingParams(), row_keys(None, rows), 61,
                  draft_len=3)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    # Each speculative phase is its first step, then blocks of 4 speculative steps; at least 4 plain blocks
    # (CSD at one row: 29 plain steps and 28 speculative in 7 phases, its draft scoring itself on
    # the tokens plain steps drew).
    assert counters.ar_steps.min() >= 16 and counters.num_drafts.min() >= 4


@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_gpu_loop_runs_no_idle_steps_at_the_end_of_a_call(models, rows, monkeypatch):
    """Under the GPU policy's checks every 4 steps, a call's tail runs one step at a time once the
    running row with the most tokens left could finish inside a block, so no step runs after every
    row is done (a block used to finish its 4 steps: up to 3 idle steps a call), whatever the
    length; and the tokens stay AR's."""
    gpu_adaptive_policy(monkeypatch)
    target, draft = models
    prompts = [[3, 4, 5, 6, 3, 4, 5], [9, 2]][:rows]
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    decode = _decode_program(target, ssd_jax.SD(draft_len="auto"), SamplingParams(), out_size=32, draft_len=3)
    for max_new in (29, 30, 31, 32):
        ar = ssd_jax.generate(target, prompts, max_new_tokens=max_new)
        out = decode(target, draft, *_padded(prompts), row_keys(None, rows), cost_model.force_cap(3), np.int32(max_new))
        assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
        counters = jax.device_get(out.counters["spec"])
        assert counters.ar_steps.max() == 0
        assert_no_idle_steps(counters)


def test_gpu_loop_decides_after_a_phase_s_first_step(tiny_models, monkeypatch):
    """Under the GPU policy a phase's first speculative step runs alone and is decided on, as on
    every backend: where speculation does not pay, each probe is one speculative step, not a block
    of 4 (BV at T=1 probes; a probe that fails doubles the wait before the next)."""
    gpu_adaptive_policy(monkeypatch)
    target, draft = tiny_models
    out = _decode(target, draft, [[0, 2, 1, 0, 2]] * 4, ssd_jax.BV(draft_len="auto"), FALL_BACK,
                  SamplingParams(temperature=1.0), jax.random.split(jax.random.PRNGKey(1), 4), 60, draft_len=2)
    counters = jax.device_get(out.counters["spec"])
    # Two probes over 60 tokens here: 2 speculative steps (8 when each probe was a block of 4).
    assert 1 <= int(np.max(counters.num_drafts)) <= 3 and counters.ar_steps.min() >= 50


def test_pld_dispatches_its_caps_per_run_of_steps_at_batch_above_one(models, monkeypatch):
    """Capped PLD compiles one step per cap from batch 2 (a per-step width switch copies the KV
    cache on CPU), keeps the per-step width at batch 1 (a row that found nothing costs a plain
    step), and LogitSpec and the GPU policy's single width have nothing to dispatch."""
    from ssd_jax.loop.retrieval import RetrievalParts

    target, _ = models

    def parts(method, capped=True):
        return RetrievalParts(method=method, draft_len=4, tparams=target.params, tcfg=target.config,
                              sampling=SamplingParams(), prompt_size=8, out_size=8, pending_width=24, capped=capped)

    pld = parts(ssd_jax.PLD(draft_len="auto"))
    assert pld.dispatch_caps(2) == pld.dispatch_caps(8) == (1, 2, 4)
    assert pld.dispatch_caps(1) is None
    assert parts(ssd_jax.PLD(draft_len=4), capped=False).dispatch_caps(8) is None
    assert parts(ssd_jax.LogitSpec(draft_len="auto", tree_size=8), capped=False).dispatch_caps(8) is None
    gpu_adaptive_policy(monkeypatch)
    assert pld.dispatch_caps(8) is None


VOCAB, NEW, SAMPLES = 4, 3, 6000


@pytest.fixture(scope="module")
def tiny_models():
    return law_pair(VOCAB)


def _assert_target_law(target, prompt, sampling, tokens) -> None:
    """The first NEW tokens of SAMPLES rows (int32 [SAMPLES, >= NEW]) follow the target's law after
    prompt: every sequence's frequency within 5 standard errors of its probability."""
    counts = np.zeros((VOCAB,) * NEW)
    for row in np.asarray(tokens)[:, :NEW]:
        counts[tuple(row)] += 1
    freq, law = counts / SAMPLES, exact_law(target, prompt, sampling, NEW)
    sigma = np.sqrt(law * (1 - law) / SAMPLES) + 1e-12
    assert np.all(np.abs(freq - law) <= 5 * sigma + 1e-9)


@pytest.mark.parametrize("method, costs, draft_len", [
    (ssd_jax.SD(draft_len="auto", threshold=0.5), ALWAYS_SPECULATE, 2),
    pytest.param(ssd_jax.SD(draft_len="auto", threshold=0.5), "while_loop", 2, marks=pytest.mark.slow),
    pytest.param(ssd_jax.SD(draft_len="auto", threshold=0.6), ALWAYS_SPECULATE, 4, marks=pytest.mark.slow),
    (ssd_jax.SD(draft_len="auto"), DRAFT_THEN_PLAIN, 4),
    pytest.param(ssd_jax.SD(draft_len="auto"), "blocks_of_2", 4, marks=pytest.mark.slow),
    pytest.param(ssd_jax.PLD(draft_len="auto", max_ngram=2), "blocks_of_2", 4, marks=pytest.mark.slow),
    (ssd_jax.BV(draft_len="auto", threshold=0.7), FALL_BACK, 2),
    (ssd_jax.GBV(draft_len="auto", paths=3), FALL_BACK, 2),
    (ssd_jax.PLD(draft_len="auto", max_ngram=2), CHEAP, 2),
    pytest.param(ssd_jax.PLD(draft_len="auto", max_ngram=2), cost_model.force_cap(2), 4, marks=pytest.mark.slow),
    (ssd_jax.LogitSpec(draft_len="auto", tree_size=6, topk=2, max_ngram=2), CHEAP, 2),
    (ssd_jax.CSD(max_draft_tokens="auto"), DRAFT_THEN_PLAIN, 2),
    (ssd_jax.CSD(max_draft_tokens="auto"), np.asarray([1.0, 1.0, 0.1, 0.9, 0.0], np.float32), 2),
    (ssd_jax.SpecInfer(draft_len="auto", paths=1), cost_model.force_cap(2), 4),
    pytest.param(ssd_jax.SpecTr(draft_len="auto", paths=1), cost_model.force_cap(1), 4, marks=pytest.mark.slow),
    pytest.param(ssd_jax.GBV(draft_len="auto", paths=1), cost_model.force_cap(2), 4, marks=pytest.mark.slow),
], ids=["sd-early-stop", "sd-early-stop-while-loop", "sd-early-stop-two-widths", "sd-chosen-caps",
        "sd-gpu-loop", "pld-gpu-loop", "bv-early-stop-then-plain",
        "gbv-then-plain", "pld-then-plain", "pld-capped", "logitspec-then-plain", "csd-then-plain",
        "csd-chosen-caps", "specinfer-one-path-capped", "spectr-one-path-capped", "gbv-one-path-capped"])
def test_sampled_law_with_adaptive_lengths(tiny_models, method, costs, draft_len, monkeypatch):
    """(The default run keeps one case per kind of choice; -m slow runs them all.)
    T=1: draft lengths that depend on the draft's confidence (per row), on the running
    acceptance (each step's cap, the fall back to plain decoding) and the verification width
    picked from the drafts (2 or 4 tokens) keep the target's law over 3 tokens. "while_loop":
    the batch drafts with the early-stopping loop batch 1 uses, not one scan per cap.
    "blocks_of_2": the GPU policy's loop, checking and choosing every 2 steps (a phase's first
    step and the call's tail one at a time). Retrieval, SD and CSD never probe (they learn while decoding plainly;
    SD's and CSD's plain steps record the target's probability of each token for the draft's
    scoring): their "then plain" costs pay at first, then not. BV and GBV at T=1 still probe.
    "one-path-capped": the multi-path methods with the one path "auto" chooses on CPU, each step
    capped below the planned length (their tree walk once verified the unproposed tail too)."""
    while_loop = isinstance(costs, str) and costs == "while_loop"
    then_plain = costs is CHEAP or costs is DRAFT_THEN_PLAIN
    if isinstance(costs, str) and costs == "blocks_of_2":
        gpu_adaptive_policy(monkeypatch, steps_per_check=2)
        costs = DRAFT_THEN_PLAIN if method.drafts_with_model else CHEAP
    if isinstance(costs, str):
        from ssd_jax.loop.speculative import SpeculativeParts

        monkeypatch.setattr(SpeculativeParts, "scan_caps_from_batch", SAMPLES + 1)
        costs = ALWAYS_SPECULATE
    target, draft = tiny_models
    draft = draft if method.drafts_with_model else None
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1, 0, 2]
    keys = jax.random.split(jax.random.PRNGKey(5), SAMPLES)
    # Output slots past NEW: the caches then hold a tree's room (a tree steps only where it fits).
    out = _decode(target, draft, [prompt] * SAMPLES, method, costs, sampling, keys, NEW, draft_len=draft_len,
                  out_size=NEW + 8)
    _assert_target_law(target, prompt, sampling, out.tokens)
    counters = jax.device_get(out.counters["spec"])
    assert counters.num_drafts.min() > 0   # every row verified a draft (a probe at least)
    if getattr(method, "paths", None) == 1 and (while_loop or costs[4] == 0):
        # The early stop (the while_loop's) or a chosen cap happened: some rows proposed fewer
        # tokens. (A step compiled per cap proposes all it drafted, up to the cap.)
        assert counters.num_drafted.sum() < draft_len * counters.num_drafts.sum()
    if 0 < costs[4] < draft_len:   # a forced cap held every draft to it
        assert counters.num_drafted.sum() <= costs[4] * counters.num_drafts.sum()
    if not isinstance(method, (ssd_jax.SD, ssd_jax.BV, ssd_jax.GBV)):   # the probe's draft was used
        assert counters.num_accepted.sum() > 0
    if then_plain:   # some rows fell back to plain decoding after their speculative steps
        assert counters.ar_steps.max() > 0


@pytest.mark.parametrize("method, costs", [
    (ssd_jax.SD(draft_len="auto"), ALWAYS_SPECULATE),
    (ssd_jax.SD(draft_len="auto"), DRAFT_THEN_PLAIN),
    (ssd_jax.PLD(draft_len="auto", max_ngram=2), CHEAP),
], ids=["sd", "sd-then-plain", "pld-then-plain"])
def test_sampled_law_when_decoded_in_pieces(tiny_models, method, costs):
    """T=1, the adaptive loop run in pieces as `generate` streams (`begin_arrays`, then
    `resume_arrays` pausing once every row has one more token): each pause ends the loop's phase
    (the draft reads the tokens it missed, the next phase starts afresh), and the law over 3
    tokens stays the target's."""
    from ssd_jax.loop.decoder import begin_arrays, resume_arrays

    target, draft = tiny_models
    draft = draft if method.drafts_with_model else None
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1, 0, 2]
    tokens, lengths = _padded([prompt] * SAMPLES)
    keys = jax.random.split(jax.random.PRNGKey(5), SAMPLES)
    plan = cost_model.AutoPlan(draft_len=2, threshold=None, capped=True)
    options = dict(method=method, sampling=sampling, eos_ids=(), out_size=NEW + 8, plan=plan)
    begin = jax.jit(lambda t, d, c: begin_arrays(t, d, tokens, lengths, keys, np.int32(NEW), costs=c, **options))
    resume = jax.jit(lambda t, d, c, state, piece: resume_arrays(t, d, tokens, lengths, keys, np.int32(NEW), state,
                                                                 piece, costs=c, **options))
    state, out = begin(target, draft, costs)
    pieces = 0
    while not np.all(np.asarray(out.finish_reason) != 0):
        state, out = resume(target, draft, costs, state, np.int32(1))
        pieces += 1
    assert pieces == NEW - 1   # one token each: every row speculates at most one step per piece
    _assert_target_law(target, prompt, sampling, out.tokens)
    assert jax.device_get(out.counters["spec"]).num_drafts.min() > 0   # speculative steps happened


# ---------------------------------------------------------------------------- the stopping rule


def test_a_draft_equal_to_the_target_drafts_to_the_maximum(models):
    """The stopping rule never stops a draft that is always right and sure of it (with costs where
    speculation pays: on this tiny pair a draft as large as the target never pays, and the cost
    model rightly decodes plainly)."""
    target, _ = models
    sure = target.with_params(jax.tree.map(lambda x: 8 * x, target.params))  # sharp laws
    for method in (ssd_jax.SD(draft_len="auto"), ssd_jax.BV(draft_len="auto")):
        out = _decode(sure, sure, [[3, 4, 5, 6], [7]], method, ALWAYS_SPECULATE, SamplingParams(),
                      row_keys(None, 2), 40, draft_len=4)
        counters = jax.device_get(out.counters["spec"])
        assert np.all(counters.num_drafted == 4 * counters.num_drafts) and counters.ar_steps.sum() == 0
        assert np.all(counters.num_accepted == counters.num_drafted)


@pytest.mark.parametrize("method", [ssd_jax.SD(draft_len="auto"), ssd_jax.CSD(max_draft_tokens="auto", lenience=1.0)],
                         ids=["sd", "csd-lenience-1"])
def test_a_draft_scored_on_the_plain_tokens_brings_speculation_back(models, method):
    """A loop that starts plain (prior acceptance 0: a step would emit one token) with a draft that
    always agrees with the target: when the draft catches up it scores itself on the tokens it
    missed, and speculation resumes without a probe; the AR tokens."""
    target, _ = models
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    prompts = [[3, 4, 5, 6], [9, 2]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=60)
    out = _decode(target, target, prompts, method, np.asarray([1.0, 1.2, 0.1, 0.0, 0.0], np.float32),
                  SamplingParams(), row_keys(None, 2), 60, draft_len=3)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    # Plain until the pending buffer filled (a probe would have speculated from the first step),
    # then speculation.
    assert counters.ar_steps.min() >= adaptive_loop.PENDING_WIDTH - 2 and counters.ar_steps.max() < 30
    assert counters.num_drafts.min() > 0 and counters.num_accepted.sum() >= 0.8 * counters.num_drafted.sum()


def test_a_random_draft_falls_back_to_plain_decoding(monkeypatch):
    """On the embedded target, with measured costs (on the tiny test pair a speculative step can
    cost about one plain step, and speculating at one token then rightly never loses, so the rule
    may keep it). A static maximum of 2 compiles and calibrates caps 1 and 2 only: a draft whose
    tokens are never accepted loses at every cap."""
    measuring(monkeypatch)
    target, _ = ssd_jax.default_models()
    stranger = llama(target.config.vocab_size, 64, 2, seed=42, eos=())
    prompt = target.tokenizer.encode("def parse(line):\n    ").ids
    ar = ssd_jax.generate(target, [prompt], max_new_tokens=96)
    out = ssd_jax.generate(target, [prompt], max_new_tokens=96, method=ssd_jax.SD(draft_len="auto", max_draft_len=2),
                           draft=stranger)
    assert out.tokens == ar.tokens
    assert out.stats["ar_fallback_share"] > 0.5
    assert out.stats["loop_costs"][:3] != cost_model.UNMEASURED.loop_array(9).tolist()  # measured


def test_calls_whose_loop_decoded_plainly_start_plain(models, monkeypatch):
    """A call whose loop decoded at least PLAIN_SHARE of its steps plainly makes the next calls of
    the program run AR's loop from the start, all but a probe every PROBE_EVERY calls (doubling
    while probes decode plainly again, up to PROBE_EVERY_MAX); a probe whose loop speculated ends
    it. The tokens are AR's every time; a deterministic tuner remembers nothing."""
    from ssd_jax.tuning import against_ar
    from ssd_jax.tuning import plain_verdicts

    measuring(monkeypatch)
    monkeypatch.setattr(plain_verdicts, "PROBE_EVERY", 3)
    monkeypatch.setattr(plain_verdicts, "PROBE_EVERY_MAX", 6)
    # Whether a loop counts as plain is set here, not by the tiny pair's speed: every call's (share >= 0),
    # and no call is checked against AR's program.
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 0.0)
    monkeypatch.setattr(against_ar, "GAIN_CHECK", float("inf"))
    target, draft = models
    prompts = [[3, 4, 5, 3, 4], [7]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=20)

    counters = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_rejected", "acceptance_rate",
                "mean_acceptance_length", "block_efficiency", "accepted_per_position", "steps_by_cap",
                "observed_acceptance")

    def starts_plain(method=ssd_jax.SD(draft_len="auto", max_draft_len=3)) -> bool:
        out = ssd_jax.generate(target, prompts, max_new_tokens=20, method=method, draft=draft)
        assert out.tokens == ar.tokens and out.stats["method"] == method.name and out.stats["adaptive"]
        assert all(name in out.stats for name in counters)   # the same keys, summed over calls
        if out.stats.get("plain_from_start"):
            assert out.stats["ar_fallback_share"] == 1.0 and out.stats["mean_draft_len"] == 0.0
            assert out.stats["num_drafts"] == 0 and out.stats["block_efficiency"] == 1.0
            return True
        assert "loop_costs" in out.stats
        return False

    assert [starts_plain() for _ in range(10)] == [False, True, True, False] + [True] * 5 + [False]
    assert not starts_plain(ssd_jax.SD(draft_len="auto", max_draft_len=2))   # another program
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 1.01)   # from now on, every loop speculates
    assert [starts_plain() for _ in range(8)] == [True] * 5 + [False, False, False]
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 0.0)
    deterministic(monkeypatch)
    assert [starts_plain() for _ in range(3)] == [False] * 3


def test_a_call_of_the_prefill_alone_leaves_the_verdict_alone(models, monkeypatch):
    """A 1-token call runs no loop step (its token is the prefill's), so its plain share (0.0)
    says nothing: recorded, it ended a plain verdict of the calls of its output bucket."""
    from ssd_jax.tuning import plain_verdicts

    measuring(monkeypatch)
    recorded = []
    monkeypatch.setattr(plain_verdicts, "remember_share", lambda tuner, key, share, lost=False: recorded.append(share))
    target, draft = models
    for max_new in (1, 6):
        ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=max_new,
                         method=ssd_jax.SD(draft_len="auto", max_draft_len=3), draft=draft)
    assert len(recorded) == 1


def test_calls_that_lose_to_ar_s_program_start_plain(models, monkeypatch):
    """A call whose steps, at the loop's prices, come to more than AR's program would take (AR's
    step measured against the loop's plain step, `against_ar.ar_step_ratio`) makes the next calls
    start plain, as a call that decoded plainly does; one that beats it does not. Calls that
    clearly pay (below GAIN_CHECK of the loop's plain steps) never time AR's program."""
    from ssd_jax.tuning import against_ar
    from ssd_jax.tuning import plain_verdicts

    measuring(monkeypatch)
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 1.01)   # the share alone never makes a verdict
    target, draft = models
    prompts = [[3, 4, 5, 3, 4], [7]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=20)
    asked = []

    def call(ratio: float):
        monkeypatch.setattr(against_ar, "ar_step_ratio", lambda *args: asked.append(ratio) or ratio)
        out = ssd_jax.generate(target, prompts, max_new_tokens=20, method=ssd_jax.SD(draft_len="auto", max_draft_len=3),
                               draft=draft)
        assert out.tokens == ar.tokens
        return out.stats

    monkeypatch.setattr(against_ar, "GAIN_CHECK", 10.0)   # every call pays clearly: never checked
    stats = call(0.01)
    assert asked == [] and stats["loses_to_ar"] is False and "priced_speedup_vs_ar" not in stats
    monkeypatch.setattr(against_ar, "GAIN_CHECK", 0.0)    # every call checked
    stats = call(5.0)                                     # AR's step 5 loop plain steps: speculation wins
    assert stats["loses_to_ar"] is False and stats["priced_speedup_vs_ar"] > 1.0
    assert not call(5.0).get("plain_from_start")
    stats = call(0.01)                                    # AR nearly free: the call lost
    assert stats["loses_to_ar"] is True and stats["priced_speedup_vs_ar"] < 1.0
    assert stats["ar_step_over_loop_plain"] == 0.01
    assert call(0.01).get("plain_from_start")             # the next call runs AR's program


def _ar_ratio_calls(models, monkeypatch, calls: int = 2):
    """Runs `calls` PLD "auto" calls on the tiny pair that always check AR's step ratio (never
    a verdict): (each call's ratio, the ratios measured: once per key, the later calls reading it)."""
    from ssd_jax.tuning import against_ar
    from ssd_jax.tuning import plain_verdicts

    measuring(monkeypatch)
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 1.01)
    monkeypatch.setenv("SSD_JAX_CALIBRATION_DIR", "")
    monkeypatch.setattr(against_ar, "GAIN_CHECK", 0.0)
    monkeypatch.setattr(against_ar, "GAIN_MARGIN", -1.0)   # measured, never a verdict
    target, draft = models
    ratios, measured = [], []
    ratio_of = against_ar.ar_step_ratio
    monkeypatch.setattr(against_ar, "ar_step_ratio", lambda *args: measured.append(ratio_of(*args)) or measured[-1])
    for _ in range(calls):
        out = ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=40, method=ssd_jax.PLD(draft_len="auto"))
        assert not out.stats.get("plain_from_start"), out.stats
        ratios.append(out.stats["ar_step_over_loop_plain"])
        assert ratios[-1] == measured[-1]
    return ratios, measured


def test_ar_step_ratio_is_measured_once_per_key(models, monkeypatch):
    """AR's program's step over the adaptive loop's plain step, measured on the two compiled
    programs of a real call: finite and positive, measured once per key (the second call reuses
    it). Its size is wall-clock time on a shared machine (kept whatever it is here), so only the
    arithmetic is pinned down (next test)."""
    from ssd_jax.tuning import against_ar

    monkeypatch.setattr(against_ar, "PLAUSIBLE_RATIO", (0.0, float("inf")))
    ratios, measured = _ar_ratio_calls(models, monkeypatch)
    assert ratios[0] == ratios[1] and np.isfinite(ratios[0]) and ratios[0] > 0 and len(measured) == 1


def test_ar_step_ratio_is_the_per_step_difference_of_both_programs(models, monkeypatch):
    """Both programs timed alike, each program's step the difference of its long and short runs
    over the steps between them: with a clock that charges AR's program 1.25 ms a step and the
    loop's 1 ms a step, each on top of a large fixed launch cost, the ratio is exactly 1.25 (a
    ratio of whole-run times, or of times over all steps, would not be). A ratio no two programs
    of one target forward per token can have (5 here) is noise: no ratio, so no verdict, and it
    is not measured again for the key."""
    from ssd_jax.tuning import against_ar

    real_timed_run = against_ar.timed_run
    ar_step = {"s": 1.25e-3}
    programs_timed = []

    def clocked_timed_run(executable, args, max_new, forced=None):
        programs_timed.append(forced is not None)
        run_real = real_timed_run(executable, args, max_new, forced)
        per_step = 1e-3 if forced is not None else ar_step["s"]    # forced: the loop's program

        def run():
            _, out = run_real()
            return 0.5 + per_step * int(jax.device_get(out.counters["spec"].target_calls)), out

        return run

    monkeypatch.setattr(against_ar, "timed_run", clocked_timed_run)
    ratios, _ = _ar_ratio_calls(models, monkeypatch, calls=1)
    assert ratios[0] == pytest.approx(1.25, rel=1e-9)
    ar_step["s"] = 5e-3
    programs_timed.clear()
    assert _ar_ratio_calls(models, monkeypatch, calls=2) == ([None, None], [None])
    assert len(programs_timed) == 4   # one measurement (short and long runs of both programs)


def test_a_call_of_few_tokens_calibrates_with_the_program_s_output_width(models, monkeypatch):
    """A calibration and AR's step ratio are kept for every call of the program, whose max_new may
    be anything up to its output's width (a bucket of at least 16): a call of 2 tokens times runs
    of 16 (the program's width, below _CALIBRATION_TOKENS), not of its own max_new (a call of one
    token timed only noise: on the tiny pair it priced the speculative step at a quarter of its
    cost, and the calls after it decided with that)."""
    from ssd_jax.tuning import against_ar

    measuring(monkeypatch)
    monkeypatch.setenv("SSD_JAX_CALIBRATION_DIR", "")
    monkeypatch.setattr(against_ar, "GAIN_CHECK", 0.0)     # every call checked
    monkeypatch.setattr(against_ar, "GAIN_MARGIN", -1.0)   # measured, never a verdict
    monkeypatch.setattr(against_ar, "PLAUSIBLE_RATIO", (0.0, float("inf")))
    timed = {"loop": set(), "ar": set()}

    def recording(module, name):
        real = module.timed_run

        def timed_run(executable, args, max_new, forced=None):
            timed[name].add(max_new)
            return real(executable, args, max_new, forced)

        monkeypatch.setattr(module, "timed_run", timed_run)

    recording(measure, "loop")
    recording(against_ar, "ar")
    target, _ = models
    out = ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=2, method=ssd_jax.PLD(draft_len="auto"))
    assert out.stats["ar_step_over_loop_plain"] is not None
    assert timed == {"loop": {1, 16}, "ar": {1, 16}}


def test_pricing_a_call_at_the_loop_s_prices():
    """A step at a cap the calibration timed costs that time, other caps the fixed cost plus a draft
    forward per extra token; plain steps the plain price; a call is judged against AR only where
    it is priced within GAIN_CHECK of its plain steps, and lost unless it beats AR by GAIN_MARGIN."""
    from ssd_jax.tuning import against_ar

    costs = [1.0, 1.5, 0.25, 0.7, 0.0, 1.4, 0.0, 0.0, 3.0]     # t_ar, t_spec, c_draft, prior, cap; caps 1..4
    assert against_ar.step_price(costs, 1) == 1.4 and against_ar.step_price(costs, 4) == 3.0
    assert against_ar.step_price(costs, 2) == 1.75 and against_ar.step_price(costs, 3) == 2.0
    assert against_ar.call_seconds(costs, [2, 0, 0, 1], plain_steps=3) == 2 * 1.4 + 3.0 + 3 * 1.0
    never = lambda: pytest.fail("AR's program timed for a call that clearly pays")   # noqa: E731
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 2], 0, ar_steps=20, ar_ratio=never) == (False, None)
    # 10 steps at cap 4 (30 s) against AR's 20 steps at its 1.0 s: lost.
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 10], 0, ar_steps=20, ar_ratio=lambda: 1.0) == (True, pytest.approx(2 / 3))
    # 5 steps (15 s), checked (above GAIN_CHECK's 14 s): won; with AR's step at half the plain one: lost.
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 5], 0, ar_steps=20, ar_ratio=lambda: 1.0) == (False, pytest.approx(4 / 3))
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 5], 0, ar_steps=20, ar_ratio=lambda: 0.5)[0]
    # A tie with AR (20 s against 20 s) is lost: the loop's host work is not priced; 19 s won.
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 6], 2, ar_steps=20, ar_ratio=lambda: 1.0) == (True, 1.0)
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 5], 4, ar_steps=20, ar_ratio=lambda: 1.0) == (False, pytest.approx(20 / 19))
    # Where AR's step is unknown, nothing.
    assert against_ar.loses_to_ar(costs, [0, 0, 0, 10], 0, ar_steps=20, ar_ratio=lambda: None) == (False, None)


def test_each_program_is_calibrated_on_its_own(models, monkeypatch):
    """The loop's costs are calibrated once per compiled program, argument shapes included: a
    call whose prompts fall in another length bucket (another program, other step costs) is
    measured anew, while a repeated shape reuses the calibration."""
    from ssd_jax.tuning import against_ar

    tuner = measuring(monkeypatch)
    monkeypatch.setattr(against_ar, "GAIN_CHECK", float("inf"))   # no verdict makes a call start plain
    target, _ = models
    method = ssd_jax.PLD(draft_len="auto")
    short, long = [[3, 4, 5, 3, 4]], [[3 + i % 50 for i in range(60)]]
    first = ssd_jax.generate(target, short, max_new_tokens=16, method=method)
    again = ssd_jax.generate(target, short, max_new_tokens=16, method=method)
    assert len(tuner.calibrations) == 1 and again.stats["loop_costs"][:3] == first.stats["loop_costs"][:3]
    assert again.stats["cost_measure_time_s"] < first.stats["cost_measure_time_s"]   # calibration counted
    ssd_jax.generate(target, long, max_new_tokens=16, method=method)
    assert len(tuner.calibrations) == 2


def test_deterministic_auto_decides_without_timings(models, monkeypatch):
    """A deterministic tuner: the loop's costs are the fixed UNMEASURED ones and a sampled
    call gives the same tokens every time."""
    deterministic(monkeypatch)
    target, draft = models
    calls = [ssd_jax.generate(target, [[3, 4, 5], [6]], max_new_tokens=24, method=ssd_jax.SD(), draft=draft,
                              temperature=1.0, key=jax.random.PRNGKey(5)) for _ in range(3)]
    assert calls[0].tokens == calls[1].tokens == calls[2].tokens
    expected = cost_model.UNMEASURED.loop_array(calls[0].stats["planned_draft_len"] + 1)
    np.testing.assert_allclose(calls[0].stats["loop_costs"][:3], expected, rtol=1e-6)


# ------------------------------------------------------------------------------ the cost model


@pytest.mark.parametrize("scan_from", [2, 3], ids=["scan-per-cap", "while-loop"])
def test_forced_cap_limits_every_draft_and_keeps_greedy_output(models, scan_from, monkeypatch):
    from ssd_jax.loop.speculative import SpeculativeParts

    monkeypatch.setattr(SpeculativeParts, "scan_caps_from_batch", scan_from)
    target, draft = models
    prompts = [[3, 4, 5, 6], [9, 2]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=30)
    out = _decode(target, draft, prompts, ssd_jax.SD(draft_len="auto", threshold=1e-6), cost_model.force_cap(2),
                  SamplingParams(), row_keys(None, 2), 30, draft_len=6)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    assert counters.ar_steps.sum() == 0 and np.all(counters.num_drafted == 2 * counters.num_drafts)
    # The steps_by_cap stat: every step the batch ran, all at the forced cap.
    assert counters.cap_steps.tolist() == [0, int(counters.target_calls) - 1, 0, 0, 0, 0]
    assert speculative_stats(counters, np.asarray(out.num_tokens))["steps_by_cap"] == counters.cap_steps.tolist()


@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_no_draft_longer_than_the_tokens_a_row_can_keep(models, rows):
    """A step keeps at most the tokens its row has left, so the call's last steps price each cap
    by the tokens kept: with one token left the loop decodes it plainly, with two it drafts one
    (at the plan's costs SD drafted 8 tokens for a row's last token, a step ~2x a plain one)."""
    target, draft = models
    prompts = [[3, 4, 5, 6], [9, 2]][:rows]
    costs = cost_model.loop_inputs(cost_model.UNMEASURED, cost_model.PRIOR_ACCEPTANCE, 9, 8)
    decode = _decode_program(target, ssd_jax.SD(draft_len="auto"), SamplingParams(), out_size=3, draft_len=8)
    for max_new, most in ((2, 0), (3, 1)):
        ar = ssd_jax.generate(target, prompts, max_new_tokens=max_new)
        out = decode(target, draft, *_padded(prompts), row_keys(None, rows), costs, np.int32(max_new))
        assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
        counters = jax.device_get(out.counters["spec"])
        assert int(np.max(counters.num_drafted)) <= most * int(np.max(counters.num_drafts))
        assert int(np.max(counters.num_drafts)) <= 1


def within_remaining_reference(mean, sd, remaining):
    """`within_remaining` by hand: cap l of a row with r tokens left counts as cap min(l, r - 1)."""
    kept_mean, kept_sd = np.ones_like(mean), np.zeros_like(sd)
    for b, r in enumerate(remaining):
        for l in range(1, mean.shape[1] + 1):
            k = min(l, max(int(r), 1) - 1)
            if k > 0:
                kept_mean[b, l - 1], kept_sd[b, l - 1] = mean[b, k - 1], sd[b, k - 1]
    return kept_mean, kept_sd


def test_tokens_per_step_count_only_what_a_row_can_keep():
    """The moments the loop prices caps by count a row's tokens up to those it has left: never
    more than r, one token (no spread) at r = 1."""
    from ssd_jax.loop.acceptance import tokens_moments, within_remaining

    reached = np.full((4, 5), 10.0, np.float32)
    accepted = 0.8 * reached
    mean, sd = tokens_moments(reached, accepted, 0.8)
    remaining = np.asarray([1, 2, 4, 100], np.int32)
    kept = within_remaining(mean, sd, remaining)
    for got, want in zip(kept, within_remaining_reference(np.asarray(mean), np.asarray(sd), remaining)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert np.all(np.asarray(kept[0]) <= np.maximum(remaining, 1)[:, None])


def test_batch_steps_are_the_slowest_running_rows():
    """A batch needs the steps of its slowest running row: the renewal count r / E, plus the
    expected largest of its rows' spreads at batch > 1 (none for one row)."""
    from ssd_jax.loop.acceptance import batch_steps, expected_largest_normal

    assert float(expected_largest_normal(1)) == pytest.approx(0.0, abs=1e-6)
    assert float(expected_largest_normal(2)) == pytest.approx(0.59, abs=0.01)
    assert float(expected_largest_normal(8)) == pytest.approx(1.42, abs=0.02)
    mean = np.asarray([4.0, 2.0, 1.5], np.float32)
    sd = np.zeros(3, np.float32)
    remaining = np.asarray([100, 60, 90], np.int32)
    assert float(batch_steps(mean, sd, remaining, np.asarray([True, True, False]))) == pytest.approx(30.0)
    assert float(batch_steps(mean[:1], np.ones(1, np.float32), remaining[:1], np.ones(1, bool))) == \
        pytest.approx(25.0)
    spread = float(batch_steps(mean[:2], np.ones(2, np.float32), remaining[:2], np.ones(2, bool)))
    assert spread == pytest.approx(max(25 + 0.59 * 10 / 8, 30 + 0.59 * np.sqrt(60) / 2 ** 1.5), rel=1e-2)
    # Per cap (a trailing axis): the slowest row may differ between caps.
    by_cap = batch_steps(np.asarray([[2.0, 4.0], [1.5, 1.6]], np.float32), np.zeros((2, 2), np.float32),
                         np.asarray([40, 30], np.int32), np.ones(2, bool))
    np.testing.assert_allclose(np.asarray(by_cap), [20.0, 18.75], rtol=1e-6)
    # Never more than r: each step emits a token (here the spread term alone would count 3 x 2.6).
    wide = batch_steps(np.full(64, 1.1, np.float32), np.ones(64, np.float32), np.full(64, 3, np.int32),
                       np.ones(64, bool))
    assert float(wide) == pytest.approx(3.0)


def test_a_slow_row_shortens_the_batch_cap():
    """With one row that accepts little, a batch's cap is the one that finishes that row soonest,
    not the mean row's (at batch 8 the mean row's acceptance chose caps that lost 20-30%)."""
    from ssd_jax.loop.acceptance import batch_steps, tokens_moments

    L = 8
    cost = 1.0 + 0.3 * np.arange(L)   # a spec step at cap l: 1 + 0.3 (l - 1) AR steps
    good = np.full(L, 0.9, np.float32)
    bad = np.full(L, 0.45, np.float32)
    reached = np.full((2, L), 1e5, np.float32)
    accepted = np.stack([good, bad]) * reached
    mean, sd = tokens_moments(reached, accepted, 0.5)
    fastest_mean_row = int(np.argmax(np.asarray(mean[0]) / cost)) + 1
    seconds = np.asarray(batch_steps(mean, sd, np.asarray([128, 128]), np.ones(2, bool))) * cost
    assert int(np.argmin(seconds)) + 1 < fastest_mean_row


def test_cap_choice_sticks_where_caps_are_dispatched():
    """The fastest cap, but where each cap is its own program (dispatched per run of steps) the
    current cap stays unless another is SWITCH_MARGIN faster (near ties made SD flip between caps
    1 and 2 every few steps at batch 8, 0.93 of fixed L=2 against 0.99 with the margin); exact
    ties go to the longer cap."""
    from ssd_jax.loop.acceptance import SWITCH_MARGIN, cap_index

    near = 1 - SWITCH_MARGIN / 2
    seconds = np.asarray([10.0, 10.0 * near, 12.0, np.inf], np.float32)
    current = np.int32(0)
    assert int(cap_index(seconds, current, sticky=False)) == 1
    assert int(cap_index(seconds, current, sticky=True)) == 0
    faster = seconds.copy()
    faster[1] = 10.0 * (1 - 2 * SWITCH_MARGIN)
    assert int(cap_index(faster, current, sticky=True)) == 1
    assert int(cap_index(faster, np.int32(2), sticky=True)) == 1
    tied = np.asarray([10.0, 9.0, 9.0, np.inf], np.float32)
    assert int(cap_index(tied, current, sticky=False)) == 2


def test_stale_next_cap_gets_a_probe():
    """Where caps are dispatched at batch > 1, a cap whose next candidate's first new position
    has decayed below PROBE_BELOW steps of evidence (over the running rows) runs at that
    candidate instead, if the model prices it within PROBE_WITHIN of the current cap; fresh
    evidence, the longest cap, a next cap priced far dearer, or only finished rows holding the
    evidence leave it where it is."""
    from ssd_jax.loop.acceptance import PROBE_BELOW, PROBE_WITHIN, probe_up

    candidate = np.asarray([True, True, False, True, False, False, False, True])
    running = np.ones(4, bool)
    stale = np.full((4, 8), 0.5 * PROBE_BELOW, np.float32)
    fresh = np.full((4, 8), 2.0 * PROBE_BELOW, np.float32)
    even = np.full(8, 10.0, np.float32)
    assert int(probe_up(np.int32(0), candidate, stale, running, even)) == 1
    assert int(probe_up(np.int32(1), candidate, stale, running, even)) == 3   # cap 3 is not compiled: index 3 is cap 4
    assert int(probe_up(np.int32(7), candidate, stale, running, even)) == 7
    assert int(probe_up(np.int32(1), candidate, fresh, running, even)) == 1
    # A next cap priced just within PROBE_WITHIN is probed; one priced beyond it is not.
    near = np.asarray([10, 10, np.inf, 10, np.inf, np.inf, np.inf, 10 * (1 + PROBE_WITHIN) - 0.01], np.float32)
    dear = near.copy()
    dear[7] = 10 * (1 + PROBE_WITHIN) + 0.1
    assert int(probe_up(np.int32(3), candidate, stale, running, near)) == 7
    assert int(probe_up(np.int32(3), candidate, stale, running, dear)) == 3
    # Only the running rows' evidence counts: a finished row's fresh sums do not hide a stale cap.
    mixed = stale.copy()
    mixed[0] = 100.0
    assert int(probe_up(np.int32(0), candidate, mixed, np.asarray([False, True, True, True]), even)) == 1
    assert int(probe_up(np.int32(0), candidate, mixed, running, even)) == 0


def test_unmeasured_positions_get_an_optimistic_acceptance():
    """The cap choice's optimism (EXPLORE standard errors) lifts a position's acceptance the less
    it was measured, and not at all where the evidence is overwhelming; a position measured low
    a few times and then decayed gets tried again."""
    from ssd_jax.loop.acceptance import reach_probabilities
    from ssd_jax.loop.adaptive_loop import EXPLORE

    assert EXPLORE > 0
    reached = np.asarray([50.0, 50.0, 1.0, 1.0], np.float32)
    accepted = np.asarray([40.0, 30.0, 0.0, 0.0], np.float32)
    plain = np.asarray(reach_probabilities(reached, accepted, 0.7))
    hopeful = np.asarray(reach_probabilities(reached, accepted, 0.7, optimism=EXPLORE))
    alpha, alpha_up = plain / np.append(1.0, plain[:-1]), hopeful / np.append(1.0, hopeful[:-1])
    lift = alpha_up - alpha
    assert np.all(lift > 0) and lift[2] > 2 * lift[1]
    many = np.asarray(reach_probabilities(reached * 1e6, accepted * 1e6, 0.7, optimism=EXPLORE))
    np.testing.assert_allclose(many, np.asarray(reach_probabilities(reached * 1e6, accepted * 1e6, 0.7)),
                               atol=1e-3)


def test_rows_borrow_the_batchs_acceptance_by_position():
    """At batch > 1 a row's estimate at a position it reached a few times (a probe of the next cap)
    is pulled towards its own pooled acceptance times the batch's shape there, so what 8 rows
    measured together counts: acceptance 0.92 at position 2 after 0.6 at position 1 reads 0.85,
    against 0.69 pulled towards the row's pooled acceptance alone. A position nobody reached keeps
    the pooled guess (shape 1), and rows that stopped running do not count."""
    from ssd_jax.loop.acceptance import position_shape, reach_probabilities

    reached = np.tile(np.asarray([30.0, 2.4], np.float32), (8, 1))
    accepted = np.tile(np.asarray([18.0, 2.2], np.float32), (8, 1))
    running = np.ones(8, bool)

    def alpha(p):
        p = np.asarray(p)
        return p[..., 1] / p[..., 0]

    flat = alpha(reach_probabilities(reached, accepted, 0.6))
    shape = np.asarray(position_shape(reached, accepted, running, 0.6))
    shaped = alpha(reach_probabilities(reached, accepted, 0.6, shape=shape))
    np.testing.assert_allclose(flat, 0.69, atol=0.01)
    np.testing.assert_allclose(shaped, 0.85, atol=0.01)
    assert shape[1] > 1.3 and shape[0] < 1.0
    unreached = np.asarray(position_shape(reached * [1, 0], accepted * [1, 0], running, 0.6))
    np.testing.assert_allclose(unreached[1], 1.0, atol=1e-5)
    # A finished row's sums (here: never past position 1) leave the running rows' shape as it is.
    mixed_reached, mixed_accepted = reached.copy(), accepted.copy()
    mixed_reached[0], mixed_accepted[0] = [500.0, 0.0], [100.0, 0.0]
    finished = running.copy()
    finished[0] = False
    np.testing.assert_allclose(np.asarray(position_shape(mixed_reached, mixed_accepted, finished, 0.6)),
                               np.asarray(position_shape(reached[1:], accepted[1:], running[1:], 0.6)), rtol=1e-5)


def test_measured_cap_costs_steer_the_cap(models):
    """A draft that is always right drafts to the longest cap where caps cost what the line
    through the first inputs says, and to a shorter one where the measured step time of the
    longest (the cost inputs' per-cap table) makes it a bad deal; greedy output is AR's either way."""
    target, _ = models
    sure = target.with_params(jax.tree.map(lambda x: 8 * x, target.params))  # sharp laws
    prompts = [[3, 4, 5, 6], [7]]
    ar = ssd_jax.generate(sure, prompts, max_new_tokens=40)
    linear = np.asarray([1.0, 1.2, 0.05, 0.9, 0.0, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)   # L = 8
    pricey = linear.copy()
    pricey[5:] = [1.2, 1.25, 0.0, 1.35, 0.0, 0.0, 0.0, 40.0]
    drafted = []
    for costs in (linear, pricey):
        out = _decode(sure, sure, prompts, ssd_jax.SD(draft_len="auto"), costs, SamplingParams(), row_keys(None, 2),
                      40, draft_len=8)
        assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
        counters = jax.device_get(out.counters["spec"])
        drafted.append(counters.num_drafted.sum() / counters.num_drafts.sum())
    assert drafted[0] > 6 and drafted[1] <= 4


def test_measured_cap_prices_are_fitted_nondecreasing():
    """A longer cap priced below a shorter one is pooled with it (their mean, least squares);
    unmeasured caps stay 0 and prices already in order are kept as measured."""
    fitted = cost_model.nondecreasing([2.0, 2.66, 0.0, 2.52, 0.0, 0.0, 0.0, 2.56])
    np.testing.assert_allclose(fitted, [2.0, 2.58, 0, 2.58, 0, 0, 0, 2.58], rtol=1e-6)
    np.testing.assert_allclose(cost_model.nondecreasing([3.0, 1.0, 2.0, 5.0]), [2.0, 2.0, 2.0, 5.0], rtol=1e-6)
    in_order = [1.2, 1.25, 0.0, 1.35, 0.0, 0.0, 0.0, 40.0]
    np.testing.assert_array_equal(cost_model.nondecreasing(in_order), np.float32(in_order))
    np.testing.assert_array_equal(cost_model.nondecreasing(np.zeros(4)), np.zeros(4))


def test_calibration_rounds_are_pooled_by_a_trimmed_mean():
    """One round's outlier (the machine slowed during it) is dropped, not averaged in."""
    assert cost_model.trimmed_mean([2.0, 2.2, 9.0, 2.1, 0.1]) == pytest.approx(2.1)
    assert cost_model.trimmed_mean([3.0, 1.0]) == pytest.approx(2.0)


def test_tokens_per_step_model_matches_enumeration():
    """The loop's E(l) and spread of the tokens a capped step emits, against the law of T written
    out: T = 1 + (accepted tokens), P(T > k) = prod_{j<=k} alpha_j for k <= cap."""
    from ssd_jax.loop.acceptance import expected_tokens_by_cap, tokens_mean_and_spread

    alpha = np.asarray([0.9, 0.6, 0.5, 0.2], np.float32)
    reached = np.asarray([4.0, 3.0, 2.0, 1.0], np.float32) * 1e5   # enough evidence that pooling is negligible
    accepted = alpha * reached
    survive = np.cumprod(alpha)
    for cap in range(1, 5):
        tail = np.append(survive[:cap], 0.0)
        law = np.append(1 - survive[0], -np.diff(tail))   # P(T = 1), ..., P(T = cap + 1)
        t = np.arange(1, cap + 2)
        mean, sd = tokens_mean_and_spread(reached, accepted, 0.5, cap)
        assert float(mean) == pytest.approx(np.sum(t * law), rel=1e-5)
        assert float(sd) == pytest.approx(np.sqrt(np.sum(t * t * law) - np.sum(t * law) ** 2), rel=1e-4)
        assert float(expected_tokens_by_cap(reached, accepted, 0.5)[cap - 1]) == pytest.approx(float(mean), rel=1e-5)
    # No evidence at all: the prior acceptance; at one position only: the pooled acceptance.
    assert float(expected_tokens_by_cap(np.zeros(2, np.float32), np.zeros(2, np.float32), 0.5)[1]) == \
        pytest.approx(1.75)
    e = expected_tokens_by_cap(np.asarray([1e5, 0.0], np.float32), np.asarray([8e4, 0.0], np.float32), 0.5)
    assert float(e[1] - e[0]) == pytest.approx(0.8 * 0.8, rel=1e-3)


def test_verification_widths_follow_the_cap():
    from ssd_jax.loop.speculative import SpeculativeParts

    def caps(L, threshold):
        return SpeculativeParts(method="sd", num_draft_tokens=L, num_paths=1, tparams={}, tcfg=None, dparams={},
                                dcfg=None, sampling=SamplingParams(), capacity=64, threshold=threshold).verify_caps

    assert caps(8, 0.02) == (2, 4, 8) and caps(5, 0.0) == (2, 4, 5) and caps(2, 0.02) == (2,)
    assert caps(8, None) == (8,)   # fixed lengths: one width


def test_early_stop_defaults_to_greedy_only():
    assert ssd_jax.SD(draft_len="auto").early_stop(True) == ssd_jax.methods.GREEDY_THRESHOLD
    assert ssd_jax.SD(draft_len="auto").early_stop(False) == 0.0
    assert ssd_jax.BV(draft_len="auto", threshold=0.3).early_stop(False) == 0.3


def test_cost_model_choices(monkeypatch):
    cheap = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.01, draft=0.02)
    assert cost_model.choose_draft_len(cheap, 0.9, 8) > cost_model.choose_draft_len(cheap, 0.4, 8)
    assert cost_model.predicted_speedup(cheap, 0.0, 1) < 1 < cost_model.predicted_speedup(cheap, 0.8, 4)
    assert cost_model.acceptance_of(0, 0) is None and cost_model.acceptance_of(3, 1) == 0.75
    for tuner in (Tuner(), Tuner(deterministic=True)):
        assert tuner.acceptance_for("k") == cost_model.PRIOR_ACCEPTANCE
        tuner.remember_acceptance("k", 0.2)
        tuner.remember_acceptance("k", 0.6)
    assert tuner.acceptance_for("k") == cost_model.PRIOR_ACCEPTANCE   # a deterministic call ignores the past
    assert Tuner().acceptance_for("k") == cost_model.PRIOR_ACCEPTANCE   # a tuner sees only its own memory
    remembering = Tuner()
    remembering.remember_acceptance("k", 0.2)
    remembering.remember_acceptance("k", 0.6)
    assert remembering.acceptance_for("k") == pytest.approx(0.4)


def test_decayed_means_weigh_recent_values_and_may_start_as_a_plain_mean():
    decayed, running = memory.DecayedMeans(0.25), memory.DecayedMeans(0.25, running_start=True)
    for value in (4.0, 0.0, 0.0, 0.0, 8.0):
        decayed.add("k", value)
        running.add("k", value)
    assert decayed.lookup("k") == pytest.approx(4.0 * 0.75 ** 4 + 0.25 * 8.0)   # the first value decays from 1
    assert running.lookup("k") == pytest.approx(0.75 * 1.0 + 0.25 * 8.0)   # (4 + 0 + 0 + 0) / 4, then 8 at 1/4
    assert running.lookup("other") is None and running.lookup("other", 3.0) == 3.0
    running.clear()
    assert running.lookup("k") is None


def test_command_line_takes_auto():
    import argparse

    from ssd_jax.cli.generate_cmd import build_method, draft_len_arg

    args = argparse.Namespace(method="bv", num_draft_tokens=draft_len_arg("auto"), max_draft_len=6,
                              draft_threshold=0.05)
    assert build_method(args) == ssd_jax.BV(draft_len="auto", max_draft_len=6, threshold=0.05)
    with pytest.raises(argparse.ArgumentTypeError, match="'often'"):
        draft_len_arg("often")
    args = argparse.Namespace(method="pld", num_draft_tokens="auto", max_draft_len=4)
    assert build_method(args) == ssd_jax.PLD(draft_len="auto", max_draft_len=4)
    args = argparse.Namespace(method="csd", max_draft_tokens=draft_len_arg("auto"))
    assert build_method(args) == ssd_jax.CSD(max_draft_tokens="auto") and build_method(args).adaptive


def test_auto_inside_a_users_jit_equals_autoregressive(models):
    """decode under the user's jit cannot measure: it plans from what the process knows."""
    target, draft = models
    tokens = np.array([[3, 4, 5, 6], [9, 0, 0, 0]], np.int32)
    lengths = np.array([4, 1], np.int32)

    @jax.jit
    def run(target, draft, tokens, lengths):
        out = ssd_jax.decode(target, tokens, lengths, method=ssd_jax.SD(draft_len="auto"), max_new_tokens=24,
                             key=jax.random.PRNGKey(0), draft=draft)
        return out.tokens, out.num_tokens

    ar = ssd_jax.decode(target, tokens, lengths, method="ar", max_new_tokens=24, key=jax.random.PRNGKey(0))
    new_tokens, counts = run(target, draft, tokens, lengths)
    assert np.array_equal(np.asarray(new_tokens), np.asarray(ar.tokens))
    assert np.array_equal(np.asarray(counts), np.asarray(ar.num_tokens))


def test_remembered_values_are_bounded_and_tied_to_living_weights():
    recent = memory.Recent(limit=2)
    for i in range(3):
        recent.store(i, i)
    assert list(recent) == [1, 2] and recent.lookup(0, "gone") == "gone"
    recent.lookup(1)
    recent.store(3, 3)
    assert list(recent) == [1, 3]

    a, b = {"w": jax.numpy.ones(2)}, {"w": jax.numpy.zeros(2)}
    assert memory.ParamsIdentity(a, b) == memory.ParamsIdentity(a, b)
    assert memory.ParamsIdentity(a, b) != memory.ParamsIdentity(b, a)
    assert memory.ParamsIdentity(a, b) != memory.ParamsIdentity({"w": jax.numpy.ones(2)}, b)


def test_target_cache_leaves_out_the_drafts_lag(models):
    """Under "auto" SD and CSD size their buffers for drafters that lag by a plain phase; the
    target's cache of a chain (one path, PLD, CSD) takes only the prompt and the outputs, a
    tree's also one step's room, and rows still reach max_new_tokens."""
    from ssd_jax.loop.decoder import make_parts
    from ssd_jax.loop.skeleton import target_capacity

    target, draft = models
    plan = cost_model.AutoPlan(draft_len=8, threshold=0.5, capped=True)
    parts = make_parts(ssd_jax.SD(draft_len="auto"), target, draft, SamplingParams(), 64, 128, plan=plan)
    assert parts.capacity >= 64 + 128 + parts.room + 24
    assert target_capacity(parts, 64, 128) == 64 + 128
    for method in (ssd_jax.PLD(draft_len="auto"), ssd_jax.CSD(max_draft_tokens="auto")):
        parts = make_parts(method, target, draft, SamplingParams(), 64, 128, plan=plan)
        assert target_capacity(parts, 64, 128) == 64 + 128
    tree_plan = cost_model.AutoPlan(draft_len=8, threshold=None, capped=False)
    for method in (ssd_jax.LogitSpec(draft_len=8, tree_size=16), ssd_jax.SpecInfer(draft_len=4, paths=2)):
        fixed = make_parts(method, target, draft, SamplingParams(), 64, 128)
        assert target_capacity(fixed, 64, 128) == 64 + 128 + fixed.room + 2
        # Under the adaptive loop, which decodes plainly while a tree lacks room (SpecInfer) or
        # keeps the tree's nodes that have a slot (LogitSpec):
        adaptive = make_parts(method, target, draft, SamplingParams(), 64, 128, plan=tree_plan)
        assert target_capacity(adaptive, 64, 128) == 64 + 128


# Speculation cheaper than a plain step: the loop never decodes plainly by choice.
SPECULATION_PAYS = np.asarray([1.0, 0.5, 0.0, 0.9, 0.0], np.float32)


@pytest.mark.parametrize("costs, rows, gated, temperature", [
    (SPECULATION_PAYS, 1, True, 0.0), (SPECULATION_PAYS, 1, True, 1.0), (ALWAYS_SPECULATE, 1, False, 0.0),
    (SPECULATION_PAYS, 2, False, 0.0)], ids=["one-row", "one-row-coupled-t1", "forced", "two-rows"])
def test_logitspec_auto_verifies_a_tree_only_where_it_retrieved(models, costs, rows, gated, temperature):
    """At one row under "auto", a LogitSpec step whose root branch retrieved nothing runs as a
    plain step, counted with the plain ones; the prompt repeats no token, so its first steps
    retrieve nothing, and the text the model writes soon repeats. Under a forced cap (the
    calibration's timing of a tree's verification) and at two rows every step verifies its tree.
    The tokens are AR's either way: greedy, and at T=1 under the Gumbel coupling, where a plain
    step drawing with another step's noise would differ."""
    target, _ = models
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    prompts = [list(range(3, 43))] * rows
    key = jax.random.PRNGKey(3)
    coupling = dict(temperature=temperature, coupling="gumbel") if temperature else {}
    sampling = SamplingParams(**coupling)
    ar = ssd_jax.generate(target, prompts, max_new_tokens=32, key=key, **coupling)
    out = _decode(target, target, prompts, ssd_jax.LogitSpec(draft_len="auto", tree_size=8), costs, sampling,
                  row_keys(key, rows, sampling), 32, draft_len=4)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    counters = jax.device_get(out.counters["spec"])
    plain, verified = int(counters.ar_steps.max()), int(counters.cap_steps.sum())
    assert plain + verified == int(counters.target_calls) - 1   # every step after the prefill is one or the other
    assert verified > 0 and int(counters.num_drafts.max()) == verified
    assert (plain > 0) == gated


@pytest.mark.parametrize("method", [ssd_jax.SD(draft_len="auto"), ssd_jax.PLD(draft_len="auto"),
                                    pytest.param(ssd_jax.CSD(max_draft_tokens="auto"), marks=pytest.mark.slow),
                                    ssd_jax.LogitSpec(draft_len="auto", tree_size=16),
                                    ssd_jax.SpecInfer(draft_len="auto", paths=2)],
                         ids=["sd", "pld", "csd", "logitspec", "specinfer"])
def test_speculation_up_to_the_end_of_a_cache_without_room(models, method):
    """The target's cache has no slot past prompt + outputs under "auto", and every step it can
    speculates up to 8 tokens (the draft is the target, the prompts repeat). A chain's last drafts
    reach past the cache, their writes dropped; LogitSpec's tree keeps the nodes with a slot; a
    SpecInfer tree decodes plainly once a row lacks its room. The output is still AR's to the
    last token, ending on max_new_tokens (a query that read a dropped slot, or a row stopped for
    want of room, fails)."""
    target, _ = models
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    prompts = [[3 + i % 50 for i in range(64)], [9, 2, 9, 2, 9, 2]]
    ar = ssd_jax.generate(target, prompts, max_new_tokens=61)
    out = _decode(target, target, prompts, method, ALWAYS_SPECULATE, SamplingParams(), row_keys(None, 2), 61,
                  draft_len=8 if method.name != "specinfer" else 4)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar.tokens
    assert np.all(np.asarray(out.finish_reason) == 2)   # "length": max_new_tokens, not the cache
    counters = jax.device_get(out.counters["spec"])
    assert counters.num_drafted.sum() / counters.num_drafts.sum() > 2   # long drafts, to the last step
    room_gated = method.name == "specinfer"
    assert (counters.ar_steps.max() > 0) == room_gated   # plain steps only where a tree lacked room
