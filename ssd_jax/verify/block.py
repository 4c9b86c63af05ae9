"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding").

    w_0 = 1,  w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_{i-1}(X_i))
        closed form: S_i = sum_{l<=i} log(p_{l-1}(X_l) / q_{l-1}(X_l)),  w_i = exp(S_i - max_{j<=i} S_j)
    for i = 0..L, independently: D_i is a token with probability
        h_i = r_i / (r_i + 1 - w_i),   r_i = sum_x (w_i p_i(x) - q_i(x))_+,   q_L := 0
    tau = the largest i whose D_i is a token (h_0 = 1, so tau >= 0);
    emit X_1..X_tau, then Y ~ norm((w_tau p_tau - q_tau)_+)  (= p_L when tau = L).

Only the token-or-reject outcome of each D_i decides tau, so a single token is drawn, from row tau.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.verify._common import (as_probs, check_single, draft_lengths, first_true, gather_tokens, log_ratio,
                                    positive_part, row_keys, sample_from_weights)
from ssd_jax.verify.result import VerifyResult


def block_weights_row(draft, q, p):
    """w [L+1] for one row: draft int [L], q [L, V], p [L+1, V]."""
    n_draft = draft.shape[0]
    lr = log_ratio(gather_tokens(p[:n_draft], draft), gather_tokens(q, draft))
    s = jnp.concatenate([jnp.zeros((1,), p.dtype), jnp.cumsum(lr)])
    return jnp.exp(s - jax.lax.cummax(s, axis=0))


def _q_padded(q):
    return jnp.concatenate([q, jnp.zeros_like(q[:1])], axis=0)              # q_L := 0


def _token_prob_h(w, p, q):
    """h [L+1] from w [L+1], p [L+1, V], q [L, V]; row L has q_L = 0, so r_L = w_L sum(p_L)."""
    n_draft = q.shape[0]
    r = jnp.sum(positive_part(w[:n_draft, None] * p[:n_draft] - q), axis=-1)
    r = jnp.concatenate([r, (w[n_draft] * jnp.sum(p[n_draft]))[None]])
    den = r + (1 - w)
    # den = 0 only when w_i = 1 and p_i = q_i; then X_{i+1} ~ q_i = p_i keeps w_{i+1} = 1, so a
    # later D is a token surely and the value here never decides tau. 1 keeps tau >= 0.
    return jnp.where(den > 0, r / jnp.where(den > 0, den, 1), 1)


def _masked_tables(draft, q, p, length):
    """(w [L+1], h [L+1], q with rows at or past length zeroed [L, V]) of a row that proposed
    length tokens (None: all L)."""
    n_draft = draft.shape[0]
    w = block_weights_row(draft, q, p)
    if length is not None:
        q = jnp.where(jnp.arange(n_draft)[:, None] < length, q, 0)
    h = _token_prob_h(w, p, q)
    if length is not None:
        h = jnp.where(jnp.arange(n_draft + 1) <= length, h, 0)
    return w, h, q


def _tables_row(draft, q, p, length):
    w, h, q = _masked_tables(draft, q, p, length)
    return h, positive_part(w[:, None] * p - _q_padded(q))


@jax.jit
def block_tables(draft_tokens, q, p, lengths=None):
    """The deterministic part of block verification (used by the exact-law tests).

    draft_tokens int [B, L], q [B, L, V], p [B, L+1, V] (float32 or float64); lengths int [B]
    (None: L), the tokens each row proposed.
    Returns (h [B, L+1]: probability that D_i is a token, h_0 = 1;
             residual [B, L+1, V]: unnormalised law of the next token when tau = i)."""
    return jax.vmap(_tables_row)(draft_tokens.astype(jnp.int32), q, p, draft_lengths(lengths, draft_tokens))


def block_row(key, draft, q, p, length=None):
    """Block verification of one row: key, draft int32 [L], q [L, V], p [L+1, V]; length int32 []
    (None: L): the tokens proposed. A draft of length n < L is verified as a block of n tokens:
    q_n := 0 (as q_L in the full block) and D_i for i > n is never a token.
    Returns (num_accepted int32 [], next_token int32 [])."""
    n_draft = draft.shape[0]
    k_accept, k_token = jax.random.split(key)
    w, h, q = _masked_tables(draft, q, p, length)
    u = jax.random.uniform(k_accept, (n_draft + 1,), dtype=p.dtype)
    is_token = (u < h).at[0].set(True)
    tau = (n_draft - first_true(is_token[::-1])).astype(jnp.int32)
    p_tau = p[tau]
    q_tau = jnp.where(tau < n_draft, q[jnp.minimum(tau, n_draft - 1)], 0)
    y = sample_from_weights(k_token, positive_part(w[tau] * p_tau - q_tau), fallback=p_tau)
    return tau, y


@jax.jit
def _block_core(key, draft_tokens, q, p, lengths):
    n, y = jax.vmap(block_row)(row_keys(key, draft_tokens.shape[0], like=draft_tokens), draft_tokens, q, p, lengths)
    return VerifyResult(n, y, jnp.zeros_like(n))


def block(key, draft_tokens, q, p, lengths=None) -> VerifyResult:
    """Block verification of one draft path; exact for any draft law q, and never accepts fewer
    tokens in expectation than token-wise verification.

    key: a jax.random key (split per row). draft_tokens: int [B, L], X_i sampled from q[:, i-1].
    q: float [B, L, V] draft probabilities. p: float [B, L+1, V] target probabilities.
    Computed in float32 (float64 if given float64). lengths: optional int [B] in [0, L], the
    tokens row b proposed (a draft that stopped early; exact when the stop depends only on what
    was drafted before it, tests/test_adaptive.py).
    Returns VerifyResult(num_accepted [B] in [0, lengths], next_token [B], path_index [B] = 0).
    """
    draft_tokens, q, p = jnp.asarray(draft_tokens), jnp.asarray(q), jnp.asarray(p)
    check_single(draft_tokens, q, p)
    q, p = as_probs(q, p)
    return _block_core(key, draft_tokens.astype(jnp.int32), q, p, draft_lengths(lengths, draft_tokens))
