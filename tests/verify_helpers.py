"""Shared machinery of the verifier tests: prefix-dependent random target/draft tables, the exact
law of a verifier's output computed by enumeration in float64, a Monte Carlo harness over many
vmapped keys, a Bernstein bound to compare counts with an exact law, and deliberately broken
verifiers for the power checks.

Conventions. A table set has V tokens and draft length L. `P[d]` has shape (V,)*d + (V,): the
target law after prefix z_1..z_d (d = 0..L); `Q[d]` likewise for the draft (d = 0..L-1). A
verifier step emits a sequence of length m in 1..L+1; it is *extended* to length L+1 with the
target's conditionals, and that extended sequence must have exactly the target's joint law
T(z) = prod_d P[d][z_<d][z_d].
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax import verify
from ssd_jax.verify.result import VerifyResult


# --------------------------------------------------------------------------- tables


@dataclass
class Tables:
    P: list  # P[d]: float64 array of shape (V,)*d + (V,), d = 0..L
    Q: list  # Q[d]: d = 0..L-1

    @property
    def V(self) -> int:
        return self.P[0].shape[-1]

    @property
    def L(self) -> int:
        return len(self.Q)


def _random_row(rng, v, alpha, zero_prob):
    row = rng.dirichlet(np.full(v, alpha))
    if v > 1 and rng.random() < zero_prob:
        keep = rng.integers(v)
        drop = rng.choice([i for i in range(v) if i != keep], size=rng.integers(1, v), replace=False)
        row[drop] = 0.0
        row /= row.sum()
    return row


def random_tables(seed: int, V: int, L: int, alpha: float = 0.8, zero_prob: float = 0.3,
                  special_prob: float = 0.25) -> Tables:
    """Target and draft laws drawn per prefix from a Dirichlet, with zeros in some rows (target
    zeros where the draft has mass and the reverse) and, with probability `special_prob` per
    prefix, a special node: q = p (0/0 residuals, all GBV keys tied), p one-hot, q one-hot, or
    p proportional to q on part of the support (ties in the GBV order)."""
    rng = np.random.default_rng(seed)
    P, Q = [], []
    for d in range(L + 1):
        p_d = np.zeros((V,) * d + (V,))
        q_d = np.zeros((V,) * d + (V,))
        for prefix in itertools.product(range(V), repeat=d):
            p = _random_row(rng, V, alpha, zero_prob)
            q = _random_row(rng, V, alpha, zero_prob)
            if rng.random() < special_prob:
                kind = rng.integers(4)
                if kind == 0:
                    q = p.copy()
                elif kind == 1:
                    p = np.eye(V)[rng.integers(V)]
                elif kind == 2:
                    q = np.eye(V)[rng.integers(V)]
                else:
                    q = p.copy()
                    q[0] *= 3.0
                    q /= q.sum()
            p_d[prefix] = p
            q_d[prefix] = q
        P.append(p_d)
        if d < L:
            Q.append(q_d)
    return Tables(P, Q)


def iid_tables(p, q, L: int) -> Tables:
    """The same target row p and draft row q after every prefix."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    V = p.shape[0]
    P = [np.broadcast_to(p, (V,) * d + (V,)).copy() for d in range(L + 1)]
    Q = [np.broadcast_to(q, (V,) * d + (V,)).copy() for d in range(L)]
    return Tables(P, Q)


# --------------------------------------------------------------------------- exact laws


def target_law(t: Tables) -> np.ndarray:
    """T as an array of shape (V,)*(L+1)."""
    law = t.P[0]
    for d in range(1, t.L + 1):
        law = law[..., None] * t.P[d]
    return law


def extend(emitted: list, t: Tables) -> np.ndarray:
    """emitted[m-1]: array (V,)*m, probability of emitting exactly that sequence of length m.
    Returns the law of the sequence extended to length L+1 with the target's conditionals."""
    law = emitted[0]
    for m in range(1, t.L + 1):
        law = law[..., None] * t.P[m] + emitted[m]
    return law


def tv(a, b) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def _rows(t: Tables, seqs: np.ndarray, table: list, depth: int) -> np.ndarray:
    """table[depth][seq[:depth]] for each sequence in seqs [..., >=depth] -> [..., V]."""
    rows = table[depth][tuple(seqs[..., j] for j in range(depth))]
    return np.broadcast_to(rows, seqs.shape[:-1] + rows.shape[-1:])


def single_path_inputs(t: Tables):
    """Every draft path, its draft probability and verifier inputs (float64 numpy).
    Returns drafts [N, L], prob [N], q [N, L, V], p [N, L+1, V]."""
    drafts = np.array(list(itertools.product(range(t.V), repeat=t.L)), dtype=np.int32)
    q = np.stack([_rows(t, drafts, t.Q, d) for d in range(t.L)], axis=1)
    p = np.stack([_rows(t, drafts, t.P, d) for d in range(t.L + 1)], axis=1)
    prob = np.prod(np.take_along_axis(q, drafts[..., None], axis=-1)[..., 0], axis=1)
    return drafts, prob, q, p


def multi_path_inputs(t: Tables, K: int):
    """Every K-tuple of i.i.d. draft paths. Returns paths [N, K, L], prob [N], q [N, K, L, V],
    p [N, K, L+1, V]."""
    drafts, prob1, q1, p1 = single_path_inputs(t)
    n1 = drafts.shape[0]
    combos = np.array(list(itertools.product(range(n1), repeat=K)), dtype=np.int64)   # [N, K]
    return drafts[combos], np.prod(prob1[combos], axis=1), q1[combos], p1[combos]


def _normalize_or(weights, fallback):
    total = weights.sum(-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    fb = fallback / fallback.sum(-1, keepdims=True)
    return np.where(total > 0, weights / safe, fb)


def _emit(emitted: list, seqs: np.ndarray, m: np.ndarray, y_law: np.ndarray, V: int) -> None:
    """Add mass y_law[i, y] to the sequence seqs[i, :m[i]] + [y] for every row i."""
    for length in np.unique(m):
        rows = m == length
        idx = np.zeros(rows.sum(), dtype=np.int64)
        for j in range(length):
            idx = idx * V + seqs[rows, j]
        flat = emitted[length].reshape(-1, V)
        np.add.at(flat, idx, y_law[rows])


def _empty_emissions(t: Tables) -> list:
    return [np.zeros((t.V,) * m) for m in range(1, t.L + 2)]


def law_from_stop_tables(t: Tables, drafts, prob, stop_prob, residual, fallback) -> np.ndarray:
    """Extended law for a single-path verifier whose output given the draft is: n accepted with
    probability stop_prob[:, n], next token ~ normalise(residual[:, n]) (fallback[:, n] if 0)."""
    emitted = _empty_emissions(t)
    y_law = _normalize_or(residual, fallback)                     # [N, L+1, V]
    for n in range(t.L + 1):
        w = (prob * stop_prob[:, n])[:, None] * y_law[:, n]
        _emit(emitted, drafts, np.full(len(drafts), n), w, t.V)
    return extend(emitted, t)


def tokenwise_stop_prob(accept) -> np.ndarray:
    """P(n accepted) [N, L+1] from the per-position acceptance probabilities [N, L]."""
    n_rows, L = accept.shape
    keep = np.concatenate([np.ones((n_rows, 1)), np.cumprod(accept, axis=1)], axis=1)
    stop = np.concatenate([1 - accept, np.ones((n_rows, 1))], axis=1)
    return keep * stop


def block_stop_prob(h) -> np.ndarray:
    """P(tau = i) [N, L+1] = h_i prod_{j>i} (1 - h_j), with h_0 = 1 as the sampler uses."""
    h = np.array(h, dtype=np.float64)
    h[:, 0] = 1.0
    later = np.concatenate([np.cumprod((1 - h)[:, ::-1], axis=1)[:, ::-1][:, 1:],
                            np.ones((h.shape[0], 1))], axis=1)
    return h * later


def x64(fn, *args):
    """Call fn with float64 jax arrays (x64 enabled); return numpy float64/int results."""
    with jax.enable_x64(True):
        out = fn(*[jnp.asarray(a) for a in args])
        return jax.tree_util.tree_map(np.asarray, out)


def exact_law_tokenwise(t: Tables) -> np.ndarray:
    drafts, prob, q, p = single_path_inputs(t)
    accept, residual = x64(verify.tokenwise_tables, drafts, q, p)
    return law_from_stop_tables(t, drafts, prob, tokenwise_stop_prob(accept), residual, p)


def exact_law_block(t: Tables) -> np.ndarray:
    drafts, prob, q, p = single_path_inputs(t)
    h, residual = x64(verify.block_tables, drafts, q, p)
    return law_from_stop_tables(t, drafts, prob, block_stop_prob(h), residual, p)


def exact_law_broken_argmax(t: Tables) -> np.ndarray:
    """Argmax acceptance at temperature > 0: keep X_i while it equals argmax p_{i-1}, then sample
    the next token from p (a bug public engines have shipped)."""
    drafts, prob, q, p = single_path_inputs(t)
    match = drafts == np.argmax(p[:, :-1], axis=-1)
    accept = match.astype(np.float64)
    return law_from_stop_tables(t, drafts, prob, tokenwise_stop_prob(accept), p, p)


def expected_accepted(stop_prob, prob) -> float:
    n = np.arange(stop_prob.shape[1])
    return float(np.sum(prob[:, None] * stop_prob * n))


def exact_law_gbv(t: Tables, K: int, skew: bool = True) -> np.ndarray:
    """Exact law of gbv; skew=False is the broken variant that verifies X* with q instead of q~."""
    paths, prob, q, p = multi_path_inputs(t, K)
    k_star, x_star, q_tilde, p_star = x64(verify.skewed_draft, paths, q, p)
    q_used = q_tilde if skew else q[np.arange(len(k_star)), k_star]
    h, residual = x64(verify.block_tables, x_star, q_used, p_star)
    return law_from_stop_tables(t, x_star, prob, block_stop_prob(h), residual, p_star)


def exact_law_walk(t: Tables, K: int, node_rule) -> np.ndarray:
    """Exact law of a tree-walk verifier (specinfer, spectr) by enumerating every K-tuple of
    paths and, per tuple, every branch of the walk; node_rule is the library's node function,
    evaluated in float64. Mass at depth d sits on the lowest-index path with the accepted prefix."""
    paths, prob, q, p = multi_path_inputs(t, K)
    n_rows = len(prob)
    emitted = _empty_emissions(t)
    rule = jax.jit(jax.vmap(node_rule))
    mass = np.zeros((n_rows, K))
    mass[:, 0] = prob
    ar = np.arange(n_rows)
    for d in range(t.L):
        new_mass = np.zeros_like(mass)
        for r in range(K):
            live = mass[:, r] > 0
            if not live.any():
                continue
            alive = np.all(paths[:, :, :d] == paths[:, r:r + 1, :d], axis=-1)        # [N, K]
            accept, residual = x64(rule, p[:, r, d], q[:, r, d], paths[:, :, d], alive)
            rejected_before = np.concatenate(
                [np.ones((n_rows, 1)), np.cumprod(1 - accept, axis=1)[:, :-1]], axis=1)
            choose = accept * rejected_before                                       # [N, K]
            stop = np.prod(1 - accept, axis=1)
            y_law = _normalize_or(residual, p[:, r, d])
            w = (mass[:, r] * stop)[:, None] * y_law
            _emit(emitted, paths[:, r][live], np.full(live.sum(), d), w[live], t.V)
            for j in range(K):
                nxt_alive = alive & (paths[:, :, d] == paths[:, j:j + 1, d])
                rep = np.argmax(nxt_alive, axis=1)
                np.add.at(new_mass, (ar, rep), mass[:, r] * choose[:, j])
        mass = new_mass
    for r in range(K):
        y_law = _normalize_or(p[:, r, t.L], p[:, r, t.L])
        _emit(emitted, paths[:, r], np.full(n_rows, t.L), mass[:, r, None] * y_law, t.V)
    return extend(emitted, t)


# --------------------------------------------------------------------------- Monte Carlo


def _flat_tables(t: Tables):
    P = [jnp.asarray(t.P[d].reshape(-1, t.V), jnp.float32) for d in range(t.L + 1)]
    Q = [jnp.asarray(t.Q[d].reshape(-1, t.V), jnp.float32) for d in range(t.L)]
    return P, Q


def _log(x):
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1)), -jnp.inf)


def mc_counts(t: Tables, verifier, K: int | None, n_keys: int, rows: int, seed: int) -> np.ndarray:
    """Counts of the extended emitted sequence (flat index over V^(L+1)) over n_keys * rows
    independent speculative steps. Each step samples K i.i.d. draft paths from the draft tables
    (one path and a single-path verifier when K is None), gathers q and p rows, verifies, and
    extends the emission with target samples. One jit, vmapped over keys."""
    tables = _flat_tables(t)
    V, L = t.V, t.L
    k_paths = 1 if K is None else K

    def one(key, tables):
        P, Q = tables
        k_draft, k_verify, k_ext = jax.random.split(key, 3)
        draft_keys = jax.random.split(k_draft, L)
        idx = jnp.zeros((rows, k_paths), jnp.int32)
        toks, q_rows, p_rows = [], [], []
        for d in range(L):
            q_d, p_d = Q[d][idx], P[d][idx]
            tok = jax.random.categorical(draft_keys[d], _log(q_d)).astype(jnp.int32)
            toks.append(tok)
            q_rows.append(q_d)
            p_rows.append(p_d)
            idx = idx * V + tok
        p_rows.append(P[L][idx])
        paths = jnp.stack(toks, axis=-1)                  # [rows, K, L]
        q_in = jnp.stack(q_rows, axis=-2)                 # [rows, K, L, V]
        p_in = jnp.stack(p_rows, axis=-2)                 # [rows, K, L+1, V]
        if K is None:
            res = verifier(k_verify, paths[:, 0], q_in[:, 0], p_in[:, 0])
        else:
            res = verifier(k_verify, paths, q_in, p_in)
        chosen = jnp.take_along_axis(paths, res.path_index[:, None, None], axis=1)[:, 0]
        ext_keys = jax.random.split(k_ext, L + 1)
        flat = jnp.zeros((rows,), jnp.int32)
        for j in range(L + 1):
            drawn = jax.random.categorical(ext_keys[j], _log(P[j][flat])).astype(jnp.int32)
            from_path = chosen[:, j] if j < L else drawn
            tok = jnp.where(j < res.num_accepted, from_path,
                            jnp.where(j == res.num_accepted, res.next_token, drawn))
            flat = flat * V + tok
        return jnp.bincount(flat, length=V ** (L + 1)), jnp.sum(res.num_accepted)

    keys = jax.random.split(jax.random.PRNGKey(seed), n_keys)
    # Tables are arguments, not closed-over constants: XLA would constant-fold the gathers.
    counts, accepted = jax.jit(jax.vmap(one, in_axes=(0, None)))(keys, tables)
    return np.asarray(counts).sum(0), float(np.asarray(accepted).sum()) / (n_keys * rows)


def bernstein_check(counts, law, delta: float = 1e-6):
    """Do the counts fit the exact law? For each outcome j, Bernstein's inequality for the
    binomial count c_j with mean N pi_j and variance N pi_j (1 - pi_j) gives
    P(|c_j - N pi_j| >= t_j) <= 2 exp(-t_j^2 / (2 (N pi_j (1 - pi_j) + t_j / 3))).
    With t_j solving that bound = delta / M for each of the M outcomes, the union bound makes
    the probability that a correct verifier fails this check at most delta (1e-6), with no
    normal approximation. Returns (passed, worst |c_j - N pi_j| / t_j)."""
    counts = np.asarray(counts, np.float64).ravel()
    law = np.asarray(law, np.float64).ravel()
    n = counts.sum()
    log_term = math.log(2 * law.size / delta)
    var = n * law * (1 - law)
    thresh = log_term / 3 + np.sqrt((log_term / 3) ** 2 + 2 * var * log_term)
    ratio = np.abs(counts - n * law) / thresh
    return bool(np.all(ratio <= 1)), float(ratio.max())


# --------------------------------------------------------------------------- broken verifiers


def broken_argmax_tokenwise(key, draft_tokens, q, p) -> VerifyResult:
    """Argmax acceptance at temperature > 0 (inexact on purpose)."""
    del q
    top = jnp.argmax(p, axis=-1)
    match = draft_tokens == top[:, :-1]
    n = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    y = jax.random.categorical(key, _log(p_n)).astype(jnp.int32)
    return VerifyResult(n, y, jnp.zeros_like(n))


def broken_gbv_unskewed(key, paths, q, p) -> VerifyResult:
    """GBV that verifies X* with the draft law q instead of the skewed q~ (inexact on purpose)."""
    k_star, x_star, _, p_star = verify.skewed_draft(paths, q, p)
    q_star = jnp.take_along_axis(q, k_star[:, None, None, None], axis=1)[:, 0]
    res = verify.block(key, x_star, q_star, p_star)
    return VerifyResult(res.num_accepted, res.next_token, k_star)
