"""Retrieval drafting (prompt lookup, LogitSpec) is lossless: greedy output equals autoregressive
output token for token, the sampled law equals the target's; trees and fallbacks behave."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from method_options import make
from ssd_jax.draft.logitspec import logitspec_tree
from ssd_jax.draft.prompt_lookup import prompt_lookup_tree
from ssd_jax.draft.tree_layout import logitspec_layout, rank_branch_length
from ssd_jax.runtime import compile_cache
from ssd_jax.loop import retrieval
from ssd_jax.errors import InputError
from ssd_jax.sampling import SamplingParams
from ssd_jax.verify.point_tree import point_mass_chain, point_mass_tree
from spec_models import llama
from test_speculative import _consistent, _exact_law

METHOD_OPTIONS = [
    ("pld", dict(num_draft_tokens=4)),
    ("pld", dict(num_draft_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)),
    ("logitspec", dict(num_draft_tokens=3, logitspec_topk=6, tree_capacity=20)),
    ("logitspec", dict()),  # the defaults: draft_len "auto", the backend policy's tree
]


@pytest.fixture(scope="module")
def target():
    return llama(64, 64, 2, seed=0)


def _repetitive_prompts(rng):
    motif = rng.integers(2, 64, 7).tolist()
    return [motif * 3 + [5], rng.integers(2, 64, 4).tolist(), (motif[:4] * 4)[:13]]


@pytest.mark.parametrize("method, options", METHOD_OPTIONS)
def test_greedy_equals_autoregressive_batched_and_alone(target, method, options):
    prompts = _repetitive_prompts(np.random.default_rng(1))
    reference = ssd_jax.generate(target, prompts, max_new_tokens=40)
    out = ssd_jax.generate(target, prompts, max_new_tokens=40, method=make(method, **options))
    assert out.tokens == reference.tokens
    assert out.finish_reasons == reference.finish_reasons
    assert out.stats["num_draft_tokens"] > 0
    if options.get("prompt_lookup_min", 1) == 1 and not make(method, **options).adaptive:
        # Retrieval hits on the repeated text (a fixed length: "auto" may rightly decode this
        # random model's continuation plainly after its first steps miss; tests/test_adaptive.py).
        assert out.stats["num_accepted_tokens"] > 0
    alone = ssd_jax.generate(target, prompts[2:3], max_new_tokens=40, method=make(method, **options))
    assert alone.tokens[0] == out.tokens[2]


def test_embedded_target_greedy_equals_autoregressive():
    model, _ = ssd_jax.default_models()
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef "
    prompts = [model.tokenizer.encode(text).ids, model.tokenizer.encode("import os\nimport sys\n").ids]
    reference = ssd_jax.generate(model, prompts, max_new_tokens=48)
    for method in ("pld", "logitspec"):
        # A fixed length: "auto" may rightly decode these prompts plainly (tests/test_adaptive.py).
        options = dict(num_draft_tokens=5, tree_capacity=24) if method == "logitspec" else dict(num_draft_tokens=5)
        out = ssd_jax.generate(model, prompts, max_new_tokens=48, method=make(method, **options))
        assert out.tokens == reference.tokens, method
        assert out.stats["mean_acceptance_length"] > 1.0


# ---------------------------------------------------------------------------------- trees

def test_logitspec_layout_lengths_follow_rank_and_capacity():
    layout = logitspec_layout(root_length=5, topk=40, capacity=64)
    assert layout.num_nodes <= 64
    assert layout.lengths[0] == 5
    assert list(layout.lengths[1:9]) == [4] * 8 and layout.lengths[9] == 3
    assert [rank_branch_length(r) for r in (0, 7, 8, 31, 32)] == [4, 4, 3, 3, 1]
    depth, mask = layout.depth(), layout.mask()
    for start, length in zip(layout.starts, layout.lengths):
        assert layout.parents[start] == 0  # branches share only the root
        assert list(depth[start: start + length]) == list(range(1, length + 1))
        assert mask[start + length - 1].sum() == length + 1


def test_logitspec_without_any_match_drafts_the_guesses_alone():
    """All-distinct context: nothing to retrieve; the tree is root + top-k guesses, one node each."""
    layout = logitspec_layout(root_length=3, topk=4, capacity=32)
    context = jnp.asarray([list(range(10, 30))], jnp.int32)
    logits = jnp.zeros((1, 64)).at[0, jnp.asarray([29, 7, 8, 9, 5])].set(jnp.asarray([9.0, 8, 7, 6, 5]))
    tokens, valid = jax.jit(functools.partial(logitspec_tree, layout=layout, max_ngram=3))(
        context, jnp.asarray([20]), logits)
    tokens, valid = np.asarray(tokens[0]), np.asarray(valid[0])
    assert tokens[0] == 29 and valid[0]
    assert not valid[1:4].any()  # root branch: no match
    firsts = [layout.starts[r] for r in range(1, 5)]
    assert tokens[firsts].tolist() == [7, 8, 9, 5]  # the root (29) excluded, in rank order
    assert valid[firsts].all() and valid.sum() == 5


def test_logitspec_branch_retrieves_the_text_after_root_and_guess():
    layout = logitspec_layout(root_length=2, topk=2, capacity=16)
    #           ... 3 4 [5 6] 9 9 ...  root=3? no: context ends with root 4; guess 5 -> continue "6 9 9"
    context = jnp.asarray([[1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4]], jnp.int32)
    logits = jnp.zeros((1, 16)).at[0, jnp.asarray([4, 5, 12])].set(jnp.asarray([3.0, 2.0, 1.0]))
    tokens, valid = logitspec_tree(context, jnp.asarray([11]), logits, layout, max_ngram=3)
    tokens, valid = np.asarray(tokens[0]), np.asarray(valid[0])
    assert tokens[1:3].tolist() == [5, 6] and valid[1:3].all()  # root 4's own continuation
    # rank 0 would be 5, already the root branch's first token: the next guess (12) takes its place.
    start = layout.starts[1]
    assert tokens[start] == 12 and valid[start] and not valid[start + 1:start + 4].any()


def test_prompt_lookup_tree_marks_short_matches_invalid():
    context = jnp.asarray([[7, 8, 9, 7, 8, 0, 0], [1, 2, 3, 4, 5, 6, 0]], jnp.int32)
    tokens, valid = prompt_lookup_tree(context, jnp.asarray([5, 6]), num_draft_tokens=4, n_min=1, n_max=3)
    assert np.asarray(tokens)[0, :3].tolist() == [8, 9, 7] and np.asarray(valid)[0].tolist() == [1, 1, 1, 1, 0]
    assert np.asarray(valid)[1].tolist() == [1, 0, 0, 0, 0]


def test_point_mass_walk_descends_only_into_valid_children_that_match():
    parents = np.array([-1, 0, 1, 0, 3])
    tokens = jnp.asarray([[9, 1, 2, 3, 4]])
    scores = jnp.zeros((1, 5, 8))
    # The argmax after the root is 3 (node 3), after node 3 it is 4 (node 4), after node 4 it is 6.
    scores = scores.at[0, 0, 3].set(1).at[0, 3, 4].set(1).at[0, 4, 6].set(1)
    both = point_mass_tree(jax.random.PRNGKey(0), tokens, jnp.ones((1, 5), bool), parents, scores, greedy=True)
    assert (int(both.num_accepted[0]), int(both.next_token[0])) == (2, 6)
    assert np.asarray(both.nodes[0]).tolist() == [0, 3, 4]
    cut = point_mass_tree(jax.random.PRNGKey(0), tokens, jnp.asarray([[1, 1, 1, 1, 0]], bool), parents, scores, greedy=True)
    assert (int(cut.num_accepted[0]), int(cut.next_token[0])) == (1, 4)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_chain_walk_equals_the_tree_walk_on_a_chain(greedy):
    """PLD's vectorised chain verification gives the tree walk's verdict from the same key, on
    chains with invalid tails and with laws that make every depth likely to stop."""
    rng = np.random.default_rng(0)
    b, depth, vocab = 64, 5, 3
    tokens = jnp.asarray(rng.integers(0, vocab, (b, depth + 1)), jnp.int32)
    valid = jnp.asarray(np.arange(depth + 1)[None, :] <= rng.integers(0, depth + 1, (b, 1)))
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, depth + 1, vocab)) * 2, jnp.float32))
    key = jax.random.PRNGKey(3)
    chain = point_mass_chain(key, tokens, valid, p, greedy=greedy)
    tree = point_mass_tree(key, tokens, valid, np.arange(depth + 1) - 1, p, greedy=greedy)
    for got, want in zip(chain, tree):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(set(np.asarray(chain.num_accepted).tolist())) > 3


# ---------------------------------------------------------------------------------- sampling law

VOCAB, NEW, SAMPLES = 4, 3, 6000


@pytest.fixture(scope="module")
def tiny_target():
    return llama(VOCAB, 32, 1, seed=3, scale=0.4, eos=())


def _empirical(target, prompt, method, options, sampling):
    keys = jax.random.split(jax.random.PRNGKey(12), SAMPLES)
    out = ssd_jax.generate(target, [prompt] * SAMPLES, max_new_tokens=NEW, method=make(method, **options), key=keys,
                           temperature=sampling.temperature)
    counts = np.zeros((VOCAB,) * NEW)
    for row in out.tokens:
        counts[tuple(row)] += 1
    return counts / SAMPLES, out.stats


PROMPT = [0, 2, 1, 3, 0, 2, 1, 3, 0, 2]


@pytest.mark.parametrize("method, options", [
    ("pld", dict(num_draft_tokens=2)),
    ("logitspec", dict(num_draft_tokens=2, logitspec_topk=3, tree_capacity=12)),
])
def test_sampled_law_equals_target_law(tiny_target, method, options):
    sampling = SamplingParams(temperature=1.0)
    freq, stats = _empirical(tiny_target, PROMPT, method, options, sampling)
    assert stats["num_accepted_tokens"] > 0.1 * SAMPLES  # drafts are really accepted and tested
    assert _consistent(freq, _exact_law(tiny_target, PROMPT, sampling))


def test_sampling_law_check_has_power(tiny_target, monkeypatch):
    """Accepting by argmax at temperature 1 (treating the walk as greedy) fails the same check."""
    sampling = SamplingParams(temperature=1.0)
    broken = functools.partial(point_mass_chain, greedy=True)
    monkeypatch.setattr(retrieval, "point_mass_chain", lambda *a, greedy: broken(*a))
    compile_cache.clear()  # the executables compiled with the real verifier must not be reused
    try:
        freq, _ = _empirical(tiny_target, PROMPT, "pld", dict(num_draft_tokens=2), sampling)
    finally:
        compile_cache.clear()
    assert not _consistent(freq, _exact_law(tiny_target, PROMPT, sampling))


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(method=ssd_jax.PLD(draft_len=4), num_draft_tokens=0), r"use method=PLD\(draft_len=0\)"),
    (dict(method="pld", prompt_lookup_min=3, prompt_lookup_max=2), r"use method=PLD\(min_ngram=3, max_ngram=2\)"),
    (dict(method="pld", logitspec_topk=3), "PLD has no option for logitspec_topk"),
    (dict(method="logitspec", tree_capacity=1), r"use method=LogitSpec\(tree_size=1\)"),
    (dict(method="logitspec", max_ngram=0), r"use method=LogitSpec\(max_ngram=0\)"),
    (dict(method="logitspec", num_paths=2), "LogitSpec has no option for num_paths"),
])
def test_bad_retrieval_arguments(target, kwargs, match):
    with pytest.raises(InputError, match=match):
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, **kwargs)


def test_retrieval_refuses_a_draft_model(target):
    with pytest.raises(InputError, match="drafts without a model and takes no draft"):
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method="pld", draft=target)
