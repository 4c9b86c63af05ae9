"""Max-Gram (MaG), the statistical bottom level of Cascade Speculative Drafting: copy what followed
the longest earlier occurrence of the text's suffix, and fill what that leaves open by chaining
a bigram table (most frequent next token per token; see `ssd_jax.draft.bigram`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.draft.ngram import find_continuation, suffix_queries
from ssd_jax.errors import InputError


def maxgram_draft(
    context: jax.Array, length: jax.Array, bigram: jax.Array, *, num_tokens: int, max_ngram: int
) -> jax.Array:
    """Drafts num_tokens tokens per row without a model.

    context int32 [B, C] (row b valid in [0, length[b])), length int32 [B], bigram int32 [V].
    The row's last max_ngram..1 tokens are matched against earlier text (longest n first, see
    `find_continuation`) and the continuation is copied; each position it cannot fill (no match,
    or a continuation shorter than num_tokens) is bigram[previous token], starting from the last
    copied token, else the row's last token, else (an empty row) token id 0.
    Returns int32 [B, num_tokens].
    """
    if max_ngram < 1:
        raise InputError(f"max_ngram must be at least 1, got {max_ngram}")
    context, length, bigram = jnp.asarray(context), jnp.asarray(length), jnp.asarray(bigram)
    if bigram.ndim != 1 or bigram.shape[0] < 1:
        raise InputError(f"bigram must be a non-empty table int32 [V], got shape {tuple(bigram.shape)}")
    query, query_len = suffix_queries(context, length, max_ngram)
    copied, count, _ = find_continuation(
        context, length, query, query_len, n_min=1, n_max=max_ngram, num_tokens=num_tokens
    )
    copied, count = copied[:, 0], count[:, 0]
    capacity = context.shape[1]
    length = jnp.clip(length.astype(jnp.int32), 0, capacity)
    last = jnp.take_along_axis(context.astype(jnp.int32), jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(length > 0, last, 0)
    bigram = bigram.astype(jnp.int32)

    def step(previous, inputs):
        copied_i, i = inputs
        token = jnp.where(i < count, copied_i, bigram[previous])
        return token, token

    steps = jnp.arange(num_tokens, dtype=jnp.int32)
    _, tokens = jax.lax.scan(step, last, (copied.T, steps))
    return tokens.T
