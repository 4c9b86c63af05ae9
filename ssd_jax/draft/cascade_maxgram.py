"""Max-Gram for the cascade's inner loop: the same proposal as `ssd_jax.draft.maxgram.maxgram_draft`
in a handful of fused array ops and no nested loop.

A cascade step calls Max-Gram once per review round, inside the decode `while_loop`, where XLA:CPU
pays a fixed cost per operation; `maxgram_draft` spends dozens of operations (one search per
n-gram order, a `lax.scan` over the bigram chain) on a few hundred tokens of context. Here every
order is scored at once: for each end position e, the length of the match between the text
ending at e and the row's suffix (up to max_ngram) comes from one gather and a running AND; one
max over score = (match length, full continuation available, e) picks the same occurrence
(longest n, then a full num_tokens continuation, then the most recent); the bigram chain is
unrolled (num_tokens is static and small). tests/test_cascade.py checks equality with
`maxgram_draft`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def maxgram_tokens(context: jax.Array, length: jax.Array, bigram: jax.Array, *, num_tokens: int,
                   max_ngram: int) -> jax.Array:
    """context int32 [B, C] (row b valid in [0, length[b])), length int32 [B] >= 1, bigram int32
    [V]. Returns int32 [B, num_tokens]: what `maxgram_draft` returns for the same arguments."""
    batch, capacity = context.shape
    length = jnp.clip(length.astype(jnp.int32), 1, capacity)
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
    previous = suffix[:, 0]
    tokens = []
    for i in range(num_tokens):
        previous = jnp.where(i < count, copied[:, i], bigram[previous])
        tokens.append(previous)
    return jnp.stack(tokens, axis=1)
