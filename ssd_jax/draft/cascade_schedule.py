"""The static schedule of Cascade Speculative Drafting (CSD): a validated k-matrix unfolded into
the tree of review rounds and Max-Gram draws that one decode step runs, with every static width.

Levels: 0 is the target, 1..n the neural drafters (largest first), n + 1 Max-Gram (G). The
k-matrix has a row per reviewer level and a column per level, (n + 2) x (n + 2) (the last row,
Max-Gram's, reviews nothing and may be left out): k[r][c] for a neural c > r is the number of
review rounds level c runs inside the block it builds for r, and k[r][n+1] the number of Max-Gram
tokens appended after them. Entries with c <= r must be 0. A round of level c builds c's own block
(row c, recursively), then c reviews it in one forward and emits its accepted tokens plus one
correction or bonus token: a round of a block of static width W_c has static width W_c + 1, so

    W_r = sum_{neural c > r} k[r][c] * (W_c + 1) + k[r][n+1].

Pending widths. Before each forward a drafter processes the prefix tokens it has not seen yet
(the text that joined the prefix since its last forward) together with the block it reviews. The
most such tokens each forward can meet follows from the schedule alone: `_pending_widths` tracks,
per level, an upper bound U on "text length - cache length" through the step (Max-Gram appends k:
+k; a review by r of a block started when the bounds were U0 and ending with U: U_r = 1, levels
above r get U0 + W_r + 1, levels below r max(1, min(U0 + W_r + 1, U + 1)), since their caches
are rolled back to the accepted text) and iterates steps to the fixed point. Every cache always
lacks at least the last text token (U >= 1), so a forward always yields the logits that predict
the block's first token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import numpy as np

from ssd_jax.errors import InputError

# Guards against a k-matrix that would unroll into an enormous program.
MAX_BLOCK_WIDTH = 256
MAX_ROUNDS_PER_STEP = 64


@dataclasses.dataclass(frozen=True)
class MaxGramDraw:
    """Append `count` Max-Gram tokens to the block being built."""

    count: int

    @property
    def width(self) -> int:
        return self.count


@dataclasses.dataclass(frozen=True)
class Round:
    """One review round: `level` (1..n) builds its block from `block` (ops of the levels below it),
    then reviews it in one forward over `pending` unseen prefix tokens + the block's `block_width`.

    index: the round's place in the step (pre-order), distinct per round (random keys, counters).
    """

    level: int
    block: tuple
    index: int
    pending: int = 0

    @functools.cached_property
    def block_width(self) -> int:
        return block_width(self.block)

    @property
    def width(self) -> int:
        """Static number of tokens the round emits at most: the block's plus one."""
        return self.block_width + 1


Op = Union[MaxGramDraw, Round]


def block_width(ops: Sequence[Op]) -> int:
    """Static width (most valid tokens) of a block built by `ops`."""
    return sum(op.width for op in ops)


def iter_rounds(ops: Sequence[Op]):
    """Every round of a block, nested ones included, in pre-order."""
    for op in ops:
        if isinstance(op, Round):
            yield op
            yield from iter_rounds(op.block)


@dataclasses.dataclass(frozen=True)
class CascadeSchedule:
    """A validated k-matrix and the step it unfolds into.

    k_matrix: (n + 2) x (n + 2) ints; num_drafters: n; ops: the ops building the target's block;
    max_draft_tokens: the most draft tokens the target verifies per step (the block is cut there),
    or None for the whole block. Hashable: part of the engine's static compile key.
    """

    k_matrix: tuple[tuple[int, ...], ...]
    num_drafters: int
    ops: tuple
    max_draft_tokens: int | None = None

    @property
    def maxgram_level(self) -> int:
        return self.num_drafters + 1

    @functools.cached_property
    def width(self) -> int:
        """W_0: static width of the block the drafters build for the target."""
        return block_width(self.ops)

    @property
    def target_width(self) -> int:
        """Static width of the draft the target verifies: W_0, or less when capped."""
        return self.width if self.max_draft_tokens is None else min(self.width, self.max_draft_tokens)

    @functools.cached_property
    def rounds(self) -> tuple[Round, ...]:
        return tuple(iter_rounds(self.ops))

    @functools.cached_property
    def rounds_per_level(self) -> tuple[int, ...]:
        """Forwards per step of each drafter 1..n."""
        return tuple(sum(r.level == c for r in self.rounds) for c in range(1, self.num_drafters + 1))

    @functools.cached_property
    def max_pending(self) -> int:
        return max((r.pending for r in self.rounds), default=1)

    @property
    def uses_maxgram(self) -> bool:
        return any(row[self.maxgram_level] > 0 for row in self.k_matrix)


def _as_int(value, where: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{where} must be a non-negative integer, got {value!r}")
    if value < 0:
        raise InputError(f"{where} must be a non-negative integer, got {value}")
    return int(value)


def parse_k_matrix(k_matrix, num_drafters: int) -> tuple[tuple[int, ...], ...]:
    """Validates a k-matrix for n = num_drafters drafters; returns it as (n + 2) x (n + 2) ints.

    Accepts nested sequences or a 2-D integer array with n + 2 columns and n + 1 or n + 2 rows.
    Raises InputError naming the bad entry: wrong shape, a negative or non-integer entry, a level
    drafting for itself or a larger level (k[r][c] != 0 with c <= r), a Max-Gram row that is not
    zero, a target row that drafts nothing, or a drafter that no row above it ever calls.
    """
    size = num_drafters + 2
    shape_hint = (f"{size} x {size} (rows: target, drafts 1..{num_drafters}, Max-Gram; "
                  f"columns: the same levels)" if num_drafters else f"{size} x {size} (target, Max-Gram)")
    if isinstance(k_matrix, (str, bytes)) or not hasattr(k_matrix, "__len__"):
        raise InputError(f"k_matrix must be a nested list of integers, {shape_hint}; got {k_matrix!r}")
    rows = list(k_matrix)
    if len(rows) not in (size - 1, size):
        raise InputError(f"k_matrix must have {size} rows ({size - 1} without the Max-Gram row) for "
                         f"{num_drafters} drafter(s), {shape_hint}; got {len(rows)} rows")
    parsed = []
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) != size:
            raise InputError(f"k_matrix row {r} must have {size} entries, {shape_hint}; got {row!r}")
        parsed.append(tuple(_as_int(v, f"k_matrix[{r}][{c}]") for c, v in enumerate(row)))
    if len(parsed) == size - 1:
        parsed.append((0,) * size)
    for r, row in enumerate(parsed):
        for c, value in enumerate(row):
            if c <= r and value:
                raise InputError(f"k_matrix[{r}][{c}] = {value}: a level only drafts for levels above it "
                                 f"(entries need column > row; use 0 here)")
    if not any(parsed[0]):
        raise InputError(f"k_matrix row 0 (the target's) drafts nothing: {list(parsed[0])}")
    used = {0}
    for r in range(size - 1):  # rows in level order: a level is reached only from above
        if r in used:
            used.update(c for c in range(r + 1, size) if parsed[r][c])
    for c in range(1, size - 1):
        if c not in used:
            raise InputError(f"draft {c} (k_matrix column {c}) is never called: no reached row above it "
                             f"gives it review rounds; drop the model or give it rounds")
    return tuple(parsed)


def default_cascade(num_drafters: int, greedy: bool = True) -> tuple[tuple[tuple[int, ...], ...], int | None]:
    """(k-matrix, max_draft_tokens) used when no k-matrix is given, for greedy decoding or not.

    Chosen with `benchmarks/bench_cascade.py` on the embedded models. Greedy: Max-Gram's copies
    often agree with the drafter's argmax, so wide rounds pay: the best one-drafter schedule tried
    is D1 running 3 rounds, each reviewing 2 Max-Gram tokens (up to 9 draft tokens). Sampling: the
    drafter keeps a Max-Gram token with probability q(token), which is small on sampled text, so
    rounds mostly emit one token and narrow blocks waste less of the target's forward: 4 rounds
    over 1 Max-Gram token each, the target checking at most 6.

    n = 0: 4 Max-Gram tokens. n >= 2 (both temperatures): D1 runs 3 rounds, each D_i reviews one
    round of D_{i+1}, the last drafter reviews 1 Max-Gram token; the target checks at most 6.
    """
    size = num_drafters + 2
    k = np.zeros((size, size), int)
    g = size - 1
    cap: int | None = 6
    if num_drafters == 0:
        k[0, g], cap = 4, None
    elif num_drafters == 1 and greedy:
        k[0, 1], k[1, g], cap = 3, 2, None
    elif num_drafters == 1:
        k[0, 1], k[1, g] = 4, 1
    else:
        k[0, 1] = 3
        for r in range(1, num_drafters):
            k[r, r + 1] = 1
        k[num_drafters, g] = 1
    return tuple(tuple(int(v) for v in row) for row in k), cap


def default_k_matrix(num_drafters: int, greedy: bool = True) -> tuple[tuple[int, ...], ...]:
    """The k-matrix of `default_cascade`."""
    return default_cascade(num_drafters, greedy)[0]


def _block_ops(k: tuple[tuple[int, ...], ...], level: int, counter: list[int]) -> tuple:
    size = len(k)
    ops: list[Op] = []
    for c in range(level + 1, size):
        count = k[level][c]
        if not count:
            continue
        if c == size - 1:
            ops.append(MaxGramDraw(count))
            continue
        for _ in range(count):
            index = counter[0]
            counter[0] += 1
            ops.append(Round(level=c, block=_block_ops(k, c, counter), index=index))
    return tuple(ops)


def _close(bound: list[int], start: list[int], reviewer: int, width: int) -> None:
    """Bounds after `reviewer` reviewed a block of static `width` begun at bounds `start`."""
    for c in range(1, len(bound)):
        if c < reviewer:
            bound[c] = start[c] + width + 1
        elif c == reviewer:
            bound[c] = 1
        else:
            bound[c] = max(1, min(start[c] + width + 1, bound[c] + 1))


def _pending_widths(ops: tuple, num_drafters: int, target_width: int) -> dict[int, int]:
    """round index -> the most unseen prefix tokens its forward can meet (see module docstring)."""
    pending: dict[int, int] = {}

    def walk(block: tuple, bound: list[int]) -> None:
        for op in block:
            if isinstance(op, MaxGramDraw):
                for c in range(1, len(bound)):
                    bound[c] += op.count
                continue
            start = list(bound)
            pending[op.index] = max(pending.get(op.index, 0), bound[op.level])
            walk(op.block, bound)
            _close(bound, start, op.level, op.block_width)

    bound = [0] + [1] * num_drafters  # after prefill: every cache lacks only the first token
    for _ in range(64):
        start = list(bound)
        walk(ops, bound)
        _close(bound, start, 0, target_width)
        if bound == start:
            return pending
    raise AssertionError("pending-width analysis did not converge")  # unreachable: every drafter is used


def _with_pending(ops: tuple, pending: dict[int, int]) -> tuple:
    return tuple(dataclasses.replace(op, block=_with_pending(op.block, pending), pending=pending[op.index])
                 if isinstance(op, Round) else op for op in ops)


def build_schedule(k_matrix, num_drafters: int, max_draft_tokens: int | None = None,
                   greedy: bool = True) -> CascadeSchedule:
    """Validates k_matrix (see `parse_k_matrix`; None = `default_cascade(num_drafters, greedy)`,
    with its cap unless max_draft_tokens is given) and unfolds it; max_draft_tokens (an int >= 1
    or None) caps the draft the target verifies.
    Raises InputError if the step would exceed MAX_BLOCK_WIDTH draft tokens or
    MAX_ROUNDS_PER_STEP review rounds."""
    if max_draft_tokens is not None and (isinstance(max_draft_tokens, bool) or not isinstance(
            max_draft_tokens, (int, np.integer)) or max_draft_tokens < 1):
        raise InputError(f"max_draft_tokens must be an integer >= 1 or None, got {max_draft_tokens!r}")
    if k_matrix is None:
        k, default_cap = default_cascade(num_drafters, greedy)
        max_draft_tokens = default_cap if max_draft_tokens is None else max_draft_tokens
    else:
        k = parse_k_matrix(k_matrix, num_drafters)
    ops = _block_ops(k, 0, [0])
    rounds = list(iter_rounds(ops))
    if len(rounds) > MAX_ROUNDS_PER_STEP:
        raise InputError(f"k_matrix {[list(r) for r in k]} unfolds into {len(rounds)} review rounds per step; "
                         f"at most {MAX_ROUNDS_PER_STEP} are supported")
    width = block_width(ops)
    if width > MAX_BLOCK_WIDTH:
        raise InputError(f"k_matrix {[list(r) for r in k]} drafts up to {width} tokens per step; "
                         f"at most {MAX_BLOCK_WIDTH} are supported")
    cap = None if max_draft_tokens is None else int(max_draft_tokens)
    target_width = width if cap is None else min(width, cap)
    ops = _with_pending(ops, _pending_widths(ops, num_drafters, target_width))
    return CascadeSchedule(k_matrix=k, num_drafters=num_drafters, ops=ops, max_draft_tokens=cap)
