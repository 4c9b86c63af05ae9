"""`forward`: the cache-free causal forward, the reference every cached path is checked against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.models.transformer import forward_full


@functools.partial(jax.jit, static_argnames=("config",))
def _forward(params, tokens, config):
    return forward_full(params, config, tokens)


def forward(model: Model, tokens) -> jax.Array:
    """int32 tokens [B, T] -> float32 logits [B, T, V] (full causal forward, no cache).

    Works inside a user's jit on a traced Model and tokens; token ids are checked only when
    they are concrete."""
    if not isinstance(model, Model):
        raise InputError(f"model must be an ssd_jax Model (see ssd_jax.load), got {type(model).__name__}")
    if isinstance(tokens, jax.core.Tracer):
        if tokens.ndim != 2 or tokens.shape[1] == 0 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise InputError(f"tokens must be integers [batch, length >= 1], got {tokens.shape} {tokens.dtype}")
        return _forward(model.params, tokens.astype(jnp.int32), model.config)
    array = np.asarray(tokens)
    if array.ndim != 2 or array.shape[1] == 0:
        raise InputError(f"tokens must have shape [batch, length] with length >= 1, got {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"tokens must be integers, got dtype {array.dtype}")
    bad = (array < 0) | (array >= model.config.vocab_size)
    if bad.any():
        raise InputError(f"token id {int(array[bad][0])} is outside the vocabulary [0, {model.config.vocab_size})")
    if array.shape[1] > model.config.max_position_embeddings:
        raise InputError(
            f"{array.shape[1]} tokens exceed the model's max_position_embeddings={model.config.max_position_embeddings}"
        )
    return _forward(model.params, jnp.asarray(array, jnp.int32), model.config)
