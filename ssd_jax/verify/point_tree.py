"""Exact verification of a deterministic draft tree (retrieval drafts: prompt lookup, LogitSpec).

A retrieval draft is a point mass: the drafter proposes tokens without sampling them, so there is
no q to compare against. Walking the tree is then exact rejection sampling: at the current node
draw Y from the target's distribution there; if Y is a (valid) child, descend into it, else emit
Y and stop. Each emitted token is a fresh draw from the target at its prefix, so the output law is
the target's whatever the tree holds. At temperature 0 the draw is the argmax: the walk keeps the
longest branch that follows the target's argmax chain.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backend import scan_unroll
from ssd_jax.verify._common import (argmax_first, first_true, leading_true_count, row_keys, rows_like,
                                    sample_from_weights, typed_like)
from ssd_jax.verify._unroll import rows_rolled_on_cpu


class TreeVerdict(NamedTuple):
    """num_accepted int32 [B]: tree nodes accepted below the root; next_token int32 [B];
    nodes int32 [B, D+1]: the accepted path's node indices, root first (entries past
    num_accepted + 1 are 0 and meaningless)."""

    num_accepted: jax.Array
    next_token: jax.Array
    nodes: jax.Array


def _walk_row(key, tokens, valid, p, parents, max_depth: int, greedy: bool, unrolled: bool = False):
    keys = jax.random.split(key, max_depth + 1)

    def step(carry, d):
        node, stopped, n, nxt = carry
        scores = p[node]
        y = argmax_first(scores) if greedy else sample_from_weights(keys[d], scores, fallback=scores)
        children = (parents == node) & valid & (tokens == y)
        has_child = jnp.any(children)
        descend = ~stopped & has_child
        stop_here = ~stopped & ~has_child
        node = jnp.where(descend, first_true(children), node)
        carry = (node, stopped | stop_here, n + descend.astype(jnp.int32), jnp.where(stop_here, y, nxt))
        return carry, node

    init = typed_like((jnp.asarray(0, jnp.int32), jnp.asarray(False), jnp.asarray(0, jnp.int32),
                       jnp.asarray(0, jnp.int32)), tokens, valid, p, parents, keys)
    # A leaf has no children, so the walk always stops by iteration max_depth (index max_depth).
    (_, _, n, nxt), visited = jax.lax.scan(step, init, jnp.arange(max_depth + 1),
                                              unroll=scan_unroll(unrolled, max_depth + 1))
    nodes = jnp.concatenate([jnp.zeros((1,), jnp.int32), visited[:max_depth]])
    nodes = jnp.where(jnp.arange(max_depth + 1) <= n, nodes, 0)
    return n, nxt, nodes


def point_mass_tree(key, tokens, valid, parents, p, *, greedy: bool) -> TreeVerdict:
    """Verifies a batch of deterministic draft trees.

    key: PRNG key (split into one key per row). tokens int32 [B, N] (node 0 = the root, the last
    emitted token); valid bool [B, N] (invalid nodes are never accepted); parents: int [N]
    (a static layout, -1 at the root, parents before children) or int32 [B, N]; p float32 [B, N, V]: the target's processed
    probabilities after each node (at temperature 0 any scores with the target's argmax).
    greedy: draw the argmax instead of sampling.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, n_nodes = tokens.shape
    parents_arr = np.asarray(parents) if not isinstance(parents, jax.Array) else parents
    parents_b = rows_like(jnp.broadcast_to(jnp.asarray(parents_arr, jnp.int32), (b, n_nodes)), tokens)
    static = isinstance(parents_arr, np.ndarray) and parents_arr.ndim == 1
    max_depth = _max_depth(parents_arr) if static else n_nodes - 1
    row = functools.partial(_walk_row, max_depth=max_depth, greedy=greedy)
    valid = rows_like(jnp.asarray(valid, bool), tokens)
    return TreeVerdict(*rows_rolled_on_cpu(row, row_keys(key, b, like=tokens), tokens, valid, p, parents_b))


def _chain_row(key, tokens, valid, p, greedy: bool):
    """`_walk_row` on a chain (node d's child is node d + 1) with every depth's draw at once: the
    same keys, so the same verdict, without a sequential scan."""
    depth = tokens.shape[0] - 1
    keys = jax.random.split(key, depth + 1)
    if greedy:
        y = argmax_first(p)
    else:
        y = jax.vmap(lambda k, w: sample_from_weights(k, w, fallback=w))(keys, p)
    n = leading_true_count(valid[1:] & (tokens[1:] == y[:-1]))
    nodes = jnp.where(jnp.arange(depth + 1) <= n, jnp.arange(depth + 1, dtype=jnp.int32), 0)
    return n, y[n], nodes


def point_mass_chain(key, tokens, valid, p, *, greedy: bool) -> TreeVerdict:
    """`point_mass_tree` for one chain (node d + 1 under node d: prompt lookup's layout), the
    same verdict from the same key. tokens int32 [B, D+1], valid bool [B, D+1], p float32
    [B, D+1, V]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n, nxt, nodes = jax.vmap(lambda k, t, v, pp: _chain_row(k, t, v, pp, greedy))(
        row_keys(key, tokens.shape[0], like=tokens), tokens, rows_like(jnp.asarray(valid, bool), tokens), p)
    return TreeVerdict(n, nxt, nodes)


def _max_depth(parents: np.ndarray) -> int:
    """Depth of the deepest node of a static layout whose parents precede their children."""
    depth = np.zeros(parents.shape[0], np.int64)
    for node in range(1, parents.shape[0]):
        depth[node] = depth[parents[node]] + 1
    return int(depth.max(initial=0))
