"""Saguaro fan-out: how many cached outcomes (forks) each verification outcome depth gets.

A verification of L draft tokens ends in an outcome (k, t): k accepted tokens, then token t. SSD
caches a next speculation for F_k candidate tokens t at each depth k = 0..L; the budget
B = sum F_k is the number of speculations the draft prepares per step.

- "uniform": F_k = B / (L+1) (the remainder to the shallowest depths).
- "geometric" (Saguaro): with per-token acceptance rate a and a miss rate that falls as a power of
  the fan-out, 1 - p_hit(F) = F^-r, the hit-maximising allocation is
      F_k ~ a^(k/(1+r))                          k < L
      F_L ~ a^(L/(1+r)) * (1-a)^(-1/(1+r))       (all L accepted: the bonus position)
  scaled to sum to B. Depth k's outcome has probability a^k (1-a) (k < L) or a^L (k = L); the
  allocation follows from a Lagrange condition on sum_k P(k) F_k^-r.

Integer allocations use largest-remainder rounding under the caps (V-1 tokens at k < L, where the
drafted token is excluded, V at k = L), and give every depth at least one fork when B >= L+1 (a
depth with no fork is a certain miss, which the continuous optimum never asks for).

`FanoutEstimator` estimates a and r online on the host from the verification outcomes (see its
docstring); a and r may also be fixed by the caller.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ssd_jax.errors import InputError

FANOUT_STRATEGIES = ("uniform", "geometric")
# Until WARMUP_STEPS verification outcomes were seen, the geometric allocation uses these.
DEFAULT_ACCEPTANCE = 0.7
DEFAULT_MISS_EXPONENT = 1.0
WARMUP_STEPS = 8
REFRESH_STEPS = 4
# Estimates are clipped to these ranges (a -> 1 would send the whole budget to depth L).
ACCEPTANCE_RANGE = (0.05, 0.95)
EXPONENT_RANGE = (0.1, 4.0)


def fanout_caps(num_draft_tokens: int, vocab: int) -> np.ndarray:
    """The most forks each depth can hold: int64 [L+1] (V-1 below depth L, V at depth L)."""
    caps = np.full(num_draft_tokens + 1, vocab - 1, np.int64)
    caps[-1] = vocab
    return caps


def max_budget(num_draft_tokens: int, vocab: int) -> int:
    """The largest usable fan-out budget: every candidate token at every depth."""
    return int(fanout_caps(num_draft_tokens, vocab).sum())


def _round_with_caps(weights: np.ndarray, budget: int, caps: np.ndarray) -> np.ndarray:
    """Integers >= 0 proportional to weights (float [D] > 0), each <= caps[d], summing to
    min(budget, caps.sum()); at least 1 per entry when the budget allows it.

    Water-filling: the budget goes out in proportion to the weights; entries that would fall
    below the floor or pass their cap are fixed there and the rest re-shared; then
    largest-remainder rounding of the continuous shares."""
    budget = int(min(budget, caps.sum()))
    low = np.full(len(caps), 1.0 if budget >= len(caps) else 0.0)
    high = caps.astype(np.float64)
    value = np.zeros(len(caps))
    fixed = np.zeros(len(caps), bool)
    for _ in range(2 * len(caps) + 1):
        left = budget - value[fixed].sum()
        w = np.where(fixed, 0.0, weights)
        free_value = left * w / w.sum() if w.sum() > 0 else np.zeros(len(caps))
        value = np.where(fixed, value, free_value)
        below, above = ~fixed & (value < low), ~fixed & (value > high)
        if not (below.any() or above.any()):
            break
        # Fix the worse side first: lifting entries to the floor lowers everyone else's share.
        side = below if below.any() else above
        value = np.where(side, np.where(below, low, high), value)
        fixed |= side
    alloc = np.clip(np.floor(value + 1e-9), 0, caps).astype(np.int64)
    order = np.argsort(-(value - alloc), kind="stable")
    for d in order:
        if alloc.sum() >= budget:
            break
        if alloc[d] < caps[d]:
            alloc[d] += 1
    return alloc


def uniform_fanout(num_draft_tokens: int, budget: int, vocab: int) -> tuple[int, ...]:
    """F_0..F_L as equal as the caps allow, summing to the budget (or to the caps' sum)."""
    weights = np.ones(num_draft_tokens + 1)
    # A tiny tilt towards shallow depths puts the remainder there (they are the likelier outcomes).
    weights -= 1e-9 * np.arange(num_draft_tokens + 1)
    return tuple(int(f) for f in _round_with_caps(weights, budget, fanout_caps(num_draft_tokens, vocab)))


def geometric_fanout(num_draft_tokens: int, budget: int, vocab: int, acceptance: float,
                     miss_exponent: float) -> tuple[int, ...]:
    """Saguaro's allocation F_0..F_L for acceptance rate a and miss exponent r (module docstring)."""
    a = float(np.clip(acceptance, *ACCEPTANCE_RANGE))
    r = float(np.clip(miss_exponent, *EXPONENT_RANGE))
    k = np.arange(num_draft_tokens + 1, dtype=np.float64)
    log_w = k * math.log(a) / (1 + r)
    log_w[-1] -= math.log(1 - a) / (1 + r)
    weights = np.exp(log_w - log_w.max())
    return tuple(int(f) for f in _round_with_caps(weights, budget, fanout_caps(num_draft_tokens, vocab)))


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where each of the S = sum F_k cache slots forks: slot s holds the speculation for the
    rank[s]-th candidate token at depth[s]. fanout int32 [L+1]; depth, rank int32 [S]."""

    fanout: np.ndarray
    depth: np.ndarray
    rank: np.ndarray

    @classmethod
    def from_fanout(cls, fanout, num_slots: int) -> "SlotLayout":
        """Slots ordered by depth then rank; unused slots (sum F < num_slots) repeat the last
        real slot, so every slot is a valid fork and lookups take the first match."""
        fanout = np.asarray(fanout, np.int32)
        depth = np.repeat(np.arange(len(fanout), dtype=np.int32), fanout)
        rank = np.concatenate([np.arange(f, dtype=np.int32) for f in fanout])
        if len(depth) < num_slots:
            pad = num_slots - len(depth)
            depth = np.concatenate([depth, np.full(pad, depth[-1], np.int32)])
            rank = np.concatenate([rank, np.full(pad, rank[-1], np.int32)])
        return cls(fanout=fanout, depth=depth, rank=rank)


class FanoutEstimator:
    """Chooses each step's fan-out and learns Saguaro's a and r from the outcomes (host side).

    a: accepted draft tokens / (accepted + rejections), where a step with k < L ends in one
    rejection: the maximum-likelihood acceptance rate of the geometric outcome model.
    r: least-squares fit of log(miss rate) = -r log(F) through the origin over the fan-out values
    F >= 2 seen at least 4 times, weighted by their counts (miss rates smoothed by +1/2).
    Before WARMUP_STEPS outcomes (or with no usable F), the defaults (or the given values) hold.
    A value given by the caller is never re-estimated. `layout()` re-derives the geometric
    allocation every REFRESH_STEPS recorded steps.
    """

    def __init__(self, strategy: str, num_draft_tokens: int, budget: int, vocab: int,
                 acceptance: float | None = None, miss_exponent: float | None = None):
        self.strategy = strategy
        self.length = num_draft_tokens
        self.budget = budget
        self.vocab = vocab
        self.fixed_acceptance = acceptance
        self.fixed_exponent = miss_exponent
        self.accepted = 0
        self.rejections = 0
        self.steps = 0
        self.by_fanout: dict[int, list[int]] = {}  # F -> [outcomes, misses]
        self._layout: SlotLayout | None = None
        self._layout_step = 0

    @property
    def num_slots(self) -> int:
        return int(min(self.budget, max_budget(self.length, self.vocab)))

    def acceptance(self) -> float:
        if self.fixed_acceptance is not None:
            return self.fixed_acceptance
        if self.steps < WARMUP_STEPS or self.accepted + self.rejections == 0:
            return DEFAULT_ACCEPTANCE
        return float(np.clip(self.accepted / (self.accepted + self.rejections), *ACCEPTANCE_RANGE))

    def miss_exponent(self) -> float:
        if self.fixed_exponent is not None:
            return self.fixed_exponent
        logs, log_miss, weights = [], [], []
        for f, (n, misses) in self.by_fanout.items():
            if f >= 2 and n >= 4:
                logs.append(math.log(f))
                log_miss.append(math.log((misses + 0.5) / (n + 1.0)))
                weights.append(n)
        if self.steps < WARMUP_STEPS or not logs:
            return DEFAULT_MISS_EXPONENT
        x, y, w = np.array(logs), np.array(log_miss), np.array(weights, float)
        return float(np.clip(-np.sum(w * x * y) / np.sum(w * x * x), *EXPONENT_RANGE))

    def fanout(self) -> tuple[int, ...]:
        """This step's F_0..F_L."""
        if self.strategy == "uniform":
            return uniform_fanout(self.length, self.budget, self.vocab)
        return geometric_fanout(self.length, self.budget, self.vocab, self.acceptance(), self.miss_exponent())

    def layout(self) -> SlotLayout:
        """This step's slot layout. The geometric allocation is refreshed every REFRESH_STEPS
        recorded steps (its estimates move slowly; recomputing costs host time every step)."""
        if self._layout is None or (self.strategy == "geometric" and self.steps - self._layout_step >= REFRESH_STEPS):
            fanout = self.fanout()
            if self._layout is None or tuple(self._layout.fanout) != fanout:
                self._layout = SlotLayout.from_fanout(fanout, self.num_slots)
            self._layout_step = self.steps
        return self._layout

    def record(self, accepted: np.ndarray, hit: np.ndarray, fanout) -> None:
        """Outcomes of one step for the rows that took part: accepted int [R] (k), hit bool [R]
        (their outcome was cached), fanout: the F_0..F_L the cache was built with."""
        accepted, hit = np.asarray(accepted), np.asarray(hit)
        if accepted.size == 0:
            return
        self.steps += 1
        self.accepted += int(accepted.sum())
        self.rejections += int(np.sum(accepted < self.length))
        for k, h in zip(accepted.tolist(), hit.tolist()):
            entry = self.by_fanout.setdefault(int(fanout[k]), [0, 0])
            entry[0] += 1
            entry[1] += 0 if h else 1


def check_fanout_options(strategy, budget, acceptance, miss_exponent) -> None:
    """Raises InputError naming a bad fan-out option."""
    if strategy not in FANOUT_STRATEGIES:
        raise InputError(f"fanout must be one of {', '.join(map(repr, FANOUT_STRATEGIES))}, got {strategy!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise InputError(f"fanout_budget must be an integer >= 1, got {budget!r}")
    for name, value, low, high in (("fanout_acceptance", acceptance, 0.0, 1.0),
                                   ("fanout_exponent", miss_exponent, 0.0, math.inf)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
            raise InputError(f"{name} must be a number in ({low:g}, {high:g}), got {value!r}")
