"""One `generate` call under draft_len="auto", as the host policy sees it: the plan the tuner makes
for the call (`plan_call`), the loop's cost inputs calibrated on the call's compiled program
(`AutoCall.calibrate`), what the tuner remembers after it (`AutoCall.record`), the call priced
against AR's own program (`against_ar_stats`), and the reference runs of AR's program that
per-call "auto" prices its choices against (`ar_reference`, `fixed_seconds`)."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ssd_jax.methods import Method
from ssd_jax.model import Model
from ssd_jax.runtime import decode_program
from ssd_jax.runtime.prompts import PromptBatch, bucket
from ssd_jax.sampling import SamplingParams
from ssd_jax.tuning import against_ar, cost_model, measure
from ssd_jax.tuning.cost_model import AutoPlan, StepCosts

AR_REFERENCE_RUNS = 2   # timed runs of AR's program for a per-call choice's baseline (the fastest kept)


@dataclasses.dataclass
class AutoCall:
    """A call's adaptive-speculation plan, its loop's cost inputs (float32 [5 + L], replaced by
    the calibrated ones once measured) and what the tuner remembers after it."""

    tuner: object
    plan: AutoPlan
    loop_inputs: np.ndarray
    costs: StepCosts
    memory_key: tuple
    measure_s: float   # seconds this call spent measuring costs (0 where the tuner had them)
    table_caps: tuple = ()   # the caps whose step the calibration times whole

    def calibrate(self, executable, args: tuple, calibration_key) -> jax.Array:
        """The loop's cost inputs measured on the call's own compiled program (once per program,
        kept under calibration_key; args: its arguments, the cost inputs last): a short run forced
        to speculate and one forced to decode plainly give the step times that the per-forward
        measurement misses (sampling, verification, bookkeeping). Placed like args' cost inputs."""
        start = time.perf_counter()
        inputs = measure.calibrated_inputs(self.tuner, executable, args, calibration_key, self.costs,
                                           self.loop_inputs, takes_cap=self.plan.capped, table_caps=self.table_caps)
        self.measure_s += time.perf_counter() - start
        self.loop_inputs = inputs
        return jax.device_put(inputs, args[-1].sharding)

    def record(self, counters) -> dict:
        """Remembers the call's acceptance (counters: its spec counters) for the next plan; the
        stats of the plan."""
        counters = jax.device_get(counters)
        observed = cost_model.acceptance_of(int(np.sum(counters.num_accepted)), int(np.sum(counters.num_rejected)))
        self.tuner.remember_acceptance(self.memory_key, observed)
        return dict(adaptive=True, num_draft_tokens_per_step=self.plan.draft_len, planned_draft_len=self.plan.draft_len,
                    early_stop_threshold=self.plan.threshold, observed_acceptance=observed,
                    cost_measure_time_s=self.measure_s, loop_costs=[float(x) for x in self.loop_inputs])


def plan_call(tuner, method: Method, target: Model, draft, sampling: SamplingParams, batch: PromptBatch,
              max_new_tokens: int) -> AutoCall:
    """The tuner's plan for an "auto" call: the pair's costs (measured once per tuner and shape;
    the fixed relative costs for a deterministic tuner) and the remembered acceptance (the prior
    before any, and always for a deterministic tuner)."""
    start = time.perf_counter()
    costs = measure.measure_costs(tuner, target, cost_model.cost_draft(method, draft, target), batch.batch_size,
                                  batch.max_length + max_new_tokens // 2, cost_model.cost_width(method))
    memory_key = cost_model.acceptance_key(target, draft, method, sampling)
    plan, loop_inputs = cost_model.plan(method, target, draft, sampling, costs, tuner.acceptance_for(memory_key))
    return AutoCall(tuner=tuner, plan=plan, loop_inputs=loop_inputs, costs=costs, memory_key=memory_key,
                    measure_s=time.perf_counter() - start, table_caps=cost_model.table_caps(method, plan))


def verdict_key(method: Method, target: Model, draft, sampling: SamplingParams, batch: PromptBatch,
                max_new_tokens: int) -> tuple:
    """What a "decode plainly from the start" verdict is remembered under (`ssd.auto.starts_plain`,
    `plain_verdicts.starts_plain`): the pair's weights, the method, sampling and the call's shapes."""
    return (cost_model.acceptance_key(target, draft, method, sampling), method, sampling, batch.batch_size,
            batch.tokens.shape[1], bucket(max_new_tokens))


def no_drafts() -> dict:
    """The draft counters of a call that drafted nothing (`ssd_jax.metrics`' values for zero
    drafts; each target call gave each row one token), new lists each time."""
    return dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_rejected=0, acceptance_rate=0.0,
                mean_acceptance_length=0.0, block_efficiency=1.0, accepted_per_position=[], steps_by_cap=[],
                observed_acceptance=None)


def against_ar_stats(tuner, target: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key,
                     loop_costs: list, counters, num_tokens, loop_executable, loop_args: tuple, loop_key) -> dict:
    """Stats of an "auto" call that speculated, priced against AR's own program
    (`ssd_jax.tuning.against_ar`; counters: the call's spec counters on the host): loses_to_ar (the
    next calls start plain), and where checked priced_speedup_vs_ar and ar_step_over_loop_plain.
    AR's program is the one a plain-from-start call runs, compiled here only for calls within
    `against_ar.GAIN_CHECK` of the loop's plain steps. Their step ratio is kept by the tuner under
    loop_key (the loop's program key and argument signature, which fix AR's program too), so a
    later call does not build AR's program and inputs to find it, and in the tuner's store per
    loop program (`against_ar.stored_ratio`), so a later process does not either."""
    by_cap = np.asarray(counters.cap_steps).tolist()
    plain_steps = int(counters.target_calls) - 1 - int(sum(by_cap))
    ar_steps = int(np.max(np.asarray(num_tokens))) - 1
    found: dict = {}

    def ar_ratio() -> float | None:
        known, ratio = against_ar.stored_ratio(tuner, loop_executable, loop_key)
        if not known:
            executable, args, _, _ = decode_program.ar_executable(target, batch, max_new_tokens, sampling, key)
            ratio = against_ar.ar_step_ratio(tuner, executable, args, loop_executable, loop_args, loop_key)
        found["ar_step_over_loop_plain"] = ratio
        return ratio

    lost, speedup = against_ar.loses_to_ar(loop_costs, by_cap, plain_steps, ar_steps, ar_ratio)
    if speedup is not None:
        found["priced_speedup_vs_ar"] = speedup
    return dict(loses_to_ar=lost, **found)


def fixed_seconds(method: Method, target: Model, draft, batch: PromptBatch, max_new_tokens: int,
                  sampling: SamplingParams, key) -> float:
    """A fixed-length program's fixed part on a call's inputs (its run to one token, the fastest
    of AR_REFERENCE_RUNS; `PerCallMemory.record_fixed`), the program already compiled and run."""
    executable, args, _, _ = decode_program.fixed_executable(method, target, draft, batch, max_new_tokens, sampling,
                                                             key)
    one_token = decode_program.with_budget(target, args, 1)
    return min(decode_program.run_seconds(executable, one_token) for _ in range(AR_REFERENCE_RUNS))


def ar_reference(target: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key
                 ) -> tuple[float, int, float]:
    """AR's program (the one a plain-from-start call runs) on a per-call "auto" call's inputs:
    (the fastest of AR_REFERENCE_RUNS runs that are not the executable's first, its target calls,
    the fastest of as many runs to one token: the call's fixed part, `PerCallMemory.record_fixed`),
    the price of the choice's baseline. The fastest: the baseline is measured once and kept while
    the method's programs win, each of whose prices every call of it measures again, so one slow
    run (another process, a clock ramping up) would price AR's program dear for good. The runs are
    the same executable with another token budget (an argument), interleaved: the whole runs at
    `reference_budget`."""
    executable, args, _, compile_s = decode_program.ar_executable(target, batch, max_new_tokens, sampling, key)
    if compile_s:
        decode_program.first_run_s(executable, args)
    one_token = decode_program.with_budget(target, args, 1)
    whole = decode_program.with_budget(target, args, reference_budget(target, batch, max_new_tokens))
    fastest = fixed = float("inf")
    for _ in range(AR_REFERENCE_RUNS):
        fixed = min(fixed, decode_program.run_seconds(executable, one_token))
        start = time.perf_counter()
        output = jax.block_until_ready(executable(*whole))
        fastest = min(fastest, time.perf_counter() - start)
    return fastest, int(jax.device_get(output.counters["spec"].target_calls)), fixed


def reference_budget(target: Model, batch: PromptBatch, max_new_tokens: int) -> int:
    """The tokens AR's reference runs decode: the program's output budget (`bucket`), which its
    price serves (every call of the key asks for at most that many), within the target's
    positions after the longest prompt, at least max_new_tokens. A call of one or two tokens
    would time the fixed part alone, or one step against it: noise that priced a key's steps
    many times too dear."""
    room = target.config.max_position_embeddings - batch.max_length
    return max(int(max_new_tokens), min(bucket(max_new_tokens), room))
