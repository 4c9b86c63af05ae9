"""Draft-model drafting: catch up on the tokens emitted last step, then L autoregressive draft
steps in `lax.scan`, for K independent paths at once (the draft cache holds K copies per row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.draft.vocab import align_logits
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, commit
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities, sample


def draft_paths(
    params: dict,
    config: ModelConfig,
    cache: KVCache,
    chunk: jax.Array,
    chunk_len: jax.Array,
    keys: jax.Array,
    *,
    num_draft_tokens: int,
    sampling: SamplingParams,
    target_vocab: int,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Drafts num_draft_tokens (L) tokens per path.

    cache: draft cache of batch B*K (path k of row b at index b*K + k, all copies holding the
    same committed text). chunk int32 [B*K, C]: tokens not yet in the cache, chunk_len[i] of them
    valid (>= 1; the last valid one is the root of the new paths). keys uint32 [B*K, 2].
    Returns (paths int32 [B*K, L], q float32 [B*K, L, target_vocab] the processed draft
    probabilities each token was sampled from, cache with the chunk and the first L-1 path tokens
    committed).
    """
    n, c = chunk.shape
    positions = cache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    logits, cache = forward_cached(params, config, chunk, positions, cache, logit_indices=(chunk_len - 1)[:, None])
    cache = commit(cache, chunk_len)

    def probs_of(logits):
        return probabilities(align_logits(logits, target_vocab), sampling)

    def draw(q, key):
        return jnp.argmax(q, axis=-1).astype(jnp.int32) if sampling.greedy else jax.vmap(sample)(key, q)

    def step(carry, i):
        logits, cache = carry
        q = probs_of(logits)
        token = draw(q, jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i))
        new_logits, cache = forward_cached(params, config, token[:, None], cache.lengths[:, None], cache)
        return (new_logits[:, 0], commit(cache, jnp.ones((n,), jnp.int32))), (token, q)

    (logits, cache), (tokens, qs) = jax.lax.scan(
        step, (logits[:, 0], cache), jnp.arange(num_draft_tokens - 1, dtype=jnp.int32)
    )
    q_last = probs_of(logits)
    last = draw(q_last, jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, num_draft_tokens - 1))
    paths = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)
    return paths, q, cache
