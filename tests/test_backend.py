"""The backend policy (`ssd_jax.backend`): its documented choices per platform, that no other
module asks JAX for the backend, the fused prompt attention against the reference attention, and
greedy identity of every method in bfloat16 (the accelerator dtype) on CPU."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.errors import InputError
from ssd_jax.models.attention import causal_attention
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.params import init_params
from ssd_jax.models.transformer import _attend, forward_cached

PACKAGE = os.path.dirname(os.path.abspath(ssd_jax.__file__))

DOCUMENTED = {
    "cpu": dict(dtype="float32", unroll_layers=True, prefill_attention="reference", decode_attention="reference",
                logitspec_tree_size=8, fused_prefill_min_tokens=0, min_decode_rows=1, unroll_draft_steps=False,
                warm_new_programs=False),
    "gpu": dict(dtype="bfloat16", unroll_layers=True, prefill_attention="cudnn", decode_attention="xla",
                logitspec_tree_size=16, fused_prefill_min_tokens=256, min_decode_rows=2, unroll_draft_steps=False,
                warm_new_programs=True),
    "tpu": dict(dtype="bfloat16", unroll_layers=True, prefill_attention="xla", decode_attention="pallas",
                logitspec_tree_size=64, fused_prefill_min_tokens=256, min_decode_rows=1, unroll_draft_steps=False,
                warm_new_programs=False),
}


@pytest.mark.parametrize("platform", sorted(DOCUMENTED))
def test_policy_per_platform_is_the_documented_one(platform):
    policy = backend.policy_for(platform)
    assert policy.platform == platform
    for field, value in DOCUMENTED[platform].items():
        assert getattr(policy, field) == value, field
    # The module docstring's table states the same choices.
    table = backend.__doc__
    for field, value in DOCUMENTED[platform].items():
        shown = ("yes" if value else "no") if isinstance(value, bool) else str(value)
        row = next(line for line in table.splitlines() if line.startswith(f"| `{field}`"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1 + backend.PLATFORMS.index(platform)] == shown, (field, row)


@pytest.mark.parametrize("alias, platform", [("cuda", "gpu"), ("rocm", "gpu"), ("CPU", "cpu"), ("tpu", "tpu")])
def test_platform_aliases(alias, platform):
    assert backend.normalize_platform(alias) == platform


def test_unknown_platform_is_refused():
    with pytest.raises(InputError, match="'metal'"):
        backend.policy_for("metal")


def test_platform_of_a_model_and_of_tracers():
    target, _ = ssd_jax.default_models()
    assert backend.platform_of(target) == "cpu"
    assert backend.policy_for(target).dtype == "float32"
    assert ssd_jax.methods.for_target(ssd_jax.LogitSpec(), target).tree_size == 8  # the policy's size
    assert ssd_jax.methods.for_target(ssd_jax.LogitSpec(tree_size=32), target).tree_size == 32
    assert target.params["embed"].dtype == jnp.float32  # load's default dtype follows the policy
    seen = []
    jax.jit(lambda p: seen.append(backend.platform_of(p)) or 0)(target.params)
    assert seen == ["cpu"]  # inside jit: the default device's platform


def test_unknown_dtype_name_is_refused():
    target_dir, _ = ssd_jax.defaults.default_model_dirs()
    with pytest.raises(InputError, match="'bf17'"):
        ssd_jax.load(target_dir, dtype="bf17")


_ASKS_FOR_BACKEND = re.compile(r"default_backend\(|\.platform\b|platform_dependent\(|local_devices\(\)\[0\]")


def test_no_other_module_asks_for_the_backend():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "backend.py"):
                continue
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if _ASKS_FOR_BACKEND.search(line.split("#")[0]):
                        offenders.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _config(window=None, kv_heads=2):
    return ModelConfig(model_type="mistral" if window else "llama", vocab_size=97, hidden_size=48,
                       intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=kv_heads, head_dim=16,
                       max_position_embeddings=128, sliding_window=window)


@pytest.mark.parametrize("window, kv_heads", [(None, 2), (None, 1), (5, 3), (1, 6)])
def test_fused_causal_attention_matches_reference(window, kv_heads):
    config = _config(window, kv_heads)
    b, t = 3, 11
    keys = jax.random.split(jax.random.PRNGKey(kv_heads), 3)
    q = jax.random.normal(keys[0], (b, t, config.num_heads, config.head_dim))
    k = jax.random.normal(keys[1], (b, t, kv_heads, config.head_dim))
    v = jax.random.normal(keys[2], (b, t, kv_heads, config.head_dim))
    idx = np.arange(t)
    mask = (idx[:, None] >= idx[None, :]) & ((idx[:, None] - idx[None, :] < window) if window else True)
    reference = _attend(config, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                        jnp.broadcast_to(mask, (b, t, t)))
    fused = causal_attention(q, k, v, window=window, implementation="xla")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_forward_with_fused_attention_matches_reference(window):
    """A ragged, right-padded prompt batch through forward_cached: logits at every real token and
    the written cache equal the reference attention's within 1e-5 (float32)."""
    config = _config(window)
    params = init_params(config, jax.random.PRNGKey(3))
    lengths = jnp.array([9, 4, 12], jnp.int32)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (3, 12), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (3, 12))
    cache = init_cache(config, 3, 20)
    ref_logits, ref_cache = forward_cached(params, config, tokens, positions, cache)
    fused_logits, fused_cache = forward_cached(params, config, tokens, positions, cache, prefill_attention="xla")
    real = np.arange(12)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(fused_logits)[real], np.asarray(ref_logits)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fused_cache.k), np.asarray(ref_cache.k), rtol=1e-6, atol=1e-6)


def test_masked_attention_matches_reference_on_token_trees():
    """The GPU's decode attention (XLA's dot_product_attention with the mask) against the reference
    through forward_cached: a cache holding a prompt, then a token tree (float32, within 1e-5)."""
    config = _config()
    params = init_params(config, jax.random.PRNGKey(5))
    prompt = jax.random.randint(jax.random.PRNGKey(6), (2, 7), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    _, cache = forward_cached(params, config, prompt, positions, init_cache(config, 2, 24))
    cache = cache.replace(lengths=jnp.array([7, 5], jnp.int32))
    parents = np.array([-1, 0, 0, 1, 1, 2])  # a root, two children, three grandchildren
    tree = np.eye(6, dtype=bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree[node, parent] = True
            parent = parents[parent]
    depth = tree.sum(1) - 1
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 6), 0, config.vocab_size)
    tree_positions = cache.lengths[:, None] + jnp.asarray(depth)[None]
    tree_mask = jnp.broadcast_to(jnp.asarray(tree), (2, 6, 6))
    ref, _ = forward_cached(params, config, tokens, tree_positions, cache, tree_mask, decode_attention="reference")
    xla, _ = forward_cached(params, config, tokens, tree_positions, cache, tree_mask, decode_attention="xla")
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_fused_prompt_attention_refuses_token_trees():
    config = _config()
    params = init_params(config, jax.random.PRNGKey(3))
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="token trees"):
        forward_cached(params, config, tokens, jnp.zeros((1, 3), jnp.int32), init_cache(config, 1, 8),
                       tree_mask=jnp.ones((1, 3, 3), bool), prefill_attention="xla")


@pytest.fixture(scope="module")
def bf16_pair():
    return ssd_jax.default_models(dtype="bfloat16")


BF16_METHODS = ["sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd"]


@pytest.mark.parametrize("method", BF16_METHODS)
def test_bfloat16_greedy_identity_with_bfloat16_ar(bf16_pair, method):
    """The accelerator dtype on CPU: every lossless method reproduces bf16 AR token for token."""
    target, draft = bf16_pair
    assert target.params["embed"].dtype == jnp.bfloat16
    encode = target.tokenizer.encode
    prompts = [encode("def fibonacci(n):\n").ids, encode("import os\nimport sys\n\nclass Config").ids]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=48, method="ar")
    uses_draft = method not in ("pld", "logitspec")
    out = ssd_jax.generate(target, prompts, max_new_tokens=48, method=method, **({"draft": draft} if uses_draft else {}))
    assert out.tokens == reference.tokens


def test_ar_padded_to_the_policy_rows_gives_the_same_tokens(monkeypatch):
    """A policy asking for at least 3 decode rows (as GPU asks for 2): a lone row decodes beside
    copies of itself and comes back alone, with the tokens of the unpadded decode, greedy and sampled."""
    import dataclasses

    from ssd_jax.runtime import compile_cache

    target, _ = ssd_jax.default_models()
    ids = target.tokenizer.encode("def main():").ids
    key = jax.random.PRNGKey(3)
    plain = [ssd_jax.generate(target, [ids], max_new_tokens=20, temperature=t, key=key).tokens for t in (0.0, 1.0)]
    monkeypatch.setitem(backend.POLICIES, "cpu", dataclasses.replace(backend.POLICIES["cpu"], min_decode_rows=3))
    compile_cache.clear()
    try:
        padded = [ssd_jax.generate(target, [ids], max_new_tokens=20, temperature=t, key=key) for t in (0.0, 1.0)]
    finally:
        compile_cache.clear()
    assert [p.tokens for p in padded] == plain
    assert len(padded[0].finish_reasons) == 1


@pytest.mark.parametrize("method_name", ["sd", pytest.param("specinfer", marks=pytest.mark.slow)])
def test_unrolled_draft_steps_decode_the_same_tokens(monkeypatch, method_name):
    """`unroll_draft_steps` (drafting's L - 1 forwards written out instead of scanned) changes
    the program, not its values: SD (greedy and sampled) and SpecInfer (sampled, 2 paths) decode
    the same tokens from the same key either way. ("auto"'s per-cap steps draft through the same
    call with the same flag; their programs take ~30 s to compile here.)"""
    import dataclasses

    from ssd_jax.draft.model_chain import draft_paths
    from ssd_jax.runtime import compile_cache
    from ssd_jax.loop import speculative

    target, draft = ssd_jax.default_models()
    ids = target.tokenizer.encode("def main():").ids
    key = jax.random.PRNGKey(5)
    cases = [(0.0, 4), (1.0, 3)] if method_name == "sd" else [(1.0, 3)]

    def run():
        outs = []
        for temperature, length in cases:
            method = (ssd_jax.SD(draft_len=length) if method_name == "sd"
                      else ssd_jax.SpecInfer(draft_len=length, paths=2))
            outs.append(ssd_jax.generate(target, [ids], method=method, draft=draft, max_new_tokens=24,
                                         temperature=temperature, key=key).tokens)
        return outs

    seen = []   # the unroll flag of every drafting traced
    monkeypatch.setattr(speculative, "draft_paths", lambda *a, **kw: seen.append(kw["unroll"]) or draft_paths(*a, **kw))
    compile_cache.clear()
    scanned = run()
    assert seen and not any(seen)
    monkeypatch.setitem(backend.POLICIES, "cpu", dataclasses.replace(backend.POLICIES["cpu"], unroll_draft_steps=True))
    seen.clear()
    compile_cache.clear()
    try:
        unrolled = run()
    finally:
        compile_cache.clear()
    assert seen and all(seen)
    assert unrolled == scanned


@pytest.mark.parametrize("num_draft_tokens", [2, 3])
def test_unrolled_drafting_lowers_without_its_loop(num_draft_tokens):
    """`draft_paths(unroll=True)` writes its L - 1 forwards out even for one forward (L = 2), where
    `lax.scan(unroll=True)` would still lower a `while` of one turn: the program exported for a GPU
    holds one loop fewer than the scanned one (the others are the stacked layers' scans)."""
    import functools

    from ssd_jax.draft.model_chain import draft_paths
    from ssd_jax.sampling import SamplingParams

    config = _config()
    params = init_params(config, jax.random.PRNGKey(3))
    args = dict(cache=init_cache(config, 2, 16), chunk=jnp.ones((2, 1), jnp.int32), chunk_len=jnp.ones((2,), jnp.int32),
                keys=jax.random.split(jax.random.PRNGKey(0), 2))
    loops = {}
    for unroll in (False, True):
        drafting = jax.jit(functools.partial(draft_paths, config=config, num_draft_tokens=num_draft_tokens,
                                             sampling=SamplingParams(temperature=1.0), target_vocab=config.vocab_size,
                                             unroll=unroll))
        text = jax.export.export(drafting, platforms=["cuda"])(params, **args).mlir_module()
        loops[unroll] = text.count("stablehlo.while")
    assert loops[True] == loops[False] - 1
