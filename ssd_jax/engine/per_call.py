"""draft_len="auto" chosen per call among fixed programs, where the adaptive loop's own steps cost
more than a fixed program's of the same length (the backend policy's `adaptive_per_call_below_rows`).

The adaptive loop decides inside the program, step by step; on XLA:GPU its control flow (a while
loop of runs, a `lax.switch` over caps, the plain fallback's checks) reads predicates back to the
host between kernels. On an NVIDIA H100 (2026-11-27, embedded pair, bf16, SD at batch 1, held-out
code, T=1; `benchmarks/results/loop_overhead_gpu_h100_*`), the loop forced to caps 2 and 4 took
0.271 and 0.363 ms a step against fixed L=2 and L=4's 0.245 and 0.327 ms (+10-11%), and its plain
step 0.193 ms against AR's program's 0.152 ms (+27%); traced at T=0, its steps left the device
idle 72 us each against 25 us for fixed L=2 with about as many kernels. "auto" there ran
1.18-1.42x AR, 0.84-0.91 of fixed L=2 (`adaptive_gpu_h100_sd_b1_1127.json`); no choice of caps
wins back a tenth of every step. Capturing while loops and conditionals in CUDA graphs
(`--xla_gpu_enable_command_buffer=...,CONDITIONAL,WHILE`) made the loop slower still (+16-20%).

So a call here runs one program, chosen before it starts: fixed length L* (the method with
draft_len=L*) or AR's program (L* = 0), L* maximising the predicted speedup

    E(L, a) price(0) / price(L),     E(L, a) = (1 - a^(L+1)) / (1 - a)

with a the pair's remembered per-position acceptance (`adaptive.ACCEPTANCE`, which these calls
update from their counters as the loop's do) and price(L) the seconds per target call of length
L's program: the cost model's step (`StepCosts.spec_step`, target(1) for AR) plus the part of it
the model misses (sampling, verification, bookkeeping, the launches), measured on the program's
past calls of that length, else of the nearest measured one (`prices`). The choice depends
only on past calls and timings, so each call keeps its fixed program's exact law. While AR's
program wins, every PROBE_EVERY-th call runs the best length anyway, so the acceptance stays
current. Each length run compiles its program once (the compile cache keeps it).
"""

from __future__ import annotations

import threading

import numpy as np

from ssd_jax.engine.adaptive import DecayedMeans, Recent, StepCosts, agreed, expected_tokens, timings_allowed

METHODS = ("sd", "bv")   # single-path methods drafting with a model: their fixed programs differ only in L
PRICE_WEIGHT = 0.5       # a call's weight in its length's remembered seconds per target call
PROBE_EVERY = 8          # while AR's program wins, one call in this many runs the best length

_PRICES = DecayedMeans(PRICE_WEIGHT, running_start=True)   # (program key, L) -> seconds per target call
_AR_CALLS = Recent()   # program key -> calls of AR's program since the last speculation
_LOCK = threading.Lock()


def applies(method, policy, rows: int) -> bool:
    """Whether an "auto" call of `method` on `rows` prompts runs a fixed program chosen per call:
    the backend policy says so below its `adaptive_per_call_below_rows`, for the METHODS."""
    return (getattr(method, "adaptive", False) and method.name in METHODS
            and rows < policy.adaptive_per_call_below_rows)


def model_seconds(costs: StepCosts, length: int) -> float:
    """The cost model's seconds per target call of length's program (0: AR's, one target token)."""
    return costs.target(1) if length == 0 else costs.spec_step(length)


def prices(key, costs: StepCosts, max_len: int) -> np.ndarray:
    """float64 [max_len + 1]: seconds per target call of AR's program (index 0) and of each fixed
    length 1..max_len: the model's plus the surplus measured on that program; for a length not
    measured, the nearest measured length's surplus (the shorter on a tie), else AR's, else none;
    for AR's program not measured, the shortest measured length's (priced bare against measured
    drafts, AR's program looked cheaper than it is, and a call that paid would hand the next one
    to it)."""
    surplus = {}
    for length in range(max_len + 1):
        measured = _PRICES.lookup((key, length)) if timings_allowed() else None
        if measured is not None:
            surplus[length] = measured - model_seconds(costs, length)
    drafted = [n for n in surplus if n > 0]
    out = np.empty(max_len + 1, np.float64)
    for length in range(max_len + 1):
        if length in surplus:
            extra = surplus[length]
        elif drafted:
            extra = surplus[min(drafted, key=lambda n: (abs(n - length), n))]
        else:
            extra = surplus.get(0, 0.0)
        out[length] = max(model_seconds(costs, length) + extra, 1e-12)
    return out


def predicted_speedups(key, costs: StepCosts, acceptance: float, max_len: int) -> np.ndarray:
    """float64 [max_len + 1]: each program's predicted speedup over AR's (index 0: 1.0)."""
    price = prices(key, costs, max_len)
    tokens = np.asarray([1.0] + [expected_tokens(acceptance, n) for n in range(1, max_len + 1)])
    return tokens * price[0] / price


def choose(key, costs: StepCosts, acceptance: float, max_len: int) -> int:
    """The length this call runs (0: AR's program): the best predicted speedup (ties: the
    shorter), a speculative length over AR's only where it predicts a gain; where AR's wins, the
    best length on every PROBE_EVERY-th call. Decided on process 0's prices on every process
    (`agreed`)."""
    speedups = agreed(predicted_speedups(key, costs, acceptance, max_len))
    best = 1 + int(np.argmax(np.round(speedups[1:], 6)))
    if speedups[best] > 1.0:
        with _LOCK:
            _AR_CALLS.store(key, 0)
        return best
    with _LOCK:
        since = _AR_CALLS.lookup(key, 0) + 1
        probe = since >= PROBE_EVERY and timings_allowed()
        _AR_CALLS.store(key, 0 if probe else since)
    return best if probe else 0


def record(key, length: int, seconds: float, target_calls: int) -> None:
    """A finished call of length's program (0: AR's): its seconds per target call join that
    length's price (not under SSD_JAX_DETERMINISTIC_AUTO=1, nor for a call of no target call)."""
    if timings_allowed() and target_calls > 0 and seconds > 0:
        _PRICES.add((key, int(length)), float(seconds) / int(target_calls))


def forget() -> None:
    """Drops the remembered prices and probe counts (tests, benchmarks starting anew)."""
    _PRICES.clear()
    _AR_CALLS.clear()
