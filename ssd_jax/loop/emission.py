"""Appending each step's emitted tokens to the per-row output buffers, with EOS and length limits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

FINISH_RUNNING, FINISH_EOS, FINISH_LENGTH = 0, 1, 2   # a row's finish reason (`DecodeOutput.finish_reason`)


@struct.dataclass
class Outputs:
    """out int32 [B, N]; num_out int32 [B]; finish int32 [B] (FINISH_*); done bool [B]."""

    out: jax.Array
    num_out: jax.Array
    finish: jax.Array
    done: jax.Array

    @classmethod
    def empty(cls, batch: int, size: int) -> "Outputs":
        return cls(out=jnp.zeros((batch, size), jnp.int32), num_out=jnp.zeros((batch,), jnp.int32),
                   finish=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool))


def append(outputs: Outputs, tokens: jax.Array, count: jax.Array, max_new: jax.Array, eos_ids: jax.Array):
    """Appends tokens[b, :count[b]] (int32 [B, M], [B]) to unfinished rows, cut after the first EOS
    and at max_new tokens. Returns (outputs, number appended per row int32 [B])."""
    b, m = tokens.shape
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    is_eos = (j < count[:, None]) & jnp.isin(tokens, eos_ids)
    has_eos = jnp.any(is_eos, axis=1)
    eos_at = jnp.argmax(is_eos, axis=1).astype(jnp.int32)
    n = jnp.where(has_eos, eos_at + 1, count)
    n = jnp.minimum(n, max_new - outputs.num_out)
    n = jnp.where(outputs.done, 0, n).astype(jnp.int32)
    size = outputs.out.shape[1]
    slots = jnp.where(j < n[:, None], outputs.num_out[:, None] + j, size)
    out = outputs.out.at[jnp.arange(b)[:, None], slots].set(tokens, mode="drop")
    num_out = outputs.num_out + n
    hit_eos = ~outputs.done & has_eos & (eos_at < n)
    hit_length = ~outputs.done & ~hit_eos & (num_out >= max_new)
    finish = jnp.where(hit_eos, FINISH_EOS, jnp.where(hit_length, FINISH_LENGTH, outputs.finish))
    done = outputs.done | hit_eos | hit_length
    return Outputs(out=out, num_out=num_out, finish=finish, done=done), n


def emitted_tokens(chosen: jax.Array, num_accepted: jax.Array, next_token: jax.Array) -> jax.Array:
    """A step's emitted tokens: chosen int32 [B, M] (the accepted path), num_accepted int32 [B],
    next_token int32 [B] -> int32 [B, M+1]: chosen[:a] + [next] + zeros."""
    if chosen.shape[1] == 0:
        return next_token[:, None]
    j = jnp.arange(chosen.shape[1] + 1)[None, :]
    padded = jnp.concatenate([chosen, jnp.zeros_like(chosen[:, :1])], axis=1)
    return jnp.where(j < num_accepted[:, None], padded, jnp.where(j == num_accepted[:, None], next_token[:, None], 0))


def stop_rows(outputs: Outputs, mask: jax.Array) -> Outputs:
    """Ends rows in mask (bool [B]) that are still running with finish reason "length"
    (used when a row's cache has no room for another step)."""
    stop = mask & ~outputs.done
    return outputs.replace(finish=jnp.where(stop, FINISH_LENGTH, outputs.finish), done=outputs.done | stop)
