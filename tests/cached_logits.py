"""Logits through the KV cache: a model fed its tokens chunk by chunk (shared by the family and
`widen` tests, which compare them with a full forward or another model's)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ssd_jax.models.kv_cache import commit, init_cache
from ssd_jax.models.transformer import decode_step


def incremental_logits(model, tokens: np.ndarray, sizes) -> np.ndarray:
    """Logits float32 [B, T, V] of tokens int32 [B, T] fed through a fresh (donated) cache in
    chunks of `sizes` (summing to T)."""
    cache = init_cache(model.config, tokens.shape[0], 32)
    pieces, start = [], 0
    for size in sizes:
        chunk = jnp.asarray(tokens[:, start:start + size])
        positions = jnp.broadcast_to(jnp.arange(start, start + size, dtype=jnp.int32), chunk.shape)
        logits, cache = decode_step(model.params, config=model.config, tokens=chunk, positions=positions, cache=cache)
        cache = commit(cache, jnp.full((tokens.shape[0],), size, jnp.int32))
        pieces.append(np.asarray(logits))
        start += size
    assert start == tokens.shape[1]
    return np.concatenate(pieces, axis=1)
