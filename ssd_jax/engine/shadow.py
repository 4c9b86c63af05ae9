"""Shadow evidence: what a retrieval draft would have had accepted, read off plain decoding.

A retrieval draft (prompt lookup's chain, LogitSpec's tree) is a point mass, and its exact
verification is a walk of the tree that draws each next token from the target and descends while
the draw is a child (`ssd_jax.verify.point_tree`). Plain decoding draws the same tokens from the
same distributions, so walking the draft made at a plain block's first step with the tokens the
block emitted gives a depth with the law a speculative step's accepted count has (at every
temperature): the adaptive loop learns the acceptance while it decodes plainly, and needs no
probes (speculative steps run only to measure, each costing 2-4 plain steps at batch 8 on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def matched_depth(tree_tokens: jax.Array, valid: jax.Array, parents: np.ndarray, emitted: jax.Array,
                  emitted_len: jax.Array) -> jax.Array:
    """The depth the exact walk of each row's tree reaches on its emitted tokens, int32 [B].

    tree_tokens int32 [B, N] (node 0: the root, the last token before the block), valid bool
    [B, N], parents: int [N] (static, -1 at the root); emitted int32 [B, K]: the tokens drawn after
    the root; emitted_len int32 [B]: how many of them each row drew (a row that finished draws fewer).
    """
    parents = jnp.asarray(parents, jnp.int32)[None, :]
    node = jnp.zeros(tree_tokens.shape[:1], jnp.int32)
    depth = jnp.zeros_like(node)
    alive = jnp.ones(node.shape, bool)
    for d in range(emitted.shape[1]):
        children = valid & (parents == node[:, None]) & (tree_tokens == emitted[:, d, None])
        alive = alive & (d < emitted_len) & jnp.any(children, axis=1)
        node = jnp.where(alive, jnp.argmax(children, axis=1).astype(jnp.int32), node)
        depth = depth + alive.astype(jnp.int32)
    return depth


def shadow_counts(tree_tokens: jax.Array, valid: jax.Array, parents: np.ndarray, emitted: jax.Array,
                  emitted_len: jax.Array, draft_len: int) -> tuple[jax.Array, jax.Array]:
    """(reached, accepted) float32 [B, draft_len]: the per-position counts
    (`ssd_jax.engine.adaptive_loop.position_counts`) of a speculative step whose draft was the
    tree (arguments as `matched_depth`), over the positions whose outcome the block shows, k <=
    emitted_len: a row that drew K tokens and matched all K reached K + 1 with its outcome unknown.
    A row whose tree holds no draft counts as reaching 1 and missing there, as in a real step."""
    depth = matched_depth(tree_tokens, valid, parents, emitted, emitted_len)
    drafted = jnp.sum(valid, axis=1) - 1
    k = jnp.arange(1, draft_len + 1, dtype=jnp.int32)[None, :]
    known = k <= emitted_len[:, None]
    reached = known & ((drafted[:, None] >= k) | (k == 1)) & (depth[:, None] >= k - 1)
    hit = known & (depth[:, None] >= k)
    return reached.astype(jnp.float32), hit.astype(jnp.float32)
