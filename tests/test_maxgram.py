"""Max-Gram drafting (`ssd_jax.draft.maxgram`) against a plain-Python reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.draft.bigram import default_bigram
from ssd_jax.draft.maxgram import maxgram_draft
from ssd_jax.errors import InputError


def reference_maxgram(text, bigram, num_tokens, max_ngram):
    """Longest suffix (n = max_ngram..1) with an earlier occurrence followed by something; its most
    recent occurrence with a full continuation, else its most recent one; bigram chain after."""
    draft = []
    for n in range(min(max_ngram, len(text)), 0, -1):
        suffix = text[len(text) - n:]
        ends = [e for e in range(n - 1, len(text) - 1) if text[e - n + 1: e + 1] == suffix]
        if ends:
            full = [e for e in ends if e + num_tokens < len(text)]
            e = max(full) if full else max(ends)
            draft = text[e + 1: e + 1 + num_tokens]
            break
    previous = draft[-1] if draft else (text[-1] if text else 0)
    while len(draft) < num_tokens:
        previous = bigram[previous]
        draft.append(previous)
    return draft


@pytest.mark.parametrize("num_tokens, max_ngram", [(1, 2), (3, 3), (4, 1), (6, 4), (2, 5)])
def test_maxgram_matches_reference(num_tokens, max_ngram):
    rng = np.random.default_rng(100 * num_tokens + max_ngram)
    batch, capacity, vocab = 96, 16, int(rng.integers(3, 7))
    context = rng.integers(0, vocab, size=(batch, capacity)).astype(np.int32)
    length = rng.integers(0, capacity + 1, size=batch).astype(np.int32)
    length[:3] = [0, 1, capacity]
    bigram = rng.integers(0, vocab, size=vocab).astype(np.int32)
    run = jax.jit(maxgram_draft, static_argnames=("num_tokens", "max_ngram"))
    got = np.asarray(run(context, length, bigram, num_tokens=num_tokens, max_ngram=max_ngram))
    assert got.shape == (batch, num_tokens) and got.dtype == np.int32
    for b in range(batch):
        want = reference_maxgram(context[b, : length[b]].tolist(), bigram.tolist(), num_tokens, max_ngram)
        assert got[b].tolist() == want, (b, context[b, : length[b]].tolist())


def test_no_match_chains_the_bigram_from_the_last_token():
    bigram = jnp.array([1, 2, 3, 4, 0, 5], jnp.int32)
    context = jnp.array([[5, 4, 9, 9]])  # nothing before the final 4 is a 4, and 9s are garbage
    draft = maxgram_draft(context, jnp.array([2]), bigram, num_tokens=4, max_ngram=3)
    assert draft.tolist() == [[0, 1, 2, 3]]


def test_short_continuation_is_completed_by_the_bigram():
    bigram = jnp.array([3, 3, 3, 1, 3], jnp.int32)
    context = jnp.array([[2, 4, 0, 2, 4]])  # "2 4" recurs; only "0 2 4" follows its first occurrence
    draft = maxgram_draft(context, jnp.array([5]), bigram, num_tokens=5, max_ngram=2)
    assert draft.tolist() == [[0, 2, 4, 3, 1]]


def test_empty_row_chains_from_token_zero():
    bigram = jnp.array([2, 0, 1], jnp.int32)
    draft = maxgram_draft(jnp.array([[1, 1, 1]]), jnp.array([0]), bigram, num_tokens=3, max_ngram=2)
    assert draft.tolist() == [[2, 1, 0]]


def test_drafts_with_the_shipped_table():
    bigram = jnp.asarray(default_bigram())
    context = jnp.array([[17, 400, 17, 401, 17, 9]])
    draft = maxgram_draft(context, jnp.array([5]), bigram, num_tokens=3, max_ngram=4)
    assert draft.tolist() == [[400, 17, 401]]
    draft = maxgram_draft(context, jnp.array([2]), bigram, num_tokens=3, max_ngram=4)
    assert draft.tolist() == [[int(bigram[400]), int(bigram[bigram[400]]), int(bigram[bigram[bigram[400]]])]]


def test_bad_arguments_raise_input_error():
    with pytest.raises(InputError, match="max_ngram must be at least 1, got 0"):
        maxgram_draft(jnp.zeros((1, 4), jnp.int32), jnp.array([2]), jnp.zeros((4,), jnp.int32),
                      num_tokens=2, max_ngram=0)
    with pytest.raises(InputError, match=r"bigram must be a non-empty table int32 \[V\], got shape \(2, 2\)"):
        maxgram_draft(jnp.zeros((1, 4), jnp.int32), jnp.array([2]), jnp.zeros((2, 2), jnp.int32),
                      num_tokens=2, max_ngram=2)


def test_maxgram_drafter_is_a_pytree_with_its_table_as_leaf():
    from ssd_jax.draft.maxgram import MaxGram

    table = jnp.arange(5, dtype=jnp.int32)[::-1]
    drafter = MaxGram(bigram=table)
    assert jax.tree.leaves(drafter) == [drafter.bigram]
    doubled = jax.tree.map(lambda x: x, drafter)
    assert isinstance(doubled, MaxGram)
    context = jnp.array([[1, 2, 3, 1, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m: m.draft(context, jnp.array([5]), num_tokens=2,
                                                                      max_ngram=2))(drafter)), [[3, 1]])
