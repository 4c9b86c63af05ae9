"""Cascade Speculative Drafting (Chen et al. 2023, "Cascade Speculative Drafting for Even Faster
LLM Inference"), cached and static-shaped: builds the draft the target verifies in one step.

Levels: the target (0), neural drafters D_1 (largest) .. D_n, and Max-Gram G at the bottom
(`ssd_jax.draft.maxgram`: longest-suffix match in the text, then a bigram table). The
k-matrix (`ssd_jax.draft.cascade_schedule`) says how each reviewer's block is built, left to right, from
the levels below it: k[r][c] review rounds of each neural level c > r, then k[r][G] Max-Gram
tokens over the current prefix (committed text + everything drafted so far this step).

Vertical cascade: a neural drafter never generates autoregressively; a round of D_c builds D_c's
own block (row c, recursively), then D_c reviews it in ONE forward and emits its accepted tokens
plus one correction (or bonus) token (`ssd_jax.draft.cascade_review`). Horizontal cascade: the
earlier positions of a block come from the larger drafters, the later ones from smaller levels.

Static-shape adaptation of the paper: a level contributes EXACTLY k[r][c] rounds (or tokens), not
"rounds until at least k tokens", so every block has a static width W (see the schedule) and a
per-row valid count; blocks are ragged only through valid counts, never through shapes. The
target may verify only the first max_draft_tokens of its block (a static cap: the rounds fill a
block whose valid count varies, the target's forward pays for its static width).

Laws (temperature > 0): a Max-Gram token's law is the point mass on it; the tokens a review of
D_c emits have exactly D_c's law given the prefix (token-wise speculative sampling against the
laws of the block), so their law for the level above is D_c's processed probabilities at their
positions. The target verifies the final draft against these per-position laws, so the cascade
is lossless. At temperature 0 drafters accept leniently (`lenience`); the target's greedy check
keeps the output equal to greedy decoding whatever the drafters do.

Text and caches: one context buffer per row holds the committed text and the tokens drafted so
far this step; `length` is the current prefix. Each drafter's KV cache holds a prefix of that text
(context[:cache length]) and always lacks at least its last token. A review forward runs over the
window context[cache length : start + W_c] (the prefix tokens it has not seen, at most the
round's static `pending`, then the block), takes logits at the W_c + 1 block positions, commits
the unseen prefix plus the accepted tokens, and writes the correction at start + accepted. Every
cache is then cut back to the new prefix (minus its last token): the text after it changed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.draft.maxgram import maxgram_draft
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.cascade_review import greedy_review, sampled_review
from ssd_jax.draft.cascade_schedule import CascadeSchedule, MaxGramDraw, Round
from ssd_jax.draft.ngram import append_tokens
from ssd_jax.draft.vocab import align_logits
from ssd_jax.models.kv_cache import commit, rollback
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities


@struct.dataclass
class ReviewCounters:
    """Per drafter level (index level - 1) and row: rounds int32 [n, B] reviews run; reviewed
    int32 [n, B] valid block tokens reviewed; accepted int32 [n, B] of them kept."""

    rounds: jax.Array
    reviewed: jax.Array
    accepted: jax.Array

    @classmethod
    def zeros(cls, num_drafters: int, batch: int) -> "ReviewCounters":
        z = jnp.zeros((num_drafters, batch), jnp.int32)
        return cls(rounds=z, reviewed=z, accepted=z)


@struct.dataclass
class CascadeState:
    """Drafting state of B rows.

    context int32 [B, C]: committed text, then the tokens drafted this step; length int32 [B]:
    the current prefix; caches: one KVCache per drafter; base int32 [B]: where this step's draft
    starts (the target's block); laws float32 [B, W, V] (temperature > 0, else None): the law of
    each drafted token, indexed by position - base; counters: ReviewCounters.
    """

    context: jax.Array
    length: jax.Array
    caches: tuple
    base: jax.Array
    laws: jax.Array | None
    counters: ReviewCounters


def _put(buffer: jax.Array, offset: jax.Array, values: jax.Array) -> jax.Array:
    """buffer [B, W, ...] with values [B, k, ...] written at rows offset[b] + 0..k-1 (past W dropped)."""
    b, k = values.shape[:2]
    slots = offset[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    slots = jnp.where(slots >= 0, slots, buffer.shape[1])
    return buffer.at[jnp.arange(b)[:, None], slots].set(values.astype(buffer.dtype), mode="drop")


def _take(buffer: jax.Array, offset: jax.Array, width: int) -> jax.Array:
    """buffer[b, offset[b] + 0..width-1] (indices clipped into range): [B, width, ...]."""
    slots = jnp.clip(offset[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], 0, buffer.shape[1] - 1)
    return buffer[jnp.arange(buffer.shape[0])[:, None], slots]


class CascadeDrafter:
    """Builds one step's draft by walking the static schedule at trace time.

    params / configs: per drafter (level 1..n), params as the decode loop runs them; bigram int32
    [V] (unused without Max-Gram ops); vocab: the target's vocabulary size V; lenience: static
    float >= 1 (temperature 0 only).
    """

    def __init__(self, params: tuple, configs: tuple, schedule: CascadeSchedule, sampling: SamplingParams,
                 lenience: float, bigram: jax.Array, max_ngram: int, vocab: int):
        self.params, self.configs, self.schedule = params, configs, schedule
        self.sampling, self.lenience, self.bigram = sampling, lenience, bigram
        self.max_ngram, self.vocab = max_ngram, vocab

    def draft(self, state: CascadeState, keys: jax.Array, active: jax.Array) -> CascadeState:
        """Appends the target's block to every row's context (length grows by 0..W_0).

        keys uint32 [B, 2]: this step's key per row (round i uses fold_in(key, 2 + i));
        active bool [B]: rows whose reviews count in the counters.
        """
        tallies: list = []  # (level index, valid, accepted) per review, added up once at the end
        state = self._build(self.schedule.ops, state, keys, tallies)
        if not tallies:
            return state
        act = active.astype(jnp.int32)
        levels = range(self.schedule.num_drafters)
        zero = jnp.zeros_like(act)

        def total(field: int):
            return jnp.stack([sum((t[field] for t in tallies if t[0] == i), zero) * act for i in levels])

        rounds = jnp.asarray([[sum(t[0] == i for t in tallies)] for i in levels], jnp.int32) * act[None, :]
        c = state.counters
        return state.replace(counters=c.replace(rounds=c.rounds + rounds, reviewed=c.reviewed + total(1),
                                                accepted=c.accepted + total(2)))

    def _build(self, ops, state: CascadeState, keys, tallies: list) -> CascadeState:
        for op in ops:
            if isinstance(op, MaxGramDraw):
                state = self._maxgram(op.count, state)
            else:
                state = self._round(op, state, keys, tallies)
        return state

    def _maxgram(self, count: int, state: CascadeState) -> CascadeState:
        b = state.length.shape[0]
        tokens = maxgram_draft(state.context, state.length, self.bigram, num_tokens=count, max_ngram=self.max_ngram)
        offset = state.length - state.base
        context, length = append_tokens(state.context, state.length, tokens, jnp.full((b,), count, jnp.int32))
        laws = state.laws
        if laws is not None:
            laws = _put(laws, offset, jax.nn.one_hot(tokens, self.vocab, dtype=laws.dtype))
        return state.replace(context=context, length=length, laws=laws)

    def _round(self, rnd: Round, state: CascadeState, keys, tallies: list) -> CascadeState:
        start = state.length
        state = self._build(rnd.block, state, keys, tallies)
        return self._review(rnd, start, state, keys, tallies)

    def _review(self, rnd: Round, start: jax.Array, state: CascadeState, keys, tallies: list) -> CascadeState:
        level, width = rnd.level, rnd.block_width
        i = level - 1
        context, capacity = state.context, state.context.shape[1]
        rows = jnp.arange(context.shape[0])
        cache = state.caches[i]
        seen = cache.lengths
        # One forward over [unseen prefix tokens, block]: positions seen .. seen + pending + W - 1.
        positions = seen[:, None] + jnp.arange(rnd.pending + width, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(context, jnp.clip(positions, 0, capacity - 1), axis=1)
        logit_rows = (start - 1 - seen)[:, None] + jnp.arange(width + 1, dtype=jnp.int32)[None, :]
        logits, cache = forward_cached(self.params[i], self.configs[i], tokens, positions, cache,
                                       logit_indices=logit_rows)
        logits = align_logits(logits, self.vocab)
        block = _take(context, start, width)
        valid = state.length - start
        laws = state.laws
        if self.sampling.by_argmax:
            reviewed = start[:, None] + jnp.arange(width + 1, dtype=jnp.int32)[None, :]  # the laws' positions
            accepted, token = greedy_review(decision_logits(logits, keys, reviewed, self.sampling), block, valid,
                                            self.lenience)
        else:
            q = probabilities(logits, self.sampling)
            round_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 2 + rnd.index)
            accepted, token = sampled_review(round_keys, block, valid, _take(laws, start - state.base, width), q)
            laws = _put(laws, start - state.base, q)  # the emitted tokens now have the reviewer's law
        cache = commit(cache, start - seen + accepted)
        end = start + accepted  # the correction's position; the new prefix is context[:end + 1]
        # Levels below the reviewer may have seen block tokens past the accepted ones; the levels
        # above it have seen nothing past `start`.
        caches = tuple(cache if j == i else rollback(c, end) if j > i else c for j, c in enumerate(state.caches))
        context = context.at[rows, jnp.where(end < capacity, end, capacity)].set(token, mode="drop")
        tallies.append((i, valid, accepted))
        return state.replace(context=context, length=end + 1, caches=caches, laws=laws)
