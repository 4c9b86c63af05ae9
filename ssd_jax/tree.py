"""K draft paths from one root -> a static token tree the target scores in one forward.

Node 0 is the root (the last emitted token, not yet in the caches); node 1 + k*L + i holds token i
of path k. Paths that share a prefix share nodes: every (k, i) maps to its canonical node, the one
of the lowest path index with the same prefix, and the tree's parent pointers and ancestor mask
run through canonical nodes only. Non-canonical nodes stay in the static-shaped tree (N = 1 + K*L)
as exact duplicates: scoring them is redundant but harmless, and their rows are never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TokenTree:
    """A batch of token trees over N = 1 + K*L nodes.

    tokens int32 [B, N]; parents int32 [B, N] (-1 at the root); depth int32 [B, N];
    mask bool [B, N, N] (mask[b, i, j]: node j is node i or an ancestor of it);
    canonical int32 [B, K, L]: the node holding token i of path k (first path with that prefix).
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    mask: jax.Array
    canonical: jax.Array


def _canonical_nodes(paths: jax.Array) -> jax.Array:
    """paths int32 [K, L] -> int32 [K, L] node index of the first path sharing each prefix."""
    k, length = paths.shape
    same_token = paths[:, None, :] == paths[None, :, :]  # [K, K', L]
    same_prefix = jnp.cumprod(same_token.astype(jnp.int32), axis=-1).astype(bool)
    first = jnp.argmax(same_prefix, axis=1)  # lowest k' (k' = k always matches)
    return 1 + first * length + jnp.arange(length)[None, :]


def _tree_row(root: jax.Array, paths: jax.Array) -> TokenTree:
    k, length = paths.shape
    n = 1 + k * length
    canonical = _canonical_nodes(paths)
    tokens = jnp.concatenate([root[None], paths.reshape(-1)])
    parent_of = jnp.concatenate([jnp.zeros((k, 1), jnp.int32), canonical[:, :-1]], axis=1)
    parents = jnp.concatenate([jnp.array([-1], jnp.int32), parent_of.reshape(-1).astype(jnp.int32)])
    depth = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.tile(jnp.arange(1, length + 1, dtype=jnp.int32), k)])

    # Ancestors-or-self of (k, i) are the root and canonical[k, 0..i].
    on_path = jax.lax.cummax(jax.nn.one_hot(canonical, n, dtype=jnp.int32), axis=1).astype(bool)  # [K, L, N]
    root_row = jax.nn.one_hot(0, n, dtype=bool)
    mask = jnp.concatenate([root_row[None], on_path.reshape(k * length, n) | root_row[None]], axis=0)
    return TokenTree(tokens=tokens.astype(jnp.int32), parents=parents, depth=depth, mask=mask,
                     canonical=canonical.astype(jnp.int32))


def build_tree(root: jax.Array, paths: jax.Array) -> TokenTree:
    """root int32 [B] (last emitted token), paths int32 [B, K, L] -> TokenTree over 1 + K*L nodes."""
    return jax.vmap(_tree_row)(root.astype(jnp.int32), paths.astype(jnp.int32))


def path_nodes(tree: TokenTree, path_index: jax.Array) -> jax.Array:
    """Nodes of the root and of path path_index[b] (int32 [B]): int32 [B, 1 + L], for compaction."""
    rows = jnp.arange(tree.canonical.shape[0])
    chosen = tree.canonical[rows, path_index]
    return jnp.concatenate([jnp.zeros_like(chosen[:, :1]), chosen], axis=1)


def gather_path_rows(node_rows: jax.Array, tree: TokenTree) -> jax.Array:
    """Per-node rows [B, N, ...] -> per-path rows [B, K, L+1, ...]: row i of path k is the node
    reached after i tokens of path k (i = 0: the root)."""
    b, k, _ = tree.canonical.shape
    nodes = jnp.concatenate([jnp.zeros((b, k, 1), jnp.int32), tree.canonical], axis=2)  # [B, K, L+1]
    return jax.vmap(lambda rows, idx: rows[idx])(node_rows, nodes)
