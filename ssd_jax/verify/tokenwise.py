"""Token-wise speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Accept X_i while u_i < p_{i-1}(X_i) / q_{i-1}(X_i); at the first rejection (row n) emit
Y ~ norm((p_n - q_n)_+); after L acceptances emit the bonus Y ~ p_L."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.verify._common import (accept_prob, as_probs, check_single, draft_lengths, gather_tokens,
                                    leading_true_count, positive_part, row_keys, sample_from_weights)
from ssd_jax.verify.result import VerifyResult


def _residual(p_row, q_row):
    return positive_part(p_row - q_row)


def _accept_row(draft, q, p, length):
    """Probability of keeping each proposed token given the earlier ones were kept, [L] (0 at or
    past length)."""
    n_draft = draft.shape[0]
    acc = accept_prob(gather_tokens(p[:n_draft], draft), gather_tokens(q, draft))
    return jnp.where(jnp.arange(n_draft) < length, acc, 0)


def _tables_row(draft, q, p, length):
    n_draft = draft.shape[0]
    res = jnp.concatenate([_residual(p[:n_draft], q), p[n_draft:]], axis=0)
    res = jnp.where(jnp.arange(n_draft + 1)[:, None] < length, res, p)
    return _accept_row(draft, q, p, length), res


@jax.jit
def tokenwise_tables(draft_tokens, q, p, lengths=None):
    """The deterministic part of token-wise verification (used by the exact-law tests).

    draft_tokens int [B, L], q [B, L, V], p [B, L+1, V] (float32 or float64); lengths int [B]
    (None: L), the tokens each row proposed.
    Returns (accept [B, L]: probability of keeping X_i given X_1..X_{i-1} were kept,
             residual [B, L+1, V]: unnormalised law of the next token when the first rejection is
             at row n < L, and p_L at row L)."""
    return jax.vmap(_tables_row)(draft_tokens.astype(jnp.int32), q, p, draft_lengths(lengths, draft_tokens))


def _row(key, draft, q, p, length):
    """length int32 []: the draft tokens actually proposed (draft[length:] are ignored)."""
    n_draft = draft.shape[0]
    k_accept, k_token = jax.random.split(key)
    acc = _accept_row(draft, q, p, length)
    u = jax.random.uniform(k_accept, (n_draft,), dtype=p.dtype)
    n = leading_true_count(u < acc)
    p_n = p[n]
    q_n = q[jnp.minimum(n, n_draft - 1)]
    weights = jnp.where(n < length, _residual(p_n, q_n), p_n)
    y = sample_from_weights(k_token, weights, fallback=p_n)
    return n, y


@jax.jit
def _tokenwise_core(key, draft_tokens, q, p, lengths):
    n, y = jax.vmap(_row)(row_keys(key, draft_tokens.shape[0], like=draft_tokens), draft_tokens, q, p, lengths)
    return VerifyResult(n, y, jnp.zeros_like(n))


def tokenwise(key, draft_tokens, q, p, lengths=None) -> VerifyResult:
    """Token-wise rejection sampling of one draft path; exact for any draft law q.

    key: a jax.random key (split per row). draft_tokens: int [B, L], X_i sampled from q[:, i-1].
    q: float [B, L, V] draft probabilities. p: float [B, L+1, V] target probabilities, row i after
    the prefix and the first i draft tokens. Computed in float32 (float64 if given float64).
    lengths: optional int [B] in [0, L], the tokens row b proposed (a draft that stopped early);
    the rest of its row is ignored and after lengths[b] acceptances the bonus comes from p.
    Returns VerifyResult(num_accepted [B] in [0, lengths], next_token [B], path_index [B] = 0).
    """
    draft_tokens, q, p = jnp.asarray(draft_tokens), jnp.asarray(q), jnp.asarray(p)
    check_single(draft_tokens, q, p)
    q, p = as_probs(q, p)
    return _tokenwise_core(key, draft_tokens.astype(jnp.int32), q, p, draft_lengths(lengths, draft_tokens))
