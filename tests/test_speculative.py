"""The speculative engine is lossless: greedy output equals autoregressive output token for token,
and the sampled output law equals the target's, for every method."""

from __future__ import annotations


import jax
import numpy as np
import pytest

import ssd_jax
from method_options import make
from ssd_jax.runtime import compile_cache
from ssd_jax import verify
from ssd_jax.loop import speculative
from ssd_jax.errors import InputError
from ssd_jax.sampling import SamplingParams
from spec_models import exact_law, law_pair, llama, noisy_copy, pair

METHOD_OPTIONS = [
    ("sd", dict(num_draft_tokens=4)),
    ("bv", dict(num_draft_tokens=3)),
    ("specinfer", dict(num_draft_tokens=3, num_paths=3)),
    ("spectr", dict(num_draft_tokens=3, num_paths=2)),
    ("gbv", dict(num_draft_tokens=4, num_paths=3)),
    ("gbv", dict(num_draft_tokens=2, num_paths=1)),
]


@pytest.fixture(scope="module")
def models():
    return pair(vocab=64, seed=0, noise=0.6)


@pytest.mark.parametrize("method, options", METHOD_OPTIONS)
def test_greedy_equals_autoregressive_batched_and_alone(models, method, options):
    target, draft = models
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 64, n).tolist() for n in (6, 1, 13)]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=40)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=make(method, **options), draft=draft)
    assert out.tokens == reference.tokens
    assert out.finish_reasons == reference.finish_reasons
    assert out.stats["num_accepted_tokens"] > 0  # the noisy draft agrees often enough to matter
    alone = ssd_jax.generate(target, prompts[1:2], max_new_tokens=40, method=make(method, **options), draft=draft)
    assert alone.tokens[0] == out.tokens[1]


def test_greedy_with_a_perfect_draft_accepts_everything(models):
    target, _ = models
    out = ssd_jax.generate(target, [[3, 4, 5]], max_new_tokens=30, method=ssd_jax.SD(draft_len=4), draft=target)
    assert out.stats["acceptance_rate"] == 1.0
    assert out.tokens == ssd_jax.generate(target, [[3, 4, 5]], max_new_tokens=30).tokens


def test_draft_with_a_different_vocabulary_size_is_masked(models):
    target, _ = models
    wide = noisy_copy(llama(72, 64, 2, seed=5), 0.0, 0)  # 8 ids the target lacks
    out = ssd_jax.generate(target, [[3, 4, 5], [9]], max_new_tokens=20, method="bv", draft=wide)
    assert out.tokens == ssd_jax.generate(target, [[3, 4, 5], [9]], max_new_tokens=20).tokens


# ---------------------------------------------------------------------------------- sampling law

VOCAB, NEW, SAMPLES = 4, 3, 6000


@pytest.fixture(scope="module")
def tiny_models():
    return law_pair(VOCAB)


def _exact_law(target, prompt, sampling):
    """P(x1..x3 | prompt) for all VOCAB**3 continuations, float64."""
    return exact_law(target, prompt, sampling, NEW)


def _empirical(target, draft, prompt, method, options, sampling):
    keys = jax.random.split(jax.random.PRNGKey(11), SAMPLES)
    out = ssd_jax.generate(target, [prompt] * SAMPLES, max_new_tokens=NEW, method=make(method, **options), draft=draft, key=keys,
                           temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    counts = np.zeros((VOCAB,) * NEW)
    for row in out.tokens:
        counts[tuple(row)] += 1
    return counts / SAMPLES


def _consistent(freq, law) -> bool:
    # Per-outcome z-test at 5 sigma over 64 outcomes: false-failure probability < 1e-4 per call.
    sigma = np.sqrt(law * (1 - law) / SAMPLES) + 1e-12
    return bool(np.all(np.abs(freq - law) <= 5 * sigma + 1e-9))


@pytest.mark.parametrize("method, options", [
    ("sd", dict(num_draft_tokens=2)), ("bv", dict(num_draft_tokens=2)),
    ("specinfer", dict(num_draft_tokens=2, num_paths=3)), ("spectr", dict(num_draft_tokens=2, num_paths=3)),
    ("gbv", dict(num_draft_tokens=2, num_paths=3)),
])
def test_sampled_law_equals_target_law(tiny_models, method, options):
    target, draft = tiny_models
    sampling = SamplingParams(temperature=1.0)
    prompt = [0, 2, 1]
    law = _exact_law(target, prompt, sampling)
    assert _consistent(_empirical(target, draft, prompt, method, options, sampling), law)


def test_sampling_law_check_has_power(tiny_models, monkeypatch):
    """Greedy acceptance at temperature 1 (a bug public engines shipped) fails the same check."""
    target, draft = tiny_models
    sampling = SamplingParams(temperature=1.0)
    monkeypatch.setitem(speculative.SPECULATIVE_METHODS, "sd", (verify.greedy, False))
    prompt = [0, 2, 1]
    compile_cache.clear()  # the executables compiled with the real verifier must not be reused
    try:
        freq = _empirical(target, draft, prompt, "sd", dict(num_draft_tokens=2), sampling)
    finally:
        compile_cache.clear()
    assert not _consistent(freq, _exact_law(target, prompt, sampling))


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(method="sd"), "need a draft model"),
    (dict(method="sd", num_draft_tokens=0), r"use method=SD\(draft_len=0\)"),
    (dict(method="gbv", num_paths=0), r"use method=GBV\(paths=0\)"),
    (dict(method="bv", num_paths=2), "BV has no option for num_paths"),
    (dict(method="sd", lenience=2), "SD has no option for lenience"),
])
def test_bad_speculative_arguments(models, kwargs, match):
    target, draft = models
    if kwargs.get("method") and "need a draft" not in match:
        kwargs["draft"] = draft
    with pytest.raises(InputError, match=match):
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, **kwargs)


def test_draft_with_another_tokenizer_is_refused(models):
    from tokenizers import Tokenizer, models as tok_models

    target, draft = models
    a = Tokenizer(tok_models.WordLevel({f"a{i}": i for i in range(64)}, unk_token="a0"))
    b = Tokenizer(tok_models.WordLevel({f"b{i}": i for i in range(64)}, unk_token="b0"))
    import dataclasses

    with pytest.raises(InputError, match="draft tokenizer differs"):
        ssd_jax.generate(dataclasses.replace(target, tokenizer=a), [[1, 2]], max_new_tokens=4, method="sd",
                         draft=dataclasses.replace(draft, tokenizer=b))


def test_tokenizer_check_is_remembered_until_a_tokenizer_gains_tokens(models):
    """An agreeing pair is compared once (the check runs on every call); a tokenizer that gains
    a token afterwards is compared again and refused."""
    import dataclasses

    from tokenizers import Tokenizer, models as tok_models

    from ssd_jax.runtime.pairing import check_same_tokenizer

    target, draft = models
    vocab = {f"a{i}": i for i in range(64)}
    a = Tokenizer(tok_models.WordLevel(dict(vocab), unk_token="a0"))
    b = Tokenizer(tok_models.WordLevel(dict(vocab), unk_token="a0"))
    target, draft = dataclasses.replace(target, tokenizer=a), dataclasses.replace(draft, tokenizer=b)
    check_same_tokenizer(target, draft)
    check_same_tokenizer(target, draft)
    b.add_tokens(["only-in-the-draft"])
    with pytest.raises(InputError, match="draft tokenizer differs"):
        check_same_tokenizer(target, draft)


# ---------------------------------------------------------------------------------- cache consistency

@pytest.mark.parametrize("method, options, temperature", [
    ("sd", dict(num_draft_tokens=4), 1.0),
    ("bv", dict(num_draft_tokens=3), 0.0),
    ("gbv", dict(num_draft_tokens=3, num_paths=3), 1.0),
])
def test_target_cache_equals_fresh_prefill_of_the_emitted_text(models, method, options, temperature):
    """After many accept/reject steps (and compactions of tree paths), the target's cache holds
    exactly the K/V a fresh prefill of prompt + emitted tokens (all but the last) produces."""
    import functools

    import jax.numpy as jnp

    from ssd_jax.loop.autoregressive import prefill
    from ssd_jax.runtime.prompts import prepare_prompts, row_keys
    from ssd_jax.models.kv_cache import to_stacked

    target, draft = models
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 64, n).tolist() for n in (5, 9)]
    batch = prepare_prompts(prompts, target.config, 40)
    from ssd_jax.loop.skeleton import run

    obj = make(method, **options)

    @jax.jit
    def decode(target, draft, tokens, lengths, keys):
        parts = speculative.speculative_parts(obj, target.params, target.config, draft.params, draft.config,
                                              SamplingParams(temperature), tokens.shape[1], 64)
        state = run(parts, target.params, target.config, tokens, lengths, keys, jnp.asarray(40, jnp.int32),
                    jnp.asarray([-1], jnp.int32), sampling=SamplingParams(temperature), out_size=64)
        return state.outputs.out, state.outputs.num_out, state.counters, state.tcache

    out, num_out, counters, tcache = decode(target, draft, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                                            row_keys(jax.random.PRNGKey(3), 2))
    plan = obj
    assert int(np.sum(counters.num_drafts)) > 10
    for row, prompt in enumerate(prompts):
        emitted = np.asarray(out)[row, : int(num_out[row])].tolist()
        text = prompt + emitted[:-1]
        # The last step may commit accepted tokens past the max_new_tokens cut; they are never read.
        assert len(text) <= int(tcache.lengths[row]) <= len(text) + plan.draft_len + 1
        tokens = jnp.asarray([text + [0] * (64 - len(text))], jnp.int32)
        _, fresh = prefill(target.params, target.config, tokens, jnp.asarray([len(text)], jnp.int32), 64)
        tcache, fresh = to_stacked(tcache), to_stacked(fresh)
        n = len(text)
        # float32 sums over differently shaped caches (decode's capacity, the prefill's 64) differ
        # in the last bits: ~1e-5 on K/V entries of ~1e-2; a wrong token or slot is off by ~1.
        for ours, ref in ((tcache.k, fresh.k), (tcache.v, fresh.v)):
            np.testing.assert_allclose(np.asarray(ours)[:, row, :, :n], np.asarray(ref)[:, 0, :, :n],
                                       rtol=1e-4, atol=3e-5)
