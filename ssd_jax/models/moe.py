"""Mixture-of-experts MLP (Mixtral): a router picks the top-k of E gated experts per token.

Params of one layer (the expert axis E leads every expert leaf, so a mesh rule can shard it):

    router/kernel [D, E]
    experts/gate/kernel [E, D, F]    experts/up/kernel [E, D, F]    experts/down/kernel [E, F, D]

Static shapes under jit: every expert runs on every token and the outputs are combined with a
dense [B, T, E] weight that is zero outside each token's top-k. That is exact (an unselected
expert contributes 0 * finite = 0) and costs E/k times the FLOPs of a sparse dispatch, which
decode (memory-bound: the weights of all hit experts are read anyway) hardly notices; a grouped
dispatch (sorted tokens + `lax.ragged_dot`) would be the upgrade for long prefills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.layers import activation


def routing_weights(config: ModelConfig, router_logits: jax.Array) -> jax.Array:
    """Router logits [..., E] -> float32 combine weights [..., E]: softmax in float32, the top-k
    probabilities renormalised to sum to 1 (Mixtral), zero for the other experts."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_probs, top_ids = jax.lax.top_k(probs, config.experts_per_token)
    top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(top_ids, config.num_experts, dtype=jnp.float32)  # [..., k, E]
    return jnp.einsum("...k,...ke->...e", top_probs, one_hot)


def moe_mlp(config: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, T, D] in x's dtype (weighted sum of the selected experts' outputs)."""
    weights = routing_weights(config, jnp.einsum("btd,de->bte", x, lp["router"]["kernel"]))
    experts = lp["experts"]
    gate = jnp.einsum("btd,edf->btef", x, experts["gate"]["kernel"])
    up = jnp.einsum("btd,edf->btef", x, experts["up"]["kernel"])
    out = jnp.einsum("btef,efd->bted", activation(config.activation, gate) * up, experts["down"]["kernel"])
    return jnp.einsum("bted,bte->btd", out, weights, preferred_element_type=jnp.float32).astype(x.dtype)
