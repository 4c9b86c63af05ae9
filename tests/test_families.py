"""Gemma 1/2/3, Phi-3 and Mixtral against transformers (fp32, CPU): full-forward logits, the
unrolled layer layout, cached incremental decode, token trees under sliding windows, greedy
generation from the HF and the converted directory, conversion both ways, and bad configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ssd_jax
from checkpoints_convert import export_hf, hf_to_ssd
from cached_logits import incremental_logits
from hf_models import NEW_FAMILY_CONFIGS
from ssd_jax.errors import ConfigError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, init_cache
from ssd_jax.models.transformer import decode_params, forward_cached, forward_full

RTOL = 1e-4
FAMILIES = sorted(NEW_FAMILY_CONFIGS)
_forward = jax.jit(forward_full, static_argnums=1)


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def _greedy_matches_transformers(model, torch_model, prompt) -> None:
    out = ssd_jax.generate(model, [prompt], max_new_tokens=16)
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=model.config.eos_token_ids[0], pad_token_id=0)
    assert out.tokens[0] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers_and_converts_both_ways(name, hf_family, tmp_path):
    directory, torch_model = hf_family(name)
    model = ssd_jax.load(directory)
    assert model.config.model_type == NEW_FAMILY_CONFIGS[name]["model_type"]
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 20)).astype(np.int32)
    ref = _torch_logits(torch_model, tokens)
    full = np.asarray(ssd_jax.forward(model, tokens))
    assert _rel_err(full, ref) <= RTOL
    # The unrolled per-layer layout (static layer index) equals the scanned one (traced index).
    unrolled = forward_full(decode_params(model.params, model.config), model.config, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(unrolled), full, rtol=1e-5, atol=1e-5)
    assert _rel_err(incremental_logits(model, tokens, (8, 1, 3, 8)), full) <= RTOL
    prompt = np.random.default_rng(2).integers(3, model.config.vocab_size, 9).tolist()
    _greedy_matches_transformers(model, torch_model, prompt)

    ours = hf_to_ssd(directory, str(tmp_path / "ours"), progress=False)
    converted = ssd_jax.load(ours)
    assert converted.config == model.config
    assert _rel_err(ssd_jax.forward(converted, tokens), ref) <= RTOL
    _greedy_matches_transformers(converted, torch_model, prompt)
    back = export_hf(converted, str(tmp_path / "back"))
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), ref, atol=1e-5)


@pytest.mark.parametrize("name, changes", [
    ("gemma2", [dict(sliding_window=None, layer_types=()), dict(attn_logit_softcap=None),
                dict(final_logit_softcap=None)]),
    ("gemma3_text", [dict(rope_local=None)]),
    ("phi3", [dict(sliding_window=None)]),
    ("mixtral", [dict(experts_per_token=4)]),
])
def test_parity_configs_exercise_their_features(name, changes, hf_family):
    """Each feature changes the logits of the parity configs: the tests above would catch it missing."""
    model = ssd_jax.load(hf_family(name)[0])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (1, 20)), jnp.int32)
    base = np.asarray(_forward(model.params, model.config, tokens))
    for change in changes:
        other = _forward(model.params, dataclasses.replace(model.config, **change), tokens)
        assert _rel_err(other, base) > 1e-3, change


def test_token_tree_attends_within_each_layers_window(hf_family):
    """Gemma 2 (window 5 on layers 0 and 2, global layer 1): a tree written after a prompt gives
    every node the logits of a full forward over prompt + its root-to-node path."""
    model = ssd_jax.load(hf_family("gemma2")[0])
    config = model.config
    prompt = [5, 17, 3, 44, 9, 60, 21, 8]
    parents = [-1, 0, 1, 0, 3, 4, 2]  # two branches from the root, depths up to 4
    nodes = [11, 30, 7, 52, 2, 90, 64]
    depth = [0] * len(nodes)
    ancestors = np.eye(len(nodes), dtype=bool)
    for j, p in enumerate(parents):
        if p >= 0:
            depth[j] = depth[p] + 1
            ancestors[j] |= ancestors[p]
    step = jax.jit(forward_cached, static_argnums=1)
    cache = init_cache(config, 1, 32)
    p_tok = jnp.asarray([prompt], jnp.int32)
    _, cache = step(model.params, config, p_tok, jnp.arange(len(prompt), dtype=jnp.int32)[None], cache)
    cache = commit(cache, jnp.asarray([len(prompt)], jnp.int32))
    positions = jnp.asarray([[len(prompt) + d for d in depth]], jnp.int32)
    logits, _ = step(model.params, config, jnp.asarray([nodes], jnp.int32), positions, cache,
                     jnp.asarray(ancestors[None]))
    # Causal logits at a position ignore what follows it: one batched forward over the node paths,
    # right-padded, read at each path's last token.
    paths = [prompt + [nodes[a] for a in range(len(nodes)) if ancestors[j, a]] for j in range(len(nodes))]
    width = max(map(len, paths))
    full = _forward(model.params, config, jnp.asarray([p + [0] * (width - len(p)) for p in paths], jnp.int32))
    expected = np.stack([np.asarray(full[j, len(p) - 1]) for j, p in enumerate(paths)])
    np.testing.assert_allclose(np.asarray(logits[0]), expected, rtol=1e-4, atol=1e-4)


def _hf(name: str, **change) -> dict:
    return dict(NEW_FAMILY_CONFIGS[name], **change)


@pytest.mark.parametrize("hf, match", [
    (_hf("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
     "rope_type='longrope'"),
    (_hf("phi3", rope_scaling={"type": "su"}), "rope_type='su'"),
    (_hf("phi3", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (_hf("gemma", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (_hf("gemma2", hidden_activation="gelu_fast"), "hidden_act.*gelu_fast"),
    (_hf("gemma3_text", rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0}}), "rope_type='yarn'"),
    (_hf("gemma2", layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "chunked_attention"),
    (_hf("mixtral", num_experts_per_tok=5), "num_experts_per_tok=5"),
])
def test_unsupported_math_is_refused(hf, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trips_through_hf_json(name):
    config = ModelConfig.from_hf(_hf(name, eos_token_id=2, bos_token_id=1))
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert ModelConfig.from_hf(dataclasses.replace(config, hf_json="").to_hf()) == config


@pytest.mark.slow   # ~40 s of subprocesses; the loading itself: test_family_matches_transformers_and_converts_both_ways
def test_cli_generate_loads_new_families(hf_family, tmp_path):
    """`ssd-jax generate --target` a converted Gemma 3 with an HF Phi-3 directory as the draft."""
    import json
    import os
    import subprocess
    import sys

    target_dir = hf_to_ssd(hf_family("gemma3_text")[0], str(tmp_path / "gemma3"), progress=False)
    draft_dir = hf_family("phi3")[0]
    result = subprocess.run(
        [sys.executable, "-m", "ssd_jax.cli", "generate", "--target", target_dir, "--draft", draft_dir,
         "--method", "sd", "--prompt-ids", "3,4,5,6", "--max-new-tokens", "6", "--json"],
        capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr
    expected = ssd_jax.generate(ssd_jax.load(target_dir), [[3, 4, 5, 6]], max_new_tokens=6).tokens
    assert json.loads(result.stdout)["tokens"] == expected
