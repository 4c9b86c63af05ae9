"""The depth-by-depth walk shared by the multi-path verifiers that accept one child per node
(SpecInfer's recursive rejection sampling, SpecTr's k-sequential selection).

At depth i the accepted prefix is a node c of the token tree formed by the K paths. The alive
paths are those whose first i tokens equal c; their i-th tokens are the candidate children, with
multiplicity, in path order. A node rule turns (p(.|c), q(.|c), candidates, alive) into the
probability that each candidate is accepted given that every earlier alive candidate was
rejected, and the law of the next token when all are rejected. The walk accepts the first
candidate whose uniform falls below its probability and descends; when none is accepted, or at
depth L, it stops and draws the next token. Every shape is static: depths after the stop are
still computed and then ignored.

A node's p and q are read from the lowest-index alive path: paths that share a prefix must have
identical rows there (they do when the rows are gathered from the deduplicated tree).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.backend import scan_unroll
from ssd_jax.verify._common import first_true, row_keys, sample_from_weights, typed_like
from ssd_jax.verify.result import VerifyResult

# node_rule(p [V], q [V], candidates int32 [K], alive bool [K], *, unrolled: bool)
#     -> (accept [K], residual [V]); unrolled: its own loops as straight-line code (`_unroll`)
NodeRule = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def walk_row(node_rule: NodeRule, key, paths, q, p, *, unrolled: bool = False):
    """One row: paths int32 [K, L], q [K, L, V], p [K, L+1, V]; unrolled: the depths as
    straight-line code instead of a `lax.scan` (`ssd_jax.verify._unroll`).
    Returns (num_accepted, next_token, path_index), int32 scalars."""
    n_paths, n_draft = paths.shape
    k_accept, k_token = jax.random.split(key)
    u = jax.random.uniform(k_accept, (n_draft, n_paths), dtype=p.dtype)

    def step(carry, i):
        alive, stopped, n, stop_weights = carry
        rep = first_true(alive)
        candidates = paths[:, i]
        accept, residual = node_rule(p[rep, i], q[rep, i], candidates, alive, unrolled=unrolled)
        taken = alive & (u[i] < accept)
        any_taken = jnp.any(taken)
        token = candidates[first_true(taken)]
        descend = ~stopped & any_taken
        stop_here = ~stopped & ~any_taken
        alive = jnp.where(descend, alive & (candidates == token), alive)
        stop_weights = jnp.where(stop_here, residual, stop_weights)
        return (alive, stopped | stop_here, n + descend.astype(jnp.int32), stop_weights), None

    init = typed_like((jnp.ones((n_paths,), bool), jnp.asarray(False), jnp.asarray(0, jnp.int32),
                       jnp.zeros_like(p[0, 0])), paths, q, p, u)
    (alive, stopped, n, stop_weights), _ = jax.lax.scan(step, init, jnp.arange(n_draft),
                                                        unroll=scan_unroll(unrolled, n_draft))
    rep = first_true(alive)
    bonus = p[rep, n_draft]
    y = sample_from_weights(k_token, jnp.where(stopped, stop_weights, bonus), fallback=p[rep, n])
    return n, y, rep


def walk(node_rule: NodeRule, key, paths, q, p, *, unrolled: bool = False) -> VerifyResult:
    """Batched walk: paths int32 [B, K, L], q [B, K, L, V], p [B, K, L+1, V]."""
    row = lambda k, x, qq, pp: walk_row(node_rule, k, x, qq, pp, unrolled=unrolled)
    n, y, k = jax.vmap(row)(row_keys(key, paths.shape[0], like=paths), paths, q, p)
    return VerifyResult(n, y, k)
