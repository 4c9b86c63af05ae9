"""draft_len="auto" chosen per call among fixed programs, where the adaptive loop's own steps cost
more than a fixed program's of the same length (the backend policy's `adaptive_per_call_below_rows`).

The adaptive loop decides inside the program, step by step; on XLA:GPU its control flow (a while
loop of runs, a `lax.switch` over caps, the plain fallback's checks) reads predicates back to the
host between kernels. On an NVIDIA H100 (2026-11-27, embedded pair, bf16, SD at batch 1, held-out
code, T=1; `benchmarks/results/loop_overhead_gpu_h100_*`), the loop forced to caps 2 and 4 took
0.271 and 0.363 ms a step against fixed L=2 and L=4's 0.245 and 0.327 ms (+10-11%), and its plain
step 0.193 ms against AR's program's 0.152 ms (+27%); traced at T=0, its steps left the device
idle 72 us each against 25 us for fixed L=2 with about as many kernels. "auto" there ran
1.18-1.42x AR, 0.84-0.91 of fixed L=2 (`adaptive_gpu_h100_sd_b1_1127.json`); PLD's loop, at the
same tokens per step as fixed L=8, ran 0.92-0.95 of it at T=0 (H200, `adaptive_gpu_h200_pld_b1.json`).
No choice of caps wins back a tenth of every step. Capturing while loops and conditionals in
CUDA graphs (`--xla_gpu_enable_command_buffer=...,CONDITIONAL,WHILE`) made the loop slower still
(+16-20%). The loop's programs also compile 10-80 s on a GPU against 1-2 s for a fixed length's.

So a call here runs one program, chosen before it starts: the method at a fixed length L* (its
`Menu`: SD, BV, SpecInfer, SpecTr, GBV and PLD their draft_len, CSD its max_draft_tokens,
LogitSpec its root branch at the longest its tree allows) or AR's program (L* = 0), L* maximising
the predicted speedup

    tokens(L) price(0) / price(L)

price(L): the seconds per target call of length L's program, the cost model's step (`Menu.model_s`:
target(K L + 1) + L draft forwards at K paths' rows; retrieval and cascades draft inside the step,
target(width) alone) plus the part of it the model misses (sampling, verification, the cascade's
or lookup's drafting, bookkeeping, the launches), measured on the program's past calls of that
length, else of the nearest measured one (`prices`). tokens(L): the tokens per target call
measured on that length's past calls, else E(L, a) = (1 - a^(L+1)) / (1 - a) scaled by what the
nearest measured length read against its own E (a retrieval draft finds nothing on some steps,
a cascade's lenient review accepts near misses: the geometric law alone is off by a factor that
a measured length shows), a the pair's remembered per-position acceptance (`adaptive.ACCEPTANCE`,
which these calls update from their counters as the loop's do). The choice depends only on past
calls and timings, so each call keeps its fixed program's exact law. While AR's program wins,
the PROBE_EVERY-th call runs the best length anyway, so the acceptance stays current, and each
probe after which AR's program still wins doubles the calls to the next (up to PROBE_EVERY_MAX,
as the loop's and SSD's plain verdicts back off: on CPU, PLD at T=1 lost 1-5% to its probes
every 8th call, at 0.58-0.82x AR each). Each
length run compiles its program once (the compile cache keeps it).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ssd_jax.engine.adaptive import DecayedMeans, Recent, StepCosts, agreed, expected_tokens, timings_allowed
from ssd_jax.engine.adaptive_loop import compiled_caps, with_one

# Methods whose fixed programs differ from "auto" only in a length (and the shapes "auto" fixed
# before the call: paths, tree size).
METHODS = ("sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd")
PRICE_WEIGHT = 0.5       # a call's weight in its length's remembered seconds and tokens per target call
PROBE_EVERY = 8          # while AR's program wins, the first probe is this many calls in ...
PROBE_EVERY_MAX = 64     # ... and each probe that leaves it winning doubles that, up to this

_PRICES = DecayedMeans(PRICE_WEIGHT, running_start=True)   # (program key, L) -> seconds per target call
_TOKENS = DecayedMeans(PRICE_WEIGHT, running_start=True)   # (program key, L) -> tokens per target call
_AR_CALLS = Recent()   # program key -> (calls of AR's program since the last probe, calls between probes)
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Menu:
    """The fixed programs one call may run: lengths (>= 1, ascending), and model_s float64
    [max(lengths) + 1], the cost model's seconds per target call of AR's program (index 0) and of
    each length's (indices not in lengths unused)."""

    lengths: tuple[int, ...]
    model_s: np.ndarray

    @property
    def max_len(self) -> int:
        return self.lengths[-1]


def applies(method, policy, rows: int) -> bool:
    """Whether an "auto" call of `method` on `rows` prompts runs a fixed program chosen per call:
    the backend policy says so below its `adaptive_per_call_below_rows`, for the METHODS."""
    return (getattr(method, "adaptive", False) and method.name in METHODS
            and rows < policy.adaptive_per_call_below_rows)


def model_seconds(costs: StepCosts, length: int, paths: int = 1, draft_s: float | None = None) -> float:
    """The cost model's seconds per target call of a length's program (0: AR's, one target
    token): target(paths L + 1) + L draft forwards (draft_s each: the draft at paths' rows;
    None: costs.draft)."""
    if length == 0:
        return costs.target(1)
    draft = costs.draft if draft_s is None else draft_s
    return costs.target(paths * length + 1) + length * draft


def menu_lengths(max_len: int) -> tuple[int, ...]:
    """The lengths a call may run up to max_len: 1, the powers of two below it, and max_len (the
    adaptive loop's caps, `adaptive_loop.with_one(compiled_caps)`): the first call at a length
    compiles its program (1-3 s on CPU or GPU, the time of 10-50 batch-1 decodes of the embedded
    pair), so the choice moves among a few programs, not every length up to max_len."""
    return with_one(compiled_caps(max_len))


def simple_menu(costs: StepCosts, max_len: int) -> Menu:
    """The `menu_lengths` of a single-path method drafting with `costs`' draft (or none)."""
    return Menu(menu_lengths(max_len), np.asarray([model_seconds(costs, n) for n in range(max_len + 1)]))


def menu_for(method, target, draft, sampling, batch: int, context: int) -> Menu:
    """The menu of an "auto" call of `method` (shaped: its paths and tree size fixed) on this
    pair, batch and context, priced by the measured costs (`adaptive.measure_costs`, and for K > 1
    paths the draft's forward at K rows)."""
    from ssd_jax.engine import adaptive
    from ssd_jax.engine.cascade import cascade_schedule
    from ssd_jax.engine.retrieval import retrieval_layout

    costs = adaptive.measure_costs(target, adaptive.cost_draft(method, draft), batch, context,
                                   adaptive.cost_width(method))
    if method.name == "csd":
        width = cascade_schedule(method, len(adaptive.draft_models(draft)), sampling).target_width
        return Menu(menu_lengths(width), np.asarray([costs.target(n + 1) for n in range(width + 1)]))
    if method.name in ("pld", "logitspec"):
        lengths = (menu_lengths(method.max_draft_len) if method.name == "pld"
                   else (adaptive.logitspec_branch(method),))
        model = np.zeros(lengths[-1] + 1)
        model[0] = costs.target(1)
        for n in lengths:
            model[n] = costs.target(retrieval_layout(method, n).num_nodes)
        return Menu(lengths, model)
    paths = getattr(method, "paths", 1)
    if paths == 1:
        return simple_menu(costs, method.max_draft_len)
    rows = adaptive.forward_seconds(draft, batch * paths, 1, context) if costs.measured else None
    return Menu(menu_lengths(method.max_draft_len),
                np.asarray([model_seconds(costs, n, paths, rows) for n in range(method.max_draft_len + 1)]))


def fixed(method, length: int):
    """The method at a fixed length (CSD: its max_draft_tokens)."""
    field = "max_draft_tokens" if method.name == "csd" else "draft_len"
    return dataclasses.replace(method, **{field: int(length)})


def prices(key, menu: Menu) -> np.ndarray:
    """float64 [max_len + 1]: seconds per target call of AR's program (index 0) and of each menu
    length: the model's plus the surplus measured on that program; for a length not measured, the
    nearest measured length's surplus (the shorter on a tie), else AR's, else none; for AR's
    program not measured, the shortest measured length's (priced bare against measured drafts,
    AR's program looked cheaper than it is, and a call that paid would hand the next one to it).
    Entries of lengths off the menu: inf."""
    surplus = {}
    for length in (0,) + menu.lengths:
        measured = _PRICES.lookup((key, length)) if timings_allowed() else None
        if measured is not None:
            surplus[length] = measured - menu.model_s[length]
    drafted = [n for n in surplus if n > 0]
    out = np.full(menu.max_len + 1, np.inf)
    for length in (0,) + menu.lengths:
        if length in surplus:
            extra = surplus[length]
        elif drafted:
            extra = surplus[min(drafted, key=lambda n: (abs(n - length), n))]
        else:
            extra = surplus.get(0, 0.0)
        out[length] = max(menu.model_s[length] + extra, 1e-12)
    return out


def tokens_per_call(key, menu: Menu, acceptance: float) -> np.ndarray:
    """float64 [max_len + 1]: tokens per target call of AR's program (1) and of each menu length:
    measured on its past calls, else E(L, a) times the nearest measured length's measured / E
    (the shorter on a tie), else E(L, a). Entries off the menu: 0."""
    measured = {}
    if timings_allowed():
        for length in menu.lengths:
            value = _TOKENS.lookup((key, length))
            if value is not None:
                measured[length] = value
    out = np.zeros(menu.max_len + 1)
    out[0] = 1.0
    for length in menu.lengths:
        if length in measured:
            out[length] = measured[length]
            continue
        out[length] = expected_tokens(acceptance, length)
        if measured:
            near = min(measured, key=lambda n: (abs(n - length), n))
            out[length] *= measured[near] / expected_tokens(acceptance, near)
    return out


def predicted_speedups(key, menu: Menu, acceptance: float) -> np.ndarray:
    """float64 [max_len + 1]: each program's predicted speedup over AR's (index 0: 1.0; lengths
    off the menu: 0)."""
    price = prices(key, menu)
    return tokens_per_call(key, menu, acceptance) * price[0] / price


def choose(key, menu: Menu, acceptance: float) -> int:
    """The length this call runs (0: AR's program): the best predicted speedup (ties: the
    shorter), a speculative length over AR's only where it predicts a gain; where AR's wins, the
    best length as a probe, PROBE_EVERY calls after AR's program started winning, then twice as
    many calls after each probe it kept winning through (at most PROBE_EVERY_MAX). Decided on
    process 0's prices on every process (`agreed`)."""
    speedups = agreed(predicted_speedups(key, menu, acceptance))
    best = 1 + int(np.argmax(np.round(speedups[1:], 6)))
    if speedups[best] > 1.0:
        with _LOCK:
            _AR_CALLS.store(key, (0, PROBE_EVERY))
        return best
    with _LOCK:
        since, interval = _AR_CALLS.lookup(key, (0, PROBE_EVERY))
        since += 1
        probe = since >= interval and timings_allowed()
        _AR_CALLS.store(key, (0, min(2 * interval, PROBE_EVERY_MAX)) if probe else (since, interval))
    return best if probe else 0


def record(key, length: int, seconds: float | None, target_calls: int, tokens: float | None = None) -> None:
    """A finished call of length's program (0: AR's): its seconds per target call join that
    length's price (None: not timed, a streamed call's host copies would be in it), its tokens
    per target call (a speculative length's) that length's tokens (neither under
    SSD_JAX_DETERMINISTIC_AUTO=1, nor for a call of no target call)."""
    if not timings_allowed() or target_calls <= 0:
        return
    if seconds is not None and seconds > 0:
        _PRICES.add((key, int(length)), float(seconds) / int(target_calls))
    if length and tokens is not None and tokens > 0:
        _TOKENS.add((key, int(length)), float(tokens))


def forget() -> None:
    """Drops the remembered prices, tokens and probe counts (tests, benchmarks starting anew)."""
    _PRICES.clear()
    _TOKENS.clear()
    _AR_CALLS.clear()
