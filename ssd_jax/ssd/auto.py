"""SSD under draft_len="auto": the draft length chosen per call by the cost model, and a host-side
switch to plain decoding when SSD measures slower than the target alone.

The length: the synchronous methods' cost model (`ssd_jax.tuning.cost_model.choose_draft_len`)
with the draft's cache build priced where both models share devices (`build_priced`), SSD's own
cost per step added (`step_overhead`: what its judged steps took beyond the model's target(L+1) +
L draft forwards, measured on the program's recent calls; one target step before the first) and,
once a call was judged, the acceptance its batch's pace over its SSD steps implies
(`pace_acceptance`).

SSD's loop is host-driven and reads every step's report anyway (a step behind the devices), so
the decision costs nothing extra: after each step's read the loop adds the step's seconds and the batch's pace (the tokens the
running row furthest behind gained) to decayed sums (not the first WARMUP_STEPS steps, nor a
step that compiled); once MIN_STEPS steps were judged, if

    seconds per token of SSD  >  seconds per token of plain decoding

(SSD's tokens at the batch's pace over the call, `PlainSwitch.pace`: the window's slowest row
lags by chance more than a call's does; the ratio's log weighed against the program's recent
calls', `PlainSwitch.slower_than_plain`; a program's first call weighs its pace against the
pair's remembered acceptance instead, `PlainSwitch.cost_ratio`), the loop lets the step it queued ahead finish and decodes the
rest of the call with `ssd_steps.target_plain`: jitted chunks of PLAIN_CHUNK target steps, after each of which the
draft reads the chunk (`ssd_steps.draft_read`: it catches up, and says how often its speculation
would have been accepted there); where that acceptance predicts SSD a token RESUME_MARGIN cheaper
than plain decoding at the call's mean SSD step time (`ReadAcceptance.resume_pays`), SSD resumes, at
most MAX_RESUMES times a call. Early steps are judged before a text turns predictable (1/5
cost regime, prose: SSD "auto" at 0.70 of fixed L=4 with a final switch). Where even a step
accepting every draft token could not pay, or too few tokens are left, the rest of the call runs
as one program (streaming: chunk by chunk), unread.

The verdict is remembered per (pair, method, sampling, shapes), and it is the recent calls'
verdict, not the last one's: the mean of their log cost ratios over their SSD steps
(`PlainSwitch.call_ratio`), each call weighted VERDICT_WEIGHT against the calls before it. While that mean says SSD is
slower, `ssd_jax.generate` runs the next such calls with AR's jitted loop from the start (no
draft work at all), but for a probe, which runs SSD again and adds its ratio (the machine's load,
the prompts or the pair's acceptance may have changed; a call where the pair's acceptance rose
enough to predict a win is a probe at once, `acceptance_rose`). The first probe is the PROBE_EVERY-th
call, or, while no call of the key has paid in the process, a later one where the last SSD call
cost more than PROBE_OVERHEAD of that many plain calls (`remember`); each probe after which the
mean still finds SSD at least BACKOFF_RATIO times slower per token doubles the interval, up to
PROBE_EVERY_MAX calls; once a key has run PROBE_LENGTHS lengths, its probes keep to those, whose
programs are compiled (`probe_length`). One call is not
enough: the key covers every prompt of those shapes, and SSD's speed differs by prompt (held-out
code, batch 1, T=0, one CPU device: three prompts at 0.5-0.65 of plain decoding's seconds per
token, one at 1.47 that switched; remembering the last call's verdict sent the three to plain
decoding after it, 42-63% of all steps plain, 1.14-1.24x AR where fixed L=4 ran 1.28-1.32x). A probe runs SSD's unjudged
and judged steps at SSD's speed, so it costs in proportion to how much slower SSD is: with a
probe every 8th call, "auto" read 0.97-0.98x AR where SSD never paid (one CPU device, 15 paired
rounds of 4 calls), while near the break-even probes cost little.

The plain step's time is measured on that very program at a key's first call (a calibration,
kept on disk per program and machine like the synchronous loops', `plain_step_seconds`):
chunk runs on copies of the state after prefill (the first compiling, then PLAIN_TIMED_RUNS;
their trimmed mean, `plain_step_seconds`), and again at its next calls that run SSD until
PLAIN_TIMINGS timings; every call that switched times its plain part (`observe_plain_run`), and
the step is the median of those timings and the last PLAIN_RUNS_KEPT plain parts. Timed once, a
slow moment of the machine stayed in every later verdict (batch 4, one CPU device: 5.9 ms where
other processes read 4.5-5.6 ms, and SSD at L=5-6 judged faster than plain decoding on calls that
ran 0.83-0.99x AR; batch 8: SSD at L=2 on every step of every call, 0.84x AR).
The switch, the resumption and the length use only timings and tokens already emitted (and
the target's probabilities of those), never what decides the step to come, so the output law
stays the target's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.draft import fanout
from ssd_jax.runtime import calibration_store, program_store
from ssd_jax.runtime.compile_cache import signature
from ssd_jax.tuning import measure
from ssd_jax.tuning.cost_model import StepCosts, expected_tokens, trimmed_mean
from ssd_jax.tuning.plain_verdicts import calls_apart
from ssd_jax.tuning.ssd_memory import SSDMemory

PLAIN_CHUNK = 16
# Steps not judged: a call's first steps have no prefetched speculation yet (the draft works on
# the critical path), and until the fan-out estimate's warm-up ends the cache is laid out for a
# default acceptance, not the call's: slower than SSD's steady state (held-out code at batch 1,
# T=0, one CPU device: calls whose steps 3-10 ran 1.1-1.8x plain decoding's seconds per token ran
# 0.5-0.7x over the rest, and judged from step 3 they switched to plain: 0.84-0.95x AR where not
# switching ran 1.14-1.62x). Then MIN_STEPS judged steps.
WARMUP_STEPS = fanout.WARMUP_STEPS
MIN_STEPS = 6
DECAY = 0.85
PROBE_EVERY = 8
PROBE_EVERY_MAX = 64
BACKOFF_RATIO = 1.15
# A plain verdict's calls between probes: at least the probe's cost over this share (`remember`;
# the per-call choice's probes keep to the same, `ssd_jax.tuning.per_call.PROBE_OVERHEAD`).
PROBE_OVERHEAD = 0.01
PROBE_LENGTHS = 3        # lengths a key's probes may try (`probe_length`) ...
NEW_LENGTH_GAIN = 0.05   # ... and past those, a new one only for this predicted gain
# SSD's step overhead before a program's first judged call, in target steps (about what one CPU
# device measures at batch 1; `step_overhead`).
PRIOR_OVERHEAD = 1.0
PRIOR_STEPS = 6         # the weight of that mean in a call's switch, in judged steps ...
OTHER_LENGTH_PRIOR_STEPS = 2   # ... and of other lengths' where the call's length has none
PLAIN_TIMED_RUNS = 6
PLAIN_UNTIMED_RUNS = 2   # the chunk program's first runs (the first compiles), not timed
PLAIN_TIMINGS = 3        # a key's plain step is timed at its first this many calls that run SSD ...
PLAIN_RETIMED_RUNS = 3   # ... the later timings over this many runs (`plain_step_seconds`)
PLAIN_RUN_MIN_STEPS = 16   # a switched call's plain part times the plain step from this many steps
PLAIN_RUNS_KEPT = 8
RETIME_MARGIN = 0.2      # |log cost ratio| within which the plain step is timed again (`near_break_even`)
REPROBE_GAIN = 0.05      # a plain verdict's next call probes where the acceptance predicts this gain (`acceptance_rose`)
# A call decoding plainly resumes SSD where the draft's reading of the plain stretch predicts SSD
# this much cheaper a token (`ReadAcceptance.resume_pays`), with at least RESUME_MIN_TOKENS left
# to every live row, at most MAX_RESUMES times a call; READ_DECAY weighs each chunk read before.
RESUME_MARGIN = 0.1
RESUME_MIN_TOKENS = 3 * PLAIN_CHUNK
MAX_RESUMES = 4
READ_DECAY = 0.5


def expected_largest_normal(count: int) -> float:
    """The expected largest of `count` standard normal draws (Blom's approximation): 0 for one,
    1.05 for four (exactly: 1.03), 1.43 for eight (1.42). The host twin of
    `ssd_jax.loop.acceptance.expected_largest_normal` (traced there), for SSD's host loop."""
    n = max(int(count), 1)
    return 0.0 if n == 1 else statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@dataclasses.dataclass
class PlainSwitch:
    """Decayed sums of SSD's step seconds and of the batch's pace (tokens per step of the row
    furthest behind), against plain_step_s. call_tokens: the tokens a row decodes in the call
    (the horizon at which the batch's pace is judged; 0: the window's pace as measured).
    prior_log_ratio: the program's recent calls' mean log cost ratio over their judged steps
    (`switch_prior`; None: none to weigh), which the switch weighs as prior_steps judged steps of
    this call. prior_pace: the tokens per step the pair's remembered acceptance predicts
    (`prior_pace`; None: none), which the switch's pace weighs as PRIOR_STEPS judged steps
    where no prior_log_ratio is."""

    plain_step_s: float
    call_tokens: int = 0
    prior_log_ratio: float | None = None
    prior_steps: float = PRIOR_STEPS
    prior_pace: float | None = None
    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    judged_seconds: float = 0.0       # undecayed sums over the judged steps
    judged_pace_tokens: float = 0.0
    spent_seconds: float = 0.0        # ... and over every step but those that compiled
    spent_pace_tokens: float = 0.0
    spent_steps: int = 0
    seen: int = 0
    progress: np.ndarray | None = None
    row_sums: np.ndarray | None = None   # float64 [3, B]: decayed steps, tokens, squared tokens

    def record(self, seconds: float, row_tokens, live=None, compiled: bool = False) -> None:
        """One SSD step of `seconds` (from the previous step's record: its cache lookup and the
        fallback drafting of missed rows included) that emitted row_tokens (float [B], or a
        number at batch 1) to the rows in live (bool [B]; None: all). Its pace is how far the furthest-behind live row moved:
        a batch runs until its last row is done, so the mean row's tokens overstate it (SSD at
        batch 4 on held-out code at T=1 ran 0.96x AR, and judged by the mean row kept speculating
        on 29% of the steps: 0.975x). The call's first WARMUP_STEPS steps and a step that
        compiled (part of a compile can overlap it uncounted, the draft's programs compiling on
        their own thread) are seen but not judged: their time is not SSD's steady state."""
        row_tokens = np.atleast_1d(np.asarray(row_tokens, np.float64))
        live = np.ones(row_tokens.shape, bool) if live is None else np.asarray(live, bool)
        if self.progress is None:
            self.progress = np.zeros(row_tokens.shape, np.float64)
            self.row_sums = np.zeros((3,) + row_tokens.shape, np.float64)
        behind = np.min(self.progress[live])
        self.progress = self.progress + np.where(live, row_tokens, 0.0)
        pace = float(np.min(self.progress[live]) - behind)
        self.seen += 1
        if compiled:
            return
        self.spent_seconds += seconds
        self.spent_pace_tokens += pace
        self.spent_steps += 1
        if self.seen <= WARMUP_STEPS:
            return
        self.seconds = DECAY * self.seconds + seconds
        self.tokens = DECAY * self.tokens + pace
        self.judged_seconds += seconds
        self.judged_pace_tokens += pace
        counted = live.astype(np.float64)
        self.row_sums = DECAY * self.row_sums + np.stack([counted, counted * row_tokens, counted * row_tokens ** 2])
        self.steps += 1

    @property
    def weight(self) -> float:
        """The judged steps' decayed count (the sums' effective number of steps)."""
        return (1.0 - DECAY ** self.steps) / (1.0 - DECAY)

    def pace(self) -> float:
        """The batch's tokens per step over the call, from the window: the furthest-behind row's
        pace there, with the part of its lag that is chance at the window's length but not at
        the call's taken back. The lag of the slowest of B rows that each gain tokens with spread
        sd per step is ~z_B sd sqrt(n) over n steps (z_B the expected largest of B standard
        normals), z_B sd / sqrt(n) per step: over the ~7 steps of the window that is 2-3 times
        what it is over a whole call, and a window's slowest row made SSD look slower than plain
        decoding on every call where it ran 1.06-1.09x AR (batch 4, held-out code, T=0, one CPU
        device: every call switched to plain at step 8). A row that is slow throughout stays
        slow: only the rows' spread around their own means is taken back, and never past the
        mean row's pace."""
        if self.weight <= 0:
            return 0.0
        window = self.tokens / self.weight
        live = self.row_sums[0] > 1.0
        if self.call_tokens <= 0 or np.count_nonzero(live) < 2:
            return window
        steps, total, squares = self.row_sums[:, live]
        means = total / steps
        spread = float(np.sqrt(np.mean(np.maximum(squares / steps - means ** 2, 0.0) * steps / (steps - 1))))
        mean_row = float(np.mean(means))
        call_steps = self.call_tokens / max(mean_row, 1e-9)
        shrink = max(1.0 / np.sqrt(self.weight) - 1.0 / np.sqrt(max(call_steps, self.weight)), 0.0)
        return min(window + expected_largest_normal(np.count_nonzero(live)) * spread * shrink, max(mean_row, window))

    def slower_than_plain(self) -> bool:
        """Whether to finish the call plainly: after MIN_STEPS judged steps, the log of the
        window's `cost_ratio`, weighed as the judged steps' count against the program's recent
        calls' mean (`prior_log_ratio`) as prior_steps steps, is above 0. SSD's speed differs
        within a call: a stretch near or above the break-even can precede one far below it
        (held-out code, batch 1, T=0, one CPU device: windows of 0.9-1.1 at steps 9-18, 0.65
        after, 1.14-1.26x AR over the call); where the program's calls have paid, one such stretch
        does not end SSD, while a call slower throughout still switches within a few steps (and
        where they have not paid, the calls start plain but for probes, which the prior then
        ends sooner)."""
        if self.steps < MIN_STEPS:
            return False
        judged = np.log(self.cost_ratio())
        if self.prior_log_ratio is None:
            return judged > 0.0
        prior = self.prior_steps * self.prior_log_ratio
        return (self.steps * judged + prior) / (self.steps + self.prior_steps) > 0.0

    def judged_step_s(self) -> float | None:
        """The mean seconds of the call's judged steps (None: none judged)."""
        return self.judged_seconds / self.steps if self.steps else None

    def judged_pace(self) -> float | None:
        """The batch's pace over the call's judged steps, tokens per step (None: none judged)."""
        return self.judged_pace_tokens / self.steps if self.steps else None

    def call_pace(self) -> float | None:
        """The batch's pace over all the call's SSD steps but those that compiled, tokens per step
        (None: none); what the length's acceptance is taken from (`remember_step`)."""
        return self.spent_pace_tokens / self.spent_steps if self.spent_steps else None

    def probe_cost(self, call_s: float) -> float:
        """What running SSD cost a call of call_s seconds (end to end, compiles left out) over
        plain decoding, as a share of call_tokens plain steps; never below 0 (0.0 where
        call_tokens is not known). What the next probe of a plain verdict is expected to cost
        (`remember`). The whole call, not its SSD steps' excess: at batch 8 on one CPU device a
        probe's call took 1.26x a plain one (the draft's prefill, the first speculation, 14 SSD
        steps, the switch) where its SSD steps' excess came to ~0.08 of it."""
        if self.call_tokens <= 0:
            return 0.0
        return max(float(call_s) / (self.plain_step_s * self.call_tokens) - 1.0, 0.0)

    def judged_ratio(self) -> float:
        """SSD's seconds per token over plain decoding's over the call's judged steps (its steady
        state, which the next calls' switch weighs its window against); 1.0 before any."""
        if self.judged_pace_tokens <= 0:
            return 1.0
        return self.judged_seconds / (self.plain_step_s * self.judged_pace_tokens)

    def call_ratio(self) -> float:
        """SSD's seconds per token over plain decoding's over all the call's SSD steps but those
        that compiled (at the pace of the row furthest behind; what the call adds to its
        program's verdict, `remember`); 1.0 before any. The warm-up steps count here, though the
        switch does not judge them: a call that runs SSD pays for them, and without them the
        verdict favoured SSD where it lost (badguess, batch 1, T=1: SSD 0.93x AR, "auto" 0.92x
        with 42% of its steps speculating). The switch's prior is the steady state's,
        `judged_ratio`."""
        if self.spent_pace_tokens <= 0:
            return 1.0
        return self.spent_seconds / (self.plain_step_s * self.spent_pace_tokens)

    def cost_ratio(self) -> float:
        """SSD's decayed seconds per token (at the batch's pace, `pace`) over plain decoding's
        (> 1: SSD is slower); 1.0 before any judged step. Where the program has no judged calls
        to weigh (`prior_log_ratio` None) but the pair's acceptance is known (prior_pace), the
        pace is weighed against prior_pace as PRIOR_STEPS steps, fading as judged steps come:
        a call's first steps accept less than its rest, and the first SSD call of held-out code
        (batch 1, T=0, the 1/20 cost regime, one CPU device) accepted 0.16 a position over its
        first 24 tokens where SD's calls of the pair had measured 0.7; judged on them alone it
        switched at step 14, and its verdict sent every later call plain (1.0x AR where fixed
        L=4 ran 1.55x)."""
        pace = self.pace()
        if self.prior_log_ratio is None and self.prior_pace is not None and self.steps:
            pace = (self.steps * pace + PRIOR_STEPS * self.prior_pace) / (self.steps + PRIOR_STEPS)
        return (self.seconds / self.weight) / (self.plain_step_s * pace) if pace > 0 else 1.0

    def resume(self, predicted_pace: float) -> None:
        """SSD resumes after a plain stretch (`ReadAcceptance.resume_pays`): the window starts
        again, its pace weighed against predicted_pace (what the draft's reading of the stretch
        predicts) instead of the program's past calls, which switched this call to plain; the
        programs are warm, so one step is left unjudged (its speculation drafted on the critical
        path), not the call's warm-up. The call's totals (`call_ratio`, `judged_ratio`) go on."""
        self.seconds = self.tokens = 0.0
        self.steps = 0
        self.seen = max(WARMUP_STEPS - 1, 0)
        self.progress = None
        self.row_sums = None
        self.prior_log_ratio = None
        self.prior_pace = float(predicted_pace)


@dataclasses.dataclass
class ReadAcceptance:
    """Per row, the decayed sums of the draft's agreement with the tokens a call decoded plainly
    (`ssd_steps.draft_read`) and of their count: the acceptance SSD would have had on them."""

    agreement: np.ndarray   # float64 [B]
    count: np.ndarray       # float64 [B]

    @classmethod
    def empty(cls, batch: int) -> "ReadAcceptance":
        return cls(np.zeros((batch,), np.float64), np.zeros((batch,), np.float64))

    def add(self, agreement, count) -> None:
        """One chunk's read: agreement float [B, C] (0 past a row's count), count int [B]."""
        self.agreement = READ_DECAY * self.agreement + np.sum(np.asarray(agreement, np.float64), axis=1)
        self.count = READ_DECAY * self.count + np.asarray(count, np.float64)

    def pace(self, live, draft_len: int) -> float | None:
        """The tokens per SSD step the reads predict for the batch: E(L) at the acceptance of the
        live row that reads lowest (a batch goes at its slowest row's pace); None until every live
        row read a chunk's worth."""
        live = np.asarray(live, bool)
        if not live.any() or np.min(self.count[live]) < PLAIN_CHUNK * 0.5:
            return None
        acceptance = float(np.min(self.agreement[live] / self.count[live]))
        return expected_tokens(acceptance, draft_len)

    def resume_pays(self, live, draft_len: int, step_s: float | None, plain_step_s: float) -> float | None:
        """The predicted pace where SSD, at step_s seconds a step (the mean of the call's judged
        steps, `PlainSwitch.judged_step_s`), would decode a token RESUME_MARGIN cheaper than plain
        decoding at that pace; else None. Not the window's seconds: the window that switched is
        by its choice a slow one (at T=1, where a miss drafts on the critical path, windows of
        the same call read 22-42 ms a step at 1/20 of a target step)."""
        pace = self.pace(live, draft_len)
        if pace is None or step_s is None:
            return None
        return pace if step_s / (plain_step_s * pace) < 1.0 - RESUME_MARGIN else None


def may_resume(step_s: float | None, plain_step_s: float, draft_len: int) -> bool:
    """Whether SSD could pay again at all: at step_s seconds a step (the call's judged steps'
    mean), a step accepting every draft token (L + 1 tokens) beats plain decoding by
    RESUME_MARGIN. Where it cannot, the call's plain stretch is not read (`ssd_steps.draft_read`)."""
    return step_s is not None and step_s / (plain_step_s * (draft_len + 1)) < 1.0 - RESUME_MARGIN


def prior_pace(acceptance: float | None, draft_len: int) -> float | None:
    """The tokens per step a remembered per-position acceptance predicts at draft_len (the cost
    model's E(L)); None where none is remembered."""
    return None if acceptance is None else expected_tokens(float(acceptance), int(draft_len))


def near_break_even(prior_log_ratio: float | None) -> bool:
    """Whether a program's calls run near enough the break-even with plain decoding (their
    steady state's log cost ratio within RETIME_MARGIN of 0, or not known) that its plain step is
    worth timing again (`plain_step_seconds`'s retime): an error of a few percent there flips no
    verdict of calls far from it, while each timing costs PLAIN_RETIMED_RUNS chunks of plain
    steps (the 1/100 cost regime, batch 1, one CPU device: 0.2 s of 0.5-0.8 s calls that SSD ran
    at 0.55x plain decoding's cost a token)."""
    return prior_log_ratio is None or abs(prior_log_ratio) < RETIME_MARGIN


def plain_step_seconds(memory: SSDMemory, key, run_chunk, state, retime: bool = True, tuner=None,
                       stored: str | None = None, compile_seconds=None) -> float:
    """Seconds per plain decoding step of this program (key: what it is remembered under),
    timed by run_chunk(copy of state) -> (emitted, appended, ...) on copies (state: one whose rows
    do not end within a chunk, `ssd_jax.ssd.host_loop._Decode.timing_state`): at the key's first
    call PLAIN_UNTIMED_RUNS runs (the first compiles; on one CPU device the runs right after it
    read 4.3 and 4.1 ms a step where later ones read 2.9-3.7), then PLAIN_TIMED_RUNS runs, their
    trimmed mean. Not their best: SSD's side of the comparison is a running mean of its steps, and
    against the best of two plain runs a call that SSD sped up by 6-9% (batch 4, held-out code,
    T=0, one CPU device: fixed L=4 1.06x and 1.09x AR in two processes) was judged slower and
    decoded 99% of its steps plainly (0.95x and 0.99x AR). The key's next calls that run SSD time
    it again (PLAIN_RETIMED_RUNS runs, the program warm) until PLAIN_TIMINGS timings: one timing
    at a slow moment of the machine made plain decoding look dear, SSD was never judged slower,
    no call switched, so no plain part refreshed it (batch 8, held-out code, T=0, one CPU device:
    one process of three ran SSD at L=2 on every step, 0.84x AR, where the others ran AR's
    program). The step is the median of those timings and the last PLAIN_RUNS_KEPT switched
    calls' plain parts (`observe_plain_run`). retime False: a key timed once already is not
    timed again at this call (`near_break_even`).

    The timings are a calibration of the program, as the synchronous loops' step timings are:
    run under tuner's `calibrating` (so a call reports their seconds as calibration_time_s), and
    kept in the file `stored` (`plain_step_path`; None: in memory only), from which a later
    process of the same program and machine reads them and times only what they lack;
    compile_seconds() (None: none) the call's compile seconds so far, of which a timing run's
    compile (a length's chunk program met first at a retiming) is left out. Made anew
    in every process, the three timings cost a program's first three SSD calls 3-8 chunks of
    plain steps each (the 1/5 cost regime at batch 1, one CPU device: 0.4-0.5 s on each of two
    1.6 s calls)."""
    with memory.lock:
        timings = memory.plain_step_s.lookup(key, ())
    if not timings and stored is not None:
        kept = calibration_store.load(stored)
        if kept is not None and all(value > 0 for value in kept):
            timings = kept[-PLAIN_TIMINGS:]
            with memory.lock:
                memory.plain_step_s.store(key, timings)
    if len(timings) < PLAIN_TIMINGS and (retime or not timings):
        untimed, timed = (PLAIN_UNTIMED_RUNS, PLAIN_TIMED_RUNS) if not timings else (0, PLAIN_RETIMED_RUNS)
        compiled = 0.0 if compile_seconds is None else compile_seconds()
        with contextlib.nullcontext() if tuner is None else tuner.calibrating(
                'timing SSD\'s plain step for draft_len="auto" (per program and machine)'):
            seconds = _timed_plain_step(run_chunk, state, untimed, timed)
            if tuner is not None and compile_seconds is not None:
                tuner.leave_out_of_calibration(compile_seconds() - compiled)
        with memory.lock:
            timings = (*memory.plain_step_s.lookup(key, ()), seconds)[-PLAIN_TIMINGS:]
            memory.plain_step_s.store(key, timings)
        calibration_store.save(stored, timings)
    with memory.lock:
        return float(np.median([*memory.plain_step_s.lookup(key, ()), *memory.plain_runs.lookup(key, ())]))


def plain_step_path(store: str | None, key, timed_args) -> str | None:
    """The file a program's plain-step timings are kept in (`plain_step_seconds`'s stored), named by
    what decides them: key (the program's, `ssd_jax.ssd.host_loop`'s plain key) and timed_args
    (the target's parameters and the tokens a chunk starts from: shapes, dtypes, shardings), with
    the library's source, versions and machine (`program_store.describe`). Not the decode state:
    its cache holds 2L spare slots, and one timing serves every length L, as in memory. None where
    they stay in memory (no store, several processes) or where the key does not say all of that."""
    described = program_store.describe(f"{__name__}.plain_step_seconds", key, signature(timed_args))
    return None if described is None else calibration_store.path_for_text("ssd-plain", described, store)


def _timed_plain_step(run_chunk, state, untimed: int, timed: int) -> float:
    """The trimmed mean over `timed` runs of run_chunk on copies of state, after `untimed` runs,
    of seconds per step (a run's steps: its longest row's appended tokens)."""
    per_step = []
    for run in range(untimed + timed):
        copy = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(copy)
        start = time.perf_counter()
        out = jax.block_until_ready(run_chunk(copy))
        steps = max(int(np.max(np.asarray(out[1]))), 1)
        if run >= untimed:
            per_step.append((time.perf_counter() - start) / steps)
    return trimmed_mean(per_step)


def observe_plain_run(memory: SSDMemory, key, seconds: float, steps: int) -> None:
    """A switched call's plain part under `key` (`plain_step_seconds`'s): `seconds` for `steps`
    plain steps (one run of `ssd_steps.target_plain`, not compiling). Runs of fewer than
    PLAIN_RUN_MIN_STEPS steps are left out (a run's fixed cost would weigh in)."""
    if steps < PLAIN_RUN_MIN_STEPS or not memory.measures:
        return
    with memory.lock:
        runs = memory.plain_runs.lookup(key, ())
        memory.plain_runs.store(key, (*runs, float(seconds) / steps)[-PLAIN_RUNS_KEPT:])


def starts_plain(memory: SSDMemory, key, acceptance: float | None = None, speedup=None) -> bool:
    """Whether a call of the program `key` decodes plainly from the start: the recent calls that
    ran SSD measured it slower on the whole (`remember`), and this call is not a probe (see the
    module's docstring); always False for a deterministic tuner, where a call must not
    depend on the calls before it (verdicts remembered while timings were allowed included).
    acceptance: the pair's remembered acceptance now (None: none), or where a call of the key
    was read since its last SSD call, that read's (`note_read`); where it rose since the last
    call that ran SSD enough to predict that SSD pays by REPROBE_GAIN (`acceptance_rose`, with
    speedup), the call is a probe, and the acceptance that made it one and the length that
    prediction is best at are noted (`rise_probe`)."""
    if not memory.measures:
        return False
    with memory.lock:
        read = memory.latest_read.lookup(key)
    acceptance = acceptance if read is None else read
    if memory.verdicts.is_plain(key) and acceptance_rose(memory, key, acceptance, speedup):
        memory.verdicts.probe_now(key)
        best = None if speedup is None else best_length(speedup, float(acceptance))
        with memory.lock:
            memory.rise_probes.store(key, (float(acceptance), best))
        return False
    return memory.verdicts.starts_plain(key)


def note_read(memory: SSDMemory, key, acceptance: float | None) -> None:
    """Keeps the acceptance the draft's read of a plain call of `key` met (None: nothing read) as
    the one a rise is judged at (`starts_plain`) until the key's next SSD call. Not only the
    pair's pooled acceptance, which mixes the text SSD lost on with the text read now: after
    code, one read of prose at 1.0 moved it from 0.48 to 0.65, and the probe waited a call and
    ran at L=3, the best length at 0.82, where L=6 paid (the 1/5 cost regime, batch 1, T=0, one
    CPU device)."""
    if acceptance is not None and memory.measures:
        with memory.lock:
            memory.latest_read.store(key, float(acceptance))


def ran_at_acceptance(memory: SSDMemory, key, acceptance: float | None, draft_len: int) -> None:
    """Notes the acceptance a call of the program `key` ran SSD at draft_len with (None: none
    known), which `acceptance_rose` compares later calls' with. Where a rise in the pair's
    acceptance made the call a probe (`starts_plain`), at least that acceptance: a probe that
    still lost shows that acceptance is not enough, and where its own steps met less (a call's
    first tokens accept less than its rest, and a call that switches early measures only those),
    the next plain call's read would count as the same rise again, a probe every other call."""
    with memory.lock:
        memory.latest_read.store(key, None)
        probe = memory.rise_probes.lookup(key)
        if probe is not None:
            memory.rise_probes.store(key, None)
            acceptance = probe[0] if acceptance is None else max(float(acceptance), probe[0])
        memory.verdict_acceptance.store(key, None if acceptance is None else (float(acceptance), int(draft_len)))


def rise_probe(memory: SSDMemory, key) -> tuple[float, int | None] | None:
    """(the acceptance, the length it predicted SSD best at, or None where no cost model priced
    it) of the rise that made the coming call of `key` a probe (`starts_plain`); None where it
    is none. The probe runs at that length, at that acceptance: it tests the prediction that made
    it (priced at the acceptance its past calls' pace implied, a probe of prose after code ran at
    L=1 and L=3 where only L=6 paid, the 1/5 cost regime)."""
    with memory.lock:
        return memory.rise_probes.lookup(key)


def acceptance_rose(memory: SSDMemory, key, acceptance: float | None, speedup=None) -> bool:
    """Whether the pair's acceptance now (None: not known) predicts that SSD pays on the program
    `key`: the recent calls' mean cost ratio times the gain the rise predicts is below
    1 / (1 + REPROBE_GAIN), L and acceptance then those of the last call that ran SSD
    (`ran_at_acceptance`). The gain: with speedup (a callable (length, acceptance) -> the cost
    model's predicted speed-up of SSD over plain decoding, and its `max_draft_len`), the best
    length's speed-up at the acceptance now over L's at the acceptance then; without,
    E(L, now) / E(L, then).
    The key pools every prompt of its shapes, and where SD's calls of the pair meet text that
    accepts more (held-out prose after code, the 1/5 cost regime, batch 1, T=0: SSD at L=6 ran
    1.46x AR on prose after losing on code), a verdict from the code would keep the prose plain
    for PROBE_EVERY or more calls. The best length, not L: a verdict judged at a short length
    (L=1, chosen at the prior acceptance) predicts little gain there from any rise (at most 2
    tokens a step), and kept prose that the draft read at 0.98-1.0 plain where L=6 ran 1.30x AR."""
    if acceptance is None:
        return False
    with memory.lock:
        then = memory.verdict_acceptance.lookup(key)
    mean = memory.ratios.lookup(key)
    if then is None or mean is None:
        return False
    acceptance_then, draft_len = then
    if speedup is None:
        gain = expected_tokens(float(acceptance), draft_len) / expected_tokens(acceptance_then, draft_len)
    else:
        gain = speedup(best_length(speedup, float(acceptance)), float(acceptance)) / speedup(draft_len, acceptance_then)
    return float(np.exp(mean)) / gain < 1.0 / (1.0 + REPROBE_GAIN)


def best_length(speedup, acceptance: float) -> int:
    """The length in 1..speedup.max_draft_len that speedup (length, acceptance) -> predicted
    speed-up prices best at this acceptance (ties: the shorter)."""
    return max(range(1, speedup.max_draft_len + 1), key=lambda n: speedup(n, acceptance))


def probe_length(memory: SSDMemory, key, best: int, speedup) -> int:
    """The draft length of a call of the program `key` whose cost model prefers `best`
    (speedup: callable length -> predicted speedup over plain decoding). A probe (SSD run again
    while the key's calls start plain) takes `best` while its key has run fewer than
    PROBE_LENGTHS lengths in this process; after that it keeps to those lengths, whose programs
    are compiled (the best of them by `speedup`), unless `best` is predicted to beat both them
    and plain decoding by NEW_LENGTH_GAIN. SSD's programs compile per length (~20 s on CPU for
    the embedded pair), and the preferred length follows the acceptance and overhead the key's
    last calls measured, which move: where no length paid (short prompts, batch 1, T=1, one CPU
    device) every probe took a new length, compiled, and ran its new programs' slow first runs
    (2.3-2.7x a plain call's time besides the compile). Not fewer lengths: the model prices other
    lengths from the overhead measured at the ones run, which is not the same at every length
    (held-out code, T=0: the first call ran L=2 at 0.83x AR and the model priced L=4 at 0.57x,
    where L=4 and 6 ran 1.14x and 1.23x). A call that is no probe takes `best` (so does every
    call for a deterministic tuner)."""
    if not memory.measures or not memory.verdicts.is_plain(key):
        return best
    with memory.lock:
        ran = memory.lengths_run.lookup(key) or ()
    if best in ran or len(ran) < PROBE_LENGTHS:
        return best
    known = max(ran, key=speedup)   # ran is sorted: ties go to the shorter
    return best if speedup(best) > max(speedup(known), 1.0) * (1.0 + NEW_LENGTH_GAIN) else known


def ran_length(memory: SSDMemory, key, draft_len: int) -> None:
    """Notes that a call of the program `key` ran SSD at draft_len (`probe_length`)."""
    with memory.lock:
        known = memory.lengths_run.lookup(key) or ()
        if draft_len not in known:
            memory.lengths_run.store(key, tuple(sorted(known + (int(draft_len),))))


def prior_log_ratio(memory: SSDMemory, key, draft_len: int | None = None) -> float | None:
    """The program's recent judged calls' mean log cost ratio over their judged steps, SSD's
    steady state: over the calls at draft_len (None: at every length)."""
    return memory.steady_ratios.lookup(key if draft_len is None else (key, int(draft_len)))


def switch_prior(memory: SSDMemory, key, draft_len: int) -> tuple[float | None, float]:
    """(prior_log_ratio, prior_steps) of a call's `PlainSwitch` at draft_len: the steady state of
    the program's calls at that length as PRIOR_STEPS judged steps; at a length no judged call
    ran, every length's as OTHER_LENGTH_PRIOR_STEPS where it says SSD lost (> 0), and as
    PRIOR_STEPS where it says SSD paid (it may carry a call through a slow stretch). Another
    length's speed is weaker evidence of this one's: held-out code, batch 1, T=0, one CPU device,
    a first call at L=2 ran 1.37x plain decoding's cost a token and a probe at L=3 0.86x over its
    judged steps; weighed as 6 steps against the probe's 6, L=2's steady state ended the probe at
    its first judgement, and the calls stayed plain (0.99x AR where fixed L=4 and 6 ran 1.09x and
    1.17x). Not none at all: where every length loses (batch 8, one CPU device) a probe at a new
    length whose window read near the break-even then ran SSD to its end (12% of the steps
    speculative against 1%, 0.96x AR against 1.00x)."""
    own = prior_log_ratio(memory, key, draft_len)
    if own is not None:
        return own, PRIOR_STEPS
    other = prior_log_ratio(memory, key)
    if other is None:
        return None, PRIOR_STEPS
    return other, (PRIOR_STEPS if other < 0.0 else OTHER_LENGTH_PRIOR_STEPS)


def build_priced(tuner, costs: StepCosts, draft, batch_size: int, context: int, slots: int, colocated: bool,
                 hit_rate: float | None = None) -> StepCosts:
    """SSD's StepCosts for the cost model: the draft-model methods' `costs` (target forwards, a
    draft forward at batch_size rows), plus, where both models share one device group
    (`colocated`), a draft forward at batch_size * slots rows per draft token: the draft's cache
    build runs there between verifications, and drafts every fan-out slot (slots: the plan's
    `num_slots`) L deep (`ssd_steps.draft_build`). Priced at B rows, SSD's step grew 0.69 ms a
    draft token in the model at batch 4 (one CPU device, the embedded pair) where its judged steps
    grew ~1.8 ms (with the build's rows: 1.13), and the first calls chose L=5-6, which ran 0.80-0.83x
    AR against L=4's 0.94-1.00x. On disjoint groups the build overlaps the verification and the
    costs are returned as they are (what it adds to a step is `step_overhead`'s); so they are when
    nothing was measured (costs.measured False) or timings are not allowed.
    hit_rate: the cache's hit rate on the program's recent calls (`hit_rate`; None: none yet). The
    fallback's forwards run on the critical path only on a miss (a hit's speculation was drafted
    during the verify), so they are priced at the miss rate: priced at every step, a draft token
    cost 3.9 ms in the model where SSD's judged steps grew 1.5 ms a token (the 1/5 cost regime,
    batch 1, one CPU device, held-out prose: L=4 26 ms, L=6 29 ms a step), and after a call at L=5
    on code the model chose L=1, which ran 0.9x plain decoding's speed where L=4-6 ran 1.1-1.5x."""
    fallback = costs.draft if hit_rate is None else costs.draft * (1.0 - float(hit_rate))
    if not colocated or not costs.measured or slots <= 0:
        return costs if hit_rate is None or not costs.measured else dataclasses.replace(costs, draft=fallback)
    build = measure.forward_seconds(tuner, draft, batch_size * slots, 1, context)
    return costs if build is None else dataclasses.replace(costs, draft=fallback + build)


def hit_rate(memory: SSDMemory, key) -> float | None:
    """The cache's hit rate on the recent calls of the program `key` (None: none, and for a
    deterministic tuner)."""
    return memory.hit_rates.lookup(key) if memory.measures else None


def remember_hit_rate(memory: SSDMemory, key, rate: float, lookups: int) -> None:
    """Adds a call's cache hit rate (over `lookups` lookups; none: nothing) to the program's."""
    if memory.measures and lookups > 0:
        memory.hit_rates.add(key, float(rate))


def step_overhead(memory: SSDMemory, key, target_step_s: float) -> float:
    """Seconds a step of SSD's program `key` took beyond the cost model's speculative step
    (target(L+1) + L draft forwards) on its recent calls; before one was judged, PRIOR_OVERHEAD
    target steps (target_step_s: the cost model's target(1)); 0.0 for a deterministic tuner.
    SSD's step carries a fixed cost of its own (the host loop, the cache lookup, the fallback
    drafting of missed rows, the draft's cache build and, on one device, its share of the device),
    which favours longer drafts than the synchronous methods': without it the model chose lengths
    that ran slower than longer ones. Not 0 before the first judged call: a program's first call
    then ran too short a length and, slower than plain decoding, sent the calls after it plain. (A
    line in L fitted through the overheads measured at each length, since the build grows with L,
    chose too short lengths too: the lengths a call measures first are judged on the call's early
    steps, whose acceptance is lower.)"""
    if not memory.measures:
        return 0.0
    measured = memory.overheads.lookup(key)
    return PRIOR_OVERHEAD * float(target_step_s) if measured is None else measured


def pace_acceptance(memory: SSDMemory, key) -> float | None:
    """The per-position acceptance at which the cost model's E(L) equals the tokens per step of
    the batch's pace (its row furthest behind) on the program's recent calls; None before one was
    judged (and for a deterministic tuner). A batch of rows runs until its last row is
    done, so the rows' pooled acceptance overstates what a longer draft gains it (held-out code,
    batch 4, T=1, one CPU device: L=4 ran 1.04x and 0.97x AR where L=6 ran 0.95x and 0.89x, in
    two processes; with SSD's overhead, the pooled acceptance chose 5.6 on average, the pace's
    3.9)."""
    if not memory.measures:
        return None
    return memory.pace_acceptance.lookup(key)


def remember_step(memory: SSDMemory, key, draft_len: int, judged_step_s: float, pace_tokens: float, model_step_s: float) -> None:
    """A judged call at draft_len: its mean judged step seconds against the cost model's step at
    that length (the difference, never below 0, joins `step_overhead`) and its batch's pace in
    tokens per step over all its SSD steps, the warm-up's included (`PlainSwitch.call_pace`;
    joins `pace_acceptance`). Not the judged steps' pace: a call's first steps accept less (the
    slowest of 4 rows 2-3 tokens a step at L=4 where it later made 5), and the length is chosen
    for whole calls (batch 4, short prompts, T=0, one CPU device: 5.0 tokens a step over the
    judged steps at L=6, 4.0 over the call; L=6 was chosen where fixed L=4 ran 1.00x AR and
    "auto" 0.97x)."""
    accepted = acceptance_for_tokens(pace_tokens, draft_len)
    memory.overheads.add(key, max(float(judged_step_s) - float(model_step_s), 0.0))
    memory.pace_acceptance.add(key, accepted)


def acceptance_for_tokens(tokens_per_step: float, draft_len: int) -> float:
    """The acceptance a in [0, 0.999] with E(draft_len, a) = tokens_per_step (bisection; E rises
    with a), tokens_per_step clipped to [1, draft_len + 1]."""
    target = min(max(float(tokens_per_step), 1.0), draft_len + 1.0)
    low, high = 0.0, 0.999
    for _ in range(40):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if expected_tokens(mid, draft_len) < target else (low, mid)
    return 0.5 * (low + high)


def remember(memory: SSDMemory, key, call_ratio: float, judged_ratio: float | None, draft_len: int | None = None,
             probe_cost: float = 0.0) -> None:
    """A call at draft_len (None: not told) that ran at least MIN_STEPS SSD steps (or switched),
    with its `PlainSwitch.call_ratio` and `judged_ratio` (None: too few judged steps, the switch's
    prior is left as it was; else it joins the key's and the length's, `prior_log_ratio`) and
    its `probe_cost`. The next calls start plain (`starts_plain`) while the key's mean log call
    ratio over recent calls is above 0; a probe after which that mean is at least
    log(BACKOFF_RATIO) doubles the calls between probes; any other plain verdict sets them to
    PROBE_EVERY. Where no call of the key has paid in this process, they are at least
    probe_cost / PROBE_OVERHEAD (at most PROBE_EVERY_MAX): where SSD loses by much, a probe is
    dear (batch 8, one CPU device: a probe ran SSD for its first 14-18 steps at 0.4-0.6x AR and
    its call took 1.1-1.3x a plain one, 2-4% of the eight calls between probes), so probes come
    less often, and near the break-even they cost little and come every PROBE_EVERY calls. Not
    where a call paid: the key pools a set's prompts, and there a probe may find a prompt where
    SSD pays (batch 1, T=0, one CPU device: calls at 1.25x a plain call on one prompt spaced the
    probes 25 calls apart, and the next prompt, where SSD ran 0.6 of plain decoding's time, ran
    plainly: 1.05-1.08x AR against 1.21-1.24x). A call too short for the switch to judge
    (fewer than WARMUP_STEPS + MIN_STEPS steps) still counts here: the next such calls cannot
    switch either, and start plain if SSD's calls lost.
    A probe that a rise in the pair's acceptance made (`rise_probe`) and that paid restarts the
    mean from its own ratio, and the pace's acceptance from its own (`remember_step`): the rise
    says the text changed, and the calls before it measured another (1/5 cost regime, batch 1,
    T=0, one CPU device: prose after code, the probe ran L=6 at 0.68 of plain decoding's cost a
    token over its judged steps; weighed against the code's calls the verdict stayed plain, and the set ran 1.07x AR
    where fixed L=6 ran 1.33x; with the verdict restarted but not the pace, the next call ran
    L=1, priced at the code's pace, which lost to plain decoding)."""
    log_ratio = float(np.log(max(call_ratio, 1e-9)))
    if call_ratio < 1.0 and rise_probe(memory, key) is not None:
        mean = memory.ratios.restart(key, log_ratio)
        memory.pace_acceptance.restart(key)
    else:
        mean = memory.ratios.add(key, log_ratio)
    if judged_ratio is not None:
        steady = float(np.log(max(judged_ratio, 1e-9)))
        memory.steady_ratios.add(key, steady)
        if draft_len is not None:
            memory.steady_ratios.add((key, int(draft_len)), steady)
    with memory.lock:
        if call_ratio < 1.0:
            memory.paid.store(key, True)
        paid = memory.paid.lookup(key, False)
    apart = 0 if paid else calls_apart(probe_cost, PROBE_OVERHEAD)
    first = min(max(PROBE_EVERY, apart), PROBE_EVERY_MAX)
    memory.verdicts.remember(key, mean > 0.0, back_off=mean >= np.log(BACKOFF_RATIO), first=first, most=PROBE_EVERY_MAX)


