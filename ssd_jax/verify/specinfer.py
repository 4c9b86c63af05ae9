"""SpecInfer multi-path verification: recursive rejection sampling over K i.i.d. draft paths
(Miao et al., "SpecInfer").

At each node the candidates (next tokens of the alive paths, with multiplicity, in path order) are
tried in turn: x is accepted with probability min(1, p(x)/q(x)); on rejection
p <- norm((p - q)_+) while q stays. Accepted: descend. None accepted: Y ~ the current p.
At depth L: Y ~ p_L. Exact because, given the walk so far, the alive paths' next tokens are
i.i.d. draws from q(.|node)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ssd_jax.backend import scan_unroll
from ssd_jax.verify._common import (accept_prob, as_probs, check_multi, normalize_or, positive_part,
                                    typed_like)
from ssd_jax.verify._tree_walk import walk
from ssd_jax.verify._unroll import rolled_on_cpu
from ssd_jax.verify.result import VerifyResult


def specinfer_node(p, q, candidates, alive, *, unrolled: bool = False):
    """Recursive rejection sampling at one node.

    p, q: float [V] target and draft laws at the node; candidates: int32 [K]; alive: bool [K];
    unrolled: the candidates as straight-line code instead of a `lax.scan` (same values).
    Returns (accept [K]: probability that candidate j is accepted given every earlier alive
    candidate was rejected, 0 for dead ones; residual [V]: law of the next token when all alive
    candidates are rejected)."""

    def body(p_cur, j):
        a = accept_prob(p_cur[candidates[j]], q[candidates[j]])
        p_next = normalize_or(positive_part(p_cur - q), p_cur)
        return jnp.where(alive[j], p_next, p_cur), jnp.where(alive[j], a, 0)

    residual, accept = jax.lax.scan(body, typed_like(p, q, candidates, alive), jnp.arange(candidates.shape[0]),
                                    unroll=scan_unroll(unrolled, candidates.shape[0]))
    return accept, residual


@jax.jit
def _specinfer_core(key, paths, q, p):
    return rolled_on_cpu(functools.partial(walk, specinfer_node), key, paths, q, p)


def specinfer(key, paths, q, p) -> VerifyResult:
    """SpecInfer verification of K i.i.d. draft paths sampled from the same root.

    key: a jax.random key (split per row). paths: int [B, K, L]. q: float [B, K, L, V], the draft
    law each path token was sampled from. p: float [B, K, L+1, V] target laws (rows of paths that
    share a prefix repeat). Computed in float32 (float64 if given float64).
    Returns VerifyResult(num_accepted [B], next_token [B], path_index [B])."""
    paths, q, p = jnp.asarray(paths), jnp.asarray(q), jnp.asarray(p)
    check_multi(paths, q, p)
    q, p = as_probs(q, p)
    return _specinfer_core(key, paths.astype(jnp.int32), q, p)
