"""Logits -> probabilities, the one function every decoding method uses on both draft and target.

Processing order (as transformers): temperature, then top-k, then top-p, all in float32.
Temperature 0 means greedy: the distribution is the one-hot of the argmax (lowest id on ties).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0 = greedy); top_k >= 1 or None; top_p in (0, 1] or None.

    Hashable: jitted decoders take it as a static argument.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

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
        object.__setattr__(self, "temperature", float(t))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [..., V] (any float dtype) -> float32 probabilities [..., V] summing to 1."""
    logits = logits.astype(jnp.float32)
    if params.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    logits = logits / params.temperature
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
    """probabilities + sample, with the greedy case short-circuited to argmax: int32 [...]."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(key, probabilities(logits, params))
