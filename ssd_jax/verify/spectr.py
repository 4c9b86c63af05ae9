"""SpecTr multi-path verification with the k-sequential draft selection (Sun et al., "SpecTr").

At a node with k alive candidates (i.i.d. draws from q):
    beta(rho) = sum_x min(p(x)/rho, q(x)),   p_acc(rho) = 1 - (1 - beta(rho))^k
    rho* in [1, k] solves p_acc(rho) = rho * beta(rho)
    candidate j (in path order) is accepted with probability min(1, p(x_j) / (rho* q(x_j))),
    independently; the first accepted one is taken;
    none accepted: Y ~ norm((p - min(p/rho*, q) * p_acc/beta)_+).
The output is exact for every rho with p_acc(rho) <= rho beta(rho); bisection keeps that side of
the bracket, so a finite number of steps costs a little acceptance, never exactness."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ssd_jax.verify._common import accept_prob, as_probs, check_multi, positive_part, typed_like
from ssd_jax.verify._tree_walk import walk
from ssd_jax.verify._unroll import rolled_on_cpu
from ssd_jax.verify.result import VerifyResult

BISECTION_STEPS = 24   # bracket width (k - 1) / 2^24: below float32 resolution of rho for k <= 8
SEARCH_POINTS = 15     # the unrolled search's points a round: 16 parts, 4 bisection steps' worth
SEARCH_ROUNDS = BISECTION_STEPS // 4   # the same final bracket as the bisection


def _p_acc(beta, k):
    return 1 - jnp.power(jnp.clip(1 - beta, 0, 1), k)


def spectr_rho(p, q, k, *, unrolled: bool = False):
    """rho* for one node: p, q float [V]; k float scalar (number of candidates, >= 1).
    Returns the upper end of the final search bracket, where p_acc <= rho * beta.

    The bracket [1, k] narrows by bisection, BISECTION_STEPS steps in a `fori_loop`; unrolled,
    SEARCH_ROUNDS rounds each evaluate SEARCH_POINTS evenly spaced points at once and keep the
    part between the last point still too low and the first that is not: the same dyadic points
    as four bisection steps, so the same final bracket, in a quarter of the sequential steps
    (`ssd_jax.verify._unroll`).

    The excess p_acc - rho beta is computed from S = sum (p / rho - q)_+ as
    rho S - (S + 1 - 1 / rho)^k: for laws that sum to 1, 1 - rho beta = rho S and
    1 - beta = S + 1 - 1 / rho, sums of non-negative terms with nothing cancelling, and the excess
    strictly decreases in rho. Computed as 1 - (1 - beta)^k - rho beta, it cancelled to
    rounding noise where p is close to q (rho* = 1 for p = q): the bisection then followed the
    noise and stopped as high as 1.13 at k = 8 (float32), accepting each candidate with
    probability 1 / rho instead of 1; exact still, but 11% fewer acceptances at such a node."""
    p_row, q_row = p[None, :], q[None, :]

    def excess(rho):   # rho [N] -> [N]: > 0 where rho is too low
        inverse = 1 / rho
        surplus = jnp.sum(jnp.maximum(p_row * inverse[:, None] - q_row, 0), axis=-1)   # S
        return rho * surplus - jnp.power(jnp.clip(surplus + (1 - inverse), 0, 1), k)

    lo, hi = typed_like((jnp.ones((), p.dtype), jnp.maximum(k, 1).astype(p.dtype)), p, q, k)
    if not unrolled:
        def body(_, bracket):
            lo, hi = bracket
            mid = (lo + hi) / 2
            too_low = excess(mid[None])[0] > 0
            return jnp.where(too_low, mid, lo), jnp.where(too_low, hi, mid)

        return jax.lax.fori_loop(0, BISECTION_STEPS, body, (lo, hi))[1]
    parts = SEARCH_POINTS + 1
    fractions = jnp.arange(1, parts, dtype=p.dtype) / parts
    for _ in range(SEARCH_ROUNDS):
        points = lo + (hi - lo) * fractions
        too_low = excess(points) > 0
        # points too low form a prefix where excess falls once; counting them keeps that reading
        # and, were it not monotone, still ends on a point that is not too low (exactness)
        low_count = jnp.argmin(jnp.concatenate([too_low, jnp.zeros((1,), bool)]))
        new_lo = jnp.where(low_count > 0, points[jnp.maximum(low_count - 1, 0)], lo)
        hi = jnp.where(low_count < SEARCH_POINTS, points[jnp.minimum(low_count, SEARCH_POINTS - 1)], hi)
        lo = new_lo
    return hi


def spectr_node(p, q, candidates, alive, *, unrolled: bool = False):
    """k-sequential selection at one node (same contract as `specinfer_node`).

    p, q: float [V]; candidates: int32 [K]; alive: bool [K], k = number alive; unrolled: rho*'s
    search without a loop (`spectr_rho`).
    Returns (accept [K], residual [V])."""
    k = jnp.sum(alive).astype(p.dtype)
    rho = spectr_rho(p, q, k, unrolled=unrolled)
    accepted_part = jnp.minimum(p * (1 / rho), q)
    beta = jnp.sum(accepted_part)
    # As beta -> 0, p_acc / beta -> k; the product with accepted_part (= 0 then) stays 0.
    scale = jnp.where(beta > 0, _p_acc(beta, k) / jnp.where(beta > 0, beta, 1), k)
    residual = positive_part(p - accepted_part * scale)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p)
    accept = accept_prob(p[candidates], q[candidates], scale=rho)
    return jnp.where(alive, accept, 0), residual


@jax.jit
def _spectr_core(key, paths, q, p):
    return rolled_on_cpu(functools.partial(walk, spectr_node), key, paths, q, p)


def spectr(key, paths, q, p) -> VerifyResult:
    """SpecTr (k-sequential) verification of K i.i.d. draft paths sampled from the same root.

    key: a jax.random key (split per row). paths: int [B, K, L]. q: float [B, K, L, V].
    p: float [B, K, L+1, V] (rows of paths that share a prefix repeat).
    Computed in float32 (float64 if given float64).
    Returns VerifyResult(num_accepted [B], next_token [B], path_index [B])."""
    paths, q, p = jnp.asarray(paths), jnp.asarray(q), jnp.asarray(p)
    check_multi(paths, q, p)
    q, p = as_probs(q, p)
    return _spectr_core(key, paths.astype(jnp.int32), q, p)
