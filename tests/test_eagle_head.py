"""The feature-level draft head (`ssd_jax.eagle`): its config checks, its training-time test against
drafting through its cache, checkpoints, and training."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.eagle import EagleHead, HeadConfig, default_feature_layers, init_head, load_head, save_head
from ssd_jax.eagle.forward import fused_features, head_forward_cached, training_time_test
from ssd_jax.eagle.head import check_head_params
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.transformer import forward_full
from spec_models import llama


@pytest.fixture(scope="module")
def target():
    return llama(64, 32, 4, seed=3)


def _random_head(target, seed: int = 0, **kwargs) -> EagleHead:
    """A head with every weight random (a fresh head's fuse map is an average: too regular to
    catch a mix-up of features)."""
    head = init_head(target, **kwargs)
    leaves, treedef = jax.tree.flatten(head.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return head.with_params(jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape) for x, k in
                                                         zip(leaves, keys)]))


def test_default_feature_layers_are_low_middle_and_last():
    assert default_feature_layers(6) == (1, 3, 5)
    assert default_feature_layers(32) == (1, 16, 31)
    assert default_feature_layers(2) == (1,)
    assert default_feature_layers(1) == (0,)


@pytest.mark.parametrize("depths", [1, 3])
def test_training_time_test_equals_drafting_through_the_cache(target, depths):
    """Depth s of the training-time test at position t equals what drafting from the root at
    P = t - s + 2 computes through the head's cache: the entries before P read the target's
    features, each later one the head's own output before it. Checked at every depth for two
    roots and both rows (ragged: the rows' roots differ)."""
    head = _random_head(target, feature_layers=(0, 2, 3))
    tcfg, tparams = target.config, target.params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    _, features = forward_full(tparams, tcfg, tokens, feature_layers=head.config.feature_layers)
    trained = training_time_test(head.params, tparams, tcfg, head.config, features[:, :-1], tokens[:, 1:], depths)
    layer_config = head.config.layer_config(tcfg)
    fused = fused_features(head.params, features)
    for roots in ((3, 5), (7, 4)):
        for row, root in enumerate(roots):
            one = slice(row, row + 1)
            cache = init_cache(layer_config, 1, 32, tparams["embed"].dtype)
            positions = jnp.arange(root, dtype=jnp.int32)[None, :]
            logits, cache, outputs = head_forward_cached(head.params, tparams, layer_config, fused[one, :root],
                                                         tokens[one, 1:root + 1], positions, cache)
            cache = cache.replace(lengths=cache.lengths + root)
            # Depth 1 is the committed entry at root - 1; depth d >= 2 the draft entry at root + d - 2.
            np.testing.assert_allclose(logits[0, root - 1], trained[0][row, root - 1], rtol=1e-4, atol=1e-4)
            hidden = outputs[:, root - 1:root]
            for depth in range(2, depths + 1):
                position = root + depth - 2
                logits, cache, out = head_forward_cached(
                    head.params, tparams, layer_config, hidden, tokens[one, position + 1:position + 2],
                    jnp.full((1, 1), position, jnp.int32), cache)
                cache = cache.replace(lengths=cache.lengths + 1)
                np.testing.assert_allclose(logits[0, 0], trained[depth - 1][row, position], rtol=1e-4, atol=1e-4)
                hidden = out


def test_the_head_borrows_the_targets_embedding_norm_and_head(target):
    """A head's params hold only the fuse map and its layer; its logits move with the target's
    LM head and embedding (shared, frozen), not with a copy."""
    head = init_head(target)
    assert set(head.params) == {"fuse", "layers"}
    check_head_params(head, target.config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 6)), jnp.int32)
    _, features = forward_full(target.params, target.config, tokens, feature_layers=head.config.feature_layers)
    run = lambda tparams: training_time_test(head.params, tparams, target.config, head.config,  # noqa: E731
                                             features[:, :-1], tokens[:, 1:], 1)[0]
    scaled = dict(target.params, embed=target.params["embed"] * 2.0)
    assert not np.allclose(run(target.params), run(scaled))


def test_bad_heads_and_targets_are_refused(target):
    with pytest.raises(InputError, match=r"feature layer\(s\) \[4\] out of range"):
        init_head(target, feature_layers=(0, 4))
    with pytest.raises(InputError, match="distinct and increasing"):
        init_head(target, feature_layers=(2, 1))
    with pytest.raises(InputError, match="intermediate_size must be >= 1"):
        init_head(target, intermediate_size=0)
    head = init_head(target)
    other = llama(80, 32, 4, seed=1)
    with pytest.raises(InputError, match="vocab_size=64.*vocab_size=80"):
        head.check_target(other)
    with pytest.raises(InputError, match="hidden_size"):
        head.check_target(llama(64, 48, 4, seed=1))
    shallow = llama(64, 32, 2, seed=1)
    with pytest.raises(InputError, match="out of range for a target of 2 layers"):
        head.check_target(shallow)
    bad = head.with_params(dict(head.params, fuse={"kernel": jnp.zeros((3, 3))}))
    with pytest.raises(InputError, match=r"\['fuse'\]\['kernel'\] has shape \(3, 3\)"):
        check_head_params(bad, target.config)


def test_a_head_saves_loads_and_converts(target, tmp_path):
    head = _random_head(target)
    path = save_head(head, str(tmp_path / "head"))
    loaded = load_head(path, target=target)
    assert loaded.config == head.config and loaded.path == path
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded.params, head.params)
    half = load_head(save_head(head, str(tmp_path / "bf16"), dtype="bfloat16"), dtype="float32")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2), half.params, head.params)
    assert os.path.getsize(tmp_path / "bf16" / "head.safetensors") < 0.6 * os.path.getsize(
        tmp_path / "head" / "head.safetensors")


def test_a_failed_save_leaves_the_good_head(target, tmp_path, monkeypatch):
    """Saving over a head needs overwrite=True, and a save that fails part-way leaves the head
    that was there, with no partial directory beside it."""
    path = save_head(_random_head(target, seed=1), str(tmp_path / "head"))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(InputError, match="exists and is not empty"):
        save_head(init_head(target), path)
    import safetensors.numpy

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_head(init_head(target), path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before
    kept = load_head(path, target=target)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), kept.params,
                 _random_head(target, seed=1).params)


def test_loading_checks_the_directory_and_the_target(target, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_head(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="head_config.json is missing"):
        load_head(str(tmp_path / "empty"))
    path = save_head(init_head(target), str(tmp_path / "head"))
    with pytest.raises(InputError, match="vocab_size"):
        load_head(path, target=llama(80, 32, 4, seed=1))
    with open(os.path.join(path, "head_config.json"), "w") as f:
        json.dump({"feature_layers": [1]}, f)
    with pytest.raises(CheckpointError, match="malformed"):
        load_head(path)


def test_head_config_round_trips_through_json(target):
    config = HeadConfig.for_target(target.config, (0, 3), 40)
    assert HeadConfig.from_json(config.to_json()) == config
    assert dataclasses.replace(config, feature_layers=(0,)) != config
