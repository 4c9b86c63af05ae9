"""Training objectives over windows int32 [B, T + 1]: next-token cross-entropy and distillation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.transformer import forward_full


def next_token_loss(params: dict, config: ModelConfig, windows: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats per token) of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = forward_full(params, config, windows[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, windows[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def distillation_loss(
    draft_params: dict, draft_config: ModelConfig, target_params: dict, target_config: ModelConfig,
    windows: jax.Array, temperature: float = 1.0,
) -> jax.Array:
    """Mean KL(target || draft) per token (nats) of the next-token distributions at temperature T.

    Forward KL makes the draft cover the target's mass, which is what acceptance
    (sum_x min(p, q)) rewards. Vocabularies must match.
    """
    inputs = windows[:, :-1]
    target_logits = jax.lax.stop_gradient(forward_full(target_params, target_config, inputs))
    draft_logits = forward_full(draft_params, draft_config, inputs)
    p_log = jax.nn.log_softmax(target_logits / temperature, axis=-1)
    q_log = jax.nn.log_softmax(draft_logits / temperature, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1))
