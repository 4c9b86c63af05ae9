"""Greedy multi-path block verification (GBV; Thomas & Pal 2026).

Tokens at a node c are ordered by key_c(x) = (log p(x|c) - log q(x|c), token id), ascending, with
the unclipped log ratio. Paths compare lexicographically by key at their first difference, and
X* is the greatest of the K i.i.d. draft paths. The law of X* has the conditionals ("skewed
draft"), along c_i = X*_{1:i}:

    F_i^-(x) = sum of q(x'|c_i) over x' before x in the order
    PS(u, l) = sum_{j<K} u^(K-1-j) l^j                      (= (u^K - l^K) / (u - l), stable)
    a(x) = t_i + (1 - t_i) F_i^-(x),   b(x) = (1 - t_i) q(x|c_i),   t_0 = 0
    q~_i(x) = q(x|c_i) PS(a(x) + b(x), a(x)) / PS(1, t_i),   t_{i+1} = a(X*_{i+1}) / (a + b)(X*_{i+1})

(the max of K i.i.d. draws under a total order has CDF F^K; t_i is where the interval of c_i's
subtree starts, relative to its end). Block verification of X* against p with q~ is then exact.
Selection and F use the same integer keys (`order_key`) and the same tie-break (token id): a
mismatch between the two orders is exactly what makes some implementations inexact.
With K = 1, q~ = q and X* is the only path, so gbv returns block's verdict for the same key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.backend import scan_unroll
from ssd_jax.verify._common import as_probs, check_multi, first_true, row_keys, typed_like
from ssd_jax.verify._order import cdf_before, order_key
from ssd_jax.verify._unroll import rows_rolled_on_cpu
from ssd_jax.verify.block import block_row
from ssd_jax.verify.result import VerifyResult


def power_sum(u, lo, k: int):
    """PS(u, lo) = sum_{j=0}^{k-1} u^(k-1-j) lo^j by Horner's rule (k static, >= 1)."""
    acc = jnp.ones_like(u)
    lo_pow = jnp.ones_like(lo)
    for _ in range(k - 1):
        lo_pow = lo_pow * lo
        acc = acc * u + lo_pow
    return acc


def _select_and_skew_row(paths, q, p, *, unrolled: bool = False):
    n_paths, n_draft = paths.shape

    def step(carry, i):
        alive, t = carry
        rep = first_true(alive)
        p_i, q_i = p[rep, i], q[rep, i]
        candidates = paths[:, i]
        if n_paths == 1:
            x_star, q_tilde = candidates[0], q_i
        else:
            keys = order_key(p_i, q_i)
            cand_keys = keys[candidates]
            top = jnp.max(jnp.where(alive, cand_keys, 0))
            x_star = jnp.max(jnp.where(alive & (cand_keys == top), candidates, -1))
            a = t + (1 - t) * cdf_before(keys, q_i)
            b = (1 - t) * q_i
            q_tilde = q_i * power_sum(a + b, a, n_paths) / power_sum(jnp.ones_like(t), t, n_paths)
            den = a[x_star] + b[x_star]
            t = jnp.where(den > 0, a[x_star] / jnp.where(den > 0, den, 1), 0)
        return (alive & (candidates == x_star), t), (x_star, q_tilde, p_i)

    init = typed_like((jnp.ones((n_paths,), bool), jnp.zeros((), p.dtype)), paths, q, p)
    (alive, _), (x_star, q_tilde, p_star) = jax.lax.scan(
        step, init, jnp.arange(n_draft), unroll=scan_unroll(unrolled, n_draft))
    k_star = first_true(alive)
    p_star = jnp.concatenate([p_star, p[k_star, n_draft][None]], axis=0)
    return k_star, x_star.astype(jnp.int32), q_tilde, p_star


@jax.jit
def skewed_draft(paths, q, p):
    """GBV's path selection and skewed draft law: the deterministic part of gbv.

    paths: int [B, K, L]; q: [B, K, L, V]; p: [B, K, L+1, V] (float32 or float64).
    Returns (path_index int32 [B]: lowest index of a path equal to X*,
             x_star int32 [B, L], q_tilde [B, L, V]: law of X* given its prefix,
             p_star [B, L+1, V]: target rows along X*)."""
    return rows_rolled_on_cpu(_select_and_skew_row, paths.astype(jnp.int32), q, p)


def _gbv_row(key, paths, q, p, *, unrolled: bool):
    _, x_star, q_tilde, p_star = _select_and_skew_row(paths, q, p, unrolled=unrolled)
    n, y = block_row(key, x_star, q_tilde, p_star)
    in_prefix = jnp.arange(paths.shape[1]) < n
    shares_prefix = jnp.all((paths == x_star) | ~in_prefix, axis=1)
    return n, y, first_true(shares_prefix)


@jax.jit
def _gbv_core(key, paths, q, p):
    return VerifyResult(*rows_rolled_on_cpu(_gbv_row, row_keys(key, paths.shape[0], like=paths), paths, q, p))


def gbv(key, paths, q, p) -> VerifyResult:
    """Greedy multi-path block verification of K i.i.d. draft paths sampled from the same root.

    key: a jax.random key (split per row; with K = 1 the verdict equals `block`'s for the same key).
    paths: int [B, K, L]. q: float [B, K, L, V], the draft law each path token was sampled from.
    p: float [B, K, L+1, V] target laws (rows of paths that share a prefix repeat).
    Computed in float32 (float64 if given float64).
    Returns VerifyResult(num_accepted [B], next_token [B], path_index [B])."""
    paths, q, p = jnp.asarray(paths), jnp.asarray(q), jnp.asarray(p)
    check_multi(paths, q, p)
    q, p = as_probs(q, p)
    return _gbv_core(key, paths.astype(jnp.int32), q, p)
