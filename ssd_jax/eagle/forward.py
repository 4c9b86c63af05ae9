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

from ssd_jax.eagle.head import OWN_OUTPUT_PARAMS, SHARED_TARGET_PARAMS, HeadConfig
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.layers import norm
from ssd_jax.models.transformer import (_attend, _layer_output, _project_qkv, attention_input, embed, forward_cached,
                                        lm_head)

FEATURE_EPS = 1e-6
# The draft logit of a target token outside a head's reduced vocabulary: its draft probability is
# exactly 0 after a softmax at any temperature, and no arithmetic on it overflows (as -inf would
# in 0 * -inf).
OUTSIDE_DRAFT_VOCAB_LOGIT = -1e9


def is_eagle3(head_params: dict) -> bool:
    """Whether params are an "eagle3" head's (`ssd_jax.eagle.head`): its own norm on the token
    embedding marks them (`check_head_params` ties the leaves to the config's style)."""
    return "embed_norm" in head_params


def head_as_model(head, target):
    """The head as a one-layer `Model` of target's family (its layer, the target's embedding, final
    norm and LM head): what `ssd_jax.tuning.measure` times as the draft's forward under "auto"."""
    from ssd_jax.model import Model

    params = head_model_params(head.params, target.params)
    if is_eagle3(head.params):
        # Timed without the embedding half of its attention input, which a standard layer lacks
        # (a small share of the head's cost); its LM head is the reduced one.
        d = target.config.hidden_size
        layers = dict(params["layers"], **{n: dict(params["layers"][n], kernel=params["layers"][n]["kernel"][:, d:])
                                           for n in "qkv"})
        params = dict(params, layers=layers)
    return Model(config=head.config.layer_config(target.config), params=params)


def _unit_rms(x: jax.Array) -> jax.Array:
    """x [..., D] scaled to a root mean square of 1 over D (float32 inside, x's dtype out)."""
    f = x.astype(jnp.float32)
    return (f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + FEATURE_EPS)).astype(x.dtype)


def fused_features(head_params: dict, features: jax.Array) -> jax.Array:
    """features [B, T, K, D] (the target's residual stream after each feature layer) -> [B, T, D]
    in the head's dtype: each feature RMS-normalised (the layers' streams differ in scale by
    orders of magnitude), then the fuse map. An "eagle3" head maps the raw features."""
    f = features.astype(jnp.float32)
    if not is_eagle3(head_params):
        f = _unit_rms(f)
    kernel = head_params["fuse"]["kernel"]
    fused = jnp.einsum("btc,cd->btd", f.reshape(*f.shape[:2], -1), kernel.astype(jnp.float32))
    return fused.astype(kernel.dtype)


def head_model_params(head_params: dict, target_params: dict) -> dict:
    """The params of the head as a one-layer model: its layer, the target's embedding, final norm
    and LM head (the same arrays, not copies); an "eagle3" head's own final norm and LM head."""
    params = {k: target_params[k] for k in SHARED_TARGET_PARAMS if k in target_params}
    params.update({k: head_params[k] for k in OWN_OUTPUT_PARAMS if k in head_params})
    return dict(params, layers=head_params["layers"])


def head_inputs(head_params: dict, params: dict, layer_config: ModelConfig, hidden: jax.Array,
                next_tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(the head layer's residual input [B, T, D], the prefix of its attention input [B, T, D] or
    None) from hidden [B, T, D] (fused features, or the head's own outputs in their place) and
    next_tokens int32 [B, T]; params: `head_model_params`.

    Ours: hidden plus the token's embedding, each scaled to unit RMS first, no prefix. Added at
    their own scales, the embedding (RMS ~0.05 in the embedded target) was drowned by the
    features, and a trained head agreed with the target's argmax on 36% of held-out tokens at
    depth 1, where draft_small agrees on 63%. An "eagle3" head: hidden, with the embedding
    normed by its embed_norm as the prefix (the layer norms hidden itself)."""
    token = embed(params, layer_config, next_tokens, positions)
    if is_eagle3(head_params):
        return hidden.astype(token.dtype), norm(layer_config, token, head_params["embed_norm"])
    return _unit_rms(hidden.astype(token.dtype)) + _unit_rms(token), None


def to_target_vocab(head_params: dict, logits: jax.Array, vocab_size: int) -> jax.Array:
    """Draft logits [..., Vd] over a head's reduced vocabulary -> [..., vocab_size] over the
    target's: each row at its target id, every other token at `OUTSIDE_DRAFT_VOCAB_LOGIT`
    (draft probability 0, so tree verification stays exact). A head without one: as it is."""
    if "draft_to_target" not in head_params:
        return logits
    full = jnp.full(logits.shape[:-1] + (vocab_size,), OUTSIDE_DRAFT_VOCAB_LOGIT, logits.dtype)
    return full.at[..., head_params["draft_to_target"]].set(logits)


def head_logits(head_params: dict, target_params: dict, layer_config: ModelConfig, outputs: jax.Array) -> jax.Array:
    """The head's float32 draft logits [..., V] over the target's vocabulary from its pre-norm
    outputs [..., D]."""
    logits = lm_head(head_model_params(head_params, target_params), layer_config, outputs)
    return to_target_vocab(head_params, logits, layer_config.vocab_size)


def head_forward_cached(head_params: dict, target_params: dict, layer_config: ModelConfig, hidden: jax.Array,
                        next_tokens: jax.Array, positions: jax.Array, cache: KVCache,
                        tree_mask: jax.Array | None = None, logit_indices: jax.Array | None = None):
    """T head entries through the head's cache (written at cache.lengths + 0..T-1, not committed,
    as `forward_cached`). hidden [B, T, D], next_tokens and positions int32 [B, T].
    Returns (float32 logits [B, T or M, V], cache, outputs [B, T, D]: the head's pre-norm
    outputs, what the next depth reads in place of features)."""
    params = head_model_params(head_params, target_params)
    x, prefix = head_inputs(head_params, params, layer_config, hidden, next_tokens, positions)
    logits, cache, outputs = forward_cached(params, layer_config, next_tokens, positions, cache, tree_mask=tree_mask,
                                            logit_indices=logit_indices, feature_layers=(0,), inputs_embeds=x,
                                            attention_prefix=prefix)
    return to_target_vocab(head_params, logits, layer_config.vocab_size), cache, outputs[:, :, 0]


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
        x, prefix = head_inputs(head_params, params, layer_config, hidden, next_tokens, positions)
        q, k, v = _project_qkv(layer_config, lp, attention_input(layer_config, lp, x, prefix), positions, 0)
        keys.append(k.transpose(0, 2, 1, 3))
        values.append(v.transpose(0, 2, 1, 3))
        blocks = [idx[None, :] <= idx[:, None] - (s - 1)]
        blocks += [idx[None, :] == idx[:, None] - (s - j) for j in range(2, s + 1)]
        mask = jnp.broadcast_to(jnp.concatenate(blocks, axis=1), (b, t, s * t))
        attn = _attend(layer_config, q, jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2), mask)
        out = _layer_output(layer_config, lp, x, attn)
        outputs.append(head_logits(head_params, target_params, layer_config, out))
        # The next pass reads this pass's output one position later (position 0 reads zeros: its
        # pass >= 2 entries have no root and are never scored).
        hidden = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
    return outputs
