"""On-device n-gram retrieval (`ssd_jax.draft.ngram`) against a plain-Python reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.draft.ngram import append_tokens, find_continuation, suffix_queries
from ssd_jax.errors import InputError


def reference_lookup(text, query, n_min, n_max, num_tokens):
    """text: the valid tokens (a list); query: the valid query tokens, most recent last.
    Returns (tokens padded with 0 to num_tokens, count, matched_n)."""
    for n in range(min(n_max, len(query)), n_min - 1, -1):
        ends = [e for e in range(n - 1, len(text) - 1) if text[e - n + 1: e + 1] == query[len(query) - n:]]
        if not ends:
            continue
        full = [e for e in ends if e + num_tokens < len(text)]
        e = max(full) if full else max(ends)
        continuation = text[e + 1: e + 1 + num_tokens]
        return continuation + [0] * (num_tokens - len(continuation)), len(continuation), n
    return [0] * num_tokens, 0, 0


def random_case(rng, batch, capacity, num_queries, n_max, vocab):
    """Ragged rows (lengths 0, 1, ..., C) with in-vocabulary garbage past length, and queries that
    are either random or copied from the row's text (so long matches are common)."""
    context = rng.integers(0, vocab, size=(batch, capacity)).astype(np.int32)
    length = rng.integers(0, capacity + 1, size=batch).astype(np.int32)
    length[:3] = [0, 1, capacity]
    query = rng.integers(0, vocab, size=(batch, num_queries, n_max)).astype(np.int32)
    query_len = rng.integers(0, n_max + 1, size=(batch, num_queries)).astype(np.int32)
    query_len[rng.random(query_len.shape) < 0.5] = n_max
    for b in range(batch):
        for q in range(num_queries):
            if length[b] >= n_max and rng.random() < 0.5:
                start = rng.integers(0, length[b] - n_max + 1)
                query[b, q] = context[b, start: start + n_max]
    return context, length, query, query_len


@pytest.mark.parametrize(
    "n_min, n_max, num_tokens",
    [(1, 3, 1), (1, 4, 2), (2, 4, 3), (1, 2, 4), (2, 5, 5), (1, 4, 6), (2, 2, 6), (1, 1, 3)],
)
def test_find_continuation_matches_reference(n_min, n_max, num_tokens):
    rng = np.random.default_rng(1000 * n_min + 10 * n_max + num_tokens)
    vocab = int(rng.integers(3, 7))
    context, length, query, query_len = random_case(rng, batch=48, capacity=14, num_queries=4, n_max=n_max,
                                                    vocab=vocab)
    run = jax.jit(find_continuation, static_argnames=("n_min", "n_max", "num_tokens"))
    tokens, count, matched_n = map(np.asarray, run(context, length, query, query_len,
                                                   n_min=n_min, n_max=n_max, num_tokens=num_tokens))
    assert tokens.shape == (48, 4, num_tokens) and tokens.dtype == np.int32
    assert count.dtype == np.int32 and matched_n.dtype == np.int32
    partial = longest = unmatched = 0
    for b in range(48):
        text = context[b, : length[b]].tolist()
        for q in range(4):
            valid_query = query[b, q, n_max - query_len[b, q]:].tolist()
            want = reference_lookup(text, valid_query, n_min, n_max, num_tokens)
            got = (tokens[b, q].tolist(), int(count[b, q]), int(matched_n[b, q]))
            assert got == want, (b, q, text, valid_query)
            partial += 0 < want[1] < num_tokens
            longest += want[2] == n_max
            unmatched += want[2] == 0
    # The cases cover every outcome: n_max-gram matches, no match, short continuations.
    assert longest > 10 and unmatched > 0
    if num_tokens > 1:
        assert partial > 0


def test_larger_n_wins_over_a_more_recent_shorter_match():
    #             0  1  2  3  4  5  6  7
    context = [[7, 1, 2, 5, 9, 2, 6, 0]]
    tokens, count, n = find_continuation(jnp.array(context), jnp.array([8]), jnp.array([[[7, 1, 2]]]),
                                         jnp.array([[3]]), n_min=1, n_max=3, num_tokens=2)
    assert (tokens.tolist(), count.tolist(), n.tolist()) == ([[[5, 9]]], [[2]], [[3]])
    # With only the last token valid, the most recent "2" wins instead.
    tokens, count, n = find_continuation(jnp.array(context), jnp.array([8]), jnp.array([[[7, 1, 2]]]),
                                         jnp.array([[1]]), n_min=1, n_max=3, num_tokens=2)
    assert (tokens.tolist(), count.tolist(), n.tolist()) == ([[[6, 0]]], [[2]], [[1]])


def test_full_continuation_preferred_over_more_recent_partial_one():
    context = jnp.array([[1, 2, 9, 8, 7, 1, 2, 4]])
    query = jnp.array([[[1, 2]]])
    tokens, count, _ = find_continuation(context, jnp.array([8]), query, jnp.array([[2]]),
                                         n_min=1, n_max=2, num_tokens=3)
    assert tokens.tolist() == [[[9, 8, 7]]] and count.tolist() == [[3]]
    tokens, count, _ = find_continuation(context, jnp.array([8]), query, jnp.array([[2]]),
                                         n_min=1, n_max=2, num_tokens=1)
    assert tokens.tolist() == [[[4]]] and count.tolist() == [[1]]


def test_no_match_gives_zero_count_and_zero_tokens():
    context = jnp.array([[3, 4, 5, 6, 6, 6]])
    tokens, count, n = find_continuation(context, jnp.array([4]), jnp.array([[[0, 6], [1, 2]]]),
                                         jnp.array([[2, 2]]), n_min=1, n_max=2, num_tokens=3)
    # "6" only occurs past length (garbage), so neither query matches.
    assert tokens.tolist() == [[[0, 0, 0], [0, 0, 0]]]
    assert count.tolist() == [[0, 0]] and n.tolist() == [[0, 0]]


def test_suffix_never_matches_itself_and_short_continuation_is_padded():
    context = jnp.array([[5, 6, 7, 5, 6, 7, 0, 0], [1, 2, 3, 9, 9, 9, 9, 9]])
    length = jnp.array([6, 3])
    query, query_len = suffix_queries(context, length, 3)
    assert query.tolist() == [[[5, 6, 7]], [[1, 2, 3]]] and query_len.tolist() == [[3], [3]]
    tokens, count, n = find_continuation(context, length, query, query_len, n_min=1, n_max=3, num_tokens=4)
    # Row 0: "5 6 7" at 0..2 is followed by the three tokens 5 6 7 (then the end of the text).
    # Row 1: the suffix "1 2 3" is the whole text; nothing follows it, so no match at all.
    assert tokens.tolist() == [[[5, 6, 7, 0]], [[0, 0, 0, 0]]]
    assert count.tolist() == [[3], [0]] and n.tolist() == [[3], [0]]


def test_suffix_queries_left_pad_short_rows_and_ignore_garbage():
    context = jnp.array([[4, 8, 1, 1], [7, 9, 9, 9], [3, 3, 3, 3]])
    query, query_len = suffix_queries(context, jnp.array([3, 1, 0]), 3)
    assert query.tolist() == [[[4, 8, 1]], [[0, 0, 7]], [[0, 0, 0]]]
    assert query_len.tolist() == [[3], [1], [0]]


def test_append_tokens_ragged_and_at_capacity_edge():
    context = jnp.array([[1, 2, 0, 0, 0], [1, 2, 3, 4, 0], [5, 5, 5, 5, 5], [0, 0, 0, 0, 0]], jnp.int32)
    length = jnp.array([2, 4, 5, 0])
    tokens = jnp.array([[7, 8, 9], [7, 8, 9], [7, 8, 9], [6, 6, 6]])
    new, new_length = jax.jit(append_tokens)(context, length, tokens, jnp.array([2, 3, 3, 0]))
    assert new.tolist() == [[1, 2, 7, 8, 0], [1, 2, 3, 4, 7], [5, 5, 5, 5, 5], [0, 0, 0, 0, 0]]
    assert new_length.tolist() == [4, 5, 5, 0]


def test_appended_text_is_found_by_lookup():
    context = jnp.zeros((1, 8), jnp.int32)
    context, length = append_tokens(context, jnp.array([0]), jnp.array([[2, 3, 4, 2]]), jnp.array([4]))
    query, query_len = suffix_queries(context, length, 2)
    tokens, count, _ = find_continuation(context, length, query, query_len, n_min=1, n_max=2, num_tokens=2)
    assert tokens.tolist() == [[[3, 4]]] and count.tolist() == [[2]]


def test_realistic_size_stays_small():
    """B=8, Q=24, C=2048, n_max=8: a pass over [B, Q, C] per n, nothing quadratic in C."""
    rng = np.random.default_rng(0)
    context = rng.integers(0, 50, size=(8, 2048)).astype(np.int32)
    query = rng.integers(0, 50, size=(8, 24, 8)).astype(np.int32)
    run = jax.jit(find_continuation, static_argnames=("n_min", "n_max", "num_tokens"))
    compiled = run.lower(context, np.full((8,), 2048, np.int32), query, np.full((8, 24), 8, np.int32),
                         n_min=1, n_max=8, num_tokens=4).compile()
    analysis = compiled.memory_analysis()
    if analysis is not None:
        assert analysis.temp_size_in_bytes < 64 * 2**20
    tokens, count, n = compiled(context, np.full((8,), 2048, np.int32), query, np.full((8, 24), 8, np.int32))
    assert tokens.shape == (8, 24, 4) and int(jnp.min(n)) >= 1  # 50 symbols over 2048 tokens: every 1-gram occurs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_min=0, n_max=2, num_tokens=1), "n_min must be at least 1, got 0"),
        (dict(n_min=3, n_max=2, num_tokens=1), "n_max must be at least n_min=3, got 2"),
        (dict(n_min=1, n_max=2, num_tokens=0), "num_tokens must be at least 1, got 0"),
        (dict(n_min=1, n_max=3, num_tokens=1), r"query must have shape \[B=1, Q, n_max=3\], got \(1, 1, 2\)"),
    ],
)
def test_bad_arguments_raise_input_error(kwargs, message):
    with pytest.raises(InputError, match=message):
        find_continuation(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), jnp.zeros((1, 1, 2), jnp.int32),
                          jnp.array([[2]]), **kwargs)
