"""The decoder forward pass for every supported family, with and without a KV cache.

Params are a plain pytree (see `ssd_jax.models.params`) whose per-layer leaves are stacked on a
leading layer axis; the layers run under `lax.scan`, so the compiled program holds one layer.
All functions here are pure and take the (hashable) `ModelConfig` as a static argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.layers import activation, apply_rope, norm, rms_norm, rope_inv_freq


def _dense(x: jax.Array, p: dict) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, p["kernel"])
    if "bias" in p:
        y = y + p["bias"]
    return y


def embed(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens, positions: int32 [B, T] -> hidden [B, T, D] in the params dtype."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if config.positions == "learned":
        x = x + jnp.take(params["pos_embed"], positions, axis=0, mode="clip")
    return x


def lm_head(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (final norm included)."""
    h = norm(config, hidden, params["final_norm"])
    kernel = params["embed"].T if config.tie_word_embeddings else params["lm_head"]["kernel"]
    return jnp.einsum("...d,dv->...v", h, kernel, preferred_element_type=jnp.float32)


def _project_qkv(config: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array):
    """x [B,T,D] -> q [B,T,H,hd], k and v [B,T,KVH,hd], rotated where the family uses RoPE."""
    b, t, _ = x.shape
    q = _dense(x, lp["q"]).reshape(b, t, config.num_heads, config.head_dim)
    k = _dense(x, lp["k"]).reshape(b, t, config.num_kv_heads, config.head_dim)
    v = _dense(x, lp["v"]).reshape(b, t, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"]["scale"], config.norm_eps)
        k = rms_norm(k, lp["k_norm"]["scale"], config.norm_eps)
    if config.positions == "rope":
        inv_freq = rope_inv_freq(config.rope, config.head_dim)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
    return q, k, v


def _attend(config: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, H, hd]; k, v: [B, KVH, S, hd]; mask: bool [B, T, S] (every row has a True).
    Returns [B, T, H * hd] in q's dtype; scores and softmax in float32.
    """
    b, t, _, hd = q.shape
    qg = q.reshape(b, t, config.num_kv_heads, config.num_groups, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", weights, v)
    return out.reshape(b, t, config.num_heads * hd)


def _mlp(config: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    if config.mlp == "gated":
        hidden = activation(config.activation, _dense(x, lp["gate"])) * _dense(x, lp["up"])
        return _dense(hidden, lp["down"])
    return _dense(activation(config.activation, _dense(x, lp["fc"])), lp["proj"])


def _layer_output(config: ModelConfig, lp: dict, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual around the attention output projection, then the MLP block."""
    x = x + _dense(attn, lp["o"])
    return x + _mlp(config, lp, norm(config, x, lp["mlp_norm"]))


def _window_ok(config: ModelConfig, query_pos: jax.Array, key_pos: jax.Array) -> jax.Array:
    if config.sliding_window is None:
        return jnp.ones(jnp.broadcast_shapes(query_pos.shape, key_pos.shape), bool)
    return query_pos - key_pos < config.sliding_window


def forward_full(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Reference causal forward with no cache: int32 [B, T] -> float32 logits [B, T, V]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = jnp.arange(t)
    mask = (idx[:, None] >= idx[None, :]) & _window_ok(config, idx[:, None], idx[None, :])
    mask = jnp.broadcast_to(mask, (b, t, t))

    def layer(x, lp):
        q, k, v = _project_qkv(config, lp, norm(config, x, lp["attn_norm"]), positions)
        attn = _attend(config, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
        return _layer_output(config, lp, x, attn), None

    x, _ = jax.lax.scan(layer, embed(params, config, tokens, positions), params["layers"])
    return lm_head(params, config, x)


def cache_attention_mask(
    config: ModelConfig, lengths: jax.Array, positions: jax.Array, capacity: int, tree_mask: jax.Array | None
) -> jax.Array:
    """Which cache slots each new token may attend to: bool [B, T, capacity].

    Committed slots (s < lengths[b]) are visible to every new token; the new tokens, written at
    slots lengths[b] + j, see each other through `tree_mask` [B, T, T] (default: causal).
    """
    b, t = positions.shape
    slots = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
    base = lengths[:, None, None]
    committed = slots < base
    rel = slots - base  # index of the new token stored in each slot
    is_new = (rel >= 0) & (rel < t)
    rel_c = jnp.clip(rel, 0, t - 1)
    queries = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    if tree_mask is None:
        new_ok = rel <= queries
    else:
        tree = tree_mask.astype(bool) | jnp.eye(t, dtype=bool)[None]
        new_ok = jnp.take_along_axis(tree, jnp.broadcast_to(rel_c, (b, t, capacity)), axis=2)
    key_pos = jnp.where(committed, slots, jnp.take_along_axis(positions, rel_c[:, 0, :], axis=1)[:, None, :])
    return (committed | (is_new & new_ok)) & _window_ok(config, positions[:, :, None], key_pos)


def forward_cached(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Forward over T new tokens per row through the cache.

    tokens, positions: int32 [B, T]; new K/V go to slots cache.lengths + 0..T-1 (lengths are not
    advanced: commit, roll back or compact afterwards). tree_mask: bool [B, T, T], True where new
    token i may attend to new token j (default causal). logit_indices: optional int32 [B, M]
    selecting which of the T outputs get logits (saves the LM head on long prefills).
    Returns float32 logits [B, T or M, V] and the updated cache.
    """
    b, t = tokens.shape
    mask = cache_attention_mask(config, cache.lengths, positions, cache.capacity, tree_mask)
    rows = jnp.arange(b)[:, None]
    write_slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def layer(carry, layer_in):
        x, k_all, v_all = carry
        lp, i = layer_in
        q, k, v = _project_qkv(config, lp, norm(config, x, lp["attn_norm"]), positions)
        k_all = k_all.at[i, rows, :, write_slots].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[i, rows, :, write_slots].set(v.astype(v_all.dtype), mode="drop")
        attn = _attend(config, q, k_all[i], v_all[i], mask)
        return (_layer_output(config, lp, x, attn), k_all, v_all), None

    x = embed(params, config, tokens, positions)
    layer_ids = jnp.arange(config.num_layers)
    (x, k_all, v_all), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], layer_ids))
    if logit_indices is not None:
        x = jnp.take_along_axis(x, logit_indices[:, :, None].astype(jnp.int32), axis=1)
    return lm_head(params, config, x), cache.replace(k=k_all, v=v_all)


decode_step = jax.jit(forward_cached, static_argnames=("config",), donate_argnames=("cache",))
decode_step.__doc__ = """`forward_cached` jitted with the cache donated (updated in place): for user-written loops.
Call with keywords: decode_step(params, config=..., tokens=..., positions=..., cache=..., tree_mask=None)."""
