"""Whether an "auto" call that speculated would have run faster as AR's own program.

The adaptive loop chooses between speculating and its own plain steps, priced by its calibration.
Its plain steps are not AR's program: they keep the buffer of tokens the draft missed and check
every few steps whether speculation pays (retrieval also walks its drafts against the tokens
drawn). Where a step is many tiny kernels (a small model on a GPU) that extra work can make the
loop's plain step dearer than AR's, and a loop that rightly prefers speculating over its own plain
steps still runs below AR. Only a call-level verdict reaches AR's program
(`ssd_jax.tuning.plain_verdicts`): after a call, its steps priced at the loop's prices are compared
with AR's program's measured step over the steps AR would take, and a call that lost makes the next
calls of its program start plain (with the verdicts' probes).

AR's step is timed on its compiled program (the one a plain-from-start call runs) against the
loop's plain step, both programs timed alike in interleaved rounds (a trimmed mean of the ratios,
as the loop's calibration), once per program and argument shapes per tuner, and kept in the
tuner's store per loop program and machine beside the loop's calibration
(`ssd_jax.runtime.calibration_store`, "ar-ratio-" files: a later process neither builds nor times
AR's program for it); only for calls whose speculation the loop's own prices find within
GAIN_CHECK of its plain steps, so calls that clearly pay never compile AR's program.
"""

from __future__ import annotations

import jax
import numpy as np

from ssd_jax.runtime import calibration_store
from ssd_jax.loop.costs import host_costs
from ssd_jax.runtime.processes import agreed
from ssd_jax.tuning import measure
from ssd_jax.tuning.cost_model import FORCE_PLAIN, trimmed_mean
from ssd_jax.tuning.measure import calibration_tokens, timed_run

# A call is checked against AR's program when its priced seconds are at least this share of its
# AR steps at the loop's plain price: AR's program is at most about a quarter cheaper than those
# (docs/benchmarks.md), so a call priced below this clearly beats it.
GAIN_CHECK = 0.7
# ... and judged to lose unless its priced seconds beat AR's by this share. A loop call carries
# host work that AR's does not and the prices leave out, and a call that does not lose only keeps
# the next calls on the loop, where near ties cost: a wider margin let streaks of loop calls priced
# just under AR run slower than AR. A wrong verdict the other way costs a gain under this share
# until the next probe.
GAIN_MARGIN = 0.01

# AR's step over the loop's plain step can only lie near 1: both run one target forward per
# token, the loop's plain step adding its buffer of missed tokens and its checks. A measured ratio
# outside these bounds is the timing's noise (processes sharing a machine), and a verdict on it
# would send the calls after a call that paid to AR's program: it is kept as unmeasurable (no
# verdict) for the key.
PLAUSIBLE_RATIO = (0.5, 1.5)


def step_price(loop_costs, cap: int) -> float:
    """Seconds of a loop step capped at `cap` (0: a plain step) by the loop's prices (loop_costs:
    a call's `loop_costs` stat, the cost vector of `ssd_jax.loop.costs.LoopCosts`): the plain
    price for 0, the step its calibration timed at that cap, else the speculative step's fixed
    cost plus (cap - 1) draft forwards."""
    costs = host_costs(loop_costs)
    if cap == 0:
        return costs.ar_step
    table = costs.cap_seconds if costs.cap_seconds is not None else ()
    if 0 < cap <= len(table) and table[cap - 1] > 0:
        return float(table[cap - 1])
    return costs.spec_step + (cap - 1) * costs.draft_forward


def call_seconds(loop_costs, steps_by_cap, plain_steps: int) -> float:
    """A call's seconds at the loop's prices: its speculative steps by cap (steps_by_cap: counts
    for caps 1..L) and its plain steps at the loop's plain price."""
    spec = sum(int(n) * step_price(loop_costs, cap) for cap, n in enumerate(steps_by_cap, start=1) if n)
    return spec + int(plain_steps) * step_price(loop_costs, 0)


def known_ratio(tuner, key) -> tuple[bool, float | None]:
    """(whether `ar_step_ratio` measured key already, its ratio: None where unmeasurable)."""
    cached = tuner.remembered(tuner.ar_ratios, key)
    if cached is None:
        return False, None
    return True, None if np.isnan(cached) else cached


STORE_KIND = "ar-ratio"


def _plausible(ratio: float) -> bool:
    return PLAUSIBLE_RATIO[0] <= ratio <= PLAUSIBLE_RATIO[1]


def stored_ratio(tuner, loop_executable, key) -> tuple[bool, float | None]:
    """`known_ratio`, else the ratio a process before kept on disk for the loop's program (then
    remembered under key): (whether found, the ratio: None where unmeasurable). An implausible
    ratio on disk counts as absent, measured again and replaced: `ar_step_ratio` keeps none."""
    known, ratio = known_ratio(tuner, key)
    if known:
        return known, ratio
    kept = calibration_store.load(calibration_store.path_for(loop_executable, STORE_KIND, key, tuner.store_dir()))
    if kept is None or len(kept) != 1 or not _plausible(kept[0]):
        return False, None
    tuner.keep(tuner.ar_ratios, key, kept[0])
    return True, kept[0]


def ar_step_ratio(tuner, ar_executable, ar_args: tuple, loop_executable, loop_args: tuple, key) -> float | None:
    """AR's program's step over the adaptive loop's plain step, measured once per key: both
    programs (AR's with its args, the last one max_new; the loop's with its args, the last two
    max_new and its cost inputs, run forced plain) timed alike, runs of 1 and of
    `measure.calibration_tokens` tokens (whatever the call's max_new: the ratio is kept for every
    call of the program) interleaved over _CALIBRATION_ROUNDS rounds, each program's per
    step the round's difference over the steps between them; the trimmed mean of the rounds'
    ratios, the same on every process (`agreed`). Timed alike because two methods of timing
    differ by more than the difference sought (on CPU the loop's calibrated plain step came out
    12% below AR's timed by differences, where it does strictly more). None where a program's
    longer run takes no extra step, or the ratio is outside PLAUSIBLE_RATIO (remembered as such
    for the process); a plausible one is kept on disk too (`stored_ratio`)."""
    known, ratio = known_ratio(tuner, key)
    if known:
        return ratio
    with tuner.measuring:
        known, ratio = known_ratio(tuner, key)   # measured by another thread while this one waited
        if known:
            return ratio
        with tuner.calibrating("timing AR's step against the adaptive loop's plain step (once per program and machine)"):
            ratio = _measured_ratio(ar_executable, ar_args, loop_executable, loop_args)
        if ratio is None:
            return None
        plausible = _plausible(ratio)
        tuner.keep(tuner.ar_ratios, key, ratio if plausible else float("nan"))
        if plausible:   # an implausible one is measured again by the next process
            calibration_store.save(calibration_store.path_for(loop_executable, STORE_KIND, key, tuner.store_dir()),
                                  (ratio,))
    return ratio if plausible else None


def _measured_ratio(ar_executable, ar_args: tuple, loop_executable, loop_args: tuple) -> float | None:
    """`ar_step_ratio`'s measurement, not remembered: None where a program's longer run takes no
    extra step."""
    ar_short = timed_run(ar_executable, ar_args, 1)
    tokens = calibration_tokens(ar_short()[1])
    runs = dict(ar_short=ar_short, ar_long=timed_run(ar_executable, ar_args, tokens),
                loop_short=timed_run(loop_executable, loop_args, 1, FORCE_PLAIN),
                loop_long=timed_run(loop_executable, loop_args, tokens, FORCE_PLAIN))
    steps = {name: int(jax.device_get(run()[1].counters["spec"].target_calls)) for name, run in runs.items()}
    extra = {name: steps[f"{name}_long"] - steps[f"{name}_short"] for name in ("ar", "loop")}
    if min(extra.values()) < 1:
        return None
    ratios = []
    for _ in range(measure._CALIBRATION_ROUNDS):
        seconds = {name: run()[0] for name, run in runs.items()}
        per_step = {name: max(seconds[f"{name}_long"] - seconds[f"{name}_short"], 1e-9) / extra[name]
                    for name in ("ar", "loop")}
        ratios.append(per_step["ar"] / per_step["loop"])
    return float(agreed(np.asarray([trimmed_mean(ratios)], np.float64))[0])


def loses_to_ar(loop_costs, steps_by_cap, plain_steps: int, ar_steps: int, ar_ratio) -> tuple[bool, float | None]:
    """(whether the call lost to AR's program, AR's estimated seconds over the call's priced ones:
    the call's speedup over AR as its prices see it, None where not checked). ar_steps: the steps AR's
    program takes for the call's tokens (its longest row's); ar_ratio: a callable giving AR's step
    over the loop's plain step (`ar_step_ratio`), called only for calls within GAIN_CHECK of the
    loop's plain steps; AR's step is that times the loop's plain price."""
    spent = call_seconds(loop_costs, steps_by_cap, plain_steps)
    plain_price = step_price(loop_costs, 0)
    if spent <= 0 or ar_steps < 1 or spent < GAIN_CHECK * ar_steps * plain_price:
        return False, None
    ratio = ar_ratio()
    if ratio is None:
        return False, None
    ar_seconds = ar_steps * ratio * plain_price
    return (1 + GAIN_MARGIN) * spent > ar_seconds, ar_seconds / spent
