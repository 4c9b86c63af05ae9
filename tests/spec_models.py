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


def pair(vocab: int = 64, seed: int = 0, noise: float = 0.5, layers: int = 2):
    """(target, draft): a target of `layers` layers (2: the stacked caches' per-layer indexing is
    exercised) and a noisy copy of it as the draft."""
    target = llama(vocab, 64, layers, seed)
    return target, noisy_copy(target, noise, seed + 1)


def law_pair(vocab: int = 4):
    """(target, draft) for the sampled-law tests: a 1-layer target over a tiny vocabulary (no
    EOS) and a draft far enough from it that verification matters."""
    target = llama(vocab, 32, 1, seed=3, scale=0.4, eos=())
    return target, noisy_copy(target, 1.0, 4)


def exact_law(target, prompt: list, sampling, new: int):
    """P(x1..x_new | prompt) for every continuation, float64 array [V] * new (by full forwards)."""
    import itertools

    import numpy as np

    from ssd_jax.sampling import probabilities

    vocab = target.config.vocab_size
    law = np.zeros((vocab,) * new)
    for seq in itertools.product(range(vocab), repeat=new):
        probs = np.asarray(probabilities(ssd_jax.forward(target, np.array([prompt + list(seq)]))[0], sampling),
                           np.float64)
        law[seq] = np.prod([probs[len(prompt) - 1 + i, seq[i]] for i in range(new)])
    return law / law.sum()
