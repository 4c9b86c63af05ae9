"""Logits -> probabilities, the one function every decoding method uses on both draft and target.

Processing order (as transformers): temperature, then top-k, then top-p, all in float32.
Temperature 0 means greedy: the distribution is the one-hot of the argmax (lowest id on ties).

Two couplings of the draft with the target (`SamplingParams.coupling`): "rejection" (speculative
sampling: drafts are random draws, verification accepts or rejects them at random, the output has
the target's law) and "gumbel" (`ssd_jax.coupling`: every token is the argmax of the processed
log-law plus Gumbel noise keyed by the row and the position, the same noise for draft and target,
so the output is exactly autoregressive sampling's for the key, whatever the method). Under
"gumbel" at T > 0 every decision is an argmax, of the perturbed logits (`by_argmax`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax.errors import InputError


COUPLINGS = ("rejection", "gumbel")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0 = greedy); top_k >= 1 or None; top_p in (0, 1] or None; coupling:
    "rejection" (default) or "gumbel" (drafter-invariant, `ssd_jax.coupling`).

    Hashable: jitted decoders take it as a static argument.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    coupling: str = "rejection"

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0 or t == float("inf"):
            raise InputError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1):
            raise InputError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and (
            not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1
        ):
            raise InputError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if not isinstance(self.coupling, str) or self.coupling not in COUPLINGS:
            raise InputError(f"coupling must be one of {', '.join(map(repr, COUPLINGS))}, got {self.coupling!r}")
        object.__setattr__(self, "temperature", float(t))

    @property
    def greedy(self) -> bool:
        """Temperature 0: every token is the argmax of the logits."""
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """The Gumbel coupling at T > 0: tokens are argmaxes of Gumbel-perturbed log-laws."""
        return self.coupling == "gumbel" and not self.greedy

    @property
    def by_argmax(self) -> bool:
        """Whether every decision (drafting, verification, review) is an argmax: at T = 0 of the
        logits, under the Gumbel coupling of the perturbed logits (`ssd_jax.coupling.decision_logits`).
        Decoding code branches on this, never on `greedy`."""
        return self.greedy or self.coupled


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [..., V] (any float dtype) -> float32 probabilities [..., V] summing to 1: the
    processed law, or where decisions are argmaxes (`by_argmax`) the one-hot of the argmax of
    what it is given (under the Gumbel coupling, perturbed logits)."""
    logits = logits.astype(jnp.float32)
    if params.by_argmax:
        return jax.nn.one_hot(argmax_first(logits), logits.shape[-1], dtype=jnp.float32)
    return processed_law(logits, params)


def processed_law(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The law at T > 0 whatever the coupling: logits [..., V] -> float32 [..., V], temperature,
    top-k and top-p applied."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if params.top_p is not None and params.top_p < 1.0:
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p  # always keeps the most likely token
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws one token per row: probs float32 [..., V] -> int32 [...]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def sample_from_logits(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """probabilities + sample, with argmax decisions (`by_argmax`) short-circuited: int32 [...]."""
    if params.by_argmax:
        return argmax_first(logits)
    return sample(key, probabilities(logits, params))


def argmax_first(x):
    """argmax over the last axis, ties to the lowest index, as int32; 0 for an all-NaN row.
    A max followed by a masked max of -index: both are plain reductions, several times faster
    on CPU than jnp.argmax's (value, index) reduction. Indices are exact in float32 below 2^24."""
    n = x.shape[-1]
    if n >= 1 << 24:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)
    neg_ids = -jnp.arange(n, dtype=jnp.float32)
    first = -jnp.max(jnp.where(x == top, neg_ids, -jnp.inf), axis=-1)
    return jnp.where(first < n, first, 0).astype(jnp.int32)
