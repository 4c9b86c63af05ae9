"""A `generate` call of method SSD: the host loop at the method's length, or under draft_len="auto"
at the length the tuner's cost model chooses, with what the tuner keeps after it."""

from __future__ import annotations

import functools
import time

from ssd_jax.draft.fanout import max_budget
from ssd_jax.methods import SSD
from ssd_jax.model import Model
from ssd_jax.runtime.decode_program import bare
from ssd_jax.runtime.output import GenerateOutput
from ssd_jax.runtime.prompts import PromptBatch
from ssd_jax.sampling import SamplingParams
from ssd_jax.ssd import auto as ssd_auto
from ssd_jax.ssd import plain_read
from ssd_jax.ssd.host_loop import generate_ssd
from ssd_jax.ssd.placement import placed_model, resolve_groups
from ssd_jax.tuning import cost_model, measure


def ssd_engine_options(method: SSD, draft_len: int | None = None) -> dict:
    """`ssd_jax.ssd.host_loop.generate_ssd`'s keyword options from an SSD method object; draft_len:
    the length to decode with (None: the method's, which must then be fixed, not "auto")."""
    draft_len = method.draft_len if draft_len is None else draft_len
    if not isinstance(draft_len, int):
        raise TypeError(f"ssd_engine_options needs a fixed draft length, got {draft_len!r}: pass the chosen one")
    return dict(num_draft_tokens=draft_len, fanout_budget=method.fanout_budget, fanout=method.fanout,
                saguaro_c=method.saguaro_c, fallback=method.fallback, target_devices=method.target_devices,
                draft_devices=method.draft_devices, fanout_acceptance=method.fanout_acceptance,
                fanout_exponent=method.fanout_exponent)


def ssd_target(method: SSD, target: Model, draft: Model) -> Model:
    """The target placed on SSD's target group (`ssd_jax.ssd.placement`), where a call that a
    remembered verdict decodes plainly runs AR's loop: where SSD measured plain decoding's step
    that the verdict weighed, and where the SSD options put the target (unplaced, AR ran on the
    default device: with target_devices=[1], draft_devices=[0], on the draft's device 0)."""
    target_devices, _ = resolve_groups(method.target_devices, method.draft_devices, target, draft)
    return placed_model(target, target_devices)


def read_plain_call(tuner, method: SSD, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
                    sampling: SamplingParams, key, out: GenerateOutput, verdict_key: tuple) -> None:
    """After an "auto" call that a plain verdict decoded with AR's loop (out: its output): the
    draft's read of the call's text (`plain_read`), on SSD's draft group, where the program's
    reads are within their share of its plain calls' time (`plain_read.read_due`), kept as the
    pair's acceptance (`pair_acceptance_key`) and as the program's latest read (`ssd_auto.note_read`),
    which a later call weighs against the verdict's (`ssd_auto.acceptance_rose`). Its acceptance and seconds go in out.stats
    (plain_read_acceptance: None where nothing was read; its compile in compile_time_s)."""
    acceptance, seconds, compile_s = None, 0.0, 0.0
    if tuner.measures:
        plain_read.spent(tuner.ssd, verdict_key, out.stats["wall_time_s"], 0.0)
        if plain_read.read_due(tuner.ssd, verdict_key):
            _, draft_devices = resolve_groups(method.target_devices, method.draft_devices, target, draft)
            acceptance, seconds, compile_s = plain_read.read_call(
                placed_model(draft, draft_devices), target.config.vocab_size, batch, max_new_tokens, out, sampling,
                key)
            plain_read.spent(tuner.ssd, verdict_key, 0.0, seconds)
            tuner.remember_acceptance(pair_acceptance_key(target, draft, method, sampling), acceptance)
            ssd_auto.note_read(tuner.ssd, verdict_key, acceptance)
    out.stats.update(plain_read_acceptance=acceptance, plain_read_s=seconds,
                     compile_time_s=out.stats["compile_time_s"] + compile_s)


def pair_acceptance_key(target: Model, draft: Model, method: SSD, sampling: SamplingParams) -> tuple:
    """What SSD's acceptance is remembered under: the key SD's adaptive calls of the pair keep
    theirs under (`cost_model.SHARED_ACCEPTANCE`; the models as the decode programs take them)."""
    return cost_model.acceptance_key(bare(target), bare(draft), method, sampling)


def priced(tuner, method: SSD, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
           verdict_key: tuple) -> tuple[cost_model.StepCosts, float]:
    """(the costs an "auto" call is priced with, SSD's step overhead in seconds): the draft-model
    methods' cost model with the cache build's forwards where both models share devices and the
    fallback's at the program's recent miss rate, plus SSD's own step overhead measured on the
    program's past calls (`ssd_auto.step_overhead`)."""
    context = batch.max_length + max_new_tokens // 2
    target_devices, draft_devices = resolve_groups(method.target_devices, method.draft_devices, target, draft)
    slots = min(method.fanout_budget, max_budget(method.max_draft_len, target.config.vocab_size))
    costs = ssd_auto.build_priced(tuner, measure.measure_costs(tuner, target, draft, batch.batch_size, context,
                                                               method.max_draft_len),
                                  draft, batch.batch_size, context, slots, target_devices == draft_devices,
                                  ssd_auto.hit_rate(tuner.ssd, verdict_key))
    return costs, ssd_auto.step_overhead(tuner.ssd, verdict_key, costs.target(1))


class PricedSpeedup:
    """speedup(length, acceptance): the cost model's predicted speed-up of the program's SSD over
    plain decoding (`priced`'s costs, measured at the first use: a call that starts plain and
    needs none measures nothing); max_draft_len: the longest length it may run."""

    def __init__(self, price, max_draft_len: int):
        self.price = price
        self.max_draft_len = int(max_draft_len)

    @functools.cached_property
    def priced(self) -> tuple[cost_model.StepCosts, float]:
        return self.price()

    def __call__(self, draft_len: int, acceptance: float) -> float:
        costs, overhead = self.priced
        return cost_model.predicted_speedup(costs, acceptance, draft_len, step_overhead_s=overhead)


def priced_speedup(tuner, method: SSD, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
                   verdict_key: tuple) -> PricedSpeedup:
    """The `PricedSpeedup` of an "auto" call (what `ssd_auto.starts_plain` weighs a rise in the
    pair's acceptance with)."""
    return PricedSpeedup(lambda: priced(tuner, method, target, draft, batch, max_new_tokens, verdict_key),
                         method.max_draft_len)


def choose_length(tuner, method: SSD, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
                  verdict_key: tuple, acceptance_key: tuple) -> tuple[int, cost_model.StepCosts, float | None]:
    """(the draft length of an "auto" call, the costs it was priced with, the acceptance it was
    priced at where some call measured it, else None): `priced`'s costs and overhead, at the
    acceptance of the program's past calls' pace (before any: the pair's remembered acceptance
    under `acceptance_key`, SD's calls' included: `pair_acceptance_key`); a probe that a rise in
    the pair's acceptance made, at that rise's acceptance and best length (`ssd_auto.rise_probe`)."""
    costs, overhead = priced(tuner, method, target, draft, batch, max_new_tokens, verdict_key)
    rise = ssd_auto.rise_probe(tuner.ssd, verdict_key)
    if rise is not None and rise[1] is not None:   # a probe that a rise in acceptance made
        known, draft_len = rise
    else:
        paced = ssd_auto.pace_acceptance(tuner.ssd, verdict_key)
        known = tuner.known_acceptance(acceptance_key) if paced is None else paced
        acceptance = cost_model.PRIOR_ACCEPTANCE if known is None else known
        draft_len = ssd_auto.probe_length(
            tuner.ssd, verdict_key,
            cost_model.choose_draft_len(costs, acceptance, method.max_draft_len, step_overhead_s=overhead),
            lambda n: cost_model.predicted_speedup(costs, acceptance, n, step_overhead_s=overhead))
    ssd_auto.ran_length(tuner.ssd, verdict_key, draft_len)
    return draft_len, costs, known


def generate_ssd_call(tuner, method: SSD, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
                      sampling: SamplingParams, key, stream, verdict_key: tuple) -> tuple[GenerateOutput, int]:
    """SSD's call: at the method's length, or under "auto" at `choose_length`'s, after which the
    tuner keeps the call's acceptance, step overhead and pace. Returns (the output, the length
    it ran)."""
    if not method.adaptive:
        return generate_ssd(target, draft, batch, max_new_tokens, sampling, key, stream=stream,
                            **ssd_engine_options(method)), method.draft_len
    start = time.perf_counter()
    acceptance_key = pair_acceptance_key(target, draft, method, sampling)
    draft_len, costs, known = choose_length(tuner, method, target, draft, batch, max_new_tokens, verdict_key,
                                            acceptance_key)
    before = tuner.known_acceptance(acceptance_key)
    measure_s = time.perf_counter() - start
    out = generate_ssd(target, draft, batch, max_new_tokens, sampling, key, stream=stream, tuner=tuner,
                       verdict_key=verdict_key, prior_acceptance=known, **ssd_engine_options(method, draft_len))
    observed = cost_model.acceptance_of(out.stats["num_accepted_tokens"], out.stats["num_rejected"])
    # What a later call's rise in acceptance is measured from (`ssd_auto.acceptance_rose`): the
    # acceptance this call's SSD steps met, which its cost ratio was measured at, not the pair's
    # memory before it (after one lucky SD call on code that read 0.93 where SSD's steps met less,
    # prose at 0.99 predicted too small a gain to probe, and SSD stayed plain where it paid 1.35x).
    ssd_auto.ran_at_acceptance(tuner.ssd, verdict_key, before if observed is None else observed, draft_len)
    tuner.remember_acceptance(acceptance_key, observed)
    ssd_auto.remember_hit_rate(tuner.ssd, verdict_key, out.stats.get("cache_hit_rate", 0.0),
                               out.stats.get("cache_lookups", 0))
    if out.stats.get("judged_step_s") is not None:
        ssd_auto.remember_step(tuner.ssd, verdict_key, draft_len, out.stats["judged_step_s"],
                               out.stats["call_pace_tokens"], costs.spec_step(draft_len))
    out.stats.update(observed_acceptance=observed, cost_measure_time_s=out.stats["cost_measure_time_s"] + measure_s)
    return out, draft_len
