"""Prefix-dependent target and draft tables, and the target's law of a whole step.

Conventions. A table set has V tokens and depth n. Every speculative step the kit checks starts
at the same root, so a prefix is the sequence of tokens drafted or emitted so far in the step:
`P[d]` is a float64 array of shape (V,)*d + (V,), the target's law after the prefix z_1..z_d
(d = 0..n), read `P[d][z_1, ..., z_d]`; `Q[d]` is the draft's law after the same prefix
(d = 0..n-1). For a single verification step n is the draft length L. `draft_logits`, when
present, holds the raw draft logits Q was processed from (same shapes as Q; `-inf` allowed).

A verifier emits m tokens (1 <= m <= n+1). Its law is compared with the target's after the
emission is *extended* to n+1 tokens with the target's own conditionals (`extend`); the result
must be the target's joint law T(z) = prod_d P[d][z_<d][z_d], an array of shape (V,)*(n+1)
(`target_law`). Laws are float64 arrays of that shape throughout the kit.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ssd_jax.errors import InputError

ROW_SUM_TOL = 1e-9


def _as_levels(name: str, levels) -> tuple:
    if isinstance(levels, np.ndarray) or not hasattr(levels, "__len__"):
        raise InputError(f"{name} must be a list of arrays, one per prefix depth; got {type(levels).__name__}")
    return tuple(np.asarray(level, np.float64) for level in levels)


def _check_levels(name: str, levels: tuple, vocab: int, laws: bool) -> None:
    for d, level in enumerate(levels):
        want = (vocab,) * (d + 1)
        if level.shape != want:
            raise InputError(f"{name}[{d}] must have shape {want} (a row of V={vocab} per prefix of length {d}), "
                             f"got shape {level.shape}")
        if not laws:
            if np.isnan(level).any() or np.isposinf(level).any():
                raise InputError(f"{name}[{d}] must hold finite logits or -inf, found NaN or +inf")
            continue
        if not np.isfinite(level).all() or (level < 0).any():
            raise InputError(f"{name}[{d}] must hold finite non-negative probabilities, "
                             f"found {level[~np.isfinite(level) | (level < 0)].ravel()[0]!r}")
        sums = level.sum(axis=-1)
        bad = np.abs(sums - 1) > ROW_SUM_TOL
        if bad.any():
            prefix = tuple(int(i) for i in np.argwhere(bad)[0])
            raise InputError(f"{name}[{d}] row after prefix {prefix} sums to {sums[prefix]!r}, not 1 "
                             f"(every row is a law)")


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """Target laws P[0..n], draft laws Q[0..n-1] (float64, see the module docstring), and
    optionally the raw draft logits the Q rows were processed from. Validated on construction:
    a wrong shape, a negative or non-finite entry or a row not summing to 1 raises InputError."""

    P: tuple
    Q: tuple
    draft_logits: tuple | None = None

    def __post_init__(self):
        P, Q = _as_levels("P", self.P), _as_levels("Q", self.Q)
        if not Q:
            raise InputError("Q must have at least one level (depth n >= 1)")
        if len(P) != len(Q) + 1:
            raise InputError(f"P must have one level more than Q (P[0..n], Q[0..n-1]); got {len(P)} levels of P "
                             f"and {len(Q)} of Q")
        if P[0].ndim != 1 or P[0].shape[0] < 1:
            raise InputError(f"P[0] must be one row of V >= 1 probabilities, got shape {P[0].shape}")
        vocab = P[0].shape[0]
        _check_levels("P", P, vocab, laws=True)
        _check_levels("Q", Q, vocab, laws=True)
        object.__setattr__(self, "P", P)
        object.__setattr__(self, "Q", Q)
        if self.draft_logits is not None:
            logits = _as_levels("draft_logits", self.draft_logits)
            if len(logits) != len(Q):
                raise InputError(f"draft_logits must have one level per level of Q ({len(Q)}), got {len(logits)}")
            _check_levels("draft_logits", logits, vocab, laws=False)
            object.__setattr__(self, "draft_logits", logits)

    @property
    def V(self) -> int:
        return self.P[0].shape[-1]

    @property
    def n(self) -> int:
        """Depth: the longest draft a step over these tables can verify."""
        return len(self.Q)

    @property
    def L(self) -> int:
        """The draft length of a single verification step over these tables (= n)."""
        return len(self.Q)


def _random_row(rng, v, alpha, zero_prob):
    row = rng.dirichlet(np.full(v, alpha))
    if v > 1 and rng.random() < zero_prob:
        keep = rng.integers(v)
        drop = rng.choice([i for i in range(v) if i != keep], size=rng.integers(1, v), replace=False)
        row[drop] = 0.0
        row /= row.sum()
    return row


def _check_size(V, L) -> None:
    for name, value in (("V", V), ("L", L)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    if V ** (L + 1) > 10 ** 7:
        raise InputError(f"tables with V={V} and depth L={L} have V^(L+1) = {V ** (L + 1)} outcomes; at most 1e7")


def random_tables(seed: int, V: int, L: int, alpha: float = 0.8, zero_prob: float = 0.3,
                  special_prob: float = 0.25) -> Tables:
    """Target and draft laws drawn per prefix from a Dirichlet(alpha), depth n = L.

    With probability zero_prob a row keeps only part of its support (target zeros where the draft
    has mass and the reverse); with probability special_prob a prefix is special: q = p (0/0
    residuals, all GBV keys tied), p one-hot, q one-hot, or p proportional to q on part of the
    support (ties in GBV's order). zero_prob = special_prob = 0 gives full-support rows."""
    _check_size(V, L)
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
    """The same target row p and draft row q after every prefix, depth n = L."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if p.ndim != 1 or q.shape != p.shape:
        raise InputError(f"p and q must be rows of the same length V, got shapes {p.shape} and {q.shape}")
    _check_size(p.shape[0], L)
    V = p.shape[0]
    P = [np.broadcast_to(p, (V,) * d + (V,)).copy() for d in range(L + 1)]
    Q = [np.broadcast_to(q, (V,) * d + (V,)).copy() for d in range(L)]
    return Tables(P, Q)


def processed_tables(seed: int, V: int, L: int, sampling, scale: float = 2.0) -> Tables:
    """Raw target and draft logits drawn per prefix (normal, standard deviation `scale`), both
    processed by the library's `ssd_jax.sampling.probabilities` with `sampling` (temperature,
    top-k, top-p; temperature > 0): P and Q are the processed laws (float32 results, renormalised
    in float64), `draft_logits` the draft's raw logits. Depth n = L."""
    import jax.numpy as jnp

    from ssd_jax.sampling import SamplingParams, probabilities

    _check_size(V, L)
    if not isinstance(sampling, SamplingParams) or sampling.greedy:
        raise InputError(f"sampling must be SamplingParams with temperature > 0, got {sampling!r}")
    rng = np.random.default_rng(seed)
    P, Q, raw = [], [], []
    for d in range(L + 1):
        shape = (V,) * d + (V,)
        t_logits, d_logits = rng.normal(0.0, scale, shape), rng.normal(0.0, scale, shape)
        p = np.asarray(probabilities(jnp.asarray(t_logits, jnp.float32), sampling), np.float64)
        P.append(p / p.sum(-1, keepdims=True))
        if d < L:
            q = np.asarray(probabilities(jnp.asarray(d_logits, jnp.float32), sampling), np.float64)
            Q.append(q / q.sum(-1, keepdims=True))
            raw.append(d_logits)
    return Tables(P, Q, draft_logits=raw)


def target_law(t: Tables) -> np.ndarray:
    """T, the target's joint law of n+1 tokens: float64 (V,)*(n+1)."""
    law = t.P[0]
    for d in range(1, t.n + 1):
        law = law[..., None] * t.P[d]
    return law


def extend(emitted: list, t: Tables) -> np.ndarray:
    """emitted[m-1]: float64 (V,)*m, the probability of emitting exactly that sequence of m
    tokens (m = 1..n+1). Returns the law of the emission extended to n+1 tokens with the target's
    conditionals, float64 (V,)*(n+1)."""
    law = emitted[0]
    for m in range(1, t.n + 1):
        law = law[..., None] * t.P[m] + emitted[m]
    return law


def law_distance(a, b) -> float:
    """Total-variation distance between two laws of the same shape."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise InputError(f"laws of different shapes: {a.shape} and {b.shape}")
    return 0.5 * float(np.abs(a - b).sum())
