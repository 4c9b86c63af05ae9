"""Stateless building blocks shared by every family: norms, rotary embeddings, activations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig, RopeConfig


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result cast back to x.dtype before the scale (as transformers does).

    x: [..., D]; scale: [D].
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def rms_norm_1p(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: the normalised x times (1 + scale), all in float32, then cast to x.dtype.

    x: [..., D]; scale: [D] (stored as w, applied as 1 + w).
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); None: x."""
    if cap is None:
        return x
    return cap * jnp.tanh(x / cap)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm in float32. x: [..., D]; scale, bias: [D]."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def norm(config: ModelConfig, x: jax.Array, p: dict) -> jax.Array:
    """The family's norm with parameters `p` ({'scale'} or {'scale', 'bias'}) over x's last axis."""
    if config.norm == "layer":
        return layer_norm(x, p["scale"], p["bias"], config.norm_eps)
    if config.norm == "rms_1p":
        return rms_norm_1p(x, p["scale"], config.norm_eps)
    return rms_norm(x, p["scale"], config.norm_eps)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(name)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [head_dim // 2] float32, with linear or llama3 scaling applied."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x: [B, T, H, D] at positions [B, T] (half-split convention of transformers)."""
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
