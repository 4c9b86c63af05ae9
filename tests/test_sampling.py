"""`ssd_jax.sampling` against transformers' logits warpers, and the law of sampled tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import ssd_jax
from ssd_jax.sampling import SamplingParams, probabilities


def _hf_probs(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    scores = torch.tensor(logits)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None), (0.7, None, None), (1.3, 5, None), (0.9, None, 0.8), (0.6, 20, 0.9), (1.0, 1, None),
    (1.0, None, 0.05),
])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(0, 3, (4, 64)).astype(np.float32)
    ours = np.asarray(probabilities(jnp.asarray(logits), SamplingParams(temperature, top_k, top_p)))
    np.testing.assert_allclose(ours, _hf_probs(logits, temperature, top_k, top_p), atol=1e-6)
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-5)


def test_greedy_is_one_hot_argmax_lowest_id_on_ties():
    logits = jnp.array([[0.0, 2.0, 2.0, 1.0]])
    np.testing.assert_array_equal(np.asarray(probabilities(logits, SamplingParams(0.0))), [[0, 1, 0, 0]])


def _first_token_frequencies(model, prompt, n, **kwargs):
    keys = jax.random.split(jax.random.PRNGKey(123), n)
    out = ssd_jax.generate(model, [prompt] * n, max_new_tokens=1, key=keys, **kwargs)
    tokens = np.array([row[0] for row in out.tokens])
    return np.bincount(tokens, minlength=model.config.vocab_size) / n


def _within_bound(freq, probs, n) -> bool:
    # Per-outcome z-test at 5 sigma: with <= 96 outcomes a false failure has probability < 1e-4.
    sigma = np.sqrt(probs * (1 - probs) / n) + 1e-12
    return bool(np.all(np.abs(freq - probs) <= 5 * sigma + 1e-9))


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.7, top_k=8), dict(temperature=1.2, top_p=0.7)])
def test_sampled_first_token_follows_the_target_law(hf_family, kwargs):
    model = ssd_jax.load(hf_family("llama3")[0])
    prompt = [5, 17, 33, 2 + 1]
    logits = ssd_jax.forward(model, np.array([prompt]))[0, -1]
    exact = np.asarray(probabilities(logits, SamplingParams(**kwargs)), np.float64)
    n = 6000
    freq = _first_token_frequencies(model, prompt, n, **kwargs)
    assert _within_bound(freq, exact, n)
    assert np.all(freq[exact == 0] == 0)
    # Power: the same check rejects a law processed at another temperature.
    wrong = np.asarray(probabilities(logits, SamplingParams(kwargs["temperature"] * 1.6, kwargs.get("top_k"),
                                                            kwargs.get("top_p"))), np.float64)
    assert not _within_bound(freq, wrong, n)


def test_same_key_same_output_other_key_other_output(hf_family):
    model = ssd_jax.load(hf_family("gpt2")[0])
    prompt = [[4, 8, 15, 16]]
    a = ssd_jax.generate(model, prompt, max_new_tokens=24, temperature=1.0, key=jax.random.PRNGKey(1))
    b = ssd_jax.generate(model, prompt, max_new_tokens=24, temperature=1.0, key=jax.random.PRNGKey(1))
    c = ssd_jax.generate(model, prompt, max_new_tokens=24, temperature=1.0, key=jax.random.PRNGKey(2))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_eos_stops_a_row_and_length_stops_the_rest(hf_family):
    model = ssd_jax.load(hf_family("qwen2")[0])
    eos = model.config.eos_token_ids[0]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 96, 6).tolist() for _ in range(24)]
    out = ssd_jax.generate(model, prompts, max_new_tokens=12, temperature=1.0, key=jax.random.split(jax.random.PRNGKey(0), 24))
    for row, reason in zip(out.tokens, out.finish_reasons):
        assert (eos in row) == (reason == "eos")
        if reason == "eos":
            assert row[-1] == eos and row.count(eos) == 1
        else:
            assert len(row) == 12
    assert {"eos", "length"} <= set(out.finish_reasons)
    assert out.stats["target_calls"] <= 12
    assert out.stats["num_generated_tokens"] == sum(len(r) for r in out.tokens)
