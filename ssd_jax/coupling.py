"""The Gumbel coupling (`SamplingParams(coupling="gumbel")`): drafter-invariant sampling.

The token at sequence position s of row r is

    argmax_x  log p(x | text before s) + G_{r,s}(x),   G_{r,s} = Gumbel noise [V] from fold_in(k_r, s)

with log p the processed log-law (temperature, then top-k and top-p, as `ssd_jax.sampling`) and
k_r the row's key. By the Gumbel-max trick this is an exact draw from p; the noise depends on
nothing but the row's key and the position, so the tokens are those of autoregressive sampling
with that key whatever drafts, verifies or batches them. Drafters perturb their own log-laws with
the same noise (a draft model proposes argmax(log q + G), a tree keeps the top candidates under
log q + G), and the target accepts a draft token exactly where it is its own perturbed argmax:
every method is its greedy algorithm run on perturbed logits (`decision_logits`), and greedy
speculation reproduces greedy decoding token for token. The acceptance per token is
P(argmax(log p + G) = argmax(log q + G)) >= (1 - TV(p, q)) / (1 + TV(p, q)) (Daliri, Musco,
Suresh 2024, "Coupling without communication and drafter-invariant speculative decoding").

Positions are absolute (prompt tokens at 0..P-1, the first new token at P), so padding, bucket
widths and batch companions do not change a row's noise. A forward whose input token sits at
position s gives the law of the token at s + 1: callers pass that position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.sampling import SamplingParams, argmax_first


def log_law(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """The processed log-law at T > 0 up to a constant per row: logits [..., V] -> float32 [..., V],
    logits / T, -inf outside top-k and top-p (top-p keeps the smallest most-likely set holding
    top_p of the mass, as `ssd_jax.sampling.processed_law`). A constant per row moves no argmax,
    so the perturbed argmax needs no normalisation."""
    scaled = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        probs = jax.nn.softmax(scaled, axis=-1)
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        keep_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < sampling.top_p
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return scaled


def gumbel_noise(keys: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise of the tokens at `positions`: keys uint32 [N, 2] (the rows' keys),
    positions int32 [N, ...] -> float32 [N, ..., vocab]; entry (n, ..., x) from
    fold_in(keys[n], position), so it depends on the row's key, the position and the vocabulary
    size alone."""

    def row(key, pos):
        flat = pos.reshape(-1)
        noise = jax.vmap(lambda s: jax.random.gumbel(jax.random.fold_in(key, s), (vocab,), jnp.float32))(flat)
        return noise.reshape(pos.shape + (vocab,))

    return jax.vmap(row)(keys, positions)


def decision_logits(logits: jax.Array, keys: jax.Array, positions: jax.Array, sampling: SamplingParams,
                    copies: int = 1) -> jax.Array:
    """What a method's argmax decisions read (`SamplingParams.by_argmax`): under the Gumbel
    coupling the perturbed log-law log p + G (float32, up to a constant per row), else the logits
    unchanged.

    logits [N, ..., V]: laws of the tokens at positions int32 [N, ...] (a forward's input
    positions + 1), for rows with keys uint32 [N, 2] (their noise keys, `ssd_jax.runtime.prompts.row_keys`).
    The argmax of every row is then a sample from p, the same one whoever computes it.
    copies: rows come in groups of that many consecutive copies with one key and the same
    positions (a row's K draft paths), whose noise is drawn once per group.
    """
    if not sampling.coupled:
        return logits
    noise = gumbel_noise(keys[::copies], positions[::copies], logits.shape[-1])
    return log_law(logits, sampling) + (jnp.repeat(noise, copies, axis=0) if copies > 1 else noise)


def coupled_tokens(logits: jax.Array, keys: jax.Array, positions: jax.Array, sampling: SamplingParams) -> jax.Array:
    """The coupled draw: logits [N, ..., V], keys [N, 2], positions int32 [N, ...] -> int32 [N, ...]."""
    return argmax_first(decision_logits(logits, keys, positions, sampling))
