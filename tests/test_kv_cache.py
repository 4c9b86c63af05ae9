"""Tree attention, rollback and compaction through the static cache, against plain forwards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.models.kv_cache import commit, compact_path, init_cache, rollback
from ssd_jax.models.transformer import forward_cached

# A tree of 7 new tokens after the prefix: node -> parent (-1 = child of the last prefix token).
PARENTS = [-1, 0, 0, 1, 2, 2, 5]


def _tree_arrays(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


def _path(parents, leaf):
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _prefilled(model, prefix, capacity=32):
    step = jax.jit(forward_cached, static_argnames=("config",))
    b, t = prefix.shape
    cache = init_cache(model.config, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, cache = step(model.params, config=model.config, tokens=jnp.asarray(prefix), positions=positions, cache=cache)
    return commit(cache, jnp.full((b,), t, jnp.int32)), step


def _committed(cache, row):
    n = int(cache.lengths[row])
    return np.asarray(cache.k[:, row, :, :n]), np.asarray(cache.v[:, row, :, :n])


@pytest.mark.parametrize("family_name", ["llama3", "mistral", "gpt2"])
def test_tree_forward_equals_each_path(family_name, hf_family):
    model = ssd_jax.load(hf_family(family_name)[0])
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.config.vocab_size, (1, 9)).astype(np.int32)
    nodes = rng.integers(0, model.config.vocab_size, (1, len(PARENTS))).astype(np.int32)
    mask, depth = _tree_arrays(PARENTS)
    cache, step = _prefilled(model, prefix)
    positions = jnp.asarray(prefix.shape[1] + depth[None])
    logits, _ = step(model.params, config=model.config, tokens=jnp.asarray(nodes), positions=positions,
                     cache=cache, tree_mask=jnp.asarray(mask[None]))
    for leaf in range(len(PARENTS)):
        path = _path(PARENTS, leaf)
        sequence = np.concatenate([prefix[0], nodes[0, path]])[None]
        expected = np.asarray(ssd_jax.forward(model, sequence))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[0, leaf]), expected, rtol=1e-4, atol=1e-4)


def test_compaction_equals_cache_of_accepted_tokens(hf_family):
    model = ssd_jax.load(hf_family("qwen3")[0])
    rng = np.random.default_rng(1)
    prefixes = rng.integers(0, model.config.vocab_size, (2, 6)).astype(np.int32)
    nodes = rng.integers(0, model.config.vocab_size, (2, len(PARENTS))).astype(np.int32)
    mask, depth = _tree_arrays(PARENTS)
    cache, step = _prefilled(model, prefixes)
    _, cache = step(model.params, config=model.config, tokens=jnp.asarray(nodes),
                    positions=jnp.asarray(6 + np.stack([depth, depth])), cache=cache,
                    tree_mask=jnp.asarray(np.stack([mask, mask])))
    # Row 0 keeps the path to node 6 (0 -> 2 -> 5 -> 6), row 1 only its first two nodes (0 -> 1).
    paths = [_path(PARENTS, 6), _path(PARENTS, 3)]
    keep = np.array([4, 2], np.int32)
    node_indices = np.zeros((2, 4), np.int32)
    for r, path in enumerate(paths):
        node_indices[r, : len(path)] = path
    compacted = compact_path(cache, jnp.asarray(node_indices), jnp.asarray(keep))
    for r, path in enumerate(paths):
        accepted = np.concatenate([prefixes[r], nodes[r, path[: keep[r]]]])[None]
        reference, _ = _prefilled(model, accepted)
        for ours, ref in zip(_committed(compacted, r), _committed(reference, 0)):
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_rollback_equals_cache_of_kept_tokens(hf_family):
    model = ssd_jax.load(hf_family("llama_mqa_tied")[0])
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, model.config.vocab_size, (1, 5)).astype(np.int32)
    draft = rng.integers(0, model.config.vocab_size, (1, 4)).astype(np.int32)
    cache, step = _prefilled(model, prefix)
    _, cache = step(model.params, config=model.config, tokens=jnp.asarray(draft),
                    positions=jnp.asarray(5 + np.arange(4)[None], jnp.int32), cache=cache)
    cache = rollback(commit(cache, jnp.array([4], jnp.int32)), jnp.array([7], jnp.int32))
    reference, _ = _prefilled(model, np.concatenate([prefix, draft[:, :2]], axis=1))
    for ours, ref in zip(_committed(cache, 0), _committed(reference, 0)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # The next token through the rolled-back cache equals the reference forward.
    token = jnp.asarray(draft[:, 3:4])
    logits, _ = step(model.params, config=model.config, tokens=token, positions=jnp.array([[7]], jnp.int32), cache=cache)
    expected = ssd_jax.forward(model, np.concatenate([prefix, draft[:, :2], draft[:, 3:4]], axis=1))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0, 0]), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_writes_past_capacity_are_dropped(hf_family):
    model = ssd_jax.load(hf_family("llama3")[0])
    cache, step = _prefilled(model, np.arange(1, 7, dtype=np.int32)[None], capacity=8)
    before = np.asarray(cache.k)
    tokens = jnp.arange(10, 14, dtype=jnp.int32)[None]  # slots 6..9; 8 and 9 do not exist
    _, after = step(model.params, config=model.config, tokens=tokens,
                    positions=jnp.arange(6, 10, dtype=jnp.int32)[None], cache=cache)
    np.testing.assert_array_equal(np.asarray(after.k)[:, :, :, :6], before[:, :, :, :6])
    assert after.k.shape == cache.k.shape
