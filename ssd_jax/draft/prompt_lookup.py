"""Prompt lookup (PLD): the draft is what followed the last earlier occurrence of the text's
final n-gram (n from n_max down to n_min), copied from the prompt and the generated text."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.draft.ngram import find_continuation, suffix_queries


def prompt_lookup_tree(context: jax.Array, length: jax.Array, *, num_draft_tokens: int, n_min: int,
                       n_max: int) -> tuple[jax.Array, jax.Array]:
    """A linear draft tree (`tree_layout.linear_layout(L)`) per row.

    context int32 [B, C]: prompt + emitted text, whose last valid token (length - 1) is the root.
    Returns (tokens int32 [B, 1+L]: the root then the retrieved continuation; valid bool [B, 1+L]:
    the root and the retrieved tokens, False where the match ran short or nothing matched).
    """
    query, query_len = suffix_queries(context, length, n_max)
    draft, count, _ = find_continuation(context, length, query, query_len, n_min=n_min, n_max=n_max,
                                        num_tokens=num_draft_tokens)
    root = jnp.take_along_axis(context, jnp.maximum(length - 1, 0)[:, None], axis=1)
    valid = jnp.arange(num_draft_tokens)[None, :] < count[:, 0, None]
    tokens = jnp.concatenate([root, draft[:, 0]], axis=1).astype(jnp.int32)
    return tokens, jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], axis=1)
