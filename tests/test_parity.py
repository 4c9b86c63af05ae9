"""Every family against transformers (fp32, CPU): logits of a full forward, incremental decode
through the cache, and greedy generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ssd_jax
from ssd_jax.models.kv_cache import commit, init_cache
from ssd_jax.models.transformer import decode_step

RTOL = 1e-4


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def test_full_forward_matches_transformers(family, hf_family):
    directory, torch_model = hf_family(family)
    model = ssd_jax.load(directory)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 24))
    assert _rel_err(ssd_jax.forward(model, tokens), _torch_logits(torch_model, tokens)) <= RTOL


def test_incremental_decode_equals_full_forward(family, hf_family):
    """Prefill a prefix, then feed chunks of 1 and 3 tokens through the (donated) cache."""
    directory, _ = hf_family(family)
    model = ssd_jax.load(directory)
    config = model.config
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 20)).astype(np.int32)
    full = np.asarray(ssd_jax.forward(model, tokens))
    cache = init_cache(config, 2, 32)
    step = decode_step  # donates the cache: the old buffer must not be reused
    pieces, start = [], 0
    for size in (8, 1, 1, 3, 1, 3, 3):
        chunk = jnp.asarray(tokens[:, start:start + size])
        positions = jnp.broadcast_to(jnp.arange(start, start + size, dtype=jnp.int32), chunk.shape)
        logits, cache = step(model.params, config=config, tokens=chunk, positions=positions, cache=cache)
        cache = commit(cache, jnp.full((2,), size, jnp.int32))
        pieces.append(np.asarray(logits))
        start += size
    assert start == tokens.shape[1]
    assert _rel_err(np.concatenate(pieces, axis=1), full) <= RTOL


def test_greedy_generate_matches_transformers(family, hf_family):
    directory, torch_model = hf_family(family)
    model = ssd_jax.load(directory)
    rng = np.random.default_rng(2)
    for length in (5, 11):
        prompt = rng.integers(3, model.config.vocab_size, length).tolist()
        out = ssd_jax.generate(model, [prompt], max_new_tokens=20)
        with torch.no_grad():
            ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                       eos_token_id=model.config.eos_token_ids[0], pad_token_id=0)
        assert out.tokens[0] == ref[0, length:].tolist()


@pytest.mark.parametrize("family_name", ["llama3", "gpt2"])
def test_ragged_batch_equals_rows_alone(family_name, hf_family):
    directory, _ = hf_family(family_name)
    model = ssd_jax.load(directory)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (3, 17, 9, 1)]
    for temperature in (0.0, 1.0):
        key = jax.random.PRNGKey(7)
        batched = ssd_jax.generate(model, prompts, max_new_tokens=16, temperature=temperature, key=key)
        for i, prompt in enumerate(prompts):
            alone = ssd_jax.generate(model, [prompt], max_new_tokens=16, temperature=temperature, key=key)
            assert batched.tokens[i] == alone.tokens[0]
            assert batched.finish_reasons[i] == alone.finish_reasons[0]


def test_bfloat16_params_stay_close(hf_family):
    directory, torch_model = hf_family("llama3")
    model = ssd_jax.load(directory, dtype="bfloat16")
    assert model.params["layers"]["q"]["kernel"].dtype == jnp.bfloat16
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, (1, 16))
    logits = ssd_jax.forward(model, tokens)
    assert logits.dtype == jnp.float32
    assert _rel_err(logits, _torch_logits(torch_model, tokens)) < 5e-2
