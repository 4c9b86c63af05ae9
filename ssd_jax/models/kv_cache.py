"""Static-shaped key/value cache with per-row lengths.

Row b's committed tokens occupy slots 0..lengths[b]-1, slot s holding position s. A forward over
T new tokens writes them to slots lengths[b] + 0..T-1 without moving `lengths`; the caller then
commits with `commit` (linear drafts), `rollback`, or `compact_path` (one root-to-leaf path of a
token tree). Writes at or past capacity are dropped by the scatter, never wrapped or clamped.

Two layouts hold the same data: stacked (`k`, `v` one array [layers, B, kv_heads, capacity, hd],
the default) and per-layer (`k`, `v` tuples of `layers` arrays [B, kv_heads, capacity, hd]). A
decode loop on CPU keeps the per-layer form in its carry: XLA:CPU materialises `k[i]` of a stacked
buffer as a copy before every attention, a visible share of a decode step; a per-layer buffer is
updated in place and read by the attention dot directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """k, v: [layers, batch, kv_heads, capacity, head_dim] (params dtype), or per layer a tuple of
    [batch, kv_heads, capacity, head_dim]; lengths: int32 [batch]."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.per_layer else self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if self.per_layer else self.k.shape[1]


def init_cache(
    config: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32, per_layer: bool = False
) -> KVCache:
    """An empty cache (all lengths zero); per_layer picks the tuple-of-layers layout."""
    lengths = jnp.zeros((batch_size,), jnp.int32)
    if per_layer:
        shape = (batch_size, config.num_kv_heads, capacity, config.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
        return KVCache(k=zeros(), v=zeros(), lengths=lengths)
    shape = (config.num_layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=lengths)


def to_stacked(cache: KVCache) -> KVCache:
    """The stacked layout of a cache (a no-op on a stacked one)."""
    if not cache.per_layer:
        return cache
    return cache.replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))


def to_per_layer(cache: KVCache) -> KVCache:
    """The per-layer layout of a cache (a no-op on a per-layer one)."""
    if cache.per_layer:
        return cache
    return cache.replace(k=tuple(cache.k), v=tuple(cache.v))


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
        if cache.per_layer:
            return tuple(b.at[rows, :, dest].set(b[rows, :, src], mode="drop") for b in buf)
        gathered = buf[:, rows, :, src]  # [B, M, layers, kv_heads, head_dim]
        return buf.at[:, rows, :, dest].set(gathered, mode="drop")

    return cache.replace(k=move(cache.k), v=move(cache.v), lengths=cache.lengths + num_keep.astype(jnp.int32))
