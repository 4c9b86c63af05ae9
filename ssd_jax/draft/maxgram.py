"""Max-Gram (MaG), the statistical drafter of Cascade Speculative Drafting: copy what followed the
longest earlier occurrence of the text's suffix, and fill what that leaves open by chaining a
bigram table (most frequent next token per token; see `ssd_jax.draft.bigram`).

`MaxGram` is the drafter as data: a pytree whose one leaf is the bigram table, so it goes into a
cascade's `draft=(model, ..., MaxGram(...))` tuple and through `jax.jit` like a model.
`maxgram_draft` is the one implementation of the proposal, written for the inside of a decode
loop, where XLA:CPU pays a fixed cost per operation: every n-gram order is scored at once (for
each end position e, the length of the match between the text ending at e and the row's suffix,
up to max_ngram, from shifted copies and a running AND); one max over score = (match length,
full continuation available, e) picks the occurrence (longest n, then a full num_tokens
continuation, then the most recent); the bigram chain is unrolled (num_tokens is static and small).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.errors import InputError


def maxgram_draft(context: jax.Array, length: jax.Array, bigram: jax.Array, *, num_tokens: int,
                  max_ngram: int) -> jax.Array:
    """Drafts num_tokens tokens per row without a model.

    context int32 [B, C] (row b valid in [0, length[b])), length int32 [B], bigram int32 [V].
    The row's last max_ngram..1 tokens are matched against earlier text and the continuation is
    copied; each position it cannot fill (no match, or a continuation shorter than num_tokens) is
    bigram[previous token], starting from the last copied token, else the row's last token, else
    (an empty row) token id 0. Returns int32 [B, num_tokens].
    """
    if isinstance(max_ngram, bool) or not isinstance(max_ngram, (int, np.integer)) or max_ngram < 1:
        raise InputError(f"max_ngram must be at least 1, got {max_ngram}")
    context, length, bigram = jnp.asarray(context, jnp.int32), jnp.asarray(length), jnp.asarray(bigram)
    if bigram.ndim != 1 or bigram.shape[0] < 1:
        raise InputError(f"bigram must be a non-empty table int32 [V], got shape {tuple(bigram.shape)}")
    batch, capacity = context.shape
    length = jnp.clip(length.astype(jnp.int32), 0, capacity)
    positions = jnp.arange(capacity, dtype=jnp.int32)
    # The row's suffix, most recent token first: suffix[:, k] = context[length - 1 - k].
    back = length[:, None] - 1 - jnp.arange(max_ngram, dtype=jnp.int32)[None, :]
    suffix = jnp.take_along_axis(context, jnp.maximum(back, 0), axis=1)
    # run[b, e] = how many of the last tokens before and at e equal the suffix (capped at max_ngram,
    # at the row's start and at the suffix's own length). Shifted copies of the context fuse into
    # one elementwise pass; a single gather of all lags measured slower on CPU.
    run = jnp.zeros((batch, capacity), jnp.int32)
    alive = jnp.ones((batch, capacity), bool)
    for k in range(max_ngram):
        shifted = jnp.pad(context, ((0, 0), (k, 0)), constant_values=-1)[:, :capacity]  # context[e - k]
        alive = alive & (shifted == suffix[:, k:k + 1]) & (positions[None, :] >= k) & (back[:, k:k + 1] >= 0)
        run = run + alive.astype(jnp.int32)
    usable = (run > 0) & (positions[None, :] + 1 < length[:, None])
    full = positions[None, :] + num_tokens < length[:, None]
    score = jnp.where(usable, (run * 2 + full.astype(jnp.int32)) * capacity + positions[None, :], -1)
    best = jnp.max(score, axis=1)
    matched = best >= 0
    end = jnp.where(matched, best % capacity, 0)
    count = jnp.where(matched, jnp.minimum(num_tokens, length - 1 - end), 0)
    copied = jnp.take_along_axis(context, jnp.minimum(end[:, None] + 1 + jnp.arange(num_tokens)[None, :],
                                                      capacity - 1), axis=1)
    bigram = bigram.astype(jnp.int32)
    previous = jnp.where(length > 0, suffix[:, 0], 0)
    tokens = []
    for i in range(num_tokens):
        previous = jnp.where(i < count, copied[:, i], bigram[previous])
        tokens.append(previous)
    return jnp.stack(tokens, axis=1)


@struct.dataclass
class MaxGram:
    """The Max-Gram drafter: bigram int32 [V] (a pytree leaf, the target's vocabulary).

    `MaxGram.for_target(target)` gives the shipped table when the target has the embedded
    tokenizer; `MaxGram.for_target(target, table_or_path)` checks a table built with
    `ssd-jax build-bigram`."""

    bigram: jax.Array

    @classmethod
    def for_target(cls, target, bigram=None) -> "MaxGram":
        from ssd_jax.draft.cascade_options import resolve_bigram

        return cls(bigram=jnp.asarray(resolve_bigram(target, bigram)))

    def draft(self, context: jax.Array, length: jax.Array, *, num_tokens: int, max_ngram: int) -> jax.Array:
        """`maxgram_draft` with this table: int32 [B, num_tokens]."""
        return maxgram_draft(context, length, self.bigram, num_tokens=num_tokens, max_ngram=max_ngram)
