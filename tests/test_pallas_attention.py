"""The TPU policy's decode attention (`ssd_jax.models.pallas_attention`): the Pallas kernel run by
Pallas's interpreter on CPU against the reference attention (float32, within 1e-5) for causal
steps, token trees, grouped heads, soft-capping, sliding windows and caches read in several
blocks; greedy identity of decoding through it; its lowering for TPU; and its partitioning over a
mesh (a subprocess with fake CPU devices)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.runtime import compile_cache
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.pallas_attention import block_size, pallas_attention, supports
from ssd_jax.models.params import init_params
from ssd_jax.models.transformer import _attend, forward_cached
from tests.subprocess_env import fake_devices_env


def _config(kv_heads=2, heads=6, head_dim=16, softcap=None, window=None):
    return ModelConfig(model_type="mistral" if window else "llama", vocab_size=97, hidden_size=48,
                       intermediate_size=64, num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=2048, sliding_window=window, attn_logit_softcap=softcap)


def _tree_mask(parents) -> np.ndarray:
    """bool [N, N]: node i sees itself and its ancestors."""
    tree = np.eye(len(parents), dtype=bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree[node, parent] = True
            parent = parents[parent]
    return tree


def _cache_mask(lengths, new: np.ndarray, capacity: int) -> jnp.ndarray:
    """bool [B, T, S]: committed slots plus the new tokens' own mask `new` [T, T] at slots lengths+j."""
    lengths = np.asarray(lengths)
    t = new.shape[0]
    slots = np.arange(capacity)
    mask = np.zeros((len(lengths), t, capacity), bool)
    for row, length in enumerate(lengths):
        mask[row] = slots[None, :] < length
        mask[row, :, length:length + t] = new
    return jnp.asarray(mask)


CASES = {
    # name: (T, heads, kv_heads, capacity, lengths, new-token mask, softcap, dtype)
    "one token, one block": (1, 6, 2, 128, [5, 100], np.ones((1, 1), bool), None, jnp.float32),
    "causal block, 3 blocks, blocks skipped": (4, 6, 2, 1536, [700, 3], np.tri(4, dtype=bool), None, jnp.float32),
    "token tree, grouped heads": (6, 8, 2, 512, [130, 255], _tree_mask([-1, 0, 0, 1, 1, 2]), None, jnp.float32),
    "one KV head per query head": (3, 4, 4, 256, [0, 17], np.tri(3, dtype=bool), None, jnp.float32),
    "soft-capped scores": (2, 6, 3, 384, [40, 200], np.tri(2, dtype=bool), 5.0, jnp.float32),
    "a capacity taken whole": (2, 6, 2, 300, [250, 1], np.tri(2, dtype=bool), None, jnp.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_reference_attention(case):
    t, heads, kv_heads, capacity, lengths, new, softcap, dtype = CASES[case]
    config = _config(kv_heads, heads, softcap=softcap)
    keys = jax.random.split(jax.random.PRNGKey(len(case)), 3)
    b = len(lengths)
    q = jax.random.normal(keys[0], (b, t, heads, config.head_dim), dtype)
    k = jax.random.normal(keys[1], (b, kv_heads, capacity, config.head_dim), dtype)
    v = jax.random.normal(keys[2], (b, kv_heads, capacity, config.head_dim), dtype)
    mask = _cache_mask(lengths, new, capacity)
    reference = _attend(config, q, k, v, mask)
    kernel = pallas_attention(q, k, v, mask, scale=config.head_dim ** -0.5, softcap=softcap, interpret=True)
    assert kernel.shape == reference.shape and kernel.dtype == reference.dtype
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), rtol=1e-5, atol=1e-5)


def test_kernel_in_bfloat16_is_close_to_the_reference():
    config = _config()
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    q = jax.random.normal(keys[0], (2, 3, 6, 16), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 2, 256, 16), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 2, 256, 16), jnp.bfloat16)
    mask = _cache_mask([60, 200], np.tri(3, dtype=bool), 256)
    reference = _attend(config, q, k, v, mask).astype(jnp.float32)
    kernel = pallas_attention(q, k, v, mask, scale=0.25, interpret=True)
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(kernel.astype(jnp.float32)), np.asarray(reference), atol=0.03)


def test_block_sizes_and_supported_capacities():
    assert [block_size(s) for s in (128, 384, 1024, 4096, 300, 1000)] == [128, 128, 512, 512, 300, 1000]
    assert not supports(1030) and supports(2048)
    q = jnp.zeros((1, 1, 2, 16))
    cache = jnp.zeros((1, 2, 1030, 16))
    with pytest.raises(ValueError, match="1030 slots"):
        pallas_attention(q, cache, cache, jnp.ones((1, 1, 1030), bool), scale=0.25, interpret=True)


@pytest.mark.parametrize("window", [None, 5])
def test_forward_through_the_kernel_matches_the_reference(window):
    """forward_cached with decode_attention="pallas_interpret": a prompt into an empty cache, then a
    token tree after it; logits within 1e-5 of the reference attention's (float32)."""
    config = _config(window=window)
    params = init_params(config, jax.random.PRNGKey(5))
    prompt = jax.random.randint(jax.random.PRNGKey(6), (2, 9), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    cache = init_cache(config, 2, 256)
    ref_logits, ref_cache = forward_cached(params, config, prompt, positions, cache, decode_attention="reference")
    pallas_logits, pallas_cache = forward_cached(params, config, prompt, positions, cache,
                                                 decode_attention="pallas_interpret")
    np.testing.assert_allclose(np.asarray(pallas_logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pallas_cache.k), np.asarray(ref_cache.k), rtol=1e-6, atol=1e-6)
    cache = ref_cache.replace(lengths=jnp.array([9, 6], jnp.int32))
    tree = _tree_mask([-1, 0, 0, 1, 1, 2])
    depth = tree.sum(1) - 1
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 6), 0, config.vocab_size)
    tree_positions = cache.lengths[:, None] + jnp.asarray(depth)[None]
    tree_mask = jnp.broadcast_to(jnp.asarray(tree), (2, 6, 6))
    ref, _ = forward_cached(params, config, tokens, tree_positions, cache, tree_mask, decode_attention="reference")
    pallas, _ = forward_cached(params, config, tokens, tree_positions, cache, tree_mask,
                               decode_attention="pallas_interpret")
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_unknown_decode_attention_is_refused():
    config = _config()
    params = init_params(config, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="'flash'"):
        forward_cached(params, config, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                       init_cache(config, 1, 8), decode_attention="flash")


@pytest.mark.parametrize("method", ["ar", "sd", "logitspec"])
def test_greedy_decoding_through_the_kernel_equals_the_reference(monkeypatch, method):
    """The CPU policy switched to the interpreted kernel: AR, SD and LogitSpec (a token tree) give
    the tokens of the reference attention."""
    target, draft = ssd_jax.default_models()
    encode = target.tokenizer.encode
    prompts = [encode("def fibonacci(n):\n").ids, encode("import os\nimport sys\n").ids]
    kwargs = dict(max_new_tokens=24, method=method, **({"draft": draft} if method == "sd" else {}))
    reference = ssd_jax.generate(target, prompts, **kwargs)
    patched = dataclasses.replace(backend.POLICIES["cpu"], decode_attention="pallas_interpret")
    monkeypatch.setitem(backend.POLICIES, "cpu", patched)
    compile_cache.clear()
    try:
        out = ssd_jax.generate(target, prompts, **kwargs)
    finally:
        compile_cache.clear()
    assert out.tokens == reference.tokens


def test_forward_lowers_for_tpu_with_the_kernel():
    """The TPU path compiles to a Mosaic custom call (lowered here on CPU; compiled only on a TPU)."""
    config = dataclasses.replace(_config(kv_heads=2, heads=8, head_dim=128), hidden_size=256)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), shapes)
    cache = jax.eval_shape(lambda: init_cache(config, 2, 1024, dtype=jnp.bfloat16))
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)

    def step(params, tokens, cache):
        return forward_cached(params, config, tokens, cache.lengths[:, None] + jnp.arange(5), cache,
                              decode_attention="pallas")

    text = jax.jit(step).trace(params, tokens, cache).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.pallas_attention import pallas_attention
from ssd_jax.models.transformer import _attend
config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=64, num_layers=1,
                     num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=1024)
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(keys[0], (2, 3, 8, 16))
k = jax.random.normal(keys[1], (2, 4, 512, 16))
v = jax.random.normal(keys[2], (2, 4, 512, 16))
slots = jnp.arange(512)
mask = slots[None, None, :] < jnp.array([300, 7])[:, None, None] + jnp.arange(3)[None, :, None] + 1
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
split = NamedSharding(mesh, P("data", "model", None, None))
f = jax.jit(lambda q, k, v, m: pallas_attention(q, k, v, m, scale=0.25, interpret=True))
out = f(q, jax.device_put(k, split), jax.device_put(v, split), mask)
np.testing.assert_allclose(np.asarray(out), np.asarray(_attend(config, q, k, v, mask)), rtol=1e-5, atol=1e-5)
compiled = f.lower(q, jax.device_put(k, split), jax.device_put(v, split), mask).compile().as_text()
assert "all-gather" not in compiled, "the cache was gathered"
print("ok", out.sharding.spec)
"""


def test_kernel_on_a_mesh_runs_per_shard():
    """Cache split over rows and KV heads on 4 fake CPU devices: the custom partitioning runs the
    kernel on each shard (no all-gather in the compiled program) and matches the reference."""
    env = fake_devices_env(4)
    run = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok")
