"""Greedy verification (temperature 0): keep draft tokens while they equal the target's argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.verify._common import argmax_first, check_multi, check_single, draft_lengths, leading_true_count
from ssd_jax.verify.result import VerifyResult


@jax.jit
def _greedy_core(draft_tokens, p, lengths):
    top = argmax_first(p)                    # [B, L+1], ties -> lowest id
    proposed = jnp.arange(draft_tokens.shape[1])[None, :] < lengths[:, None]
    n = leading_true_count((draft_tokens == top[:, :-1]) & proposed)    # [B]
    nxt = jnp.take_along_axis(top, n[:, None], axis=1)[:, 0]
    return VerifyResult(n, nxt, jnp.zeros_like(n))


def greedy(key, draft_tokens, q, p, lengths=None) -> VerifyResult:
    """Greedy verification of one draft path; the emitted sequence is the target's argmax chain.

    key: ignored (kept for a uniform signature). draft_tokens: int [B, L]. q: float [B, L, V],
    ignored apart from its shape. p: float [B, L+1, V], target probabilities (or any scores with
    the same argmax) after the prefix and the first i draft tokens. lengths: optional int [B]
    in [0, L], the tokens row b proposed (the rest of its row is ignored).
    Returns VerifyResult with num_accepted = length of the prefix where draft == argmax p,
    next_token = argmax p at the first mismatch (or at row L: the bonus), path_index = 0.
    """
    del key
    draft_tokens, q, p = jnp.asarray(draft_tokens), jnp.asarray(q), jnp.asarray(p)
    check_single(draft_tokens, q, p)
    return _greedy_core(draft_tokens.astype(jnp.int32), p, draft_lengths(lengths, draft_tokens))


@jax.jit
def _greedy_multipath_core(paths, p):
    top = argmax_first(p)                    # [B, K, L+1]
    n = leading_true_count(paths == top[..., :-1])                      # [B, K]
    k = jnp.argmax(n, axis=-1).astype(jnp.int32)                        # longest; ties -> lowest index
    n_best = jnp.take_along_axis(n, k[:, None], axis=1)[:, 0]
    top_best = jnp.take_along_axis(top, k[:, None, None], axis=1)[:, 0]  # [B, L+1]
    nxt = jnp.take_along_axis(top_best, n_best[:, None], axis=1)[:, 0]
    return VerifyResult(n_best, nxt, k)


def greedy_multipath(key, paths, q, p) -> VerifyResult:
    """Greedy verification of K paths: the path with the longest prefix matching the target's
    argmax chain wins (ties: lowest index); next_token = argmax p at its first mismatch.

    key, q: ignored (q only for its shape). paths: int [B, K, L]. p: float [B, K, L+1, V].
    Returns VerifyResult(num_accepted [B], next_token [B], path_index [B]).
    """
    del key
    paths, q, p = jnp.asarray(paths), jnp.asarray(q), jnp.asarray(p)
    check_multi(paths, q, p)
    return _greedy_multipath_core(paths.astype(jnp.int32), p)
