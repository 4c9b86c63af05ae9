"""`ssd_jax.decode` inside a user's `jax.jit`: equal to `generate` (same key) and, greedy, to AR;
composes with `forward`; no host callback; no recompiles for fresh params; bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.errors import InputError

NEW = 16
SYNC = [ssd_jax.AR(), ssd_jax.SD(draft_len=3), ssd_jax.BV(draft_len=3), ssd_jax.SpecInfer(draft_len=3, paths=2),
        ssd_jax.SpecTr(draft_len=3, paths=2), ssd_jax.GBV(draft_len=3, paths=2), ssd_jax.PLD(),
        ssd_jax.LogitSpec(tree_size=16), ssd_jax.CSD()]


@pytest.fixture(scope="module")
def pair():
    return ssd_jax.default_models()


def _draft(method, draft):
    if method.name in ("ar", "pld", "logitspec"):
        return None
    return (draft,) if method.name == "csd" else draft


def _batch(target):
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class A:\n    def __init__(self):"]
    rows = [target.tokenizer.encode(t).ids for t in texts]
    width = max(map(len, rows)) + 3  # not a bucket size: decode sees other padding than generate
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return rows, tokens, np.array([len(r) for r in rows], np.int32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", SYNC, ids=[m.name for m in SYNC])
def test_decode_in_user_jit_equals_generate_and_greedy_ar(pair, method, temperature):
    target, draft = pair
    rows, tokens, lengths = _batch(target)
    key = jax.random.PRNGKey(4)
    sampling = ssd_jax.SamplingParams(temperature=temperature)
    eos = tuple(target.config.eos_token_ids or ())

    @jax.jit
    def user(target, draft, tokens, lengths, key):
        out = ssd_jax.decode(target, tokens, lengths, method=method, max_new_tokens=NEW, key=key, draft=draft,
                             sampling=sampling, eos_ids=eos)
        return out.tokens, out.num_tokens

    out, num = user(target, _draft(method, draft), tokens, lengths, key)
    ours = [np.asarray(out)[b, :int(num[b])].tolist() for b in range(len(rows))]
    gen = ssd_jax.generate(target, rows, max_new_tokens=NEW, method=method, draft=_draft(method, draft), key=key,
                           temperature=temperature)
    assert ours == gen.tokens
    if temperature == 0.0:
        assert ours == ssd_jax.generate(target, rows, max_new_tokens=NEW).tokens


def test_decode_then_forward_twice_in_one_jit_no_callback_no_recompile(pair):
    target, draft = pair
    rows, tokens, lengths = _batch(target)

    @jax.jit
    def user(target, draft, tokens, lengths, key):
        a = ssd_jax.decode(target, tokens, lengths, method=ssd_jax.SD(draft_len=3), max_new_tokens=8, key=key,
                           draft=draft)
        b = ssd_jax.decode(target, tokens[::-1], lengths[::-1], method="pld", max_new_tokens=8, key=key)
        scores = ssd_jax.forward(target, a.tokens)  # score the continuation
        return a.tokens, b.tokens, jnp.sum(jax.nn.log_softmax(scores), axis=(1, 2))

    key = jax.random.PRNGKey(0)
    a, b, score = user(target, draft, tokens, lengths, key)
    assert a.shape == (3, 8) and b.shape == (3, 8) and score.shape == (3,)
    np.testing.assert_array_equal(np.asarray(b)[::-1], np.asarray(a))  # greedy: both are AR's tokens
    jaxpr = str(jax.make_jaxpr(user)(target, draft, tokens, lengths, key))
    assert "callback" not in jaxpr
    fresh = jax.tree.map(lambda x: x * 1.0, target)
    assert isinstance(fresh, ssd_jax.Model)
    user(fresh, draft, tokens, lengths, key)
    assert user._cache_size() == 1


def test_decode_bad_input(pair):
    target, draft = pair
    tokens, lengths, key = np.array([[1, 2, 3]], np.int32), np.array([3], np.int32), jax.random.PRNGKey(0)
    call = lambda **kw: ssd_jax.decode(**dict(dict(target=target, tokens=tokens, lengths=lengths, method="ar",  # noqa: E731
                                                   max_new_tokens=4, key=key), **kw))
    with pytest.raises(InputError, match="use ssd_jax.generate"):
        call(method=ssd_jax.SSD(), draft=draft)
    with pytest.raises(InputError, match="target must be an ssd_jax Model, got the method object"):
        call(target=ssd_jax.SD())
    with pytest.raises(InputError, match="method must be a method object"):
        call(method=draft)
    with pytest.raises(InputError, match="a tuple of drafters is for CSD"):
        call(method="sd", draft=(draft, draft))
    with pytest.raises(InputError, match=r"lengths\[0\] = 5 must be in \[1, 3\]"):
        call(lengths=np.array([5], np.int32))
    with pytest.raises(InputError, match=r"lengths\[0\] = 0"):
        call(lengths=np.array([0], np.int32))
    with pytest.raises(InputError, match=r"tokens\[0, 1\] = 99999 is outside the vocabulary"):
        call(tokens=np.array([[1, 99999, 3]], np.int32))
    with pytest.raises(InputError, match="max_new_tokens must be a static Python int"):
        jax.jit(lambda n: call(max_new_tokens=n).tokens)(4)
    with pytest.raises(InputError, match=r"use method=SD\(draft_len=4\)"):
        ssd_jax.generate(target, [[1, 2]], max_new_tokens=4, method="sd", draft=draft, num_draft_tokens=4)
