"""Aligning a draft's vocabulary with the target's (same tokenizer, possibly padded differently)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def align_logits(logits: jax.Array, target_vocab: int) -> jax.Array:
    """Draft logits [..., Vd] -> [..., target_vocab]: ids the target lacks are cut, ids the draft
    lacks get -inf (the draft can never propose them; the target may still emit them)."""
    vd = logits.shape[-1]
    if vd == target_vocab:
        return logits
    if vd > target_vocab:
        return logits[..., :target_vocab]
    pad = jnp.full(logits.shape[:-1] + (target_vocab - vd,), -jnp.inf, logits.dtype)
    return jnp.concatenate([logits, pad], axis=-1)
