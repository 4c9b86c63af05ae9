"""The building blocks of an exact law: every draft enumerated with its probability, a verifier's
deterministic part evaluated in float64, and the emitted sequences accumulated by length.

Shapes (numpy, float64 unless stated): N enumerated rows; drafts int32 [N, L]; paths int32
[N, K, L]; draft probabilities prob [N]; q [N, L, V] or [N, K, L, V]; p [N, L+1, V] or
[N, K, L+1, V] (row i conditions on the prefix and the first i draft tokens).

A single-path verifier's deterministic part is a *rule*: rule(drafts, q, p) -> (stop [N, L+1],
next_law [N, L+1, V]), where stop[:, a] is the probability that a draft tokens are kept and
next_law[:, a] the law of the token emitted after them (rows of next_law sum to 1).
A tree verifier that accepts one child per node is described by a *node rule* with the contract
of `ssd_jax.verify.specinfer_node`: node_rule(p [V], q [V], candidates int32 [K], alive bool [K])
-> (accept [K]: probability that candidate j is accepted given every earlier alive candidate was
rejected, residual [V]: the unnormalised law of the next token when all are rejected).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.testing.tables import Tables

MAX_VOCAB = 6          # exact enumeration: V <= 6
MAX_ROWS = 3_000_000   # enumerated draft rows (K-tuples of paths, trees) per law


def check_enumerable(t: Tables, rows: int | None = None, what: str = "draft rows") -> None:
    """Raises InputError when t is not a Tables, its vocabulary is above MAX_VOCAB or an
    enumeration would visit more than MAX_ROWS rows."""
    if not isinstance(t, Tables):
        raise InputError(f"tables must be ssd_jax.testing.Tables, got {type(t).__name__}")
    if t.V > MAX_VOCAB:
        raise InputError(f"exact enumeration needs V <= {MAX_VOCAB}, got V={t.V}")
    if rows is not None and rows > MAX_ROWS:
        raise InputError(f"exact enumeration would visit {rows} {what}; at most {MAX_ROWS} "
                         f"(lower V={t.V}, the depth n={t.n} or K)")


def check_paths(K) -> int:
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise InputError(f"K (the number of draft paths) must be an integer >= 1, got {K!r}")
    return int(K)


def x64(fn, *args):
    """fn(*args) with float64 jax arrays (x64 enabled); the results as numpy arrays."""
    with jax.enable_x64(True):
        out = fn(*[jnp.asarray(a) for a in args])
        return jax.tree_util.tree_map(np.asarray, out)


def rows(table: tuple, seqs: np.ndarray, depth: int) -> np.ndarray:
    """table[depth][seq[:depth]] for every sequence of seqs [..., >= depth] -> [..., V]."""
    out = table[depth][tuple(seqs[..., j] for j in range(depth))]
    return np.broadcast_to(out, seqs.shape[:-1] + out.shape[-1:])


def rows_at(table: tuple, seqs: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """table[depth[i]][seqs[i, :depth[i]]] for variable depths: seqs [N, >= max depth], depth
    int [N] -> [N, V]."""
    depth = np.asarray(depth)
    out = np.zeros((seqs.shape[0], table[0].shape[-1]))
    for d in np.unique(depth):
        sel = depth == d
        out[sel] = rows(table, seqs[sel], int(d))
    return out


def single_path_inputs(t: Tables, Q: tuple | None = None, L: int | None = None):
    """Every draft path of length L (default n) with its probability under Q (default t.Q).
    Returns drafts int32 [N, L], prob [N], q [N, L, V], p [N, L+1, V], N = V^L."""
    Q = t.Q if Q is None else Q
    L = t.n if L is None else L
    if not 1 <= L <= t.n:
        raise InputError(f"draft length L must be in [1, n={t.n}], got {L}")
    check_enumerable(t, t.V ** L)
    drafts = np.array(list(itertools.product(range(t.V), repeat=L)), dtype=np.int32).reshape(-1, L)
    q = np.stack([rows(Q, drafts, d) for d in range(L)], axis=1)
    p = np.stack([rows(t.P, drafts, d) for d in range(L + 1)], axis=1)
    prob = np.prod(np.take_along_axis(q, drafts[..., None], axis=-1)[..., 0], axis=1)
    return drafts, prob, q, p


def multi_path_inputs(t: Tables, K: int):
    """Every K-tuple of i.i.d. draft paths. Returns paths [N, K, L], prob [N], q [N, K, L, V],
    p [N, K, L+1, V], N = V^(L K)."""
    K = check_paths(K)
    check_enumerable(t, t.V ** (t.n * K), f"{K}-tuples of paths")
    drafts, prob1, q1, p1 = single_path_inputs(t)
    combos = np.array(list(itertools.product(range(drafts.shape[0]), repeat=K)), dtype=np.int64)
    return drafts[combos], np.prod(prob1[combos], axis=1), q1[combos], p1[combos]


def normalize_or(weights, fallback):
    """weights / their sum over the last axis; fallback (normalised) where the sum is 0."""
    total = weights.sum(-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    fb = fallback / fallback.sum(-1, keepdims=True)
    return np.where(total > 0, weights / safe, fb)


class Emissions:
    """Probability mass of every emitted sequence, by length m = 1..n+1."""

    def __init__(self, t: Tables):
        self.tables = t
        self.by_length = [np.zeros((t.V,) * m) for m in range(1, t.n + 2)]

    def add(self, seqs: np.ndarray, kept, y_law: np.ndarray) -> None:
        """Adds y_law[i, y] to the sequence seqs[i, :kept[i]] + [y] for every row i.
        seqs int [N, >= max kept]; kept int [N] (or one int); y_law [N, V]."""
        V = self.tables.V
        kept = np.broadcast_to(np.asarray(kept), (seqs.shape[0],))
        if kept.size and kept.max() > self.tables.n:
            raise InputError(f"an emission of {int(kept.max()) + 1} tokens does not fit tables of depth "
                             f"n={self.tables.n} (at most n+1 tokens)")
        for length in np.unique(kept):
            sel = kept == length
            idx = np.zeros(int(sel.sum()), dtype=np.int64)
            for j in range(int(length)):
                idx = idx * V + seqs[sel, j]
            flat = self.by_length[int(length)].reshape(-1, V)
            np.add.at(flat, idx, y_law[sel])

    def law(self) -> np.ndarray:
        """The law of the emission extended to n+1 tokens, float64 (V,)*(n+1)."""
        from ssd_jax.testing.tables import extend

        return extend(self.by_length, self.tables)


def tokenwise_stop_prob(accept) -> np.ndarray:
    """P(a kept) [N, L+1] from the per-position acceptance probabilities accept [N, L]."""
    n_rows = accept.shape[0]
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


def expected_accepted(stop, prob) -> float:
    """E[draft tokens kept] from stop [N, L+1] and the draft probabilities prob [N]."""
    n = np.arange(stop.shape[1])
    return float(np.sum(prob[:, None] * stop * n))


def law_of_stops(t: Tables, drafts, weight, stop, next_law) -> np.ndarray:
    """The extended law of a single-path step whose draft i (probability weight[i]) keeps a
    tokens with probability stop[i, a] and then emits a token of law next_law[i, a]."""
    emitted = Emissions(t)
    add_stops(emitted, drafts, weight, stop, next_law)
    return emitted.law()


def add_stops(emitted: Emissions, seqs, weight, stop, next_law, before=None) -> None:
    """Adds a single-path step's emissions to `emitted`: seqs [N, >= before + L] holds the
    prefix (before[i] tokens, default 0) followed by the draft; a kept draft tokens emit
    seqs[i, :before[i] + a] + [y] with mass weight[i] stop[i, a] next_law[i, a, y]."""
    before = np.zeros(len(weight), np.int64) if before is None else np.asarray(before)
    for a in range(stop.shape[1]):
        w = (weight * stop[:, a])[:, None] * next_law[:, a]
        live = w.sum(-1) > 0
        if live.any():
            emitted.add(seqs[live], before[live] + a, w[live])


def single_path_law(t: Tables, rule, Q: tuple | None = None, q_seen: tuple | None = None,
                    L: int | None = None) -> np.ndarray:
    """Exact law of a single-path verifier over every draft of length L (default n).

    rule: the verifier's deterministic part (module docstring). Q: the law drafts are sampled
    from (default t.Q); q_seen: the q handed to the verifier (default: Q itself)."""
    drafts, prob, q, p = single_path_inputs(t, Q, L)
    if q_seen is not None:
        q = np.stack([rows(q_seen, drafts, d) for d in range(drafts.shape[1])], axis=1)
    stop, next_law = rule(drafts, q, p)
    return law_of_stops(t, drafts, prob, stop, next_law)


def walk_law(t: Tables, paths, prob, q, p, node_rule) -> np.ndarray:
    """Exact law of a tree walk that accepts one child per node (SpecInfer, SpecTr, or any node
    rule with their contract), over enumerated draft trees given as paths [N, K, L] (paths that
    share a prefix share its rows) with probabilities prob [N]. Every branch of the walk is
    followed; the node rule runs in float64. Mass at depth d sits on the lowest-index path with
    the accepted prefix, as the library's walk keeps it."""
    n_rows, K, L = paths.shape
    emitted = Emissions(t)
    rule = jax.jit(jax.vmap(node_rule))
    mass = np.zeros((n_rows, K))
    mass[:, 0] = prob
    ar = np.arange(n_rows)
    for d in range(L):
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
            y_law = normalize_or(residual, p[:, r, d])
            w = (mass[:, r] * stop)[:, None] * y_law
            emitted.add(paths[:, r][live], d, w[live])
            for j in range(K):
                nxt_alive = alive & (paths[:, :, d] == paths[:, j:j + 1, d])
                rep = np.argmax(nxt_alive, axis=1)
                np.add.at(new_mass, (ar, rep), mass[:, r] * choose[:, j])
        mass = new_mass
    for r in range(K):
        y_law = normalize_or(p[:, r, L], p[:, r, L])
        emitted.add(paths[:, r], L, mass[:, r, None] * y_law)
    return emitted.law()
