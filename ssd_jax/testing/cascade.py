"""Cascade Speculative Drafting (method "csd") at temperature > 0: the exact law of one step and
its sampled counterpart, both walking the library's own schedule
(`ssd_jax.draft.cascade_schedule.build_schedule`) with the library's Max-Gram
(`ssd_jax.draft.maxgram.maxgram_draft`) and reviews (`ssd_jax.verify.tokenwise_tables`,
`ssd_jax.draft.cascade_review.sampled_review`).

What a step does (`ssd_jax.draft.cascade`, `ssd_jax.loop.cascade`). Levels: the target (0),
drafters 1..m, Max-Gram. A Max-Gram draw appends deterministic tokens whose recorded law is their
one-hot. A round of drafter c builds a block from the levels below it, then reviews it: token-wise
speculative sampling of the block against drafter c's law, each block token against the law
recorded for it, capped at the block's valid count (all kept: the next token from drafter c's law
at the valid count); the kept tokens and the correction are re-recorded with drafter c's law. The
target finally verifies the first max_draft_tokens of the draft the same way against the recorded
laws. Lenience (accepting when p(x) > q(x)/l) exists only at temperature 0: at T > 0 the library
refuses lenience > 1 (`ssd_jax.draft.cascade_options.check_lenience`), so every review is exact
and the step's law is the target's.

Tables. Drafter 1's law is tables.Q; drafters 2..m come in `CascadeSetup.drafters` (Q-like
levels). A step drafts at most W_0 = schedule.width tokens and reads drafter laws after prefixes of
up to W_0 - 1 tokens, so the tables need depth n >= W_0; the emission (at most max_draft_tokens + 1
tokens) is extended to n + 1 tokens. Max-Gram reads `prompt` followed by the step's text.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.testing.device_tables import emission, prefix_rows, stack_levels
from ssd_jax.testing.enumeration import check_enumerable, law_of_stops, rows_at
from ssd_jax.testing.exact_law import tokenwise_rule
from ssd_jax.testing.tables import Tables

MAX_WORLDS = 1_000_000


@dataclasses.dataclass(frozen=True, eq=False)
class CascadeSetup:
    """A cascade to check. k_matrix: as `ssd_jax.CSD` takes it (rows: target, drafters 1..m,
    optionally Max-Gram; columns: target, drafters 1..m, Max-Gram); max_draft_tokens: the cap on
    the draft the target verifies (None: all of it); drafters: the laws of drafters 2..m, each a
    sequence of levels shaped like Q; prompt: the text before the step (Max-Gram matches in it),
    default (0, 1, 0, 2, 1) mod V; bigram: Max-Gram's table int [V], default x -> (x + 1) mod V;
    max_ngram: Max-Gram's longest n-gram."""

    k_matrix: tuple = ((0, 2, 0), (0, 0, 1), (0, 0, 0))
    max_draft_tokens: int | None = None
    drafters: tuple = ()
    prompt: tuple | None = None
    bigram: tuple | None = None
    max_ngram: int = 4


@dataclasses.dataclass
class _Plan:
    schedule: object
    levels: tuple      # drafter laws, level 1 first
    prompt: np.ndarray
    bigram: np.ndarray


def _plan(t: Tables, setup: CascadeSetup) -> _Plan:
    from ssd_jax.draft.cascade_schedule import build_schedule

    if not isinstance(setup, CascadeSetup):
        raise InputError(f"setup must be an ssd_jax.testing.CascadeSetup, got {type(setup).__name__}")
    k_matrix = setup.k_matrix
    if isinstance(k_matrix, (str, bytes)) or not hasattr(k_matrix, "__len__") or not len(k_matrix) \
            or not hasattr(k_matrix[0], "__len__"):
        raise InputError(f"k_matrix must be a nested list of integers, got {k_matrix!r}")
    num_drafters = len(k_matrix[0]) - 2
    if num_drafters < 0:
        raise InputError(f"k_matrix rows need at least 2 columns (target, Max-Gram), got {k_matrix!r}")
    schedule = build_schedule(k_matrix, num_drafters, setup.max_draft_tokens, greedy=False)
    if len(setup.drafters) != max(num_drafters - 1, 0):
        raise InputError(f"k_matrix names {num_drafters} drafter(s): drafter 1's law is tables.Q and drafters "
                         f"needs the laws of drafters 2..{num_drafters}, got {len(setup.drafters)}")
    levels = (t.Q,) + tuple(Tables(t.P, q).Q for q in setup.drafters)
    if t.n < schedule.width:
        raise InputError(f"k_matrix {[list(r) for r in schedule.k_matrix]} drafts up to W_0={schedule.width} "
                         f"tokens: the tables need depth n >= {schedule.width}, got n={t.n}")
    prompt = np.array([0, 1, 0, 2, 1]) % t.V if setup.prompt is None else np.asarray(setup.prompt)
    bigram = (np.arange(t.V) + 1) % t.V if setup.bigram is None else np.asarray(setup.bigram)
    for name, value in (("prompt", prompt), ("bigram", bigram)):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer) or value.size < 1 \
                or value.min() < 0 or value.max() >= t.V:
            raise InputError(f"{name} must be token ids in [0, V={t.V}) [>= 1], got {value.tolist()}")
    if bigram.shape[0] != t.V:
        raise InputError(f"bigram must have V={t.V} entries, got {bigram.shape[0]}")
    return _Plan(schedule, levels, prompt.astype(np.int32), bigram.astype(np.int32))


# ------------------------------------------------------------------------------------- exact law


@dataclasses.dataclass
class _Worlds:
    """Every branch of the step so far: text int64 [M, W_0 + 1] (the step's tokens), length
    int64 [M], laws float64 [M, W_0, V] (each token's recorded law), prob float64 [M]."""

    text: np.ndarray
    length: np.ndarray
    laws: np.ndarray
    prob: np.ndarray

    def take(self, index) -> "_Worlds":
        return _Worlds(self.text[index], self.length[index], self.laws[index], self.prob[index])


def _maxgram(plan: _Plan, worlds: _Worlds, count: int, max_ngram: int) -> _Worlds:
    from ssd_jax.draft.maxgram import maxgram_draft

    m, V = worlds.text.shape[0], worlds.laws.shape[-1]
    prompt = np.broadcast_to(plan.prompt, (m, plan.prompt.shape[0]))
    context = np.concatenate([prompt, worlds.text], axis=1).astype(np.int32)
    tokens = np.asarray(maxgram_draft(context, (plan.prompt.shape[0] + worlds.length).astype(np.int32),
                                      plan.bigram, num_tokens=count, max_ngram=max_ngram))
    text, laws = worlds.text.copy(), worlds.laws.copy()
    ar = np.arange(m)
    for i in range(count):
        text[ar, worlds.length + i] = tokens[:, i]
        laws[ar, worlds.length + i] = np.eye(V)[tokens[:, i]]
    return _Worlds(text, worlds.length + count, laws, worlds.prob)


def _review(plan: _Plan, t: Tables, rnd, start: np.ndarray, worlds: _Worlds):
    width, W0 = rnd.block_width, worlds.laws.shape[1]
    table = plan.levels[rnd.level - 1]
    m, V = worlds.text.shape[0], t.V
    ar = np.arange(m)
    valid = worlds.length - start
    q = np.stack([rows_at(table, worlds.text, np.minimum(start + j, t.n - 1)) for j in range(width + 1)], axis=1)
    if width == 0:
        stop, next_law = np.ones((m, 1)), q[:, :1] / q[:, :1].sum(-1, keepdims=True)
    else:
        slots = np.minimum(start[:, None] + np.arange(width)[None, :], W0 - 1)
        block = worlds.text[ar[:, None], slots].astype(np.int32)
        q_below = worlds.laws[ar[:, None], slots]
        stop, next_law = tokenwise_rule(block, q_below, q, valid.astype(np.int32))
    pieces, origin = [], []
    for a in range(width + 1):
        for y in range(V):
            w = worlds.prob * stop[:, a] * next_law[:, a, y]
            sel = np.flatnonzero(w > 0)
            if not sel.size:
                continue
            branch = worlds.take(sel)
            text, laws = branch.text.copy(), branch.laws.copy()
            at = start[sel] + a
            text[np.arange(sel.size), at] = y
            written = start[sel, None] + np.arange(width + 1)[None, :]
            keep = written < W0
            laws[np.nonzero(keep)[0], written[keep]] = q[sel][keep]
            pieces.append(_Worlds(text, at + 1, laws, w[sel]))
            origin.append(sel)
    merged = _Worlds(*(np.concatenate([getattr(p, f.name) for p in pieces]) for f in dataclasses.fields(_Worlds)))
    if merged.prob.shape[0] > MAX_WORLDS:
        raise InputError(f"the cascade branches into {merged.prob.shape[0]} worlds; at most {MAX_WORLDS}")
    return merged, np.concatenate(origin)


def _walk(plan: _Plan, t: Tables, ops, worlds: _Worlds, max_ngram: int):
    from ssd_jax.draft.cascade_schedule import MaxGramDraw

    origin = np.arange(worlds.prob.shape[0])
    for op in ops:
        if isinstance(op, MaxGramDraw):
            worlds = _maxgram(plan, worlds, op.count, max_ngram)
            continue
        start = worlds.length.copy()
        worlds, inner = _walk(plan, t, op.block, worlds, max_ngram)
        worlds, last = _review(plan, t, op, start[inner], worlds)
        origin = origin[inner[last]]
    return worlds, origin


def cascade_law(t: Tables, setup: CascadeSetup | None = None) -> np.ndarray:
    """Exact law of one cascade step at temperature > 0 (module docstring), float64 (V,)*(n+1)."""
    setup = CascadeSetup() if setup is None else setup
    check_enumerable(t)
    plan = _plan(t, setup)
    W0, V = plan.schedule.width, t.V
    worlds = _Worlds(np.zeros((1, W0 + 1), np.int64), np.zeros(1, np.int64), np.zeros((1, W0, V)), np.ones(1))
    worlds, _ = _walk(plan, t, plan.schedule.ops, worlds, setup.max_ngram)
    width = plan.schedule.target_width
    valid = np.minimum(worlds.length, width).astype(np.int32)
    draft = worlds.text[:, :width].astype(np.int32)
    p = np.stack([rows_at(t.P, worlds.text, np.full(worlds.prob.shape[0], j)) for j in range(width + 1)], axis=1)
    stop, next_law = tokenwise_rule(draft, worlds.laws[:, :width], p, valid)
    return law_of_stops(t, draft, worlds.prob, stop, next_law)


# ------------------------------------------------------------------------------------- sampled


def cascade_sampler(t: Tables, setup: CascadeSetup | None = None):
    """(arrays, step) for the sampled-law harness: the same walk on the device, each review by
    the library's `sampled_review` with the decode loop's keys (round i: fold_in(key, 2 + i),
    the target's verification: fold_in(key, 0))."""
    from ssd_jax.draft.cascade_review import sampled_review
    from ssd_jax.draft.cascade_schedule import MaxGramDraw
    from ssd_jax.draft.maxgram import maxgram_draft

    setup = CascadeSetup() if setup is None else setup
    plan = _plan(t, setup)
    schedule, V, n = plan.schedule, t.V, t.n
    W0, width = schedule.width, schedule.target_width
    base = plan.prompt.shape[0]
    capacity = base + W0 + 2
    arrays = {"levels": tuple(stack_levels(level) for level in plan.levels), "P": stack_levels(t.P)}
    prompt, bigram = plan.prompt, plan.bigram

    def put(buffer, offset, values):
        b, k = values.shape[:2]
        slots = offset[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
        return buffer.at[jnp.arange(b)[:, None], slots].set(values.astype(buffer.dtype), mode="drop")

    def take(buffer, offset, count):
        slots = jnp.clip(offset[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :], 0, buffer.shape[1] - 1)
        return buffer[jnp.arange(buffer.shape[0])[:, None], slots]

    def step(key, arrays, rows):
        row_keys = jax.random.split(key, rows)
        context = jnp.zeros((rows, capacity), jnp.int32).at[:, :base].set(jnp.asarray(prompt))
        state = [context, jnp.full((rows,), base, jnp.int32), jnp.zeros((rows, W0, V), jnp.float32)]

        def walk(ops):
            for op in ops:
                context, length, laws = state
                if isinstance(op, MaxGramDraw):
                    tokens = maxgram_draft(context, length, jnp.asarray(bigram), num_tokens=op.count,
                                           max_ngram=setup.max_ngram)
                    state[0] = put(context, length, tokens)
                    state[2] = put(laws, length - base, jax.nn.one_hot(tokens, V, dtype=jnp.float32))
                    state[1] = length + op.count
                    continue
                start = length
                walk(op.block)
                context, length, laws = state
                prefixes = prefix_rows(context[:, base:base + n], V)
                depth = jnp.clip(start[:, None] - base + jnp.arange(op.block_width + 1)[None, :], 0, n - 1)
                q = arrays["levels"][op.level - 1][jnp.take_along_axis(prefixes, depth, axis=1)]
                round_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, 2 + op.index)
                accepted, token = sampled_review(round_keys, take(context, start, op.block_width), length - start,
                                                 take(laws, start - base, op.block_width), q)
                end = start + accepted
                state[0] = context.at[jnp.arange(rows), end].set(token, mode="drop")
                state[1] = end + 1
                state[2] = put(laws, start - base, q)

        walk(schedule.ops)
        context, length, laws = state
        draft = context[:, base:base + width]
        prefixes = prefix_rows(context[:, base:base + width], V)
        p = arrays["P"][prefixes]
        target_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, 0)
        accepted, token = sampled_review(target_keys, draft, jnp.minimum(length - base, width), laws[:, :width], p)
        return emission(draft, accepted, token, n + 1)

    return arrays, step
