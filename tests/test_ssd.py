"""SSD (speculative speculative decoding, Saguaro) is lossless: greedy output equals autoregressive
output, the sampled law equals the target's; its speculation cache holds exactly what a
synchronous draft would draft; target and draft arrays live on their own device groups.

Multi-device checks need fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N),
which must be set before jax is imported; the rest of the suite runs with one device in this
process, so each multi-device check runs `tests/ssd_multidevice.py` in a subprocess.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from subprocess_env import fake_devices_env

import ssd_jax
from method_options import make
from ssd_jax import verify
from ssd_jax.draft.fanout import FanoutEstimator, SlotLayout, geometric_fanout, uniform_fanout
from ssd_jax.draft.saguaro import draft_chain, sample_blocked, saguaro_reshape
from ssd_jax.ssd import auto as ssd_auto
from ssd_jax.ssd import call as ssd_call
from ssd_jax.ssd import plain_read
from ssd_jax.runtime.decode_program import bare
from ssd_jax.ssd import steps as ssd_steps
from ssd_jax.loop.autoregressive import prefill
from ssd_jax.errors import InputError
from ssd_jax.models.transformer import forward_cached, forward_full
from ssd_jax.coupling import decision_logits
from ssd_jax.runtime.prompts import prepare_prompts, row_keys
from ssd_jax.sampling import SamplingParams, argmax_first, probabilities
from ssd_jax.tuning import cost_model, measure
from ssd_jax.tuning.memory import Recent
from ssd_jax.tuning.tuner import DETERMINISTIC_ENV
from spec_models import llama, noisy_copy
from tuning_helpers import deterministic, measuring, use_tuner

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def models():
    """A 2-layer random target and a lightly perturbed copy: acceptance ~0.4-0.6, so hits,
    misses and every outcome depth occur."""
    target = llama(64, 64, 2, seed=0)
    return target, noisy_copy(target, 0.03, 5)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(2, 64, n).tolist() for n in (6, 1, 13)]


@pytest.fixture(scope="module")
def reference(models, prompts):
    return ssd_jax.generate(models[0], prompts, max_new_tokens=40)


# ---------------------------------------------------------------------------------- greedy == AR

@pytest.mark.parametrize("options", [
    dict(fanout="uniform"),
    dict(fanout="geometric", fanout_budget=6, num_draft_tokens=3),
    dict(fanout="geometric", saguaro_c=0.3, fallback="ngram"),
    dict(fanout="uniform", fanout_budget=3, num_draft_tokens=5, fallback="auto"),
    dict(fanout="geometric", fanout_budget=1, num_draft_tokens=1, saguaro_c=0.0),
])
def test_greedy_equals_autoregressive_batched_and_alone(models, prompts, reference, options):
    target, draft = models
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=make("ssd", **options), draft=draft)
    assert out.tokens == reference.tokens
    assert out.finish_reasons == reference.finish_reasons
    s = out.stats
    assert s["num_accepted_tokens"] > 0 and s["colocated"] is True
    assert 0 < s["cache_hit_rate"] < 1 and s["fallback_rows"] > 0  # both paths were taken
    assert sum(s["outcomes_by_accepted_length"]) == s["cache_lookups"]
    alone = ssd_jax.generate(target, prompts[2:3], max_new_tokens=40, method=make("ssd", **options), draft=draft)
    assert alone.tokens[0] == out.tokens[2]


def test_greedy_matches_sd_acceptance_and_a_perfect_draft_always_hits(models, prompts):
    """At temperature 0 the speculations are the draft's greedy chains, as in SD: same acceptance.
    With the target as its own draft every outcome is (L, argmax): every lookup hits."""
    target, draft = models
    sd = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SD(draft_len=4), draft=draft)
    ssd = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len=4), draft=draft)
    assert ssd.stats["num_accepted_tokens"] == sd.stats["num_accepted_tokens"]
    assert ssd.stats["num_drafts"] == sd.stats["num_drafts"]
    perfect = ssd_jax.generate(target, prompts, max_new_tokens=40, method="ssd", draft=target)
    assert perfect.stats["acceptance_rate"] == 1.0 and perfect.stats["cache_hit_rate"] == 1.0
    assert perfect.stats["fallback_calls"] == 1  # only the very first speculation
    assert perfect.tokens == ssd_jax.generate(target, prompts, max_new_tokens=40).tokens


def test_embedded_pair_greedy_equals_autoregressive():
    target, draft = ssd_jax.default_models()
    texts = ["def fibonacci(n):", "import os\n\nclass Config:", "for i in range("]
    prompts = [target.tokenizer.encode(t).ids for t in texts]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=48)
    for options in (dict(), dict(fanout="uniform", saguaro_c=0.5, fallback="ngram")):
        out = ssd_jax.generate(target, prompts, max_new_tokens=48, method=make("ssd", **options), draft=draft)
        assert out.tokens == reference.tokens
        assert out.stats["cache_hit_rate"] > 0.5
    alone = ssd_jax.generate(target, prompts[:1], max_new_tokens=48, method="ssd", draft=draft)
    assert alone.tokens[0] == reference.tokens[0]


def test_auto_fallback_switches_to_ngram_at_large_batch(models):
    target, draft = models
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 64, 5).tolist() for _ in range(8)]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=24)
    out = ssd_jax.generate(target, prompts, max_new_tokens=24, method=ssd_jax.SSD(fallback="auto"), draft=draft)
    assert out.stats["fallback"] == "ngram" and out.tokens == reference.tokens
    small = ssd_jax.generate(target, prompts[:2], max_new_tokens=24, method=ssd_jax.SSD(fallback="auto"), draft=draft)
    assert small.stats["fallback"] == "jit" and small.tokens == reference.tokens[:2]


def test_eos_and_streaming(models, prompts):
    """Rows end at EOS exactly as AR's do; the stream carries the same tokens."""
    target, draft = models
    with_eos = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(7, 19)))
    reference = ssd_jax.generate(with_eos, prompts, max_new_tokens=40)
    got: list[list[int]] = [[] for _ in prompts]

    def sink(tokens, counts):
        for row in range(len(prompts)):
            got[row].extend(int(t) for t in tokens[row, : counts[row]])

    out = ssd_jax.generate(with_eos, prompts, max_new_tokens=40, method="ssd", draft=draft, stream=sink)
    assert out.tokens == reference.tokens and out.finish_reasons == reference.finish_reasons
    assert got == out.tokens


def test_a_sink_gets_copies_it_may_change(models, prompts, reference):
    """The stream's sink gets arrays of its own: one that clears what it was handed (a buffer it
    reuses) leaves the decode AR's (SSD handed it its live decode arrays: the next step read the
    zeros)."""
    target, draft = models
    got: list[list[int]] = [[] for _ in prompts]

    def clearing_sink(tokens, counts):
        for row in range(len(prompts)):
            got[row].extend(int(t) for t in tokens[row, : counts[row]])
        tokens[:] = 0
        counts[:] = 0

    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len=3), draft=draft,
                           stream=clearing_sink)
    assert out.tokens == reference.tokens and got == out.tokens


def test_host_queues_each_step_before_reading_the_one_before(models, prompts, monkeypatch):
    """The host loop queues step s+1 before it reads step s (so its work overlaps the devices'),
    and stops queueing ahead once no row surely needs another step. A step queued for rows that
    all ended at an EOS meanwhile changes nothing: tokens, finish reasons and every counter equal
    those of the loop reading each step before queueing the next."""
    import ssd_jax.ssd.host_loop as ssd_engine

    target, draft = models
    # One row ending at an EOS well before max_new_tokens: the step queued ahead of that read is for no row.
    alone = ssd_jax.generate(target, prompts[:1], max_new_tokens=40).tokens[0]
    eos = next(t for i, t in enumerate(alone) if i >= 8 and t not in alone[:i])
    with_eos = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(eos,)))
    events: list[str] = []
    original_dispatch, original_absorb = ssd_engine._Decode.dispatch_step, ssd_engine._Decode.absorb

    def dispatch(self, *args):
        events.append("D")
        return original_dispatch(self, *args)

    def absorb(self, flight):
        events.append("a" if self.done.all() else "A")   # "a": queued for rows that had all ended
        return original_absorb(self, flight)

    monkeypatch.setattr(ssd_engine._Decode, "dispatch_step", dispatch)
    monkeypatch.setattr(ssd_engine._Decode, "absorb", absorb)
    method = ssd_jax.SSD(draft_len=3)
    calls = ((target, prompts), (with_eos, prompts[:1]))
    ahead = [ssd_jax.generate(model, rows, max_new_tokens=40, method=method, draft=draft) for model, rows in calls]
    sequence = "".join(events)
    assert sequence.startswith("DDADA") and "AA" in sequence   # ahead, then reading out at a call's end
    assert "a" in sequence and events.count("D") == events.count("A") + events.count("a")
    events.clear()
    monkeypatch.setattr(ssd_engine._Decode, "surely_continues", lambda self, unread: False)
    reading = [ssd_jax.generate(model, rows, max_new_tokens=40, method=method, draft=draft) for model, rows in calls]
    assert "DD" not in "".join(events)
    for a, r in zip(ahead, reading):
        assert a.tokens == r.tokens and a.finish_reasons == r.finish_reasons
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_calls", "ssd_steps",
                    "accepted_per_position", "cache_lookups", "outcomes_by_accepted_length"):
            assert a.stats[key] == r.stats[key], key
    assert ahead[1].finish_reasons == ["eos"] and len(ahead[1].tokens[0]) < 30


# ---------------------------------------------------------------------------------- draft_len="auto"

SWITCHES = {"never": lambda self: False, "after-one-step": lambda self: self.seen >= 1,
            "measured": ssd_auto.PlainSwitch.slower_than_plain}


@pytest.fixture(autouse=True)
def tuner(monkeypatch):
    """Each test starts with no program remembered as slower than plain decoding, and "auto"
    measures (the switch compares timings): a fresh measuring tuner, the default for the test."""
    return measuring(monkeypatch)


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_auto_greedy_equals_autoregressive_and_streams(models, prompts, reference, monkeypatch, switch, tuner):
    """draft_len="auto": SSD steps, then (if the switch says SSD is slower) plain decoding chunks
    to the end: the AR tokens, streamed as they come."""
    target, draft = models
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES[switch])
    monkeypatch.setattr(tuner.ssd, "plain_runs", Recent())
    got: list[list[int]] = [[] for _ in prompts]

    def sink(tokens, counts):
        for row in range(len(prompts)):
            got[row].extend(int(t) for t in tokens[row, : counts[row]])

    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft, stream=sink)
    assert out.tokens == reference.tokens and got == out.tokens
    assert out.stats["adaptive"] and 1 <= out.stats["planned_draft_len"] <= 4 and out.stats["plain_step_s"] > 0
    if switch == "never":
        assert out.stats["switched_to_plain_at_step"] is None and out.stats["ar_fallback_share"] == 0
    if switch == "after-one-step":
        # the step queued before the first was read finishes first (SSD's host loop runs a step ahead)
        assert out.stats["switched_to_plain_at_step"] == 2 and out.stats["ssd_steps"] == 2
        assert out.stats["ar_fallback_share"] > 0.5
        # its plain chunks (16 steps, compiled by the plain step's measurement) timed the plain step
        assert all(seconds > 0 for runs in tuner.ssd.plain_runs.values() for seconds in runs)
        assert sum(map(len, tuner.ssd.plain_runs.values())) >= 1


def _resuming(monkeypatch, chunk: int = ssd_auto.PLAIN_CHUNK) -> None:
    """SSD "auto" switching to plain after each SSD step and resuming after every plain chunk
    the draft read (plain chunks of `chunk` tokens), as often as MAX_RESUMES allows."""
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["after-one-step"])
    monkeypatch.setattr(ssd_auto, "PLAIN_CHUNK", chunk)
    monkeypatch.setattr(ssd_auto, "RESUME_MIN_TOKENS", 1)
    monkeypatch.setattr(ssd_auto, "may_resume", lambda *args: True)
    monkeypatch.setattr(ssd_auto.ReadAcceptance, "resume_pays", lambda self, *args: 2.0)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("coupling", ["greedy", "gumbel"])
def test_ssd_resumed_after_plain_stretches_keeps_autoregressive_tokens(models, prompts, monkeypatch, streaming,
                                                                       coupling):
    """SSD resumed after plain stretches (the draft read each one, `ssd_steps.draft_read`), again
    and again: greedy output is AR's, and under the Gumbel coupling at T=1 AR's sampled tokens,
    streamed as they come."""
    target, draft = models
    _resuming(monkeypatch, chunk=4)
    sampling = dict() if coupling == "greedy" else dict(temperature=1.0, coupling="gumbel")
    reference = ssd_jax.generate(target, prompts, max_new_tokens=40, **sampling)
    got: list[list[int]] = [[] for _ in prompts]

    def sink(tokens, counts):
        for row in range(len(prompts)):
            got[row].extend(int(t) for t in tokens[row, : counts[row]])

    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=3),
                           draft=draft, stream=sink if streaming else None, **sampling)
    assert out.tokens == reference.tokens and (got == out.tokens or not streaming)
    # Each SSD stretch runs two steps: the one read and the one queued ahead of that read.
    assert out.stats["ssd_resumed"] == ssd_auto.MAX_RESUMES and out.stats["switched_to_plain_at_step"] == 2
    assert out.stats["ssd_steps"] == 2 * (1 + ssd_auto.MAX_RESUMES)


def test_resuming_needs_the_reads_to_predict_a_cheaper_token():
    """The reads' acceptance (of the live row reading lowest) predicts SSD's pace; SSD resumes
    where its window's step time at that pace beats plain decoding by RESUME_MARGIN, and the
    stretch is read only where a step accepting every draft token could pay."""
    reads = ssd_auto.ReadAcceptance.empty(2)
    live = np.array([True, True])
    assert reads.pace(live, 4) is None   # nothing read yet
    chunk = ssd_auto.PLAIN_CHUNK
    reads.add(np.array([[1.0] * chunk, [0.5] * chunk]), np.array([chunk, chunk]))
    assert reads.pace(live, 4) == pytest.approx(cost_model.expected_tokens(0.5, 4))    # the lower row
    assert reads.pace(np.array([True, False]), 4) == pytest.approx(cost_model.expected_tokens(1.0, 4))
    pace = cost_model.expected_tokens(0.5, 4)   # 1.94 tokens a step
    assert reads.resume_pays(live, 4, step_s=1.5, plain_step_s=1.0) == pytest.approx(pace)   # 0.77 a token
    assert reads.resume_pays(live, 4, step_s=1.8, plain_step_s=1.0) is None                  # 0.93: too close
    assert reads.resume_pays(live, 4, step_s=None, plain_step_s=1.0) is None
    reads.add(np.zeros((2, chunk)), np.array([chunk, chunk]))   # the last chunk weighs READ_DECAY against 1
    assert reads.pace(np.array([True, False]), 4) == pytest.approx(cost_model.expected_tokens(
        ssd_auto.READ_DECAY / (1 + ssd_auto.READ_DECAY), 4))
    assert ssd_auto.may_resume(4.0, 1.0, 4) and not ssd_auto.may_resume(4.6, 1.0, 4)
    assert not ssd_auto.may_resume(None, 1.0, 4)


def test_a_resumed_switch_judges_its_window_afresh():
    """On resuming, the switch's window restarts (one step unjudged, then MIN_STEPS judged ones
    before it may switch again) and weighs its pace against the reads' prediction, not the
    program's past calls; the call's totals go on."""
    switch = ssd_auto.PlainSwitch(1.0, prior_log_ratio=0.5)
    for _ in range(ssd_auto.WARMUP_STEPS + ssd_auto.MIN_STEPS):
        switch.record(2.0, 1.0)
    assert switch.slower_than_plain()
    spent = switch.spent_steps
    switch.resume(3.0)
    assert switch.steps == 0 and not switch.slower_than_plain()
    assert switch.prior_log_ratio is None and switch.prior_pace == 3.0
    switch.record(9.0, 1.0)   # unjudged: drafted on the critical path
    for _ in range(ssd_auto.MIN_STEPS):
        switch.record(1.5, 2.0)   # 0.75 s a token, against plain decoding's 1 s
    assert switch.steps == ssd_auto.MIN_STEPS and not switch.slower_than_plain()
    assert switch.spent_steps == spent + 1 + ssd_auto.MIN_STEPS


@pytest.mark.parametrize("streaming", [False, True])
def test_auto_remembers_that_ssd_was_slower(models, prompts, reference, monkeypatch, streaming, tuner):
    """A call that switched to plain decoding makes the next calls of the program decode plainly
    from the start (no SSD step, no draft prefill), all but every PROBE_EVERY-th, which runs SSD
    again; a probe that finds SSD faster ends it. Tokens are the AR tokens every time."""
    target, draft = models
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY", 3)
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY_MAX", 3)   # the backoff: test_probes_back_off
    monkeypatch.setattr(tuner.ssd.ratios, "weight", 1.0)  # each call's own ratio (the mean: its own test)
    monkeypatch.setattr(ssd_auto, "WARMUP_STEPS", 1)      # so that a 40-token call is judged
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["after-one-step"])
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 2.0)
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=4)
    got: list[list[int]] = [[] for _ in prompts]

    def sink(tokens, counts):
        for row in range(len(prompts)):
            got[row].extend(int(t) for t in tokens[row, : counts[row]])

    def call():
        got[:] = [[] for _ in prompts]
        out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft,
                               stream=sink if streaming else None)
        assert out.tokens == reference.tokens and (got == out.tokens or not streaming)
        return out.stats["switched_to_plain_at_step"], out.stats["ssd_steps"]

    assert call() == (2, 2)                      # measured slower after one step (and the one queued ahead)
    assert [call() for _ in range(2)] == [(0, 0), (0, 0)]
    assert call() == (2, 2)                      # the probe: SSD again
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 0.5)
    assert call() == (0, 0)
    assert call() == (0, 0)
    first = call()                               # the probe finds SSD faster ...
    assert first[0] is None and first[1] > 1
    second = call()                              # ... so SSD stays
    assert second[0] is None and second[1] > 1


def test_switch_times_each_step_from_read_to_read(models, prompts, reference, monkeypatch):
    """The seconds the switch records per step run from the previous step's read to its own, so
    they hold all of the host's work between them (queueing the next step: its cache lookup and
    fallback drafting are device programs now, but the host's dispatching is SSD's cost too):
    with 30 ms added to each step's queueing, every recorded step takes at least 30 ms. (Timed
    from the verify's dispatch only, SSD at T=1 read 0.64-0.74 of plain decoding's cost per token
    where its calls ran at 0.9-1.0x AR.)"""
    import ssd_jax.ssd.host_loop as ssd_engine

    target, draft = models
    recorded: list[float] = []
    original_record, original_dispatch = ssd_auto.PlainSwitch.record, ssd_engine._Decode.dispatch_step

    def record(self, seconds, *args, **kwargs):
        recorded.append(seconds)
        return original_record(self, seconds, *args, **kwargs)

    def slow_dispatch(self, *args):
        time.sleep(0.03)
        return original_dispatch(self, *args)

    monkeypatch.setattr(ssd_auto.PlainSwitch, "record", record)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    monkeypatch.setattr(ssd_engine._Decode, "dispatch_step", slow_dispatch)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft)
    assert out.tokens == reference.tokens
    assert len(recorded) >= 3 and min(recorded[1:]) >= 0.03


def test_switch_leaves_the_sinks_time_out_of_ssds_steps(models, prompts, reference, monkeypatch):
    """A streamed call's sink that takes 0.1 s a piece (a slow consumer) is not SSD's time: every
    step the switch records takes less (counted in, it judged SSD slower than plain decoding, and
    remembered so for later unstreamed calls)."""
    target, draft = models
    recorded: list[float] = []
    original_record = ssd_auto.PlainSwitch.record

    def record(self, seconds, *args, compiled=False, **kwargs):
        if not compiled:   # a step that compiled a program is not judged
            recorded.append(seconds)
        return original_record(self, seconds, *args, compiled=compiled, **kwargs)

    monkeypatch.setattr(ssd_auto.PlainSwitch, "record", record)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft, stream=lambda tokens, counts: time.sleep(0.1))
    assert out.tokens == reference.tokens
    assert len(recorded) >= 3 and max(recorded) < 0.1


def test_plain_step_is_timed_per_target_dtype(models, prompts, monkeypatch):
    """Plain decoding's step is remembered per target kind, its weights' dtype included: a
    bfloat16 copy of the float32 target (the same config) has a step of its own (it took the
    float32 target's, never timed on its own program)."""
    target, draft = models
    keys = []
    original = ssd_auto.plain_step_seconds
    monkeypatch.setattr(ssd_auto, "plain_step_seconds",
                        lambda memory, key, *args, **kwargs: keys.append(key) or original(memory, key, *args, **kwargs))
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    half = dataclasses.replace(target, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params))
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=2)
    for model in (target, half):
        ssd_jax.generate(model, prompts[:1], max_new_tokens=16, method=method, draft=draft)
    assert len(keys) == 2 and keys[0] != keys[1]


def test_plain_step_is_timed_over_whole_chunks_whatever_the_call_s_length(models, prompts, reference, monkeypatch):
    """Plain decoding's step is timed on runs of a whole chunk, however few tokens the call
    decodes: a 2-token call timed runs of 1 step, whose fixed cost made the step 10x dearer than
    16-step runs measured (one CPU device), and the key's later, longer calls judged SSD against
    that. The call's own tokens are AR's."""
    target, draft = models
    run_steps = []
    original = ssd_auto._timed_plain_step

    def timed(run_chunk, state, untimed, timed_runs):
        def counted(copy):
            out = run_chunk(copy)
            run_steps.append(int(np.max(np.asarray(out[1]))))
            return out
        return original(counted, state, untimed, timed_runs)

    monkeypatch.setattr(ssd_auto, "_timed_plain_step", timed)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    out = ssd_jax.generate(target, prompts, max_new_tokens=2, method=ssd_jax.SSD(draft_len="auto", max_draft_len=2),
                           draft=draft)
    assert out.tokens == [row[:2] for row in reference.tokens]
    assert run_steps and min(run_steps) >= ssd_auto.PLAIN_CHUNK - 1


def test_a_probe_s_cost_leaves_the_sinks_time_out(models, prompts, reference, monkeypatch):
    """What a call's SSD cost (`PlainSwitch.probe_cost`, which spaces the probes of a plain
    verdict) is timed without the stream's sink, as SSD's steps are: a slow consumer made probes
    look dear and spaced them up to PROBE_EVERY_MAX calls apart."""
    target, draft = models
    costed, sink_s = [], [0.0]
    original = ssd_auto.PlainSwitch.probe_cost

    def probe_cost(self, call_s):
        costed.append(call_s)
        return original(self, call_s)

    def slow_sink(tokens, counts):
        start = time.perf_counter()
        time.sleep(0.02)
        sink_s[0] += time.perf_counter() - start

    monkeypatch.setattr(ssd_auto.PlainSwitch, "probe_cost", probe_cost)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft, stream=slow_sink)
    assert out.tokens == reference.tokens and len(costed) == 1
    assert costed[0] <= out.stats["wall_time_s"] - sink_s[0]


def test_a_call_too_short_to_switch_still_sets_the_verdict(models, prompts, reference, monkeypatch, tuner):
    """A call that ends before the switch may judge (WARMUP_STEPS + MIN_STEPS steps) still adds
    its SSD steps' cost ratio to the program's verdict: where such calls lose, the next start
    plain; the switch's prior (the judged steps' ratio) is left unset."""
    target, draft = models
    monkeypatch.setattr(ssd_auto, "WARMUP_STEPS", 100)    # every step of these calls in the warm-up
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 1.5)
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=4)
    first = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
    assert first.tokens == reference.tokens and first.stats["switched_to_plain_at_step"] is None
    assert first.stats["ssd_steps"] < ssd_auto.WARMUP_STEPS + ssd_auto.MIN_STEPS
    second = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
    assert second.tokens == reference.tokens and second.stats["plain_from_start"]
    key = next(iter(tuner.ssd.ratios._values))
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) is None


def test_probes_back_off_while_ssd_stays_slower(monkeypatch, tuner):
    """Calls between probes: PROBE_EVERY after a first "slower" verdict, doubled by every probe
    that finds SSD BACKOFF_RATIO slower again (up to PROBE_EVERY_MAX), back to PROBE_EVERY after a
    probe near the break-even or one where SSD paid."""
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY", 2)
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY_MAX", 8)
    monkeypatch.setattr(tuner.ssd.ratios, "weight", 1.0)   # each call's own ratio decides
    key = ("program",)

    def calls_until_probe() -> int:
        n = 1
        while ssd_auto.starts_plain(tuner.ssd, key):
            n += 1
        return n

    much_slower = ssd_auto.BACKOFF_RATIO + 0.01
    assert not ssd_auto.starts_plain(tuner.ssd, key)        # nothing known: run SSD
    ssd_auto.remember(tuner.ssd, key, much_slower, much_slower)
    gaps = []
    for _ in range(5):
        gaps.append(calls_until_probe())
        ssd_auto.remember(tuner.ssd, key, much_slower, much_slower)   # the probe: clearly slower again
    assert gaps == [2, 4, 8, 8, 8]
    calls_until_probe()
    ssd_auto.remember(tuner.ssd, key, 1.05, 1.05)   # slower, but near the break-even
    assert calls_until_probe() == 2
    ssd_auto.remember(tuner.ssd, key, 0.8, 0.8)    # a probe found SSD faster: it runs every call
    assert not ssd_auto.starts_plain(tuner.ssd, key) and not ssd_auto.starts_plain(tuner.ssd, key)
    ssd_auto.remember(tuner.ssd, key, much_slower, much_slower)
    assert calls_until_probe() == 2


def test_a_deterministic_call_ignores_verdicts_remembered_with_timings(monkeypatch, tuner):
    """A deterministic tuner's call must not depend on the calls before it: a plain verdict (and
    the lengths its probes keep to) in its SSD memory neither starts the call plain nor picks its
    length (it did: at T=1 the call ran AR's program, other tokens than the same call in a fresh
    process)."""
    monkeypatch.setattr(ssd_auto, "PROBE_LENGTHS", 1)
    key = ("program", "remembered with timings")
    ssd_auto.ran_length(tuner.ssd, key, 2)
    ssd_auto.remember(tuner.ssd, key, 2.0, 2.0)
    assert ssd_auto.starts_plain(tuner.ssd, key)
    tuner = deterministic(monkeypatch)
    ssd_auto.ran_length(tuner.ssd, key, 2)   # the same memories, held by the deterministic tuner
    ssd_auto.remember(tuner.ssd, key, 2.0, 2.0)
    assert tuner.ssd.verdicts.is_plain(key)
    assert not any(ssd_auto.starts_plain(tuner.ssd, key) for _ in range(ssd_auto.PROBE_EVERY_MAX))
    assert ssd_auto.probe_length(tuner.ssd, key, 4, lambda n: 1.0) == 4


def test_a_probe_that_leaves_no_verdict_is_not_followed_by_one_at_every_call(monkeypatch, tuner):
    """A probe that ends without a verdict (an SSD call too short to judge: fewer than MIN_STEPS
    steps) still starts the count of calls to the next probe: after a plain verdict of 16-token
    calls, calls of 4 tokens (the same program) ran SSD at every call from the first probe on."""
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY", 4)
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY_MAX", 4)
    key = ("program", "short probes")
    ssd_auto.remember(tuner.ssd, key, 2.0, 2.0)
    probes = [not ssd_auto.starts_plain(tuner.ssd, key) for _ in range(12)]   # none of them remembers a verdict
    assert probes == [False, False, False, True] * 3


def test_a_dear_probe_spaces_the_next_ones(monkeypatch, tuner):
    """A plain verdict's calls between probes are at least the probe's cost over PROBE_OVERHEAD
    (PROBE_EVERY to PROBE_EVERY_MAX): a call whose SSD part cost 0.2 of a plain call spaces
    probes 20 calls apart at a 1% budget; near the break-even they stay PROBE_EVERY apart, and
    the backoff's doubling never goes below the cost's spacing. Once a call of the key paid,
    probes come PROBE_EVERY apart again."""
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY", 4)
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY_MAX", 32)
    monkeypatch.setattr(ssd_auto, "PROBE_OVERHEAD", 0.01)
    monkeypatch.setattr(tuner.ssd.ratios, "weight", 1.0)
    key = ("program", "dear probes")

    def calls_until_probe() -> int:
        n = 1
        while ssd_auto.starts_plain(tuner.ssd, key):
            n += 1
        return n

    ssd_auto.remember(tuner.ssd, key, 1.6, 1.6, probe_cost=0.2)
    assert calls_until_probe() == 20
    ssd_auto.remember(tuner.ssd, key, 1.6, 1.6, probe_cost=0.2)    # slower again: doubled, up to the most
    assert calls_until_probe() == 32
    ssd_auto.remember(tuner.ssd, key, 1.05, 1.05, probe_cost=0.004)  # near the break-even: every 4th call
    assert calls_until_probe() == 4
    ssd_auto.remember(tuner.ssd, key, 1.05, 1.05, probe_cost=0.09)   # no backoff, but a dearer probe
    assert calls_until_probe() == 9
    ssd_auto.remember(tuner.ssd, key, 0.6, 0.6)                     # a call where SSD paid (another prompt)
    ssd_auto.remember(tuner.ssd, key, 1.6, 1.6, probe_cost=0.2)
    assert calls_until_probe() == 4                      # probes as often as before: it may pay again
    tuner.reset()


def test_probe_cost_is_the_call_s_excess_over_plain_decoding():
    """`PlainSwitch.probe_cost`: the call's seconds over call_tokens plain steps', as a share of
    the latter; 0 where SSD paid or no horizon is known; and `call_pace` counts the warm-up steps
    that the judged pace leaves out."""
    switch = ssd_auto.PlainSwitch(plain_step_s=0.01, call_tokens=100)
    for step in range(ssd_auto.WARMUP_STEPS + 4):
        switch.record(0.03, 2.0 if step < ssd_auto.WARMUP_STEPS else 4.0)
    assert switch.probe_cost(1.25) == pytest.approx(0.25)
    assert switch.probe_cost(0.8) == 0.0
    assert ssd_auto.PlainSwitch(plain_step_s=0.01).probe_cost(1.25) == 0.0
    tokens = 2.0 * ssd_auto.WARMUP_STEPS + 16.0
    assert switch.call_pace() == pytest.approx(tokens / (ssd_auto.WARMUP_STEPS + 4))
    assert switch.judged_pace() == pytest.approx(4.0)


def test_a_probe_runs_a_length_its_program_ran_before(models, prompts, reference, monkeypatch, tuner):
    """Past PROBE_LENGTHS lengths, a probe (SSD run again while its program's calls start plain)
    keeps to the lengths its key ran, whose programs are compiled, unless the cost model predicts
    a new one to beat them and plain decoding by NEW_LENGTH_GAIN: the preferred length moves with
    the remembered acceptance, and probes at ever new lengths compiled SSD's programs (~20 s on
    CPU) each time. Plain decoding's step is measured once for every length of these shapes.
    Outside probes every length stays open."""
    target, draft = models
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY", 2)
    monkeypatch.setattr(ssd_auto, "PROBE_EVERY_MAX", 2)
    monkeypatch.setattr(ssd_auto, "PROBE_LENGTHS", 1)
    monkeypatch.setattr(ssd_auto, "WARMUP_STEPS", 1)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["after-one-step"])
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 2.0)
    measured = []
    original = ssd_auto.plain_step_seconds
    monkeypatch.setattr(ssd_auto, "plain_step_seconds",
                        lambda memory, key, *args, **kw: measured.append(key) or original(memory, key, *args, **kw))
    predicted = {1: 0.9, 2: 0.5, 3: 0.5, 4: 0.5}   # the cost model's speedups, whatever the timings
    monkeypatch.setattr(cost_model, "predicted_speedup", lambda costs, acceptance, n, *rest, **kw: predicted[n])
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=4)

    def call():
        out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
        assert out.tokens == reference.tokens
        return out.stats

    assert call()["planned_draft_len"] == 1            # SSD measured slower: the next calls start plain
    predicted[4] = 1.02                                # preferred now, but not a clear gain
    assert call()["plain_from_start"]
    probe = call()
    assert probe["ssd_steps"] >= 1 and probe["planned_draft_len"] == 1 and probe["compile_time_s"] == 0.0
    predicted[3] = 1.2                                 # predicted to pay clearly: a new length
    assert call()["plain_from_start"]
    assert call()["planned_draft_len"] == 3
    tuner.reset()                                      # no verdict: every length open
    predicted[4] = 1.5
    assert call()["planned_draft_len"] == 4
    assert len(measured) == 4 and len(set(measured)) == 1


def test_probes_try_a_few_lengths_then_keep_to_them(tuner):
    """A key's probes take the cost model's length until PROBE_LENGTHS lengths were run; then the
    best of those (by the model), and a new one only where it is predicted to beat them and plain
    decoding by NEW_LENGTH_GAIN. A call that is no probe always takes the model's length."""
    key = ("program",)
    speedup = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8, 5: 0.9, 6: 1.04, 7: 1.2, 8: 1.0}.get
    assert ssd_auto.probe_length(tuner.ssd, key, 5, speedup) == 5          # no verdict: no probe
    ssd_auto.remember(tuner.ssd, key, 2.0, 2.0)                             # SSD slower: calls start plain
    tried = []
    for best in (2, 3, 4, 5, 6):
        tried.append(ssd_auto.probe_length(tuner.ssd, key, best, speedup))
        ssd_auto.ran_length(tuner.ssd, key, tried[-1])
    assert tried[:ssd_auto.PROBE_LENGTHS] == [2, 3, 4][:ssd_auto.PROBE_LENGTHS]
    assert tried[ssd_auto.PROBE_LENGTHS:] == [4] * (5 - ssd_auto.PROBE_LENGTHS)   # 5 and 6: no clear gain
    assert ssd_auto.probe_length(tuner.ssd, key, 7, speedup) == 7          # 1.2 > 1.05 x max(0.8, 1.0)
    tuner.reset()


def test_verdict_is_the_recent_calls_mean_log_ratio(tuner):
    """One prompt where SSD is slower, among prompts where it pays, does not send the program's
    calls to plain decoding (the last call's verdict did: 42-63% of the steps plain on held-out
    code where SSD paid 1.3x); where most calls are slower, they start plain."""
    key = ("program",)
    for _ in range(6):
        for ratio in (0.6, 0.55, 1.5, 0.65):
            ssd_auto.remember(tuner.ssd, key, ratio, ratio)
            assert not ssd_auto.starts_plain(tuner.ssd, key)
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) < 0
    for ratio in (1.4, 1.3, 0.9, 1.3, 1.25):
        ssd_auto.remember(tuner.ssd, key, ratio, ratio)
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) > 0 and ssd_auto.starts_plain(tuner.ssd, key)
    tuner.reset()
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) is None and not ssd_auto.starts_plain(tuner.ssd, key)


def test_a_plain_verdict_is_probed_again_when_the_pair_s_acceptance_rises(tuner):
    """A key pools every prompt of its shapes: where the pair's acceptance (SD's calls measure it
    too) rose since SSD's last call enough that SSD's measured cost ratio, scaled by the tokens
    per step it gains, predicts a win by REPROBE_GAIN, the next call probes (prose after code:
    SSD 1.46x AR there after losing on the code); otherwise the verdict stands, and without a
    known acceptance nothing changes."""
    key = ("program",)
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.7, 4)
    for _ in range(3):
        ssd_auto.remember(tuner.ssd, key, 1.1, 1.1, 4)
    assert ssd_auto.starts_plain(tuner.ssd, key, None)
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.7)
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.72)   # E(4) 2.88 -> 2.99: 1.06x plain still
    assert not ssd_auto.acceptance_rose(tuner.ssd, key, 0.72) and ssd_auto.acceptance_rose(tuner.ssd, key, 0.9)
    assert not ssd_auto.starts_plain(tuner.ssd, key, 0.9)   # E(4) 4.10: 0.77x: a probe
    # The probe runs SSD at the new acceptance; if it still lost, the verdict stands at that one.
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.9, 4)
    ssd_auto.remember(tuner.ssd, key, 1.2, 1.2, 4)
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.9)
    assert ssd_auto.expected_tokens(0.72, 4) / ssd_auto.expected_tokens(0.7, 4) < 1.1 * (1 + ssd_auto.REPROBE_GAIN)


def test_a_rise_is_weighed_at_the_best_length_and_a_probe_that_lost_raises_the_bar(tuner):
    """A verdict judged at a short length (L=1, chosen at the prior acceptance: 1/5 cost regime,
    prose read at 0.98-1.0 after code) predicts at most E(1) = 2 tokens a step from any rise;
    weighed with the cost model, the rise is priced at the best length, and the call probes.
    The probe's acceptance is then kept at least at the one that made it a probe: where its own
    steps met less (it switched early, on a text's first tokens), the same reads must not make
    every other call a probe."""
    key = ("program",)
    costs = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.03, draft=0.2)
    speedup = ssd_call.PricedSpeedup(lambda: (costs, 0.5), 6)
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.53, 1)
    ssd_auto.remember(tuner.ssd, key, 1.4, 1.4, 1)
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.53, speedup)
    assert not ssd_auto.acceptance_rose(tuner.ssd, key, 0.95)                # at L=1: 1.95 / 1.53 tokens
    assert ssd_auto.acceptance_rose(tuner.ssd, key, 0.95, speedup)
    assert not ssd_auto.starts_plain(tuner.ssd, key, 0.95, speedup)         # a probe ...
    best = max(range(1, 7), key=lambda n: speedup(n, 0.95))
    assert ssd_auto.rise_probe(tuner.ssd, key) == (0.95, best) and best > 1   # ... at the best length
    assert speedup(best, 0.95) > speedup(1, 0.95) * 1.5
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.6, 5)                       # its steps met 0.6 ...
    ssd_auto.remember(tuner.ssd, key, 1.2, 1.2, 5)                           # ... and it lost
    assert tuner.ssd.verdict_acceptance.lookup(key) == (0.95, 5) and ssd_auto.rise_probe(tuner.ssd, key) is None
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.95, speedup)             # the same reads: plain
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.6, 5)                       # no rise probe: as met
    assert tuner.ssd.verdict_acceptance.lookup(key) == (0.6, 5)


def test_a_rise_is_judged_at_the_latest_read_until_the_next_ssd_call(tuner):
    """The pair's pooled acceptance mixes the text SSD lost on with the text read now (after code,
    a read of prose at 1.0 moved it to 0.65): a read of a plain call of the program is the
    acceptance its next calls' rise is judged and probed at, until a call runs SSD."""
    key = ("program",)
    costs = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.03, draft=0.2)
    speedup = ssd_call.PricedSpeedup(lambda: (costs, 0.5), 6)
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.53, 1)
    ssd_auto.remember(tuner.ssd, key, 1.4, 1.4, 1)
    assert not ssd_auto.acceptance_rose(tuner.ssd, key, 0.6, speedup)
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.6, speedup)
    ssd_auto.note_read(tuner.ssd, key, None)                                  # nothing read: as before
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.6, speedup)
    ssd_auto.note_read(tuner.ssd, key, 0.97)
    assert not ssd_auto.starts_plain(tuner.ssd, key, 0.6, speedup)           # a probe, at the read's
    assert ssd_auto.rise_probe(tuner.ssd, key) == (0.97, ssd_auto.best_length(speedup, 0.97))
    ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.5, 6)                       # it ran SSD and lost
    ssd_auto.remember(tuner.ssd, key, 1.4, 1.4, 6)
    assert tuner.ssd.latest_read.lookup(key) is None
    assert ssd_auto.starts_plain(tuner.ssd, key, 0.6, speedup)               # the read is spent
    deterministic = ssd_jax.Tuner(deterministic=True)
    ssd_auto.note_read(deterministic.ssd, key, 0.97)
    assert deterministic.ssd.latest_read.lookup(key) is None


def test_a_rise_probe_that_paid_restarts_the_verdict(tuner):
    """A probe that a rise in acceptance made and that paid ends the plain verdict at once, and
    the next calls are priced at its pace: the calls before it measured another text (prose after code, 1/5 cost regime: weighed against
    them, the verdict stayed plain where SSD at L=6 ran 1.33x AR). A probe of the interval's that
    paid as much only joins the mean."""
    costs = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.03, draft=0.2)
    speedup = ssd_call.PricedSpeedup(lambda: (costs, 0.5), 6)
    for key, rise in ((("rise",), True), (("interval",), False)):
        ssd_auto.ran_at_acceptance(tuner.ssd, key, 0.5, 1)
        for _ in range(3):
            ssd_auto.remember(tuner.ssd, key, 1.8, 1.8, 1)
        if rise:
            ssd_auto.note_read(tuner.ssd, key, 1.0)
        assert ssd_auto.starts_plain(tuner.ssd, key, 0.5, speedup) is not rise
        ssd_auto.remember_step(tuner.ssd, key, 1, 0.05, 1.5, 0.05)               # the code's pace: 0.5
        ssd_auto.remember(tuner.ssd, key, 0.74, 0.74, 6)
        ssd_auto.ran_at_acceptance(tuner.ssd, key, 1.0, 6)
        ssd_auto.remember_step(tuner.ssd, key, 6, 0.1, 7.0, 0.1)                 # the probe's: ~1
        assert ssd_auto.pace_acceptance(tuner.ssd, key) == (pytest.approx(0.999, abs=1e-3) if rise else
                                                            pytest.approx(0.75, abs=1e-3))
        assert tuner.ssd.verdicts.is_plain(key) is not rise
        assert tuner.ssd.ratios.lookup(key) == (pytest.approx(np.log(0.74)) if rise else pytest.approx(
            0.75 * np.log(1.8) + 0.25 * np.log(0.74)))


def test_a_rise_probe_runs_at_the_length_and_acceptance_the_rise_was_priced_at(models, prompts, reference,
                                                                             monkeypatch, tuner):
    """A probe that a rise in the pair's acceptance made tests that prediction: at its best
    length, its switch weighing the pace against that acceptance (priced at the acceptance the
    past calls' pace implied, probes of prose after code ran at L=1 and L=3 where only L=6 paid)."""
    target, draft = models
    monkeypatch.setattr(ssd_auto, "rise_probe", lambda memory, key: (0.9, 3))
    seen = {}
    original = ssd_call.generate_ssd

    def spy(*args, **kwargs):
        seen.update(prior=kwargs["prior_acceptance"], length=kwargs["num_draft_tokens"])
        return original(*args, **kwargs)

    monkeypatch.setattr(ssd_call, "generate_ssd", spy)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft)
    assert out.tokens == reference.tokens and out.stats["planned_draft_len"] == 3
    assert seen == dict(prior=0.9, length=3)


@pytest.mark.parametrize("temperature, coupling", [(0.0, "rejection"), (1.0, "gumbel")])
def test_the_plain_read_counts_the_tokens_the_draft_decides(models, prompts, temperature, coupling):
    """The read of a call that decoded plainly (`plain_read.read_call`) counts, over every row's
    generated tokens, those that the draft's decision given the text before them is: the argmax of
    the draft's full forward at each token's position (under the Gumbel coupling, of its logits
    perturbed by the row's noise at that position). A draft that is the target decides every
    token (the read's positions and keys are the decode's); under rejection sampling nothing is
    read (AR's loop keeps no target probabilities)."""
    target, draft = models
    sampling = SamplingParams(temperature, coupling=coupling)
    key = jax.random.PRNGKey(3)
    out = ssd_jax.generate(target, prompts, max_new_tokens=20, temperature=temperature, coupling=coupling, key=key)
    batch = prepare_prompts(prompts, target.config, 20)
    read = functools.partial(plain_read.read_call, target_vocab=target.config.vocab_size, batch=batch,
                             max_new_tokens=20, out=out, sampling=sampling, key=key)
    assert read(target)[0] == 1.0
    keys = row_keys(key, len(prompts), sampling)
    agreed = total = 0
    for row, (prompt, tokens) in enumerate(zip(prompts, out.tokens)):
        logits = forward_full(draft.params, draft.config, jnp.asarray([prompt + tokens], jnp.int32))
        positions = jnp.arange(len(prompt), len(prompt) + len(tokens), dtype=jnp.int32)[None, :]
        decided = argmax_first(decision_logits(logits[:, positions[0] - 1], keys[row:row + 1], positions, sampling))
        agreed += int(np.sum(np.asarray(decided[0]) == np.asarray(tokens)))
        total += len(tokens)
    acceptance, seconds, _ = read(draft)
    assert acceptance == agreed / total and 0.0 < acceptance < 1.0 and seconds > 0.0
    assert read(draft, sampling=SamplingParams(1.0)) == (None, 0.0, 0.0)


def test_a_call_that_starts_plain_reads_its_text_for_the_pair_s_acceptance(models, prompts, reference, monkeypatch,
                                                                            tuner):
    """A call that a plain verdict runs with AR's loop has the draft read its text, and keeps
    that acceptance as the pair's (with the acceptance SSD's call met before it)."""
    target, draft = models
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=4)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 1.2)   # SSD slower: a plain verdict
    first = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
    second = ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)
    assert not first.stats.get("plain_from_start") and second.stats["plain_from_start"]
    assert second.tokens == reference.tokens
    batch = prepare_prompts(prompts, target.config, 40)
    read = second.stats["plain_read_acceptance"]
    assert read == plain_read.read_call(draft, target.config.vocab_size, batch, 40, second, SamplingParams(), None)[0]
    pair = ssd_call.pair_acceptance_key(target, draft, method, SamplingParams())
    assert tuner.known_acceptance(pair) == pytest.approx((first.stats["observed_acceptance"] + read) / 2)


def test_plain_reads_spend_a_share_of_the_plain_calls_time(tuner):
    """A read is a draft prefill over the whole text (0.15-0.4 s of 2 s plain calls at the 1/5
    cost regime on one CPU device): a program's first plain call is read, the next ones once the
    plain calls' seconds pay for another read at READ_SHARE."""
    key = ("program",)
    plain_read.spent(tuner.ssd, key, 2.0, 0.0)
    assert plain_read.read_due(tuner.ssd, key)
    plain_read.spent(tuner.ssd, key, 0.0, 0.3)
    calls = 1
    while not plain_read.read_due(tuner.ssd, key):
        plain_read.spent(tuner.ssd, key, 2.0, 0.0)
        calls += 1
    assert calls == math.ceil(0.3 / plain_read.READ_SHARE / 2.0)
    assert not ssd_auto.starts_plain(tuner.ssd, key)   # reads decide nothing by themselves


@pytest.mark.parametrize("read", ["rose", "as_ssd_met"])
def test_a_plain_read_that_rose_makes_the_next_call_a_probe(models, prompts, reference, monkeypatch, tuner, read):
    """Where SSD is the pair's only method, nothing but the plain calls' reads measures the pair's
    acceptance (prose after code stayed plain at 1.04x AR where fixed L=6 ran 1.47x: 1/5 cost
    regime, batch 1, T=0, one CPU device). Reads that rose since the verdict's SSD call make a
    call a probe within a few calls; reads at the acceptance SSD's steps met leave them plain."""
    target, draft = models
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=1)   # the verdict's length is the best one
    # SSD slower: a plain verdict (at L=1, reads of 1.0 after SSD met 0.77 predict at most E(1)
    # 2.0 / 1.77: a probe once they weigh enough against that 0.77).
    monkeypatch.setattr(ssd_auto.PlainSwitch, "call_ratio", lambda self: 1.02)
    call = lambda: ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft)  # noqa: E731
    met = call().stats["observed_acceptance"]
    monkeypatch.setattr(plain_read, "read_call", lambda *args: (1.0 if read == "rose" else met, 0.0, 0.0))
    plain = []
    for _ in range(4):
        out = call()
        assert out.tokens == reference.tokens
        plain.append(bool(out.stats.get("plain_from_start")))
    assert plain[0] and all(plain) == (read == "as_ssd_met")


def test_a_slow_first_call_weighs_no_more_than_the_next_ones(tuner):
    """A program's first calls make a plain mean, not one decayed from the first value: a first
    call at 1.3x plain decoding's cost starts the next calls plain, and one probe at 0.75x (SSD
    pays) ends that (decayed from the first, it took three such probes, 8 plain calls apart)."""
    key = ("program",)
    ssd_auto.remember(tuner.ssd, key, 1.3, 1.3)
    assert ssd_auto.starts_plain(tuner.ssd, key)
    ssd_auto.remember(tuner.ssd, key, 0.75, 0.75)
    assert not ssd_auto.starts_plain(tuner.ssd, key)
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) == pytest.approx((np.log(1.3) + np.log(0.75)) / 2)


def test_the_switch_s_prior_is_the_call_s_length_s(models, prompts, reference, monkeypatch, tuner):
    """The steady state a call's switch weighs is the one measured at its own length; at a length
    no judged call ran, the other lengths' weighs less where it says SSD lost. A first call at L=2
    slower than plain decoding ended a probe at L=3 that ran 0.86x its cost (held-out code, batch
    1, T=0, one CPU device), and the calls stayed plain where L=4 and 6 ran 1.09x and 1.17x AR;
    with no prior at all, near-break-even probes at new lengths ran to their end at batch 8."""
    key = ("program",)
    assert ssd_auto.switch_prior(tuner.ssd, key, 2) == (None, ssd_auto.PRIOR_STEPS)
    ssd_auto.remember(tuner.ssd, key, 1.37, 1.37, draft_len=2)
    assert ssd_auto.switch_prior(tuner.ssd, key, 2) == (pytest.approx(np.log(1.37)), ssd_auto.PRIOR_STEPS)
    lost = ssd_auto.switch_prior(tuner.ssd, key, 3)                  # slower at 2 tells less of 3
    assert lost == (pytest.approx(np.log(1.37)), ssd_auto.OTHER_LENGTH_PRIOR_STEPS)

    def switches(window_ratio: float, prior) -> bool:
        switch = ssd_auto.PlainSwitch(plain_step_s=1.0, prior_log_ratio=prior[0], prior_steps=prior[1])
        for _ in range(ssd_auto.WARMUP_STEPS + ssd_auto.MIN_STEPS):
            switch.record(seconds=window_ratio, row_tokens=1.0)
        return switch.slower_than_plain()

    assert not switches(0.86, lost)                       # the probe that paid goes on ...
    assert switches(0.86, ssd_auto.switch_prior(tuner.ssd, key, 2))  # ... which L=2's own prior would end
    assert switches(0.97, lost)                           # near the break-even: it ends
    ssd_auto.remember(tuner.ssd, key, 0.6, 0.6, draft_len=3)
    assert ssd_auto.switch_prior(tuner.ssd, key, 3) == (pytest.approx(np.log(0.6)), ssd_auto.PRIOR_STEPS)
    paid = (np.log(1.37) + np.log(0.6)) / 2
    assert paid < 0 and ssd_auto.switch_prior(tuner.ssd, key, 5) == (pytest.approx(paid), ssd_auto.PRIOR_STEPS)

    # Through generate: the call's length is the one remembered.
    tuner.reset()
    target, draft = models
    monkeypatch.setattr(ssd_auto, "WARMUP_STEPS", 1)
    monkeypatch.setattr(ssd_auto, "MIN_STEPS", 2)
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    monkeypatch.setattr(ssd_auto.PlainSwitch, "judged_ratio", lambda self: 1.5)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=ssd_jax.SSD(draft_len="auto", max_draft_len=4),
                           draft=draft)
    assert out.tokens == reference.tokens
    length = out.stats["planned_draft_len"]
    key = next(iter(tuner.ssd.ratios._values))
    assert ssd_auto.prior_log_ratio(tuner.ssd, key, length) == pytest.approx(np.log(1.5))
    assert ssd_auto.prior_log_ratio(tuner.ssd, key, 1 if length != 1 else 2) is None
    assert ssd_auto.prior_log_ratio(tuner.ssd, key) == pytest.approx(np.log(1.5))


def test_switch_weighs_the_program_s_recent_calls():
    """Where the program's calls paid (prior log ratio < 0), a stretch somewhat slower than plain
    decoding does not end SSD, but a call far slower throughout still switches; with no prior the
    window alone decides; a prior of "slower" ends a probe near the break-even."""

    def first_switch(window_ratio: float, prior, steps: int = 30):
        switch = ssd_auto.PlainSwitch(plain_step_s=1.0, prior_log_ratio=prior)
        for step in range(ssd_auto.WARMUP_STEPS + steps):
            switch.record(seconds=window_ratio, row_tokens=1.0)
            if switch.slower_than_plain():
                return switch.steps
        return None

    assert first_switch(1.2, None) == ssd_auto.MIN_STEPS
    assert first_switch(1.2, np.log(0.6), steps=12) is None
    assert first_switch(1.2, np.log(0.6)) > ssd_auto.MIN_STEPS + 8   # slower for long enough: it ends
    assert ssd_auto.MIN_STEPS <= first_switch(2.0, np.log(0.6)) <= ssd_auto.MIN_STEPS + 4
    assert first_switch(0.95, np.log(1.3)) == ssd_auto.MIN_STEPS
    assert first_switch(0.8, None) is None


def test_a_first_call_weighs_its_slow_start_against_the_pair_s_acceptance():
    """A key's first judged call (no steady state of earlier calls to weigh) weighs its window's
    pace against the tokens per step the pair's remembered acceptance predicts, as PRIOR_STEPS
    steps that fade: a slow start where the pair accepts well does not end SSD (the first SSD
    call of held-out code in the 1/20 regime accepted 0.16 over its first 24 tokens where SD's
    calls had measured 0.7, switched, and sent every later call plain), a call slow throughout
    still switches, and without a remembered acceptance the window alone decides."""

    def first_switch(pace: float, prior_pace, steps: int = 60):
        switch = ssd_auto.PlainSwitch(plain_step_s=1.0, prior_pace=prior_pace)
        for _ in range(ssd_auto.WARMUP_STEPS + steps):
            switch.record(seconds=2.0, row_tokens=pace)   # a step costs two plain steps
            if switch.slower_than_plain():
                return switch.steps
        return None

    good = ssd_auto.prior_pace(0.8, 4)
    assert good == pytest.approx((1 - 0.8 ** 5) / 0.2) and ssd_auto.prior_pace(None, 4) is None
    assert first_switch(1.8, None) == ssd_auto.MIN_STEPS                 # 1.11x plain decoding's cost
    assert first_switch(1.8, good, steps=12) is None                     # the prior carries it
    assert first_switch(1.8, good) > 12                                  # ... until the call's evidence outweighs it
    assert first_switch(1.0, good) <= ssd_auto.MIN_STEPS + 4             # twice plain's cost: within a few steps
    assert first_switch(1.8, ssd_auto.prior_pace(0.3, 4)) == ssd_auto.MIN_STEPS   # a poor pair's prior
    with_steady = ssd_auto.PlainSwitch(plain_step_s=1.0, prior_log_ratio=np.log(1.3), prior_pace=good)
    for _ in range(ssd_auto.WARMUP_STEPS + ssd_auto.MIN_STEPS):
        with_steady.record(seconds=2.0, row_tokens=1.8)
    assert with_steady.slower_than_plain()   # the program's own calls' steady state speaks instead


def test_ssd_reads_the_acceptance_sd_s_calls_of_the_pair_measured(models, prompts, monkeypatch, tuner):
    """SSD verifies one draft path token by token as SD does: an SD "auto" call's acceptance is
    remembered under the program's models (`bare`), SSD reads it there, and SSD's first
    call reads it: its switch's prior pace is E(L) at it. (The
    acceptance the calls report is fixed here: this pair's SD decodes plainly on CPU.)"""
    target, draft = models
    sampling = ssd_jax.SamplingParams()
    sd_key = cost_model.acceptance_key(bare(target), bare(draft), ssd_jax.SD(), sampling)
    assert sd_key == ssd_call.pair_acceptance_key(target, draft, ssd_jax.SSD(), sampling)
    assert sd_key != cost_model.acceptance_key(bare(target), bare(draft), ssd_jax.BV(), sampling)
    monkeypatch.setattr(cost_model, "acceptance_of", lambda accepted, rejected: 0.93)
    assert tuner.known_acceptance(sd_key) is None
    ssd_jax.generate(target, prompts, max_new_tokens=24, method=ssd_jax.SD(), draft=draft)
    assert tuner.known_acceptance(sd_key) == pytest.approx(0.93)
    seen = {}
    original = ssd_auto.PlainSwitch.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen["prior_pace"] = self.prior_pace

    monkeypatch.setattr(ssd_auto.PlainSwitch, "__init__", spy)
    out = ssd_jax.generate(target, prompts, max_new_tokens=24, method=ssd_jax.SSD(max_draft_len=4), draft=draft)
    length = out.stats["planned_draft_len"]
    assert seen["prior_pace"] == pytest.approx(ssd_auto.prior_pace(0.93, length))


def test_a_call_s_verdict_is_kept_with_the_acceptance_its_ssd_steps_met(models, prompts, monkeypatch, tuner):
    """What a later rise in the pair's acceptance is measured from (`acceptance_rose`) is the
    acceptance the SSD call's own steps met, where its cost ratio was measured, not the pair's
    memory before the call: after an SD call that read 0.93 where SSD's steps met 0.6, text at
    0.93 must still read as a rise (1/5 cost regime, prose after code: SSD stayed plain where it
    paid 1.35x AR)."""
    target, draft = models
    observed = iter([0.93, 0.6])
    monkeypatch.setattr(cost_model, "acceptance_of", lambda accepted, rejected: next(observed))
    ssd_jax.generate(target, prompts, max_new_tokens=24, method=ssd_jax.SD(), draft=draft)
    out = ssd_jax.generate(target, prompts, max_new_tokens=24, method=ssd_jax.SSD(max_draft_len=4), draft=draft)
    (kept,) = tuner.ssd.verdict_acceptance.values()
    assert kept == (pytest.approx(0.6), out.stats["planned_draft_len"])


def test_ssd_s_step_overhead_lengthens_the_chosen_draft(monkeypatch, tuner):
    """SSD's own cost per step (measured on its calls, beyond the model's target(L+1) + L draft)
    makes longer drafts pay: at prices like the embedded pair's on CPU the model alone stops short
    of the maximum where SSD ran fastest at it (held-out code, batch 1); at low acceptance the
    draft stays short."""
    costs = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.03, draft=0.12)
    assert cost_model.choose_draft_len(costs, 0.8, 6) < 6
    key = ("program",)
    overhead = functools.partial(ssd_auto.step_overhead, tuner.ssd, key, costs.target(1))
    # Before a judged call, PRIOR_OVERHEAD target steps: the first call drafts longer than the
    # model alone would have it (L=2 there ran 0.81x AR where L=4 and 6 ran 1.09x and 1.17x).
    assert overhead() == pytest.approx(ssd_auto.PRIOR_OVERHEAD * costs.target(1))
    prior = cost_model.PRIOR_ACCEPTANCE
    assert cost_model.choose_draft_len(costs, prior, 6, step_overhead_s=overhead()) > cost_model.choose_draft_len(
        costs, prior, 6)
    assert ssd_auto.pace_acceptance(tuner.ssd, key) is None
    # 2.1 + 0.25 L forwards a step, 4.03 tokens a step at L=4
    ssd_auto.remember_step(tuner.ssd, key, 4, judged_step_s=3.1, pace_tokens=4.03, model_step_s=costs.spec_step(4))
    assert overhead() == pytest.approx(3.1 - costs.spec_step(4))
    paced = ssd_auto.pace_acceptance(tuner.ssd, key)
    assert cost_model.expected_tokens(paced, 4) == pytest.approx(4.03, abs=1e-6)
    assert cost_model.choose_draft_len(costs, paced, 6, step_overhead_s=overhead()) == 6
    assert cost_model.choose_draft_len(costs, 0.3, 6, step_overhead_s=overhead()) <= 3
    # A call whose batch gained one token a step (its slowest row accepted nothing): acceptance 0.
    ssd_auto.remember_step(tuner.ssd, key, 4, judged_step_s=0.5, pace_tokens=1.0, model_step_s=costs.spec_step(4))
    assert overhead() == pytest.approx((3.1 - costs.spec_step(4)) / 2)   # never below 0
    assert ssd_auto.pace_acceptance(tuner.ssd, key) == pytest.approx(paced / 2, abs=1e-6)
    assert ssd_auto.acceptance_for_tokens(2.2, 4) < ssd_auto.acceptance_for_tokens(4.03, 4)
    assert ssd_auto.acceptance_for_tokens(0.5, 4) == pytest.approx(0.0, abs=1e-6)
    tuner = deterministic(monkeypatch)   # a call must not depend on the ones before
    ssd_auto.remember_step(tuner.ssd, key, 4, judged_step_s=3.1, pace_tokens=4.03, model_step_s=costs.spec_step(4))
    overhead = functools.partial(ssd_auto.step_overhead, tuner.ssd, key, costs.target(1))
    assert overhead() == 0.0 and ssd_auto.pace_acceptance(tuner.ssd, key) is None


def test_colocated_ssd_prices_the_cache_build_per_draft_token(monkeypatch, tuner):
    """With both models on one device group, a draft token costs the fallback's forward at B rows
    and the cache build's at B x slots rows (every slot drafts L deep); on disjoint groups the
    build overlaps the verification and the costs stay the draft-model methods'. At the forward
    times of batch 4 on one CPU device (the embedded pair) the build's price moves the first
    call's length from 5 to 4 (L=5-6 ran 0.80-0.83x AR there, L=4 0.94-1.00x)."""
    asked = []

    def forward_seconds(tuner, model, batch, width, context, measure=True):
        asked.append((model, batch, width, context))
        return 0.55e-3

    monkeypatch.setattr(measure, "forward_seconds", forward_seconds)
    costs = cost_model.StepCosts(target_fixed=4.34e-3, target_per_token=0.58e-3, draft=0.109e-3)
    priced = ssd_auto.build_priced(tuner, costs, "draft", 4, 192, 10, colocated=True)
    assert asked == [("draft", 40, 1, 192)]
    assert priced.draft == pytest.approx(0.659e-3) and priced.target(3) == costs.target(3)
    overhead = ssd_auto.PRIOR_OVERHEAD * costs.target(1)
    prior = cost_model.PRIOR_ACCEPTANCE
    assert cost_model.choose_draft_len(costs, prior, 6, step_overhead_s=overhead) == 5
    assert cost_model.choose_draft_len(priced, prior, 6, step_overhead_s=overhead) == 4
    assert ssd_auto.build_priced(tuner, costs, "draft", 4, 192, 10, colocated=False) is costs
    assert ssd_auto.build_priced(tuner, cost_model.UNMEASURED, "draft", 4, 192, 10, colocated=True) \
        is cost_model.UNMEASURED
    assert len(asked) == 1
    monkeypatch.setattr(measure, "forward_seconds", lambda *args, **kwargs: None)   # timings not allowed
    assert ssd_auto.build_priced(tuner, costs, "draft", 4, 192, 10, colocated=True) is costs


def test_call_ratio_counts_the_warm_up_and_the_step_time_does_not(tuner):
    """The verdict's ratio is over every SSD step of the call (the next call pays the warm-up
    too), but a step that compiled; the step time and pace the length is chosen from, and the
    next calls' switch prior, are the judged steps' (SSD's steady state)."""
    switch = ssd_auto.PlainSwitch(plain_step_s=1.0)
    assert switch.call_ratio() == 1.0 and switch.judged_step_s() is None
    switch.record(seconds=900.0, row_tokens=1.0, compiled=True)   # not counted anywhere
    for _ in range(ssd_auto.WARMUP_STEPS - 1):
        switch.record(seconds=3.0, row_tokens=1.0)      # not judged, but paid
    for seconds in (4.0, 2.0, 2.0, 2.0):
        switch.record(seconds=seconds, row_tokens=2.0)
    warm_up = ssd_auto.WARMUP_STEPS - 1
    assert switch.call_ratio() == pytest.approx((3.0 * warm_up + 10.0) / (warm_up + 8.0))
    assert switch.judged_step_s() == pytest.approx(2.5) and switch.judged_pace() == pytest.approx(2.0)
    assert switch.judged_ratio() == pytest.approx(10.0 / 8.0)
    ssd_auto.remember(tuner.ssd, ("program",), switch.call_ratio(), switch.judged_ratio())
    assert ssd_auto.prior_log_ratio(tuner.ssd, ("program",)) == pytest.approx(np.log(10.0 / 8.0))   # the steady state's
    assert ssd_auto.starts_plain(tuner.ssd, ("program",))                                         # the whole call's


def test_auto_switch_rule():
    switch = ssd_auto.PlainSwitch(plain_step_s=1.0)
    for _ in range(ssd_auto.WARMUP_STEPS):       # a call's first steps, with no prefetch yet, are not judged
        switch.record(seconds=50.0, row_tokens=1.0)
    switch.record(seconds=50.0, row_tokens=1.0, compiled=True)   # nor a step that compiled
    assert switch.steps == 0 and switch.seconds == 0.0
    for _ in range(ssd_auto.MIN_STEPS - 1):
        switch.record(seconds=5.0, row_tokens=1.0)
    assert not switch.slower_than_plain()        # too few steps to judge
    switch.record(seconds=5.0, row_tokens=1.0)
    assert switch.slower_than_plain() and switch.cost_ratio() == pytest.approx(5.0)
    fast = ssd_auto.PlainSwitch(plain_step_s=1.0)
    assert fast.cost_ratio() == 1.0              # nothing judged yet
    for _ in range(ssd_auto.WARMUP_STEPS):
        fast.record(seconds=50.0, row_tokens=1.0)
    for _ in range(10):
        fast.record(seconds=2.0, row_tokens=3.0)
    assert not fast.slower_than_plain() and fast.cost_ratio() == pytest.approx(2.0 / 3.0)
    # A batch runs at its slowest row's pace: 3 and 1 tokens per step is 1 per step, not 2.
    uneven = ssd_auto.PlainSwitch(plain_step_s=1.0)
    for _ in range(ssd_auto.WARMUP_STEPS + 10):
        uneven.record(seconds=1.5, row_tokens=np.array([3.0, 1.0, 0.0]), live=np.array([True, True, False]))
    assert uneven.slower_than_plain() and uneven.cost_ratio() == pytest.approx(1.5)


def test_batch_pace_takes_back_the_window_s_chance_lag_but_not_a_slow_row():
    """The slowest of B rows lags by chance more over a few steps than over a call: pace() adds
    back z_B sd (1/sqrt(n) - 1/sqrt(N_call)) to the window's slowest-row pace, never more than
    the mean row's; a row that is slow every step (no spread) stays the pace."""
    rng = np.random.default_rng(0)

    def judged(call_tokens, tokens_by_step):
        switch = ssd_auto.PlainSwitch(plain_step_s=1.0, call_tokens=call_tokens)
        for row_tokens in tokens_by_step:
            switch.record(seconds=1.0, row_tokens=row_tokens)
        return switch

    noisy = rng.choice([1.0, 5.0], size=(ssd_auto.WARMUP_STEPS + 12, 4))   # every row 3 a step on average
    window = judged(0, noisy)
    call = judged(128, noisy)
    assert window.pace() == pytest.approx(window.tokens / window.weight)
    mean_row = float(np.mean(call.row_sums[1] / call.row_sums[0]))
    assert window.pace() < call.pace() <= mean_row
    assert call.cost_ratio() == pytest.approx(1.0 / call.pace())
    z4 = ssd_auto.expected_largest_normal(4)
    assert z4 == pytest.approx(1.03, abs=0.03) and ssd_auto.expected_largest_normal(1) == 0.0
    steady = np.tile([3.0, 3.0, 1.0, 3.0], (ssd_auto.WARMUP_STEPS + 12, 1))   # row 2: one token, every step
    assert judged(128, steady).pace() == pytest.approx(1.0)


def _plain_step_timer(monkeypatch, tuner, seconds_per_run, rows: int = 1, **settings):
    """`ssd_auto.plain_step_seconds` on "key", with fresh memories, the module's `settings` set,
    and a fake clock under which the chunk's i-th run takes seconds_per_run[i] for 16 steps."""
    monkeypatch.setattr(tuner.ssd, "plain_step_s", Recent())
    monkeypatch.setattr(tuner.ssd, "plain_runs", Recent())
    for name, value in settings.items():
        monkeypatch.setattr(ssd_auto, name, value)
    runs = iter(seconds_per_run)
    clock = {"now": 0.0}

    def run_chunk(state):
        clock["now"] += next(runs)
        return np.zeros((rows, 16)), np.full(rows, 16)   # emitted, appended per row

    monkeypatch.setattr(ssd_auto, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    return functools.partial(ssd_auto.plain_step_seconds, tuner.ssd, "key", run_chunk, {"cache": jnp.zeros((rows, 2))})


def test_plain_step_time_is_a_trimmed_mean_of_runs_after_the_first_ones(monkeypatch, tuner):
    """The plain step that SSD's running mean is judged against: the first PLAIN_UNTIMED_RUNS
    runs (the first compiles, the next reads slow) left out, the trimmed mean of the next
    PLAIN_TIMED_RUNS per step, remembered per key. A lucky fast run does not set it (the best of
    the runs did, which made SSD that paid look slower)."""
    step = _plain_step_timer(monkeypatch, tuner, [9.0, 3.0] + [1.6, 1.6, 1.6, 1.6, 1.6, 0.8], rows=2,
                             PLAIN_TIMINGS=1, PLAIN_UNTIMED_RUNS=2, PLAIN_TIMED_RUNS=6)
    assert step() == pytest.approx(0.1)
    assert step() == pytest.approx(0.1)   # remembered: no run


def test_switched_calls_plain_parts_refresh_the_plain_step(monkeypatch, tuner):
    """A plain step timed once stays wrong if the machine was slow then (5.9 ms at batch 4 where
    other processes read 4.5-5.6): the switched calls' plain parts join it, the median of the
    first measurement and the last PLAIN_RUNS_KEPT parts; parts too short to time are left out."""
    step = _plain_step_timer(monkeypatch, tuner, [1.0, 1.6, 1.6],   # 0.1 s a step after the compiling run
                             PLAIN_TIMINGS=1, PLAIN_TIMED_RUNS=2, PLAIN_UNTIMED_RUNS=1)
    assert step() == pytest.approx(0.1)
    ssd_auto.observe_plain_run(tuner.ssd, "key", seconds=1.2, steps=16)     # 0.075 s a step
    assert step() == pytest.approx((0.1 + 0.075) / 2)
    ssd_auto.observe_plain_run(tuner.ssd, "key", seconds=0.5, steps=ssd_auto.PLAIN_RUN_MIN_STEPS - 1)   # too short
    ssd_auto.observe_plain_run(tuner.ssd, "key", seconds=8.0, steps=100)    # 0.08 s a step
    assert step() == pytest.approx(0.08)
    assert step() == pytest.approx(0.08)
    for _ in range(ssd_auto.PLAIN_RUNS_KEPT):
        ssd_auto.observe_plain_run(tuner.ssd, "key", seconds=0.9, steps=18)   # 0.05 s a step
    assert step() == pytest.approx(0.05) and len(tuner.ssd.plain_runs.lookup("key")) == ssd_auto.PLAIN_RUNS_KEPT
    ssd_auto.observe_plain_run(tuner.ssd, "other", seconds=0.9, steps=18)     # another program's: its own
    assert step() == pytest.approx(0.05)


def test_a_slow_first_plain_timing_is_outvoted_by_the_next_calls(monkeypatch, tuner):
    """Timed once at a slow moment, plain decoding looked dear, SSD was never judged slower and no
    call switched to refresh it (batch 8, T=0, CPU: one process of three ran SSD on every step at
    0.84x AR): the key's next calls time it again, PLAIN_RETIMED_RUNS warm runs each, until
    PLAIN_TIMINGS timings, and the step is their median."""
    step = _plain_step_timer(monkeypatch, tuner, [9.0, 3.2, 3.2] + [1.6] * 3 + [1.7] * 3,   # 0.2 s a step, 0.1, 0.106
                             PLAIN_TIMINGS=3, PLAIN_UNTIMED_RUNS=1, PLAIN_TIMED_RUNS=2, PLAIN_RETIMED_RUNS=3)
    assert step() == pytest.approx(0.2)                      # the slow first timing
    assert step() == pytest.approx((0.2 + 0.1) / 2)          # a second, warm: no untimed run
    assert step() == pytest.approx(1.7 / 16)                 # the median of three
    assert step() == pytest.approx(1.7 / 16)                 # three timings: no more runs
    assert len(tuner.ssd.plain_step_s.lookup("key")) == 3


def test_far_from_the_break_even_the_plain_step_is_not_timed_again(monkeypatch, tuner):
    """Each timing of the plain step costs PLAIN_RETIMED_RUNS chunks of plain steps in the call
    (0.2 s of 0.5-0.8 s calls in the 1/100 regime); where the program's calls run far from the
    break-even a few percent there flips no verdict, so a key timed once is not timed again."""
    step = _plain_step_timer(monkeypatch, tuner, [9.0, 3.2, 3.2] + [1.6] * 3,
                             PLAIN_TIMINGS=3, PLAIN_UNTIMED_RUNS=1, PLAIN_TIMED_RUNS=2, PLAIN_RETIMED_RUNS=3)
    assert step(retime=False) == pytest.approx(0.2)          # never timed: timed whatever retime says
    assert step(retime=False) == pytest.approx(0.2)          # no more runs (the fake clock has 3 left)
    assert step() == pytest.approx((0.2 + 0.1) / 2)
    assert ssd_auto.near_break_even(None) and ssd_auto.near_break_even(np.log(1.1))
    assert not ssd_auto.near_break_even(np.log(0.6)) and not ssd_auto.near_break_even(np.log(1.5))


def test_plain_step_timings_are_a_calibration_a_later_process_reads_back(models, prompts, reference, monkeypatch,
                                                                          tmp_path):
    """Plain decoding's step timings are kept like the synchronous loops' calibrations: their
    seconds are a call's calibration_time_s (a timed call leaves them out, `timed_generate`), and
    they are kept on disk per program and machine, so a new process (a fresh tuner on the same
    store) times none of them: made anew per process, the retimings cost the first SSD calls of
    each 0.4-0.5 s of 1.6 s (the 1/5 cost regime, one CPU device). A file left damaged is timed
    again and replaced."""
    target, draft = models
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["never"])
    monkeypatch.setattr(ssd_auto, "starts_plain", lambda *args, **kwargs: False)   # every call runs SSD
    monkeypatch.setattr(ssd_auto, "near_break_even", lambda prior: True)   # and retimes while it may
    timed = []
    original = ssd_auto._timed_plain_step

    def counted(run_chunk, state, untimed, runs):
        timed.append(untimed + runs)
        time.sleep(0.05)   # enough to show in calibration_time_s whatever the machine
        return original(run_chunk, state, untimed, runs)

    monkeypatch.setattr(ssd_auto, "_timed_plain_step", counted)
    method = ssd_jax.SSD(draft_len="auto", max_draft_len=2)

    def calls(tuner, count):
        use_tuner(monkeypatch, tuner)
        outs = []
        for _ in range(count):
            start = time.perf_counter()
            outs.append(ssd_jax.generate(target, prompts, max_new_tokens=40, method=method, draft=draft, tuner=tuner))
            # A timing run that compiled the chunk program: its compile is compile_time_s alone.
            once = outs[-1].stats["compile_time_s"] + outs[-1].stats["calibration_time_s"]
            assert once <= time.perf_counter() - start, outs[-1].stats
        assert all(out.tokens == reference.tokens for out in outs)
        return outs

    first = calls(ssd_jax.Tuner(store=tmp_path), ssd_auto.PLAIN_TIMINGS + 1)
    assert len(timed) == ssd_auto.PLAIN_TIMINGS
    for out, runs in zip(first, timed):
        assert out.stats["calibration_time_s"] >= 0.05 * 0.9, (out.stats["calibration_time_s"], runs)
    assert first[-1].stats["calibration_time_s"] == 0.0        # three timings: no more
    kept = list(tmp_path.glob("ssd-plain-*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["costs"]) == ssd_auto.PLAIN_TIMINGS

    later = calls(ssd_jax.Tuner(store=tmp_path), 2)          # a new process of the same program
    assert len(timed) == ssd_auto.PLAIN_TIMINGS and all(o.stats["calibration_time_s"] == 0.0 for o in later)
    assert later[0].stats["plain_step_s"] == pytest.approx(first[-1].stats["plain_step_s"])

    kept[0].write_text('{"costs": [')                         # damaged: timed again, and replaced
    calls(ssd_jax.Tuner(store=tmp_path), 1)
    assert len(timed) == ssd_auto.PLAIN_TIMINGS + 1
    assert len(json.loads(kept[0].read_text())["costs"]) == 1

    calls(ssd_jax.Tuner(store=None), 1)                        # no store: in memory only
    assert len(timed) == ssd_auto.PLAIN_TIMINGS + 2 and len(list(tmp_path.glob("ssd-plain-*.json"))) == 1


# ---------------------------------------------------------------------------------- fan-out

def test_fanout_allocations():
    assert uniform_fanout(4, 10, 100) == (2, 2, 2, 2, 2)
    assert uniform_fanout(4, 12, 100) == (3, 3, 2, 2, 2)
    assert sum(uniform_fanout(3, 2, 100)) == 2
    # Geometric: F_k ~ a^(k/(1+r)) below L, a heavier F_L; sums to the budget.
    f = geometric_fanout(4, 30, 1000, acceptance=0.6, miss_exponent=1.0)
    assert sum(f) == 30 and list(f[:4]) == sorted(f[:4], reverse=True)
    ideal = np.array([0.6 ** (k / 2) for k in range(4)] + [0.6 ** 2 * 0.4 ** -0.5])
    assert np.abs(np.array(f) - 30 * ideal / ideal.sum()).max() < 1.0
    assert geometric_fanout(4, 30, 1000, 0.95, 1.0)[-1] > geometric_fanout(4, 30, 1000, 0.5, 1.0)[-1]
    # Caps: V-1 candidates below depth L (the drafted token is excluded), V at depth L.
    assert geometric_fanout(2, 100, 4, 0.5, 1.0) == (3, 3, 4)
    assert min(geometric_fanout(4, 5, 1000, 0.3, 1.0)) == 1  # every depth keeps one fork
    layout = SlotLayout.from_fanout((2, 0, 1), 4)
    assert layout.depth.tolist() == [0, 0, 2, 2] and layout.rank.tolist() == [0, 1, 0, 0]


def test_fanout_estimator_learns_acceptance_and_exponent():
    est = FanoutEstimator("geometric", 4, 20, 1000)
    assert est.acceptance() == 0.7 and est.miss_exponent() == 1.0  # defaults before warm-up
    rng = np.random.default_rng(0)
    for _ in range(400):
        fanout = est.fanout()
        k = np.minimum(rng.geometric(1 - 0.8, size=4) - 1, 4)  # P(k) = 0.8^k 0.2, capped at L
        miss_prob = np.array([fanout[j] ** -1.5 for j in k])
        est.record(k, rng.random(4) >= miss_prob, fanout)
    assert abs(est.acceptance() - 0.8) < 0.03
    assert abs(est.miss_exponent() - 1.5) < 0.3
    fixed = FanoutEstimator("geometric", 4, 20, 1000, acceptance=0.5, miss_exponent=2.0)
    fixed.record(np.array([4, 4]), np.array([True, True]), fixed.fanout())
    assert fixed.fanout() == geometric_fanout(4, 20, 1000, 0.5, 2.0)


# ---------------------------------------------------------------------------------- Saguaro sampling

def test_saguaro_reshape_scales_the_top_tokens():
    probs = jnp.array([[0.5, 0.3, 0.15, 0.05]])
    logits = jnp.log(probs)
    sigma = saguaro_reshape(probs, logits, jnp.int32(2), 0.5, 4)
    expected = np.array([0.25, 0.15, 0.15, 0.05]) / 0.6
    np.testing.assert_allclose(np.asarray(sigma[0]), expected, rtol=1e-6)
    assert saguaro_reshape(probs, logits, jnp.int32(2), 1.0, 4) is probs
    # C = 0 with every mass in the top F: nothing else to sample, the plain distribution stays.
    point = jnp.array([[1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(saguaro_reshape(point, logits, jnp.int32(2), 0.0, 4)), point)


def test_blocked_sampler_draws_from_the_distribution():
    """sample_blocked's two-stage Gumbel draw has the law of its input (z-test at 5 sigma over
    every id, 100k draws, blocks that split the vocabulary unevenly and a zero-mass block)."""
    probs = jax.nn.softmax(jnp.arange(150.0) / 25).at[64:128].set(0.0)
    probs = probs / probs.sum()
    keys = jax.random.split(jax.random.key(7), 100_000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_blocked(k, probs)))(keys))
    freq = np.bincount(draws, minlength=150) / len(draws)
    p = np.asarray(probs, np.float64)
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / len(draws)) + 1e-9)
    assert not np.any(freq[64:128])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_read_catches_the_draft_up_on_a_plain_stretch(models, temperature):
    """After `draft_read` over a plain stretch (ragged rows, a verification's catch-up pending),
    the draft's context holds the text, its cache the text but the new root, and it drafts from
    there what a draft prefilled on that text drafts; each stretch token's agreement is whether
    the draft would have decided it (T=0) or min(1, q/p) (T>0), 0 past the row's count."""
    _, draft = models
    dcfg, vocab, length, width, chunk = draft.config, draft.config.vocab_size, 3, 96, 16
    sampling = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(5)
    prompt_lengths = np.array([5, 9], np.int32)
    tokens = rng.integers(2, vocab, (2, 9)).astype(np.int32)
    first, next_token = rng.integers(2, vocab, 2).astype(np.int32), rng.integers(2, vocab, 2).astype(np.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(4), 2))
    state = ssd_steps.draft_prefill(draft.params, tokens, prompt_lengths, first, keys, dcfg=dcfg, capacity=width,
                                    context_capacity=width)
    # The cache build's forward over [cur, d] writes their K/V uncommitted; the verification then
    # accepted k of d and chose next_token: that catch-up is pending.
    drafted = rng.integers(2, vocab, (2, length)).astype(np.int32)
    cache = state["cache"]
    positions = cache.lengths[:, None] + jnp.arange(length + 1)[None, :]
    _, cache = forward_cached(draft.params, dcfg, jnp.concatenate([first[:, None], drafted], 1), positions, cache)
    state = dict(state, cache=cache)
    accepted = np.array([2, 0])
    j = np.arange(length + 1)[None, :]
    padded = np.concatenate([drafted, np.zeros((2, 1), np.int32)], 1)
    emitted = np.where(j < accepted[:, None], padded, np.where(j == accepted[:, None], next_token[:, None], 0))
    plain = rng.integers(2, vocab, (2, chunk)).astype(np.int32)
    chosen = rng.uniform(0.05, 1.0, (2, chunk)).astype(np.float32)
    count = np.array([chunk, 11], np.int32)
    read = jax.jit(functools.partial(ssd_steps.draft_read, dcfg=dcfg, sampling=sampling, target_vocab=vocab))
    after, agreement = read(draft.params, state, emitted.astype(np.int32), (accepted + 1).astype(np.int32),
                            next_token, plain, chosen, count)
    agreement = np.asarray(agreement)
    layout = SlotLayout.from_fanout((2, 1, 1, 2), 6)
    greedy = dict(dcfg=dcfg, sampling=SamplingParams(), target_vocab=vocab, saguaro_c=1.0, rmax=6,
                  num_draft_tokens=length)
    fallback = jax.jit(functools.partial(ssd_steps.fallback_model, **greedy))
    texts = [np.concatenate([tokens[b, :prompt_lengths[b]], [first[b]], drafted[b, :accepted[b]], [next_token[b]],
                             plain[b, :count[b]]]).astype(np.int32) for b in range(2)]
    for b, text in enumerate(texts):
        assert int(after["context_len"][b]) == len(text)
        assert np.array_equal(np.asarray(after["context"])[b, :len(text)], text)
        assert int(after["cache"].lengths[b]) == len(text) - 1
        logits = np.asarray(forward_full(draft.params, dcfg, jnp.asarray(text[None]))[0], np.float64)
        start = len(text) - count[b]   # the stretch's first token; the logits before each token predict it
        predicting = logits[start - 1: len(text) - 1]
        if temperature == 0:
            expected = (np.argmax(predicting, axis=-1) == plain[b, :count[b]]).astype(np.float32)
        else:
            q = np.asarray(probabilities(jnp.asarray(predicting), sampling))[np.arange(count[b]), plain[b, :count[b]]]
            expected = np.minimum(1.0, q / chosen[b, :count[b]])
        np.testing.assert_allclose(agreement[b, :count[b]], expected, atol=2e-5)
        assert not agreement[b, count[b]:].any()
    # The cache behaves as a prefill of the text but its last token, the new root: the same greedy draft.
    widest = max(len(t) for t in texts)
    fresh = ssd_steps.draft_prefill(
        draft.params, jnp.asarray([np.pad(t[:-1], (0, widest - len(t))) for t in texts]),
        jnp.asarray([len(t) - 1 for t in texts], jnp.int32), jnp.asarray([t[-1] for t in texts]), keys, dcfg=dcfg,
        capacity=width, context_capacity=width)
    roots = jnp.asarray([t[-1] for t in texts])
    no_catch_up = (jnp.zeros((2, length + 1), jnp.int32), jnp.zeros((2,), jnp.int32))
    ours, _ = fallback(draft.params, after, *no_catch_up, roots, jnp.asarray(layout.fanout), 3)
    theirs, _ = fallback(draft.params, fresh, *no_catch_up, roots, jnp.asarray(layout.fanout), 3)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


# ---------------------------------------------------------------------------------- speculation cache

@pytest.mark.parametrize("temperature, c", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.4)])
def test_speculation_cache_equals_a_synchronous_draft(models, temperature, c):
    """For every slot (j, t) of a cache build, the cached speculation (tokens and q) is what the
    draft drafts synchronously from a fresh prefill of prompt + cur + d[:j] + [t] with the
    slot's key; the slot's token is the draft's best at depth j other than d_j."""
    _, draft = models
    dcfg, vocab, length, width = draft.config, draft.config.vocab_size, 3, 48
    sampling = SamplingParams(temperature=temperature)
    prompts = [[5, 9, 11, 3, 7], [2, 4]]
    tokens = jnp.asarray([p + [0] * (8 - len(p)) for p in prompts], jnp.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(4), 2))
    cur = jnp.asarray([13, 17], jnp.int32)
    layout = SlotLayout.from_fanout((2, 1, 1, 2), 6)
    fanout = jnp.asarray(layout.fanout)
    kw = dict(dcfg=dcfg, sampling=sampling, target_vocab=vocab, saguaro_c=c, rmax=6)
    no_catch_up = (jnp.zeros((2, length + 1), jnp.int32), jnp.zeros((2,), jnp.int32))
    state = ssd_steps.draft_prefill(draft.params, tokens, lengths, cur, keys, dcfg=dcfg, capacity=width,
                                    context_capacity=width)
    fallback = jax.jit(functools.partial(ssd_steps.fallback_model, num_draft_tokens=length, **kw))
    drafted, _ = fallback(draft.params, state, *no_catch_up, cur, fanout, 1)
    step = 5
    build = jax.jit(functools.partial(ssd_steps.draft_build, **kw))
    _, candidates, spec_q = build(draft.params, state, *no_catch_up, cur, drafted, jnp.asarray(layout.depth),
                                  jnp.asarray(layout.rank), fanout, step)
    fork, spec_tokens = candidates[:, :, 0], candidates[:, :, 1:]
    slot_keys = jax.vmap(lambda k: jax.random.split(k, 6))(ssd_steps._fold(keys, step, 1))

    @jax.jit
    def synchronous(text, text_len, fork_token, key):
        """Logits after the text, and the draft of L tokens after text + [fork_token]."""
        logits = forward_full(draft.params, dcfg, text)[0, text_len - 1]
        _, cache = prefill(draft.params, dcfg, text, text_len[None], width)
        return logits, draft_chain(draft.params, dcfg, cache, fork_token[None, None], jnp.ones((1,), jnp.int32),
                                   key[None], fanout, num_draft_tokens=length, sampling=sampling,
                                   target_vocab=vocab, saguaro_c=c, rmax=6)

    for row, prompt in enumerate(prompts):
        for slot, (j, rank) in enumerate(zip(layout.depth, layout.rank)):
            text = prompt + [int(cur[row])] + np.asarray(drafted[row, :j]).tolist()
            padded = jnp.asarray([text + [0] * (16 - len(text))], jnp.int32)
            logits, (sync_tokens, sync_q) = synchronous(padded, jnp.int32(len(text)), fork[row, slot],
                                                        slot_keys[row, slot])
            # The fork token: rank-th best draft logit at depth j, the drafted token excluded.
            logits = np.array(logits)
            if j < length:
                logits[int(drafted[row, j])] = -np.inf
            assert int(fork[row, slot]) == int(np.argsort(-logits, kind="stable")[rank])
            assert np.asarray(sync_tokens[0]).tolist() == np.asarray(spec_tokens[row, slot]).tolist()
            if temperature > 0:
                np.testing.assert_allclose(np.asarray(sync_q[0]), np.asarray(spec_q[row, slot]), atol=1e-5)


# ---------------------------------------------------------------------------------- sampling law

VOCAB, NEW, SAMPLES = 4, 3, 6000


@pytest.fixture(scope="module")
def tiny_models():
    target = llama(VOCAB, 32, 1, seed=3, scale=0.4, eos=())
    return target, noisy_copy(target, 1.0, 4)


def _exact_law(target, prompt, sampling, new: int = NEW):
    """P(x1..x_new | prompt) for all VOCAB**new continuations, float64."""
    law = np.zeros((VOCAB,) * new)
    for seq in itertools.product(range(VOCAB), repeat=new):
        tokens = np.array([prompt + list(seq)])
        probs = np.asarray(probabilities(ssd_jax.forward(target, tokens)[0], sampling), np.float64)
        law[seq] = np.prod([probs[len(prompt) - 1 + i, seq[i]] for i in range(new)])
    return law / law.sum()


def _empirical(target, draft, prompt, sampling, options, new: int = NEW):
    keys = jax.random.split(jax.random.PRNGKey(11), SAMPLES)
    out = ssd_jax.generate(target, [prompt] * SAMPLES, max_new_tokens=new, method=make("ssd", **options), draft=draft,
                           key=keys, temperature=sampling.temperature, top_k=sampling.top_k)
    counts = np.zeros((VOCAB,) * new)
    for row in out.tokens:
        counts[tuple(row)] += 1
    return counts / SAMPLES, out.stats


def _consistent(freq, law) -> bool:
    # Per-outcome z-test at 5 sigma over 64 outcomes: false-failure probability < 1e-4 per call.
    sigma = np.sqrt(law * (1 - law) / SAMPLES) + 1e-12
    return bool(np.all(np.abs(freq - law) <= 5 * sigma + 1e-9))


LAW_OPTIONS = [
    dict(num_draft_tokens=2, fanout_budget=3, fanout="geometric", fallback="jit"),
    dict(num_draft_tokens=2, fanout_budget=4, fanout="uniform", fallback="jit", saguaro_c=0.3),
    dict(num_draft_tokens=1, fanout_budget=2, fanout="geometric", fallback="ngram", saguaro_c=0.0),
]


@pytest.mark.parametrize("options", LAW_OPTIONS)
def test_sampled_law_equals_target_law(tiny_models, options):
    target, draft = tiny_models
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1]
    freq, stats = _empirical(target, draft, prompt, sampling, options)
    # Hundreds of hits and of fallback rows: both ways a speculation reaches the verifier are exercised.
    assert stats["cache_hit_rate"] * stats["cache_lookups"] > 100 and stats["fallback_rows"] > 100
    assert _consistent(freq, _exact_law(target, prompt, sampling))


@pytest.mark.slow   # ~90 s; the law across plain stretches: test_sampled_law_with_ssd_resumed_after_plain_stretches
def test_sampled_law_with_the_switch_to_plain_decoding(tiny_models, monkeypatch):
    """draft_len="auto" with the switch after the first SSD step: the rest comes from plain
    decoding chunks, and the law over 3 tokens is still the target's."""
    target, draft = tiny_models
    monkeypatch.setattr(ssd_auto.PlainSwitch, "slower_than_plain", SWITCHES["after-one-step"])
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1]
    freq, stats = _empirical(target, draft, prompt, sampling, dict(num_draft_tokens="auto", max_draft_len=2))
    assert stats["switched_to_plain_at_step"] == 1 and stats["ar_fallback_share"] > 0
    assert _consistent(freq, _exact_law(target, prompt, sampling))


def test_sampled_law_with_ssd_resumed_after_plain_stretches(tiny_models, monkeypatch):
    """SSD switching to plain after its first step and resuming after a one-token plain stretch:
    the law over 4 tokens (SSD steps before and after the stretch) is still the target's. The host
    reads each step before queueing the next here, so that 4 tokens hold both SSD stretches (the
    step queued ahead keeps the tokens: test_ssd_resumed_after_plain_stretches_keeps_autoregressive_tokens)."""
    import ssd_jax.ssd.host_loop as ssd_engine

    target, draft = tiny_models
    _resuming(monkeypatch, chunk=1)
    monkeypatch.setattr(ssd_engine._Decode, "surely_continues", lambda self, unread: False)
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1]
    freq, stats = _empirical(target, draft, prompt, sampling, dict(num_draft_tokens="auto", max_draft_len=1), new=4)
    assert stats["ssd_resumed"] >= 1 and stats["ssd_steps"] >= 2
    assert _consistent(freq, _exact_law(target, prompt, sampling, new=4))


def test_sampled_law_with_top_k(tiny_models):
    target, draft = tiny_models
    sampling = SamplingParams(temperature=0.7, top_k=3)
    prompt = [3, 1]
    freq, _ = _empirical(target, draft, prompt, sampling, LAW_OPTIONS[1])
    assert _consistent(freq, _exact_law(target, prompt, sampling))


def test_sampling_law_check_has_power(tiny_models, monkeypatch):
    """Greedy acceptance at temperature 1 fails the same check."""
    target, draft = tiny_models
    sampling = SamplingParams(temperature=1.0)
    monkeypatch.setitem(ssd_steps.VERIFIERS, "sampling", verify.greedy)
    prompt = [0, 2, 1]
    freq, _ = _empirical(target, draft, prompt, sampling, LAW_OPTIONS[0])
    assert not _consistent(freq, _exact_law(target, prompt, sampling))


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(), "need a draft model"),
    (dict(num_draft_tokens=0), "draft_len must be an integer >= 1 or 'auto' \\(adaptive\\), got 0"),
    (dict(num_draft_tokens="automatic"), "draft_len must be an integer >= 1 or 'auto'.*got 'automatic'"),
    (dict(num_draft_tokens="auto", max_draft_len=-2), "max_draft_len must be an integer >= 1, got -2"),
    (dict(fanout_budget=0), "fanout_budget must be an integer >= 1, got 0"),
    (dict(fanout="tree"), "fanout must be one of 'geometric', 'uniform', got 'tree'"),
    (dict(saguaro_c=1.5), r"saguaro_c must be a number in \[0, 1\].*got 1.5"),
    (dict(fallback="random"), "fallback must be one of 'jit', 'ngram', 'auto', got 'random'"),
    (dict(fanout_acceptance=1.0), r"fanout_acceptance must be a number in \(0, 1\), got 1.0"),
    (dict(num_paths=2), "num_paths"),
    (dict(target_devices=[0]), "give both target_devices and draft_devices"),
    (dict(target_devices=[0], draft_devices=[7]), "names device 7"),
])
def test_bad_ssd_arguments(models, kwargs, match):
    target, draft = models
    if "need a draft" not in match:
        kwargs["draft"] = draft
    with pytest.raises(InputError, match=match):
        draft = kwargs.pop("draft", None)
        if "num_paths" in kwargs:
            ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method="ssd", draft=draft, **kwargs)
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method=make("ssd", **kwargs), draft=draft)


def test_cli_flags_reach_generate(capsys):
    from ssd_jax.cli import main

    code = main(["generate", "--method", "ssd", "--prompt-ids", "5,6,7", "--max-new-tokens", "8", "--json",
                 "--fanout-budget", "4", "--fanout", "uniform", "--saguaro-c", "0.5", "--fallback", "ngram",
                 "--temperature", "1"])
    assert code == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["method"], stats["fanout_budget"], stats["fanout_strategy"], stats["saguaro_c"],
            stats["fallback"]) == ("ssd", 4, "uniform", 0.5, "ngram")


# ---------------------------------------------------------------------------------- several devices

def _multidevice(check: str, devices: int) -> dict:
    env = fake_devices_env(devices)
    env.pop(DETERMINISTIC_ENV, None)   # the subprocess's default tuner measures, as this test's does
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ssd_multidevice.py"), check], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_devices_place_each_model_on_its_own_device():
    result = _multidevice("split", 2)
    assert result["colocated"] is False and result["cpu_async_dispatch"] is False
    assert result["target_devices"] == [0] and result["draft_devices"] == [1]
    assert result["equal_to_ar"] and result["sampled_equal_to_colocated"]
    assert result["placements_ok"], result["placements"]


def test_a_call_started_plain_runs_the_target_on_its_own_devices():
    """An "auto" call that a remembered verdict decodes plainly runs AR's loop where the SSD
    options put the target (it ran on the default device, the draft's device 0 here), with AR's
    tokens."""
    result = _multidevice("plain", 2)
    assert result["plain_from_start"] and result["equal_to_ar"]
    assert result["target_params_on"] == [[1]]


@pytest.mark.slow   # the device groups' placement: test_two_devices_place_each_model_on_its_own_device
def test_four_devices_groups_of_two():
    result = _multidevice("groups", 4)
    assert result["target_devices"] == [0, 1] and result["draft_devices"] == [2, 3]
    assert result["cpu_async_dispatch"] is True
    assert result["equal_to_ar"]
    assert result["placements_ok"], result["placements"]
