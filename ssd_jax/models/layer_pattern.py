"""Per-layer static attention settings (sliding window or global, local or global RoPE), looked up
the same way whether the layers run unrolled (a Python int layer index) or under `lax.scan` (a
traced int32 index).

`ModelConfig.layer_windows` is a static tuple; with an int index the lookup is a Python choice
(the unrolled program holds only the chosen branch); with a traced index it is a `jnp.where`
between the two precomputed candidates, selected by a constant bool array indexed by the layer.
A model has at most two distinct windows (None and `sliding_window`), so at most two masks and
two RoPE frequency tables are ever built per forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.layers import rope_inv_freq

LayerIndex = int | jax.Array  # Python int (unrolled layers) or traced int32 scalar (scan)


def is_sliding(config: ModelConfig, layer: LayerIndex) -> bool | jax.Array:
    """Whether `layer` attends within `config.sliding_window` (bool, or traced bool scalar)."""
    flags = tuple(w is not None for w in config.layer_windows)
    if isinstance(layer, int):
        return flags[layer]
    return jnp.asarray(flags)[layer]


def _choose(flag: bool | jax.Array, if_true: jax.Array, if_false: jax.Array) -> jax.Array:
    if isinstance(flag, bool):
        return if_true if flag else if_false
    return jnp.where(flag, if_true, if_false)


def window_ok(window: int | None, query_pos: jax.Array, key_pos: jax.Array) -> jax.Array:
    """True where key_pos is within `window` tokens of query_pos (query - key < window); a bool
    array of their broadcast shape, all True for window None."""
    if window is None:
        return jnp.ones(jnp.broadcast_shapes(query_pos.shape, key_pos.shape), bool)
    return query_pos - key_pos < window


def layer_masks(config: ModelConfig, base: jax.Array, query_pos: jax.Array, key_pos: jax.Array):
    """(global mask, sliding mask): `base` (bool [B, T, S]) and the same restricted to the
    sliding window by positions (query_pos [B, T, 1], key_pos [B, 1 or T, S]). Both are `base`
    when the config has no sliding window."""
    if config.sliding_window is None:
        return base, base
    return base, base & window_ok(config.sliding_window, query_pos, key_pos)


def mask_for_layer(config: ModelConfig, masks, layer: LayerIndex) -> jax.Array:
    """The bool [B, T, S] attention mask of `layer` from `layer_masks`' pair."""
    full, sliding = masks
    if config.sliding_window is None or full is sliding:
        return full
    if all(w is not None for w in config.layer_windows):
        return sliding
    return _choose(is_sliding(config, layer), sliding, full)


def inv_freq_for_layer(config: ModelConfig, layer: LayerIndex) -> jax.Array:
    """RoPE inverse frequencies float32 [head_dim // 2] of `layer`: `config.rope_local` on sliding
    layers when set (Gemma 3), else `config.rope`."""
    global_freq = rope_inv_freq(config.rope, config.head_dim)
    if config.rope_local is None:
        return global_freq
    local_freq = rope_inv_freq(config.rope_local, config.head_dim)
    return _choose(is_sliding(config, layer), local_freq, global_freq)
