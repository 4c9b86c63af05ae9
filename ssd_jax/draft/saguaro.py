"""Saguaro drafting for SSD: the draft chain with Saguaro sampling, and the fork candidates.

Saguaro sampling reshapes the draft's distribution at draft position i so that the F_i tokens the
speculation cache will fork on at depth i (the draft's top-F_i) carry less draft mass:
    sigma(z)_t ~ C * q_t   if t in top_F(z)
                 q_t       otherwise
where q is the processed draft distribution (`sampling.probabilities`) and C in [0, 1]. After a
rejection the target samples from (p - sigma)_+, which then puts more mass on the cached tokens.
The draft samples from sigma AND sigma is the q handed to verification, so decoding stays exact.
C = 1 is plain sampling. At temperature 0 the draft proposes its argmax and C has no effect
(greedy verification never reads q).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.coupling import decision_logits
from ssd_jax.draft.model_chain import catch_up, extend
from ssd_jax.draft.vocab import align_logits
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.sampling import SamplingParams, argmax_first, probabilities


def saguaro_reshape(probs: jax.Array, logits: jax.Array, num_top: jax.Array, c: float, rmax: int) -> jax.Array:
    """Saguaro sampling distribution.

    probs float32 [N, V] (processed draft probabilities); logits float32 [N, V] (the draft's
    aligned logits, which rank the tokens); num_top int32 [] or [N]: F, how many top tokens
    are scaled by c (at most rmax, a static bound). Returns float32 [N, V] summing to 1; where
    every token with mass is in the top F and c = 0, the unreshaped probs (nothing else to sample).
    """
    if c == 1.0:
        return probs
    n, vocab = probs.shape
    top = jax.lax.top_k(logits, min(rmax, vocab))[1]  # [N, R]
    chosen = jnp.arange(top.shape[1])[None, :] < jnp.reshape(num_top, (-1, 1))
    in_top = jnp.zeros((n, vocab), bool).at[jnp.arange(n)[:, None], top].set(chosen)
    weights = probs * jnp.where(in_top, jnp.float32(c), jnp.float32(1.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), probs)


SAMPLE_BLOCK = 64


def sample_blocked(key: jax.Array, probs: jax.Array, block: int = SAMPLE_BLOCK) -> jax.Array:
    """One token from probs float32 [V] in two Gumbel-max draws: a block of `block` ids by its
    mass, then an id within it. P(id) = (block mass / total) * (p_id / block mass) = p_id / total,
    the law `sampling.sample` draws from, with 2*block Gumbel variates instead of V (generating
    the random bits is most of a draw's cost, so this is much cheaper for large V). Returns int32 []."""
    vocab = probs.shape[-1]
    blocks = -(-vocab // block)
    padded = jnp.pad(probs, (0, blocks * block - vocab)).reshape(blocks, block)
    k_block, k_id = jax.random.split(key)
    chosen = jax.random.categorical(k_block, jnp.log(jnp.sum(padded, axis=-1)))
    within = jax.random.categorical(k_id, jnp.log(padded[chosen]))
    return (chosen * block + within).astype(jnp.int32)


def draft_chain(
    params: dict,
    config: ModelConfig,
    cache: KVCache,
    chunk: jax.Array,
    chunk_len: jax.Array,
    keys: jax.Array,
    fanout: jax.Array,
    *,
    num_draft_tokens: int,
    sampling: SamplingParams,
    target_vocab: int,
    saguaro_c: float,
    rmax: int,
) -> tuple[jax.Array, jax.Array | None]:
    """Drafts L = num_draft_tokens tokens per row after a chunk, sampling from Saguaro's sigma.

    cache: draft cache of N rows. chunk int32 [N, W] tokens not yet committed (chunk_len[n] >= 1 of
    them valid; the last valid one is the root the draft continues). keys uint32 [N, 2]: draft
    token i of row n uses fold_in(keys[n], i); under the Gumbel coupling they are the rows' noise
    keys and each token is the argmax of the perturbed draft law (`ssd_jax.coupling`). fanout int32 [L+1]: F_i scales the top-F_i tokens
    at draft position i (ignored when saguaro_c == 1).
    Returns (tokens int32 [N, L]; q float32 [N, L, target_vocab], the distributions the tokens
    were drawn from (`sample_blocked`), or None at temperature 0 where the draft takes its argmax).
    The cache itself is not returned: callers draft on copies.
    """
    logits, cache = catch_up(params, config, cache, chunk, chunk_len)
    base = cache.lengths   # the position of each row's first draft token

    def draw(logits, i):
        logits = align_logits(logits, target_vocab)
        if sampling.by_argmax:
            scores = decision_logits(logits, keys, base + i, sampling)
            return argmax_first(scores), None
        q = saguaro_reshape(probabilities(logits, sampling), logits.astype(jnp.float32), fanout[i], saguaro_c, rmax)
        return jax.vmap(sample_blocked)(jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i), q), q

    def step(carry, i):
        logits, cache = carry
        token, q = draw(logits, i)
        return extend(params, config, cache, token), (token, q)

    (logits, _), (tokens, qs) = jax.lax.scan(step, (logits, cache),
                                             jnp.arange(num_draft_tokens - 1, dtype=jnp.int32))
    last, q_last = draw(logits, num_draft_tokens - 1)
    tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    if sampling.by_argmax:
        return tokens, None
    return tokens, jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)


def fork_tokens(logits: jax.Array, drafted: jax.Array, slot_depth: jax.Array, slot_rank: jax.Array, *,
                rmax: int) -> jax.Array:
    """The candidate outcome token of every cache slot.

    logits float32 [B, L+1, V]: the draft's (aligned) logits after cur, d_0, .., d_{L-1}, i.e. at
    depths 0..L. drafted int32 [B, L]: the speculation d being verified; at depth j < L its token
    d_j is excluded (a rejection never emits the rejected token: its residual mass is zero).
    slot_depth, slot_rank int32 [S]: slot s forks on the rank-th best remaining token at depth.
    Returns int32 [B, S].
    """
    b, depth, vocab = logits.shape
    length = drafted.shape[1]
    rows = jnp.arange(b)[:, None]
    cols = jnp.arange(length)[None, :]
    scores = logits.at[rows, cols, drafted].set(-jnp.inf)
    top = jax.lax.top_k(scores, min(rmax, vocab))[1].astype(jnp.int32)  # [B, L+1, R]
    return top[:, slot_depth, slot_rank]
