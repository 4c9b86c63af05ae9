"""Tables laid out for the sampled-law harness: every depth's rows stacked in one array and
indexed by prefix, so a batch of sequences of different lengths reads its rows with one gather.

Layout. For levels T[0..D] (T[d] of shape (V,)*d + (V,)), `stack_levels` returns an array
[R, V] with R = sum_d V^d whose row offsets[d] + index(z) holds T[d][z], where offsets[d] =
sum_{j<d} V^j and index(z_1..z_d) = sum_i z_i V^(d-i) (z read as a base-V number).
`prefix_rows` gives, for sequences [B, W], the stacked row of each prefix of length 0..W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def offsets(V: int, depth: int) -> np.ndarray:
    """int64 [depth + 1]: where the rows of each depth start (module docstring)."""
    return np.concatenate([[0], np.cumsum([V ** d for d in range(depth)])]).astype(np.int64)


def stack_levels(levels, dtype=np.float32) -> np.ndarray:
    """Levels T[0..D] -> [R, V] (module docstring)."""
    V = levels[0].shape[-1]
    return np.concatenate([np.asarray(level).reshape(-1, V) for level in levels]).astype(dtype)


def prefix_rows(seqs: jax.Array, V: int) -> jax.Array:
    """seqs int32 [B, W] -> int32 [B, W+1]: column j is the stacked row of seqs[:, :j]."""
    off = offsets(V, seqs.shape[1])
    idx = jnp.zeros(seqs.shape[:1], jnp.int32)
    out = [idx + int(off[0])]
    for j in range(seqs.shape[1]):
        idx = idx * V + seqs[:, j]
        out.append(idx + int(off[j + 1]))
    return jnp.stack(out, axis=1)


def log_weights(w: jax.Array) -> jax.Array:
    """log w with -inf where w = 0 (categorical logits of unnormalised weights)."""
    return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1)), -jnp.inf)


def draw(key: jax.Array, w: jax.Array) -> jax.Array:
    """One token per row from unnormalised weights w [B, V] -> int32 [B]."""
    return jax.random.categorical(key, log_weights(w)).astype(jnp.int32)


def emission(seq: jax.Array, kept: jax.Array, next_token: jax.Array, width: int):
    """The emitted tokens seq[:, :kept] + [next_token] in a buffer int32 [B, width] (zeros
    after), and their number kept + 1 int32 [B]."""
    j = jnp.arange(width)[None, :]
    padded = jnp.zeros((seq.shape[0], width), jnp.int32).at[:, :min(width, seq.shape[1])].set(
        seq[:, :width].astype(jnp.int32))
    tokens = jnp.where(j < kept[:, None], padded, jnp.where(j == kept[:, None], next_token[:, None], 0))
    return tokens.astype(jnp.int32), (kept + 1).astype(jnp.int32)
