"""The head's forwards: through a KV cache while drafting, and all draft depths at once while
training (training-time test).

Positions. The head's entry at position t reads the target's features at t (or, while drafting,
its own output at t - 1 in their place) plus the embedding of token t + 1, and predicts token
t + 2. With the target's cache holding positions < P and the root token (the last emitted one)
at P, the head's output at P - 1 already predicts the first draft token, P + 1; the entry at
P + d - 2 (d >= 2) reads the drafted token at P + d - 1 and predicts the one at P + d.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.eagle.head import SHARED_TARGET_PARAMS, HeadConfig
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.layers import norm
from ssd_jax.models.transformer import _attend, _layer_output, _project_qkv, embed, forward_cached, lm_head

FEATURE_EPS = 1e-6


def head_as_model(head, target):
    """The head as a one-layer `Model` of target's family (its layer, the target's embedding, final
    norm and LM head): what `ssd_jax.tuning.measure` times as the draft's forward under "auto"."""
    from ssd_jax.model import Model

    return Model(config=head.config.layer_config(target.config), params=head_model_params(head.params, target.params))


def _unit_rms(x: jax.Array) -> jax.Array:
    """x [..., D] scaled to a root mean square of 1 over D (float32 inside, x's dtype out)."""
    f = x.astype(jnp.float32)
    return (f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + FEATURE_EPS)).astype(x.dtype)


def fused_features(head_params: dict, features: jax.Array) -> jax.Array:
    """features [B, T, K, D] (the target's residual stream after each feature layer) -> [B, T, D]
    in the head's dtype: each feature RMS-normalised (the layers' streams differ in scale by
    orders of magnitude), then the fuse map."""
    f = _unit_rms(features.astype(jnp.float32))
    kernel = head_params["fuse"]["kernel"]
    fused = jnp.einsum("btc,cd->btd", f.reshape(*f.shape[:2], -1), kernel.astype(jnp.float32))
    return fused.astype(kernel.dtype)


def head_model_params(head_params: dict, target_params: dict) -> dict:
    """The params of the head as a one-layer model: its layer, the target's embedding, final norm
    and LM head (the same arrays, not copies)."""
    return dict({k: target_params[k] for k in SHARED_TARGET_PARAMS if k in target_params},
                layers=head_params["layers"])


def head_inputs(params: dict, layer_config: ModelConfig, hidden: jax.Array, next_tokens: jax.Array,
                positions: jax.Array) -> jax.Array:
    """The head's layer input [B, T, D]: hidden [B, T, D] (fused features, or the head's own
    outputs in their place) plus the embedding of next_tokens int32 [B, T] (`head_model_params`),
    each scaled to unit RMS first. Added at their own scales, the embedding (RMS ~0.05 in the
    embedded target) was drowned by the features, and a trained head agreed with the target's
    argmax on 36% of held-out tokens at depth 1, where draft_small agrees on 63%."""
    token = embed(params, layer_config, next_tokens, positions)
    return _unit_rms(hidden.astype(token.dtype)) + _unit_rms(token)


def head_forward_cached(head_params: dict, target_params: dict, layer_config: ModelConfig, hidden: jax.Array,
                        next_tokens: jax.Array, positions: jax.Array, cache: KVCache,
                        tree_mask: jax.Array | None = None, logit_indices: jax.Array | None = None):
    """T head entries through the head's cache (written at cache.lengths + 0..T-1, not committed,
    as `forward_cached`). hidden [B, T, D], next_tokens and positions int32 [B, T].
    Returns (float32 logits [B, T or M, V], cache, outputs [B, T, D]: the head's pre-norm
    outputs, what the next depth reads in place of features)."""
    params = head_model_params(head_params, target_params)
    x = head_inputs(params, layer_config, hidden, next_tokens, positions)
    logits, cache, outputs = forward_cached(params, layer_config, next_tokens, positions, cache, tree_mask=tree_mask,
                                            logit_indices=logit_indices, feature_layers=(0,), inputs_embeds=x)
    return logits, cache, outputs[:, :, 0]


def training_time_test(head_params: dict, target_params: dict, target_config: ModelConfig, config: HeadConfig,
                       features: jax.Array, next_tokens: jax.Array, passes: int) -> list[jax.Array]:
    """The head's logits at every draft depth 1..passes for every position at once, without a cache.

    features [B, T, K, D]: the target's at positions 0..T-1; next_tokens int32 [B, T]: token
    t + 1 at position t. Pass 1 reads the features everywhere; pass s reads at t the head's pass
    s - 1 output at t - 1, and attends to pass-1 entries at positions <= t - s + 1 and to the
    pass-j entry at t - s + j for j = 2..s: exactly what the entry at t sees while drafting
    depth s from the root at t - s + 2. Returns per pass float32 logits [B, T, V] predicting
    token t + 2; pass s is meaningful for t >= s - 1.
    """
    layer_config = config.layer_config(target_config)
    params = head_model_params(head_params, target_params)
    lp = jax.tree.map(lambda a: a[0], head_params["layers"])
    b, t = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = jnp.arange(t)
    hidden = fused_features(head_params, features)
    keys, values, outputs = [], [], []
    for s in range(1, passes + 1):
        x = head_inputs(params, layer_config, hidden, next_tokens, positions)
        q, k, v = _project_qkv(layer_config, lp, norm(layer_config, x, lp["attn_norm"]), positions, 0)
        keys.append(k.transpose(0, 2, 1, 3))
        values.append(v.transpose(0, 2, 1, 3))
        blocks = [idx[None, :] <= idx[:, None] - (s - 1)]
        blocks += [idx[None, :] == idx[:, None] - (s - j) for j in range(2, s + 1)]
        mask = jnp.broadcast_to(jnp.concatenate(blocks, axis=1), (b, t, s * t))
        attn = _attend(layer_config, q, jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2), mask)
        out = _layer_output(layer_config, lp, x, attn)
        outputs.append(lm_head(params, layer_config, out))
        # The next pass reads this pass's output one position later (position 0 reads zeros: its
        # pass >= 2 entries have no root and are never scored).
        hidden = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
    return outputs
