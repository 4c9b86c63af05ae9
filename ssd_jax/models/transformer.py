"""The decoder forward pass for every supported family, with and without a KV cache.

Params are a plain pytree (see `ssd_jax.models.params`) whose per-layer leaves are stacked on a
leading layer axis; the layers run under `lax.scan`, so the compiled program holds one layer.
All functions here are pure and take the (hashable) `ModelConfig` as a static argument.

`unstack_layers` turns `params["layers"]` into a tuple of per-layer dicts; the forwards accept
either form and run a tuple as an unrolled Python loop. Decode loops on CPU call `decode_params`
once, outside their `while_loop`: XLA:CPU copies each scan step's slice of every stacked weight
before its dot (the dynamic-slice is not fused into the matmul), which adds two extra passes over
the weights to every memory-bound decode step. The price is a larger program (longer compile) and,
while the loop runs, a second copy of the layer weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.backend import policy_for
from ssd_jax.models.attention import causal_attention, masked_attention
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.layer_pattern import LayerIndex, inv_freq_for_layer, layer_masks, mask_for_layer
from ssd_jax.models.layers import activation, apply_rope, norm, softcap
from ssd_jax.models.moe import moe_mlp
from ssd_jax.models.pallas_attention import pallas_attention
from ssd_jax.models.pallas_attention import supports as pallas_supports

DECODE_ATTENTION = ("reference", "xla", "pallas", "pallas_interpret")


def _dense(x: jax.Array, p: dict) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, p["kernel"])
    if "bias" in p:
        y = y + p["bias"]
    return y


def embed(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens, positions: int32 [B, T] -> hidden [B, T, D] in the params dtype."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if config.embed_scale:  # Gemma: sqrt(hidden) rounded to the params dtype, as transformers does
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    if config.positions == "learned":
        x = x + jnp.take(params["pos_embed"], positions, axis=0, mode="clip")
    return x


def lm_head(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (final norm and final soft-capping included)."""
    h = norm(config, hidden, params["final_norm"])
    # A tied model's params may carry an explicit (transposed) head: see `decode_params`.
    kernel = params["lm_head"]["kernel"] if "lm_head" in params else params["embed"].T
    logits = jnp.einsum("...d,dv->...v", h, kernel, preferred_element_type=jnp.float32)
    return softcap(logits, config.final_logit_softcap)


def _project_qkv(config: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array, layer: LayerIndex):
    """x [B,T,D] -> q [B,T,H,hd], k and v [B,T,KVH,hd], rotated where the family uses RoPE
    (with the RoPE of `layer`, see `layer_pattern.inv_freq_for_layer`)."""
    b, t, _ = x.shape
    if "qkv" in lp:  # fused by `decode_params`
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        q, k, v = jnp.split(_dense(x, lp["qkv"]), [q_size, q_size + kv_size], axis=-1)
    else:
        q, k, v = _dense(x, lp["q"]), _dense(x, lp["k"]), _dense(x, lp["v"])
    q = q.reshape(b, t, config.num_heads, config.head_dim)
    k = k.reshape(b, t, config.num_kv_heads, config.head_dim)
    v = v.reshape(b, t, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = norm(config, q, lp["q_norm"])
        k = norm(config, k, lp["k_norm"])
    if config.positions == "rope":
        inv_freq = inv_freq_for_layer(config, layer)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
    return q, k, v


def attention_input(config: ModelConfig, lp: dict, x: jax.Array, prefix: jax.Array | None = None) -> jax.Array:
    """A layer's attention input: its normed residual stream x [B, T, D], after prefix [B, T, E]
    where one is given (an EAGLE-3 head's normed token embedding: q/k/v then take E + D inputs)."""
    h = norm(config, x, lp["attn_norm"])
    return h if prefix is None else jnp.concatenate([prefix.astype(h.dtype), h], axis=-1)


def _attend(config: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, H, hd]; k, v: [B, KVH, S, hd]; mask: bool [B, T, S] (every row has a True).
    Returns [B, T, H * hd] in q's dtype; scores and softmax in float32.
    """
    b, t, _, hd = q.shape
    qg = q.reshape(b, t, config.num_kv_heads, config.num_groups, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = _score_transform(config, scores)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", weights, v)
    return out.reshape(b, t, config.num_heads * hd)


def attention_scale(config: ModelConfig) -> float:
    """The factor of raw q.k scores: 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar) (Gemma 2/3)."""
    return (config.query_pre_attn_scalar or config.head_dim) ** -0.5


def _score_transform(config: ModelConfig, scores: jax.Array) -> jax.Array:
    """Raw q.k scores (float32) -> attention logits before masking: scaled (`attention_scale`),
    then soft-capped when the config says so."""
    return softcap(scores * attention_scale(config), config.attn_logit_softcap)


def _mlp(config: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    if config.mlp == "moe":
        return moe_mlp(config, lp, x)
    if "gate_up" in lp:  # fused by `decode_params`
        gate, up = jnp.split(_dense(x, lp["gate_up"]), 2, axis=-1)
        return _dense(activation(config.activation, gate) * up, lp["down"])
    if config.mlp == "gated":
        hidden = activation(config.activation, _dense(x, lp["gate"])) * _dense(x, lp["up"])
        return _dense(hidden, lp["down"])
    return _dense(activation(config.activation, _dense(x, lp["fc"])), lp["proj"])


def _layer_output(config: ModelConfig, lp: dict, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual around the attention output projection, then the MLP block (with Gemma 2/3's
    `sandwich_norms`, each block's output is normed before its residual add)."""
    attn_out = _dense(attn, lp["o"])
    if config.sandwich_norms:
        attn_out = norm(config, attn_out, lp["post_attn_norm"])
    x = x + attn_out
    mlp_out = _mlp(config, lp, norm(config, x, lp["mlp_norm"]))
    if config.sandwich_norms:
        mlp_out = norm(config, mlp_out, lp["post_mlp_norm"])
    return x + mlp_out


def unstack_layers(params: dict) -> dict:
    """params with `layers` as a tuple of per-layer dicts (a no-op if it already is one)."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return dict(params, layers=tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers)))


def _fuse(parts: list[dict]) -> dict:
    """Dense layers sharing an input -> one layer whose outputs are theirs, concatenated."""
    fused = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=-1)}
    if "bias" in parts[0]:
        fused["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=-1)
    return fused


def decode_params(params: dict, config: ModelConfig, fuse: bool = True) -> dict:
    """The params a CPU decode loop runs on, made once outside the loop: layers unstacked, q/k/v
    and gate/up fused into one matmul each (fewer, larger matrix-vector products use the memory
    bandwidth better), and for tied embeddings an explicit head kernel [D, V] (XLA:CPU's batched
    matmul against `embed.T` [V, D] is about twice as slow as against a [D, V] kernel at batch 8).
    fuse=False keeps q/k/v and gate/up apart: for models split by heads over a mesh, where a fused
    kernel's columns would mix the three projections on every device."""
    layers = []
    for lp in unstack_layers(params)["layers"]:
        lp = dict(lp)
        if fuse and "q" in lp:
            lp["qkv"] = _fuse([lp.pop("q"), lp.pop("k"), lp.pop("v")])
        if fuse and "gate" in lp:
            lp["gate_up"] = _fuse([lp.pop("gate"), lp.pop("up")])
        layers.append(lp)
    params = dict(params, layers=tuple(layers))
    if config.tie_word_embeddings and "lm_head" not in params:
        params = dict(params, lm_head={"kernel": jnp.transpose(params["embed"])})
    return params


def _unstacked(params: dict) -> bool:
    return isinstance(params["layers"], (tuple, list))


def check_feature_layers(config: ModelConfig, feature_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layer indices whose outputs a forward returns as features, as a tuple; ValueError for
    one outside 0..num_layers-1 (callers that take them from users check first, naming the value)."""
    feature_layers = tuple(int(i) for i in feature_layers)
    bad = [i for i in feature_layers if not 0 <= i < config.num_layers]
    if bad:
        raise ValueError(f"feature layers {bad} outside 0..{config.num_layers - 1}")
    return feature_layers


def _stacked_features(outputs, feature_layers: tuple[int, ...]):
    """The feature_layers' entries of outputs (a list of [B, T, D] per layer, or one stacked
    [L, B, T, D] array) as [B, T, K, D]; None where no features are asked for."""
    return jnp.stack([outputs[i] for i in feature_layers], axis=2) if feature_layers else None


def _run_layers(params: dict, config: ModelConfig, x: jax.Array, layer, feature_layers: tuple[int, ...]):
    """x through every layer (layer(x, lp, i) -> x): (x, features [B, T, K, D] of the K
    feature_layers' outputs, or None where none are asked for)."""
    if _unstacked(params):
        outputs = []
        for i, lp in enumerate(params["layers"]):
            x = layer(x, lp, i)
            outputs.append(x)
    else:
        layer_ids = jnp.arange(config.num_layers)
        x, outputs = jax.lax.scan(lambda x, inp: (lambda y: (y, y if feature_layers else None))(layer(x, *inp)),
                                  x, (params["layers"], layer_ids))
    return x, _stacked_features(outputs, feature_layers)


def forward_full(params: dict, config: ModelConfig, tokens: jax.Array, feature_layers: tuple[int, ...] = ()):
    """Reference causal forward with no cache: int32 [B, T] -> float32 logits [B, T, V]; with
    feature_layers (layer indices), (logits, features [B, T, K, D]): the residual stream after
    each of those layers, in the params' dtype (what a feature-level draft head reads)."""
    x, features = hidden_full(params, config, tokens, feature_layers)
    logits = lm_head(params, config, x)
    return (logits, features) if feature_layers else logits


def hidden_full(params: dict, config: ModelConfig, tokens: jax.Array, feature_layers: tuple[int, ...] = ()):
    """`forward_full` up to the head: int32 [B, T] -> (the last layer's output [B, T, D] in the
    params' dtype, before the final norm; features [B, T, K, D] or None), for a caller that needs
    the logits of a few positions only (`lm_head` of those)."""
    feature_layers = check_feature_layers(config, feature_layers)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = jnp.arange(t)
    causal = jnp.broadcast_to(idx[:, None] >= idx[None, :], (b, t, t))
    masks = layer_masks(config, causal, idx[None, :, None], idx[None, None, :])

    def layer(x, lp, i):
        q, k, v = _project_qkv(config, lp, norm(config, x, lp["attn_norm"]), positions, i)
        mask = mask_for_layer(config, masks, i)
        attn = _attend(config, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
        return _layer_output(config, lp, x, attn)

    return _run_layers(params, config, embed(params, config, tokens, positions), layer, feature_layers)


def cache_attention_mask(
    config: ModelConfig, lengths: jax.Array, positions: jax.Array, capacity: int, tree_mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Which cache slots each new token may attend to: (global layers, sliding-window layers),
    each bool [B, T, capacity]; pick a layer's with `layer_pattern.mask_for_layer`.

    Committed slots (s < lengths[b]) are visible to every new token; the new tokens, written at
    slots lengths[b] + j, see each other through `tree_mask` [B, T, T] (default: causal). The
    sliding window compares positions, so a tree node sees the ancestors within its window.
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
    return layer_masks(config, committed | (is_new & new_ok), positions[:, :, None], key_pos)


def forward_cached(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
    prefill_attention: str = "reference",
    decode_attention: str | None = None,
    feature_layers: tuple[int, ...] = (),
    inputs_embeds: jax.Array | None = None,
    attention_prefix: jax.Array | None = None,
):
    """Forward over T new tokens per row through the cache.

    tokens, positions: int32 [B, T]; new K/V go to slots cache.lengths + 0..T-1 (lengths are not
    advanced: commit, roll back or compact afterwards). tree_mask: bool [B, T, T], True where new
    token i may attend to new token j (default causal). logit_indices: optional int32 [B, M]
    selecting which of the T outputs get logits (saves the LM head on long prefills).
    Returns float32 logits [B, T or M, V] and the updated cache.

    prefill_attention: "reference", or "xla" / "cudnn" for `jax.nn.dot_product_attention` over
    the new tokens alone (`ssd_jax.models.attention`); only for a prompt forward into an empty
    cache with no tree_mask, where the new tokens' causal mask is the whole mask. Models with
    attention soft-capping or per-layer windows (Gemma 2/3) keep the reference attention.
    decode_attention: the attention of every other forward: "reference" (`_attend`), "xla"
    (`jax.nn.dot_product_attention` with the mask), "pallas" (the TPU kernel of
    `ssd_jax.models.pallas_attention`, for caches it `supports`, else the reference) or
    "pallas_interpret" (that kernel through Pallas's interpreter, any backend: tests); None: the
    backend policy's for the params.

    Stacked params with a stacked cache run the layers under `lax.scan`; per-layer params
    (`unstack_layers`) or a per-layer cache run them as an unrolled loop. The cache comes back in
    the layout it came in.

    feature_layers: layer indices whose outputs (the residual stream after the layer) are also
    returned, as (logits, cache, features [B, T, K, D] in the params' dtype, all T tokens whatever
    logit_indices selects): what a feature-level draft head reads.
    inputs_embeds: optional [B, T, D], the first layer's input in place of the tokens' embeddings
    (a feature-level head's fused input, `ssd_jax.eagle`); tokens then give only the shape.
    attention_prefix: optional [B, T, E] put before every layer's normed input in its attention
    input (`attention_input`; an EAGLE-3 head's one layer).
    """
    feature_layers = check_feature_layers(config, feature_layers)
    b, t = tokens.shape
    plain = config.attn_logit_softcap is None  # the fused kernels take a scale but no soft-cap
    fused = prefill_attention != "reference" and plain and len(set(config.layer_windows)) == 1
    if prefill_attention != "reference" and tree_mask is not None:
        raise ValueError("prefill_attention applies to causal prompt forwards, not token trees")
    masks = None if fused else cache_attention_mask(config, cache.lengths, positions, cache.capacity, tree_mask)
    if decode_attention is None:
        decode_attention = policy_for(params).decode_attention
    if decode_attention not in DECODE_ATTENTION:
        raise ValueError(f"unknown decode_attention {decode_attention!r}; known: {DECODE_ATTENTION}")
    kernel = decode_attention.startswith("pallas") and pallas_supports(cache.capacity)
    scale = attention_scale(config)
    rows = jnp.arange(b)[:, None]
    write_slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def attention(lp, x, k_buf, v_buf, i=None, layer=None):
        """One layer (index `layer`) through its cache: k_buf, v_buf [B, KVH, S, hd], or stacked
        with layer index i."""
        layer = i if layer is None else layer
        q, k, v = _project_qkv(config, lp, attention_input(config, lp, x, attention_prefix), positions, layer)
        k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
        if i is None:
            # One extra update per row aimed past capacity (dropped) keeps this a scatter: XLA
            # rewrites a one-window scatter into a dynamic-update-slice, which it then duplicated
            # into the attention's operand, copying the whole layer cache several times per step.
            pad = jnp.full((b, 1), cache.capacity, jnp.int32)
            slots_x = jnp.concatenate([write_slots, pad], axis=1)
            zeros = jnp.zeros_like(k[:, :1])
            k_buf = k_buf.at[rows, :, slots_x].set(jnp.concatenate([k, zeros], 1), mode="drop")
            v_buf = v_buf.at[rows, :, slots_x].set(jnp.concatenate([v, zeros], 1), mode="drop")
            k_cur, v_cur = k_buf, v_buf
        else:
            k_buf = k_buf.at[i, rows, :, write_slots].set(k, mode="drop")
            v_buf = v_buf.at[i, rows, :, write_slots].set(v, mode="drop")
            k_cur, v_cur = k_buf[i], v_buf[i]
        if fused:
            attn = causal_attention(q, k, v, window=config.layer_windows[0], scale=scale,
                                    implementation=prefill_attention)
        elif kernel:
            attn = pallas_attention(q, k_cur, v_cur, mask_for_layer(config, masks, layer), scale=scale,
                                    softcap=config.attn_logit_softcap,
                                    interpret=decode_attention == "pallas_interpret")
        elif decode_attention == "xla" and plain:
            attn = masked_attention(q, k_cur, v_cur, mask_for_layer(config, masks, layer), scale=scale)
        else:
            attn = _attend(config, q, k_cur, v_cur, mask_for_layer(config, masks, layer))
        return _layer_output(config, lp, x, attn), k_buf, v_buf

    x = embed(params, config, tokens, positions) if inputs_embeds is None else inputs_embeds
    outputs = []   # each layer's output where features are asked for
    if cache.per_layer or _unstacked(params):
        layers = unstack_layers(params)["layers"]
        if cache.per_layer:
            k_list, v_list = list(cache.k), list(cache.v)
            for i, lp in enumerate(layers):
                x, k_list[i], v_list[i] = attention(lp, x, k_list[i], v_list[i], layer=i)
                outputs.append(x)
            k_all, v_all = tuple(k_list), tuple(v_list)
        else:
            k_all, v_all = cache.k, cache.v
            for i, lp in enumerate(layers):
                x, k_all, v_all = attention(lp, x, k_all, v_all, i)
                outputs.append(x)
    else:
        def layer(carry, layer_in):
            lp, i = layer_in
            carry = attention(lp, *carry, i)
            return carry, (carry[0] if feature_layers else None)

        layer_ids = jnp.arange(config.num_layers)
        (x, k_all, v_all), outputs = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], layer_ids))
    features = _stacked_features(outputs, feature_layers)
    if logit_indices is not None:
        x = jnp.take_along_axis(x, logit_indices[:, :, None].astype(jnp.int32), axis=1)
    logits, cache = lm_head(params, config, x), cache.replace(k=k_all, v=v_all)
    return (logits, cache, features) if feature_layers else (logits, cache)


decode_step = jax.jit(forward_cached, static_argnames=("config", "feature_layers"), donate_argnames=("cache",))
decode_step.__doc__ = """`forward_cached` jitted with the cache donated (updated in place): for user-written loops.
Call with keywords: decode_step(params, config=..., tokens=..., positions=..., cache=..., tree_mask=None)."""
