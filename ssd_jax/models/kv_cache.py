"""Static-shaped key/value cache with per-row lengths.

Row b's committed tokens occupy slots 0..lengths[b]-1, slot s holding position s. A forward over
T new tokens writes them to slots lengths[b] + 0..T-1 without moving `lengths`; the caller then
commits with `commit` (linear drafts), `rollback`, or `compact_path` (one root-to-leaf path of a
token tree). Writes at or past capacity are dropped by the scatter, never wrapped or clamped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """k, v: [layers, batch, kv_heads, capacity, head_dim] (params dtype); lengths: int32 [batch]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache (all lengths zero)."""
    shape = (config.num_layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
    )


def commit(cache: KVCache, num_new: jax.Array) -> KVCache:
    """Keeps the first num_new[b] tokens written by the last forward (int32 [B])."""
    new_lengths = jnp.minimum(cache.lengths + num_new.astype(jnp.int32), cache.capacity)
    return cache.replace(lengths=new_lengths)


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Forgets everything at or past lengths[b] (int32 [B]); lengths may only shrink."""
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths.astype(jnp.int32)))


def compact_path(cache: KVCache, node_indices: jax.Array, num_keep: jax.Array) -> KVCache:
    """Commits one root-to-leaf path of the tree written by the last forward.

    The last forward wrote tree node j of row b at slot lengths[b] + j. This moves nodes
    node_indices[b, 0..num_keep[b]-1] (int32 [B, M], in path order) into consecutive slots
    lengths[b] + 0..num_keep[b]-1 and advances lengths by num_keep (int32 [B]).
    """
    batch, width = node_indices.shape
    base = cache.lengths[:, None]
    src = base + node_indices.astype(jnp.int32)
    step = jnp.arange(width, dtype=jnp.int32)[None, :]
    # Slots not kept are sent past capacity so the scatter drops them.
    dest = jnp.where(step < num_keep[:, None], base + step, cache.capacity)
    rows = jnp.arange(batch)[:, None]

    def move(buf):
        gathered = buf[:, rows, :, src]  # [B, M, layers, kv_heads, head_dim]
        return buf.at[:, rows, :, dest].set(gathered, mode="drop")

    return KVCache(k=move(cache.k), v=move(cache.v), lengths=cache.lengths + num_keep.astype(jnp.int32))
