"""LogitSpec drafting: the last target logit predicts the next token (the root) and, through its
other top-ranked tokens, guesses the token after it; each guess t becomes a branch
[t] + the continuation retrieved for the text ending in (root, t), beside the root's own
retrieved continuation. Branches share only the root (layout: `tree_layout.logitspec_layout`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.draft.ngram import find_continuation, suffix_queries
from ssd_jax.draft.tree_layout import TreeLayout


def _candidates(last_logits: jax.Array, root: jax.Array, first_retrieved: jax.Array, has_first: jax.Array,
                count: int) -> tuple[jax.Array, jax.Array]:
    """The `count` best next-next guesses of each row, best first: the top tokens of the last
    logit without the root and without the root branch's first retrieved token (those are drafted
    already). Returns (tokens int32 [B, count], valid bool [B, count])."""
    top = jax.lax.top_k(last_logits, min(count + 2, last_logits.shape[-1]))[1].astype(jnp.int32)
    keep = (top != root[:, None]) & ~(has_first[:, None] & (top == first_retrieved[:, None]))
    # Stable compaction of the kept tokens to the front.
    slot = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, top.shape[1])
    rows = jnp.arange(top.shape[0])[:, None]
    packed = jnp.zeros_like(top).at[rows, slot].set(top, mode="drop")
    valid = jnp.arange(top.shape[1])[None, :] < jnp.sum(keep, axis=1, keepdims=True)
    return packed[:, :count], valid[:, :count]


def logitspec_tree(context: jax.Array, length: jax.Array, last_logits: jax.Array, layout: TreeLayout, *,
                   max_ngram: int) -> tuple[jax.Array, jax.Array]:
    """Fills a LogitSpec layout for each row.

    context int32 [B, C]: prompt + emitted text; its last valid token is the root. last_logits
    float [B, V]: the target's logits at the root's position (the distribution the root was drawn
    from). Retrieval uses n-grams of n = max_ngram .. 1. Returns (tokens int32 [B, N], valid
    bool [B, N]) over the layout's N nodes.
    """
    b = context.shape[0]
    root_len, rank_lens = layout.lengths[0], layout.lengths[1:]
    root = jnp.take_along_axis(context, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]

    query, query_len = suffix_queries(context, length, max_ngram)
    root_branch, root_count, _ = find_continuation(context, length, query, query_len, n_min=1, n_max=max_ngram,
                                                   num_tokens=root_len)
    root_branch, root_count = root_branch[:, 0], root_count[:, 0]
    tokens = [root[:, None], root_branch]
    valid = [jnp.ones((b, 1), bool), jnp.arange(root_len)[None, :] < root_count[:, None]]
    if rank_lens:
        guesses, guess_ok = _candidates(last_logits, root, root_branch[:, 0], root_count > 0, len(rank_lens))
        longest = max(rank_lens) - 1
        if longest > 0:
            # Query for rank r: the last max_ngram - 1 context tokens (ending in the root), then t_r.
            prefix, prefix_len = suffix_queries(context, length, max_ngram - 1) if max_ngram > 1 else (
                jnp.zeros((b, 1, 0), jnp.int32), jnp.zeros((b, 1), jnp.int32))
            rank_query = jnp.concatenate(
                [jnp.broadcast_to(prefix, (b, len(rank_lens), max_ngram - 1)), guesses[:, :, None]], axis=2)
            rank_query_len = jnp.broadcast_to(prefix_len + 1, (b, len(rank_lens)))
            follow, follow_count, _ = find_continuation(context, length, rank_query, rank_query_len, n_min=1,
                                                        n_max=max_ngram, num_tokens=longest)
        for r, rank_len in enumerate(rank_lens):
            tokens.append(guesses[:, r, None])
            valid.append(guess_ok[:, r, None])
            if rank_len > 1:
                tokens.append(follow[:, r, : rank_len - 1])
                valid.append(guess_ok[:, r, None] & (jnp.arange(rank_len - 1)[None, :] < follow_count[:, r, None]))
    return jnp.concatenate(tokens, axis=1).astype(jnp.int32), jnp.concatenate(valid, axis=1)
