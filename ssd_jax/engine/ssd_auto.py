"""SSD under draft_len="auto": the draft length chosen per call by the cost model, and a host-side
switch to plain decoding when SSD measures slower than the target alone.

SSD's loop is host-driven and already waits on every verification, so the decision costs nothing
extra: after each step the loop adds the step's seconds and the batch's pace (the tokens the
running row furthest behind gained) to decayed sums (not the first WARMUP_STEPS steps, nor a
step that compiled); once MIN_STEPS steps were judged, if

    seconds per token of SSD  >  seconds per token of plain decoding

(SSD's tokens at the batch's pace over the call, `PlainSwitch.pace`: the window's slowest row
lags by chance more than a call's does), the loop finishes the call with
`ssd_steps.target_plain`: jitted chunks of PLAIN_CHUNK target steps when streaming (streamed
chunk by chunk), else one program for the rest of the call.
The verdict is remembered per (pair, method, sampling, shapes): once a call measured SSD slower,
`ssd_jax.generate` runs the next such calls with AR's jitted loop from the start (no draft work
at all), but for a probe, which runs SSD again and renews the verdict (the machine's load, the
prompts or the pair's acceptance may have changed). The first probe is the PROBE_EVERY-th call;
each probe that finds SSD at least BACKOFF_RATIO times slower per token again doubles the
interval, up to PROBE_EVERY_MAX calls. A probe runs SSD's unjudged and judged steps at SSD's
speed, so it costs in proportion to how much slower SSD is: with a probe every 8th call, "auto"
read 0.97-0.98x AR where SSD never paid (one CPU device, 15 paired rounds of 4 calls), while near
the break-even probes cost little and a verdict that chance made "slower" is soon renewed.
The plain step's time is measured on that very program, once per program key and process: chunk
runs on copies of the state after prefill (the first compiling, then PLAIN_TIMED_RUNS; their
trimmed mean, `plain_step_seconds`).
The switch uses only timings and past steps, never a step's target probabilities, so the output
law stays the target's.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.engine.adaptive import Recent, trimmed_mean
from ssd_jax.engine.plain_verdicts import PlainVerdicts

PLAIN_CHUNK = 16
# Steps not judged: a call's first steps have no prefetched speculation yet (the draft works on
# the critical path), so they are slower than SSD's steady state. Then MIN_STEPS judged steps.
WARMUP_STEPS = 2
MIN_STEPS = 6
DECAY = 0.85
PROBE_EVERY = 8
PROBE_EVERY_MAX = 64
BACKOFF_RATIO = 1.15
PLAIN_TIMED_RUNS = 6
_PLAIN_STEP_S = Recent()
_VERDICTS = PlainVerdicts()
_LOCK = threading.Lock()


def expected_largest_normal(count: int) -> float:
    """The expected largest of `count` standard normal draws (Blom's approximation): 0 for one,
    1.05 for four (exactly: 1.03), 1.43 for eight (1.42). The host twin of
    `ssd_jax.engine.adaptive_loop.expected_largest_normal` (traced there), for SSD's host loop."""
    n = max(int(count), 1)
    return 0.0 if n == 1 else statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@dataclasses.dataclass
class PlainSwitch:
    """Decayed sums of SSD's step seconds and of the batch's pace (tokens per step of the row
    furthest behind), against plain_step_s. call_tokens: the tokens a row decodes in the call
    (the horizon at which the batch's pace is judged; 0: the window's pace as measured)."""

    plain_step_s: float
    call_tokens: int = 0
    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    seen: int = 0
    progress: np.ndarray | None = None
    row_sums: np.ndarray | None = None   # float64 [3, B]: decayed steps, tokens, squared tokens

    def record(self, seconds: float, row_tokens, live=None, compiled: bool = False) -> None:
        """One SSD step that emitted row_tokens (float [B], or a number at batch 1) to the rows
        in live (bool [B]; None: all). Its pace is how far the furthest-behind live row moved:
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
        if compiled or self.seen <= WARMUP_STEPS:
            return
        self.seconds = DECAY * self.seconds + seconds
        self.tokens = DECAY * self.tokens + pace
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
        return self.steps >= MIN_STEPS and self.cost_ratio() > 1.0

    def cost_ratio(self) -> float:
        """SSD's decayed seconds per token (at the batch's pace, `pace`) over plain decoding's
        (> 1: SSD is slower); 1.0 before any judged step."""
        pace = self.pace()
        return (self.seconds / self.weight) / (self.plain_step_s * pace) if pace > 0 else 1.0


def plain_step_seconds(key, run_chunk, state) -> float:
    """Seconds per plain decoding step of this program (key: what it is remembered under),
    timed by run_chunk(copy of state) -> (emitted, appended, ...) on copies: a first run (it
    compiles), then PLAIN_TIMED_RUNS runs, their trimmed mean. Not their best: SSD's side of the
    comparison is a running mean of its steps, and against the best of two plain runs a call
    that SSD sped up by 6-9% (batch 4, held-out code, T=0, one CPU device: fixed L=4 1.06x and
    1.09x AR in two processes) was judged slower and decoded 99% of its steps plainly (0.95x and
    0.99x AR)."""
    with _LOCK:
        known = _PLAIN_STEP_S.lookup(key)
    if known is not None:
        return known
    per_step = []
    for run in range(PLAIN_TIMED_RUNS + 1):   # the first run compiles
        copy = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(copy)
        start = time.perf_counter()
        out = jax.block_until_ready(run_chunk(copy))
        steps = max(int(np.max(np.asarray(out[1]))), 1)
        if run:
            per_step.append((time.perf_counter() - start) / steps)
    seconds = trimmed_mean(per_step)
    with _LOCK:
        _PLAIN_STEP_S.store(key, seconds)
    return seconds


def starts_plain(key) -> bool:
    """Whether a call of the program `key` decodes plainly from the start: the last call that ran
    SSD measured it slower, and this call is not a probe (see the module's docstring)."""
    return _VERDICTS.starts_plain(key)


def remember(key, slower: bool, cost_ratio: float = 1.0) -> None:
    """The verdict of a call that ran SSD long enough to judge (see `starts_plain`); cost_ratio:
    its `PlainSwitch.cost_ratio`. A probe that finds SSD slower again by at least BACKOFF_RATIO
    doubles the calls between probes; any other verdict sets them to PROBE_EVERY."""
    _VERDICTS.remember(key, slower, back_off=cost_ratio >= BACKOFF_RATIO, first=PROBE_EVERY, most=PROBE_EVERY_MAX)


def forget() -> None:
    """Drops the remembered verdicts (tests, benchmarks starting a new prompt set)."""
    _VERDICTS.forget()
