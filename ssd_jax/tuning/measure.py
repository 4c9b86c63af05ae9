"""Measurements of draft_len="auto": target and draft forwards timed in a jitted loop
(`forward_seconds`, `measure_costs`) and the decode program's own steps timed by forced runs
(`calibrated_inputs`). Each is measured once per `ssd_jax.Tuner` (kept in its memories) and, where
the tuner has a store, once per machine (`ssd_jax.runtime.calibration_store`). Under a
deterministic tuner nothing is measured: the fixed relative costs `cost_model.UNMEASURED` stand in.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.loop.costs import cost_vector, host_costs
from ssd_jax.runtime import calibration_store, program_store
from ssd_jax.runtime.compile_cache import signature
from ssd_jax.runtime.processes import agreed
from ssd_jax.tuning.cost_model import (FORCE_PLAIN, FORCE_SPECULATION, UNMEASURED, StepCosts, calibration_length,
                                       context_bucket, force_cap, model_key, nondecreasing, pair_key, trimmed_mean,
                                       usable_calibration)

_LOOP_FORWARDS = 16


_REPEATS = 5


def _loop_seconds(tuner, params, config, batch: int, width: int, context: int) -> float:
    """Seconds per forward of `width` tokens over a cache holding `context` tokens, timed as a
    jitted loop of _LOOP_FORWARDS forwards (best of _REPEATS); kept on disk per loop and machine
    (`ssd_jax.runtime.calibration_store`), so a new process reads it back (instead of ~1 s
    compiling and timing it), named without lowering the loop (0.15 s each) where
    `program_store.describe` can say what decides it."""
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.transformer import forward_cached

    per_layer = isinstance(params["layers"], (tuple, list))
    capacity = context + width + 1

    @jax.jit
    def loop(params):
        cache = init_cache(config, batch, capacity, params["embed"].dtype, per_layer=per_layer)
        cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))

        def body(i, acc):
            tokens = (jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width) + i) % config.vocab_size
            positions = context + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
            logits, _ = forward_cached(params, config, tokens, positions, cache)
            return acc + logits[:, -1, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, _LOOP_FORWARDS, body, jnp.zeros((batch,), jnp.float32))

    described = program_store.describe(f"{__name__}._loop_seconds", (config, batch, width, context, per_layer,
                                                                     _LOOP_FORWARDS), signature(params))
    lowered = None if described is not None else loop.lower(params)
    stored = calibration_store.path_for_text("forward", described or lowered.as_text(), tuner.store_dir())
    kept = calibration_store.load(stored)
    if kept is not None and len(kept) == 1 and kept[0] > 0:
        return kept[0]
    with tuner.calibrating(f'timing a forward of {width} token{"s" if width > 1 else ""} for draft_len="auto" (once per machine)'):
        compiled = (lowered or loop.lower(params)).compile()
        jax.block_until_ready(compiled(params))
        best = np.inf
        for _ in range(_REPEATS):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params))
            best = min(best, time.perf_counter() - start)
    seconds = best / _LOOP_FORWARDS
    calibration_store.save(stored, (seconds,))
    return seconds


def forward_seconds(tuner, model, batch: int, width: int, context: int, measure: bool = True) -> float | None:
    """Seconds per forward of `width` tokens at this batch and context (rounded up to a power of
    two), measured once per machine (`_loop_seconds`, kept on disk) and remembered for the
    tuner; None for a deterministic tuner, or where not yet measured and measure is False. Under
    jax.distributed every process gets process 0's number."""
    from ssd_jax.runtime.loop_params import loop_params

    if not tuner.measures:
        return None
    key = (model_key(model), batch, context_bucket(context), width)
    known = tuner.remembered(tuner.forward_seconds, key)
    if known is not None or not measure:
        return known

    def seconds() -> float:
        measured = _loop_seconds(tuner, loop_params(model), model.config, batch, width, context_bucket(context))
        return float(agreed(np.asarray([measured]))[0])

    return tuner.measured_once(tuner.forward_seconds, key, seconds)


def measure_costs(tuner, target, draft, batch: int, context: int, max_draft_len: int) -> StepCosts:
    """The pair's StepCosts at this batch and context (rounded up to a power of two), measured
    once per process (target at 1 and max_draft_len + 1 tokens, draft at 1; draft None, for
    retrieval drafting: no draft forwards, draft cost 0); UNMEASURED for a deterministic tuner. Under jax.distributed every process gets process 0's numbers."""
    if not tuner.measures:
        return UNMEASURED
    key = (pair_key(target, draft), batch, context_bucket(context), max_draft_len)
    known = tuner.remembered(tuner.step_costs, key)
    if known is not None:
        return known
    one = forward_seconds(tuner, target, batch, 1, context)
    wide = forward_seconds(tuner, target, batch, max_draft_len + 1, context)
    per_token = max(wide - one, 0.0) / max_draft_len
    draft_cost = 0.0 if draft is None else forward_seconds(tuner, draft, batch, 1, context)
    costs = StepCosts(target_fixed=max(one - per_token, 1e-9), target_per_token=per_token, draft=draft_cost)
    tuner.keep(tuner.step_costs, key, costs)
    return costs


def cached_costs(tuner, target, draft, batch: int, context: int, max_draft_len: int) -> StepCosts:
    """The costs the tuner measured already (no measuring), else UNMEASURED."""
    key = (pair_key(target, draft), batch, context_bucket(context), max_draft_len)
    known = tuner.remembered(tuner.step_costs, key)
    return UNMEASURED if known is None else known


_CALIBRATION_TOKENS = 48
_CALIBRATION_ROUNDS = 7


def _calibrate(executable, args: tuple, costs: StepCosts, takes_cap: bool,
               table_caps: tuple[int, ...] = ()) -> tuple[float, ...]:
    """(AR step, speculative step without draft forwards, one draft forward, then the seconds of
    a speculative step by cap 1..L: measured for table_caps, 0 for the others) in seconds, from
    interleaved forced runs (see `calibrated_inputs`). A change to what this returns must bump
    `calibration_store.FORMAT`, or calibrations kept on disk would be read with the new meaning."""
    size = int(np.shape(args[-1])[0])
    draft_len = size - len(FORCE_SPECULATION)

    def runner(forced, max_new):
        return timed_run(executable, args, max_new, forced)

    setup = runner(FORCE_SPECULATION, 1)
    tokens = calibration_tokens(setup()[1])
    plain_run = runner(FORCE_PLAIN, tokens)
    # A plain run opens and closes each round: the AR step is every price's denominator, and its
    # noise moved all of a round's prices together (see `calibrated_inputs`).
    runs = dict(plain=plain_run, setup=setup, spec=runner(FORCE_SPECULATION, tokens))
    if takes_cap:
        runs["one"] = runner(force_cap(1), tokens)
    middle = tuple(c for c in table_caps if 1 < c < draft_len)
    for cap in middle:
        runs[f"cap{cap}"] = runner(force_cap(cap), tokens)
    counts = {}
    for name, run in runs.items():   # warm, and the step counts (the same every round)
        counters = jax.device_get(run()[1].counters["spec"])
        steps = max(int(counters.target_calls) - 1, 1)
        plain = int(np.max(counters.ar_steps))
        # Draft forwards per speculative step as the loop counts them (a step drafts until its
        # last row stops: at batch 8 that is near the cap while the mean row drafts far fewer).
        forwards = float(counters.draft_forwards) / max(steps - plain, 1)
        counts[name] = (steps, plain, forwards)
    runs["plain_end"] = plain_run   # timed each round, after the others; warmed and counted as "plain"
    forwards = counts["spec"][2]
    measured_cap = takes_cap and forwards >= 0.5
    # The caps whose step is timed whole: the longest (spec), 1 (one) and the middle ones.
    timed = {cap: name for cap, name in ((1, "one"), (draft_len, "spec"), *((c, f"cap{c}") for c in middle))
             if measured_cap and cap in table_caps}
    rounds = []
    for _ in range(_CALIBRATION_ROUNDS):
        seconds = {name: run()[0] for name, run in runs.items()}
        setup = seconds["setup"]

        def per_step(name):
            return max(seconds[name] - setup, 1e-9) / counts[name][0]

        t_spec = per_step("spec")
        p_steps, p_plain, _ = counts["plain"]
        t_ar = float(np.mean([max(seconds[name] - setup - (p_steps - p_plain) * t_spec, 1e-9) / max(p_plain, 1)
                              for name in ("plain", "plain_end")]))
        # Unmeasured slope: a draft forward (and, for a capped loop, a verified token) per token.
        c_draft = (costs.draft + (costs.target_per_token if takes_cap else 0.0)) * t_ar / costs.target(1)
        if measured_cap:
            c_draft = max(t_spec - per_step("one"), 0.0) / forwards
        table = [per_step(timed[cap]) / t_ar if cap in timed else 0.0 for cap in range(1, draft_len + 1)]
        rounds.append((t_ar, t_spec / t_ar, c_draft / t_ar, *table))
    t_ar, spec_ratio, draft_ratio, *table = (trimmed_mean(column) for column in zip(*rounds))
    return (t_ar, max((spec_ratio - forwards * draft_ratio) * t_ar, 1e-9), draft_ratio * t_ar,
            *(ratio * t_ar for ratio in table))


def calibration_tokens(output) -> int:
    """The tokens a calibration's runs of a decode program decode (output: one run's
    `DecodeOutput`, tokens int32 [B, out_size]): as many as its output holds, up to
    _CALIBRATION_TOKENS. Not the call's max_new: what is measured is kept for every call of the
    program, whose max_new may be anything up to out_size (a call of one token timed only noise,
    and its calibration priced the next calls' steps)."""
    return min(int(np.shape(output.tokens)[1]), _CALIBRATION_TOKENS)


def timed_run(executable, args: tuple, max_new: int, forced: np.ndarray | None = None):
    """A function that runs the compiled `executable` once on `args` with max_new replaced (the
    last argument; where `forced` is given, the one before, and the loop's cost inputs, the last,
    replaced by forced zero-padded to their length) and returns (seconds, output)."""
    if forced is None:
        run_args = args[:-1] + (jax.device_put(np.asarray(max_new, np.int32), args[-1].sharding),)
    else:
        forced = np.concatenate([forced, np.zeros(int(np.shape(args[-1])[0]) - len(forced), np.float32)])
        run_args = args[:-2] + (jax.device_put(np.asarray(max_new, np.int32), args[-2].sharding),
                                jax.device_put(forced, args[-1].sharding))

    def run():
        start = time.perf_counter()
        out = jax.block_until_ready(executable(*run_args))
        return time.perf_counter() - start, out

    return run


def _kept_or_measured(tuner, executable, args: tuple, program_key, costs: StepCosts, size: int, takes_cap: bool,
                      table_caps: tuple[int, ...]) -> tuple[float, ...]:
    """The program's calibration (`calibrated_inputs`' arguments; size: its `calibration_length`):
    another thread's, else the one kept on disk, else measured (and kept); remembered for the
    process."""
    def kept_or_measured() -> tuple[float, ...]:
        stored = calibration_store.path_for(executable, key=program_key, store=tuner.store_dir())
        calibration = calibration_store.load(stored)
        if not usable_calibration(calibration, size):
            with tuner.calibrating('timing the decode program\'s steps for draft_len="auto" (once per program and machine)'):
                calibration = tuple(float(x) for x in agreed(np.asarray(
                    _calibrate(executable, args, costs, takes_cap, table_caps))))
            calibration_store.save(stored, calibration)
        return calibration

    return tuner.measured_once(tuner.calibrations, program_key, kept_or_measured)


def calibrated_inputs(tuner, executable, args: tuple, program_key, costs: StepCosts, planned: np.ndarray,
                      takes_cap: bool = False, table_caps: tuple[int, ...] = ()) -> np.ndarray:
    """loop_inputs with the AR and speculative step times measured on the compiled program itself (args:
    its arguments, the last one the cost inputs; max_new, the one before, set to `calibration_tokens`): a
    run of one token (prefill and setup, subtracted from the others), a short run with
    FORCE_SPECULATION and one with FORCE_PLAIN (which still probes, but for retrieval, which
    measures during plain steps). takes_cap (a loop that caps each step's draft): one more run
    capped at one token, so the step time without draft forwards and one draft forward's in-loop
    time are both measured (the slope between the two caps); otherwise the draft forward's cost is
    the per-forward measurement scaled like the AR step. table_caps (capped loops drafting with a
    model): the caps whose whole step is timed (forced runs at each), which the loop then prices as
    measured instead of linearly: a step's cost can grow faster than linearly with its cap, and the
line through caps 1 and L then prices long caps too cheaply. The runs are interleaved in
_CALIBRATION_ROUNDS rounds, each opened and closed by a plain run (the round's AR step is their
mean), and each cost is the trimmed mean over rounds of its ratio to the same round's AR step
(times the trimmed mean AR step): a machine's speed can drift by tens of percent within seconds,
which separate best-of timings would take for differences between the programs. Kept per program
(program_key) by the tuner, and in its store per program and machine
(`ssd_jax.runtime.calibration_store`), so a new process finds it; the prior acceptance stays the
plan's. For a deterministic tuner: `planned`, unmeasured."""
    if not tuner.measures:
        return np.asarray(planned, np.float32)
    calibration = tuner.remembered(tuner.calibrations, program_key)
    if calibration is None:
        calibration = _kept_or_measured(tuner, executable, args, program_key, costs, calibration_length(len(planned)),
                                        takes_cap, table_caps)
    t_ar, t_spec_fixed, c_draft, *table = calibration
    return cost_vector(ar_step=t_ar, spec_step=t_spec_fixed, draft_forward=c_draft,
                       acceptance=host_costs(planned).acceptance, forced_cap=0.0, cap_seconds=nondecreasing(table))
