"""Cascade Speculative Drafting (method "csd") is lossless: greedy output equals autoregressive
output token for token, the sampled law equals the target's (and a single review emits exactly
the reviewer's law); the schedule's static widths and the option checks behave."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.draft.maxgram import MaxGram


def csd_args(target, drafts, bigram=None, **options):
    """method= and draft= for generate: CSD(**options) over drafts, then Max-Gram with bigram."""
    maxgram = () if bigram is None else (MaxGram.for_target(target, bigram),)
    return dict(method=ssd_jax.CSD(**options), draft=tuple(drafts) + maxgram)
from ssd_jax.draft import cascade as cascade_draft
from ssd_jax.draft.cascade_review import sampled_review
from ssd_jax.draft.cascade_schedule import build_schedule, default_k_matrix
from ssd_jax.draft.maxgram import maxgram_draft
from ssd_jax.runtime import compile_cache
from ssd_jax.errors import InputError
from ssd_jax.sampling import SamplingParams
from spec_models import llama, noisy_copy
from test_speculative import VOCAB, _consistent, _exact_law

VOCAB_GREEDY = 64
TWO_LEVEL_K = [[0, 2, 0, 1], [0, 0, 1, 1], [0, 0, 0, 2], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def models():
    """(target, d1, d2, bigram): a 2-layer target, two noisy copies (d2 noisier), and a bigram
    table of the target's greedy next token after each single token."""
    target = llama(VOCAB_GREEDY, 64, 2, seed=0)
    tokens = jnp.arange(VOCAB_GREEDY, dtype=jnp.int32)[:, None]
    bigram = np.asarray(jnp.argmax(ssd_jax.forward(target, tokens)[:, -1], axis=-1), np.int32)
    return target, noisy_copy(target, 0.05, 1), noisy_copy(target, 0.1, 2), bigram


def _prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(2, VOCAB_GREEDY, n).tolist() for n in (6, 1, 13)]


# ---------------------------------------------------------------------------------- schedule

def test_schedule_widths_and_pending_follow_the_k_matrix():
    one = build_schedule([[0, 4, 1], [0, 0, 2], [0, 0, 0]], 1)
    assert one.width == one.target_width == 4 * (2 + 1) + 1 and one.rounds_per_level == (4,)
    # The first round of a step meets D1's last correction, the Max-Gram token and the target's
    # bonus; later rounds only the previous round's correction.
    assert [r.pending for r in one.rounds] == [3, 1, 1, 1]
    two = build_schedule(TWO_LEVEL_K, 2)
    assert two.width == 2 * ((2 + 1) + 1 + 1) + 1 and two.rounds_per_level == (2, 2)
    assert all(1 <= r.pending <= 8 for r in two.rounds)
    # A drafter reviewing an empty block drafts one token per round: plain draft-model SD.
    sd = build_schedule([[0, 3, 0], [0, 0, 0]], 1)
    assert sd.width == 3 and [r.pending for r in sd.rounds] == [2, 1, 1]
    # Defaults: greedy, 3 rounds of D1 over 2 Max-Gram tokens each; sampling, 4 rounds over 1
    # Max-Gram token each, the target checking at most 6.
    greedy = build_schedule(None, 1)
    assert greedy.k_matrix == default_k_matrix(1) and (greedy.width, greedy.target_width) == (9, 9)
    sampled = build_schedule(None, 1, greedy=False)
    assert sampled.k_matrix == default_k_matrix(1, greedy=False) and (sampled.width, sampled.target_width) == (8, 6)
    assert build_schedule(None, 1, max_draft_tokens=3, greedy=False).target_width == 3


@pytest.mark.parametrize("k_matrix, match", [
    ([[0, 4, 1]], "must have 3 rows"),
    ([[0, 4], [0, 0]], "row 0 must have 3 entries"),
    ([[0, -1, 1], [0, 0, 2]], r"k_matrix\[0\]\[1\] must be a non-negative integer"),
    ([[0, 1.5, 1], [0, 0, 2]], r"k_matrix\[0\]\[1\] must be a non-negative integer"),
    ([[1, 4, 1], [0, 0, 2]], r"k_matrix\[0\]\[0\] = 1: a level only drafts for levels above it"),
    ([[0, 0, 0], [0, 0, 2]], "row 0 .* drafts nothing"),
    ([[0, 0, 3], [0, 0, 2]], "draft 1 .* is never called"),
    ([[0, 4, 1], [0, 0, 2], [0, 0, 1]], r"k_matrix\[2\]\[2\] = 1"),
    ([[0, 65, 1], [0, 0, 1]], "65 review rounds per step; at most 64"),
    ([[0, 60, 1], [0, 0, 8]], "drafts up to 541 tokens per step; at most 256"),
])
def test_bad_k_matrix_is_refused(k_matrix, match):
    with pytest.raises(InputError, match=match):
        build_schedule(k_matrix, 1)


# ---------------------------------------------------------------------------------- greedy == AR

@pytest.mark.parametrize("levels, options, alone", [
    (1, dict(), True),  # default lenience at temperature 0: 2
    (1, dict(lenience=1.0), False),
    (2, dict(k_matrix=TWO_LEVEL_K, lenience=2.0, max_draft_tokens=6), True),
    (0, dict(k_matrix=[[0, 3], [0, 0]]), False),  # Max-Gram alone
])
def test_greedy_equals_autoregressive_batched_and_alone(models, levels, options, alone):
    target, d1, d2, bigram = models
    drafts = [d1, d2][:levels]
    prompts = _prompts()
    reference = ssd_jax.generate(target, prompts, max_new_tokens=40)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, **csd_args(target, drafts, bigram, **options))
    assert out.tokens == reference.tokens
    assert out.finish_reasons == reference.finish_reasons
    assert out.stats["num_accepted_tokens"] > 0
    assert out.stats["drafter_calls"] == [1 + (out.stats["target_calls"] - 1) * k
                                          for k in build_schedule(options.get("k_matrix"), levels).rounds_per_level]
    if alone:
        single = ssd_jax.generate(target, prompts[1:2], max_new_tokens=40, **csd_args(target, drafts, bigram, **options))
        assert single.tokens[0] == out.tokens[1]


@pytest.mark.parametrize("temperature, lenience", [(0.0, 2.0), (1.0, 1.0)])
def test_default_lenience_depends_on_temperature(models, temperature, lenience):
    target, d1, _, bigram = models
    out = ssd_jax.generate(target, _prompts()[:1], max_new_tokens=8, **csd_args(target, [d1], bigram),
                           temperature=temperature)
    assert out.stats["lenience"] == lenience


def test_drafters_equal_to_the_target_get_every_draft_token_accepted(models):
    """With the target itself as both drafters (and no unreviewed Max-Gram token at the target's
    row) the final draft follows the target's law exactly, so the target keeps every valid token:
    any slip in a drafter's cache bookkeeping (a missed pending token, a stale slot, a wrong logit
    row) would change its logits and break this. At temperature 1 the laws must match too."""
    target, _, _, bigram = models
    out = ssd_jax.generate(target, _prompts(), max_new_tokens=40, temperature=1.0,
                           **csd_args(target, [target, target], bigram, k_matrix=[[0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]]),
                           key=jax.random.PRNGKey(5))
    assert out.stats["num_draft_tokens"] > 0
    assert out.stats["acceptance_rate"] == 1.0
    assert sum(out.stats["review_accepted_tokens"]) > 0


def test_embedded_models_greedy_equals_autoregressive():
    target, draft = ssd_jax.default_models(draft="draft")
    drafts = [draft, ssd_jax.defaults.shipped_draft("draft_small")]
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef "
    prompts = [target.tokenizer.encode(text).ids, target.tokenizer.encode("import os\nimport sys\n").ids]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=32)
    out = ssd_jax.generate(target, prompts, max_new_tokens=32, **csd_args(target, drafts))
    assert out.tokens == reference.tokens
    assert out.stats["mean_acceptance_length"] > 1.0


# ---------------------------------------------------------------------------------- sampling law

SAMPLES = 6000
PROMPT = [0, 2, 1]
TINY_BIGRAM = np.array([1, 2, 3, 0], np.int32)


@pytest.fixture(scope="module")
def tiny_models():
    target = llama(VOCAB, 32, 1, seed=3, scale=0.4, eos=())
    return target, noisy_copy(target, 1.0, 4), noisy_copy(target, 2.0, 5)


def _empirical(target, drafts, options):
    """The law of 3 sampled tokens; a fixed draft length unless options name one (under "auto"
    the loop may rightly decode 3 tokens plainly, and the law would not test the cascade)."""
    options = dict(dict(max_draft_tokens=3), **options)
    keys = jax.random.split(jax.random.PRNGKey(11), SAMPLES)
    out = ssd_jax.generate(target, [PROMPT] * SAMPLES, max_new_tokens=3, key=keys,
                           temperature=1.0, **csd_args(target, drafts, TINY_BIGRAM, **options))
    counts = np.zeros((VOCAB,) * 3)
    for row in out.tokens:
        counts[tuple(row)] += 1
    return counts / SAMPLES, out.stats


@pytest.mark.parametrize("levels, options", [
    (1, dict()),
    (2, dict(k_matrix=[[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 2]], max_draft_tokens=3)),
])
def test_sampled_law_equals_target_law(tiny_models, levels, options):
    target, *drafts = tiny_models
    freq, stats = _empirical(target, drafts[:levels], options)
    assert min(stats["review_accepted_tokens"]) > 0.02 * SAMPLES  # every review really keeps tokens
    assert _consistent(freq, _exact_law(target, PROMPT, SamplingParams(temperature=1.0)))


def test_sampling_law_check_has_power(tiny_models, monkeypatch):
    """Drafters that rubber-stamp the block below them (keep every valid token, as if each were
    drawn from their own law) fail the same check."""

    def rubber_stamp(keys, block, valid, q_below, q):
        return sampled_review(keys, block, valid, q[:, :-1], q)  # q_below := q: every token kept

    target, *drafts = tiny_models
    monkeypatch.setattr(cascade_draft, "sampled_review", rubber_stamp)
    compile_cache.clear()  # the executables compiled with the real review must not be reused
    try:
        freq, _ = _empirical(target, drafts[:1], dict(k_matrix=[[0, 1, 0], [0, 0, 2]]))
    finally:
        compile_cache.clear()
    assert not _consistent(freq, _exact_law(target, PROMPT, SamplingParams(temperature=1.0)))


# ---------------------------------------------------------------------------------- one review

R = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])   # reviewer: Markov kernel
QB = np.array([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])  # the block's drafter
REVIEW_SAMPLES = 40000


def _review_law(review, point_mass: bool) -> np.ndarray:
    """Empirical law of the first 3 tokens a review of a 2-token block emits (extended by the
    reviewer's own chain when it emits fewer), starting after token 0."""
    r, qb = jnp.asarray(R, jnp.float32), jnp.asarray(QB, jnp.float32)

    def one(key):
        k1, k2, k_valid, k_review, k_ext = jax.random.split(key, 5)
        if point_mass:  # a Max-Gram-like block: deterministic tokens, one-hot laws
            g1, g2 = jnp.int32(1), jnp.int32(2)
            q_below = jax.nn.one_hot(jnp.stack([g1, g2]), 3)
        else:
            g1 = jax.random.categorical(k1, jnp.log(qb[0])).astype(jnp.int32)
            g2 = jax.random.categorical(k2, jnp.log(qb[g1])).astype(jnp.int32)
            q_below = qb[jnp.stack([0, g1])]
        # The valid count is decided before each token it admits is drawn: 0 at random, else 1
        # when g1 == 2, else 2.
        valid = jnp.where(jax.random.uniform(k_valid) < 0.2, 0, jnp.where(g1 == 2, 1, 2)).astype(jnp.int32)
        block = jnp.stack([g1, g2])
        accepted, token = review(k_review[None], block[None], valid[None], q_below[None],
                                 r[jnp.stack([0, g1, g2])][None])
        j = jnp.arange(3)
        seq = jnp.where(j < accepted[0], jnp.pad(block, (0, 1)), jnp.where(j == accepted[0], token[0], -1))
        previous = jnp.int32(0)
        out = []
        for i, k in enumerate(jax.random.split(k_ext, 3)):
            x = jnp.where(seq[i] >= 0, seq[i], jax.random.categorical(k, jnp.log(r[previous])).astype(jnp.int32))
            out.append(x)
            previous = x
        return jnp.stack(out)

    seqs = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), REVIEW_SAMPLES)))
    counts = np.zeros((3, 3, 3))
    np.add.at(counts, tuple(seqs.T), 1)
    return counts / REVIEW_SAMPLES


def _review_consistent(freq) -> bool:
    law = R[0][:, None, None] * R[:, :, None] * R[None, :, :]
    sigma = np.sqrt(law * (1 - law) / REVIEW_SAMPLES)
    return bool(np.all(np.abs(freq - law) <= 5 * sigma + 1e-9))


@pytest.mark.parametrize("point_mass", [False, True])
def test_a_review_emits_exactly_the_reviewers_law(point_mass):
    assert _review_consistent(_review_law(sampled_review, point_mass))


def test_review_law_check_has_power():
    """Drawing the correction from the reviewer's law instead of the residual fails. (Treating a
    sampled block as point masses would not: that check is exact for any block, only weaker.)"""

    def no_residual(keys, block, valid, q_below, q):
        accepted, token = sampled_review(keys, block, valid, q_below, q)
        rows = q[jnp.arange(q.shape[0]), accepted]
        fresh = jax.vmap(lambda k, p: jax.random.categorical(jax.random.fold_in(k, 7), jnp.log(p)))(keys, rows)
        return accepted, jnp.where(accepted < valid, fresh.astype(jnp.int32), token)

    assert not _review_consistent(_review_law(no_residual, point_mass=False))


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(lenience=2.0, temperature=1.0), "lenience=2.0 relaxes acceptance .* temperature 0 or under coupling=.gumbel. only"),
    (dict(lenience=0.5), "lenience must be a finite number >= 1"),
    (dict(num_draft_tokens=4), "CSD has no option for num_draft_tokens"),
    (dict(max_draft_tokens=0), "max_draft_tokens must be an integer >= 1"),
    (dict(k_matrix=[[0, 4, 1], [0, 2, 2]]), r"k_matrix\[1\]\[1\] = 2"),
    (dict(bigram=np.zeros(10, np.int32)), r"bigram must be an int32 table \[V=64\]"),
    (dict(bigram=np.full(64, 99, np.int32)), "bigram maps token 0 to 99"),
    (dict(bigram=None), "target has no tokenizer"),
    (dict(drafts=None), "need a draft model"),
])
def test_bad_cascade_arguments(models, kwargs, match):
    target, d1, _, bigram = models
    kwargs = dict(dict(drafts=[d1], bigram=bigram), **kwargs)
    temperature = kwargs.pop("temperature", 0.0)
    with pytest.raises(InputError, match=match):
        if "num_draft_tokens" in kwargs:
            ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method="csd", num_draft_tokens=4)
        drafts = kwargs.pop("drafts")
        args = csd_args(target, drafts or [], **kwargs)
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, temperature=temperature,
                         **dict(args, draft=None if drafts is None else args["draft"]))


def test_the_old_drafts_and_bigram_options_are_refused(models):
    target, d1, d2, bigram = models
    with pytest.raises(InputError, match=r"no longer takes bigram=, drafts="):
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method="csd", draft=d1, drafts=[d2], bigram=bigram)


def test_command_line_k_matrix_forms():
    import argparse

    from ssd_jax.cli.generate_cmd import METHOD_OPTION_FLAGS, parse_k_matrix_arg

    assert parse_k_matrix_arg("0,4,1;0,0,2;0,0,0") == [[0, 4, 1], [0, 0, 2], [0, 0, 0]]
    assert parse_k_matrix_arg("[[0,4,1],[0,0,2]]") == [[0, 4, 1], [0, 0, 2]]
    with pytest.raises(argparse.ArgumentTypeError, match="expected rows like"):
        parse_k_matrix_arg("0,4;x")
    assert {"k_matrix", "lenience", "max_draft_tokens"} <= set(METHOD_OPTION_FLAGS)
