"""Target/draft pairs for the speculative-engine tests, made in memory (no files)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import ssd_jax
from ssd_jax.models.params import init_params


def llama(vocab: int, hidden: int, layers: int, seed: int, scale: float = 0.3, eos=(1,)) -> ssd_jax.Model:
    config = ssd_jax.ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=512, eos_token_ids=tuple(eos),
    )
    return ssd_jax.Model(config=config, params=init_params(config, jax.random.PRNGKey(seed), scale=scale))


def noisy_copy(model: ssd_jax.Model, noise: float, seed: int) -> ssd_jax.Model:
    """The model with Gaussian noise on every weight: a draft that mostly agrees with it."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + noise * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return model.with_params(jax.tree.unflatten(treedef, noisy))


def pair(vocab: int = 64, seed: int = 0, noise: float = 0.5):
    """(target, draft): a 2-layer target and a noisy copy of it as the draft."""
    target = llama(vocab, 64, 2, seed)
    return target, noisy_copy(target, noise, seed + 1)
