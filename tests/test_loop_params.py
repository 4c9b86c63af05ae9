"""`loop_params`: the decode loops' weights are prepared once per params object, reused, and the
cache holds no params alive."""

import gc

import jax
import numpy as np
import pytest

from ssd_jax.runtime import loop_params as loop_params_module
from ssd_jax.loop.autoregressive import unroll_layers
from ssd_jax.runtime.loop_params import loop_params
from ssd_jax.models.transformer import decode_params
from tests.spec_models import llama

pytestmark = pytest.mark.skipif(not unroll_layers(), reason="loop params are prepared on CPU only")


def test_loop_params_are_made_once_and_already_decoded():
    model = llama(32, 16, 2, seed=3)
    first = loop_params(model)
    assert loop_params(model) is first
    assert isinstance(first["layers"], tuple) and "qkv" in first["layers"][0]
    # decode_params inside the loop finds nothing left to do: the same arrays come back.
    again = decode_params(first, model.config)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(first)))
    expected = jax.jit(decode_params, static_argnums=1)(model.params, model.config)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_new_params_get_their_own_entry_and_the_cache_stays_small():
    models = [llama(32, 16, 2, seed=s) for s in range(loop_params_module._LOOP_PARAMS_KEPT + 2)]
    decoded = [loop_params(m) for m in models]
    assert len({id(d) for d in decoded}) == len(models)
    assert len(loop_params_module._LOOP_PARAMS) <= loop_params_module._LOOP_PARAMS_KEPT
    # A model with the same config but other weights never gets another model's weights.
    other = models[0].with_params(jax.tree.map(lambda x: x + 1, models[0].params))
    np.testing.assert_array_equal(np.asarray(loop_params(other)["embed"]), np.asarray(other.params["embed"]))


def test_the_cache_holds_no_params_alive():
    loop_params_module._LOOP_PARAMS.clear()
    model = llama(32, 16, 2, seed=9)
    loop_params(model)
    assert len(loop_params_module._LOOP_PARAMS) == 1
    del model
    gc.collect()
    assert len(loop_params_module._LOOP_PARAMS) == 0
