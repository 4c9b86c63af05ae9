"""The target forwards' features (`feature_layers`): the residual stream after named layers, what a
feature-level draft head (EAGLE-3 style) reads, from the reference forward and through the cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.transformer import forward_cached, forward_full, lm_head, unstack_layers
from spec_models import llama


@pytest.fixture(scope="module")
def target():
    return llama(64, 32, 4, seed=2)


def _first_layers(model, count: int):
    """The model cut after its first `count` layers (stacked params sliced, config shortened)."""
    config = dataclasses.replace(model.config, num_layers=count)
    params = dict(model.params, layers=jax.tree.map(lambda x: x[:count], model.params["layers"]))
    return config, params


def test_each_feature_is_its_layers_output(target):
    """Layer i's feature, through the final norm and LM head, gives the logits of the model cut
    after layer i; the last layer's gives the model's own; the layers come back in the order
    asked, stacked or unrolled alike."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
    layers = (3, 0, 2)
    logits, features = forward_full(target.params, target.config, tokens, feature_layers=layers)
    assert features.shape == (2, 7, 3, 32) and features.dtype == target.params["embed"].dtype
    np.testing.assert_allclose(logits, forward_full(target.params, target.config, tokens), atol=1e-6)
    for k, layer in enumerate(layers):
        config, params = _first_layers(target, layer + 1)
        np.testing.assert_allclose(lm_head(params, config, features[:, :, k]), forward_full(params, config, tokens),
                                   atol=2e-5)
    _, unrolled = forward_full(unstack_layers(target.params), target.config, tokens, feature_layers=layers)
    np.testing.assert_allclose(unrolled, features, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("per_layer", [False, True])
def test_cached_forward_returns_the_reference_features(target, per_layer):
    """Through the cache (a prompt, then two more tokens), the features equal the reference
    forward's at the same positions, whatever logit_indices selects."""
    config = target.config
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    _, reference = forward_full(target.params, config, tokens, feature_layers=(1, 3))
    cache = init_cache(config, 2, 16, target.params["embed"].dtype, per_layer=per_layer)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    _, cache, first = forward_cached(target.params, config, tokens[:, :7], positions, cache, feature_layers=(1, 3),
                                     logit_indices=jnp.full((2, 1), 6, jnp.int32))
    cache = cache.replace(lengths=cache.lengths + 7)
    logits, _, second = forward_cached(target.params, config, tokens[:, 7:], positions[:, :2] + 7, cache,
                                       feature_layers=(1, 3))
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), reference, atol=2e-5)
    np.testing.assert_allclose(logits, forward_full(target.params, config, tokens)[:, 7:], atol=2e-5)


def test_feature_layers_out_of_range_are_refused(target):
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"feature layers \[4\] outside 0..3"):
        forward_full(target.params, target.config, tokens, feature_layers=(0, 4))
