"""Verifier API contract: shapes and dtypes, bad input, jit/vmap, per-row independence,
gbv(K=1) == block, greedy chains, and edge cases (q = p, zeros, one-hot rows, V = 152k, K = 8,
L = 16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import verify
from ssd_jax.errors import InputError

SINGLE = ["greedy", "tokenwise", "block"]
MULTI = ["greedy_multipath", "specinfer", "spectr", "gbv"]
SAMPLING_MULTI = ["specinfer", "spectr", "gbv"]

B, K, L, V = 4, 3, 4, 16     # one shape for most tests here, so each verifier compiles once


def _softmax(x):
    return jax.nn.softmax(jnp.asarray(x, jnp.float32), axis=-1)


def _multi_inputs(seed, b=B, k=K, l=L, v=V, scale=2.0):
    """K paths with shared prefixes (rows of equal prefixes repeat) and their q / p rows."""
    rng = np.random.default_rng(seed)
    paths = rng.integers(0, max(2, v // 4), size=(b, k, l)).astype(np.int32)   # small alphabet: shared prefixes

    def table(depth_rows):
        out = np.zeros((b, k, depth_rows, v), np.float32)
        for bi in range(b):
            cache = {}
            for ki in range(k):
                for d in range(depth_rows):
                    key = tuple(paths[bi, ki, :d])
                    if key not in cache:
                        cache[key] = np.asarray(_softmax(scale * rng.normal(size=v)))
                    out[bi, ki, d] = cache[key]
        return out

    return paths, table(l), table(l + 1)


def _call(name, key, paths, q, p):
    fn = getattr(verify, name)
    if name in SINGLE:
        return fn(key, paths[:, 0], q[:, 0], p[:, 0])
    return fn(key, paths, q, p)


def _check_result(res, b, l, k=1):
    assert isinstance(res, verify.VerifyResult)
    for field in res:
        assert field.shape == (b,) and field.dtype == jnp.int32
    n, y, idx = (np.asarray(f) for f in res)
    assert np.all((n >= 0) & (n <= l))
    assert np.all((idx >= 0) & (idx < k))
    return n, y, idx


# ----------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", SINGLE + MULTI)
def test_result_shapes_jit_and_vmap(name):
    paths, q, p = _multi_inputs(0)
    k = K if name in MULTI else 1
    _check_result(_call(name, jax.random.PRNGKey(7), paths, q, p), B, L, k)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    batched = jax.jit(jax.vmap(lambda kk: _call(name, kk, paths, q, p)))(keys)
    for i in range(3):
        single = _call(name, keys[i], paths, q, p)
        for a, b_ in zip(single, batched):
            np.testing.assert_array_equal(a, np.asarray(b_)[i])


@pytest.mark.parametrize("name", ["tokenwise", "block"] + SAMPLING_MULTI)
def test_rows_are_independent(name):
    """A row's verdict depends on its own inputs and the key only, not on other rows."""
    paths, q, p = _multi_inputs(1)
    paths2, q2, p2 = _multi_inputs(2)
    for row in range(1, B):
        paths2[row], q2[row], p2[row] = paths[row], q[row], p[row]
    key = jax.random.PRNGKey(11)
    a, b_ = _call(name, key, paths, q, p), _call(name, key, paths2, q2, p2)
    for fa, fb in zip(a, b_):
        np.testing.assert_array_equal(np.asarray(fa)[1:], np.asarray(fb)[1:])


def test_emitted_prefix_is_a_path_prefix():
    paths, q, p = _multi_inputs(3)
    for name in SAMPLING_MULTI:
        for s in range(3):
            n, _, idx = _check_result(_call(name, jax.random.PRNGKey(s), paths, q, p), B, L, K)
            for b in range(B):      # path_index is the lowest index with the accepted prefix
                same = [k for k in range(K) if np.array_equal(paths[b, k, :n[b]], paths[b, idx[b], :n[b]])]
                assert idx[b] == same[0]


def test_gbv_with_one_path_is_block():
    paths, q, p = _multi_inputs(4)
    draft = np.asarray(jax.random.categorical(jax.random.PRNGKey(0), jnp.log(q[:, :1])))
    for s in range(10):
        key = jax.random.PRNGKey(100 + s)
        want = verify.block(key, draft[:, 0], q[:, 0], p[:, 0])
        got = verify.gbv(key, draft, q[:, :1], p[:, :1])
        for a, b_ in zip(want, got):
            np.testing.assert_array_equal(a, b_)


def test_float64_and_bfloat16_inputs():
    paths, q, p = _multi_inputs(5)
    with jax.enable_x64(True):
        res = verify.block(jax.random.PRNGKey(0), paths[:, 0], q[:, 0].astype(np.float64),
                           p[:, 0].astype(np.float64))
        _check_result(res, B, L)
    res = verify.tokenwise(jax.random.PRNGKey(0), paths[:, 0], jnp.asarray(q[:, 0], jnp.bfloat16),
                           jnp.asarray(p[:, 0], jnp.bfloat16))
    _check_result(res, B, L)


# ----------------------------------------------------------------------------- bad input


def _bad_single_cases():
    d = np.zeros((2, 3), np.int32)
    q = np.full((2, 3, 5), 0.2, np.float32)
    p = np.full((2, 4, 5), 0.2, np.float32)
    return [
        ((d[0], q, p), "draft_tokens must have shape"),
        ((d.astype(np.float32), q, p), "integer"),
        ((d, q[:, :2], p), "q must have shape"),
        ((d, q[:1], p), "q must have shape"),
        ((d, q, p[:, :3]), "p must have shape"),
        ((d, q, np.full((2, 4, 6), 0.2, np.float32)), "vocabulary mismatch"),
        ((d, q.astype(np.int32), p), "floating-point"),
        ((np.zeros((2, 0), np.int32), q[:, :0], p[:, :1]), "L must be >= 1"),
    ]


@pytest.mark.parametrize("name", SINGLE)
def test_bad_single_input(name):
    for args, msg in _bad_single_cases():
        with pytest.raises(InputError, match=msg):
            getattr(verify, name)(jax.random.PRNGKey(0), *args)


@pytest.mark.parametrize("name", MULTI)
def test_bad_multi_input(name):
    paths = np.zeros((2, 3, 4), np.int32)
    q = np.full((2, 3, 4, 5), 0.2, np.float32)
    p = np.full((2, 3, 5, 5), 0.2, np.float32)
    cases = [
        ((paths[0], q, p), "paths must have shape"),
        ((paths, q[:, :2], p), "q must have shape"),
        ((paths, q, p[:, :, :4]), "p must have shape"),
        ((paths, q, np.full((2, 3, 5, 7), 0.2, np.float32)), "vocabulary mismatch"),
        ((paths[:, :0], q[:, :0], p[:, :0]), "K must be >= 1"),
    ]
    for args, msg in cases:
        with pytest.raises(InputError, match=msg) as info:
            getattr(verify, name)(jax.random.PRNGKey(0), *args)
        assert any(ch.isdigit() for ch in str(info.value))          # names the values


# ----------------------------------------------------------------------------- greedy


def test_greedy_emits_the_argmax_chain():
    rng = np.random.default_rng(6)
    b, l, v = 32, 6, 20
    p = np.asarray(_softmax(3 * rng.normal(size=(b, l + 1, v))))
    top = p.argmax(-1)
    mismatch = rng.integers(0, l + 1, size=b)            # l means "no mismatch"
    draft = top[:, :l].copy()
    for r in range(b):
        if mismatch[r] < l:
            draft[r, mismatch[r]] = (top[r, mismatch[r]] + 1 + rng.integers(v - 1)) % v
    q = np.full((b, l, v), 1.0 / v, np.float32)
    n, y, idx = _check_result(verify.greedy(None, draft, q, p), b, l)
    np.testing.assert_array_equal(n, mismatch)
    np.testing.assert_array_equal(y, top[np.arange(b), mismatch])
    np.testing.assert_array_equal(idx, 0)


def test_greedy_multipath_picks_the_longest_match_lowest_index():
    v, l = 10, 4
    p = np.full((1, 3, l + 1, v), 0.01, np.float32)
    chain = [3, 1, 4, 1, 5]
    for d, tok in enumerate(chain):
        p[:, :, d, tok] = 0.91
    paths = np.array([[[3, 1, 0, 0], [3, 1, 4, 2], [3, 1, 4, 9]]], np.int32)
    q = np.full((1, 3, l, v), 0.1, np.float32)
    n, y, idx = _check_result(verify.greedy_multipath(None, paths, q, p), 1, l, 3)
    assert (n[0], y[0], idx[0]) == (3, 1, 1)       # paths 1 and 2 tie at 3: lowest index wins
    paths[0, 2] = [3, 1, 4, 1]
    n, y, idx = _check_result(verify.greedy_multipath(None, paths, q, p), 1, l, 3)
    assert (n[0], y[0], idx[0]) == (4, 5, 2)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["tokenwise", "block"] + SAMPLING_MULTI)
def test_q_equal_p_accepts_everything(name):
    """q = p: block's residuals are 0/0, SpecTr's rho* is 1, GBV's keys all tie. Every path is
    then a target sample: token-wise, block and SpecInfer accept all of it. SpecTr's bisection
    stops a hair above rho* = 1 (acceptance 1 - 4e-7 per candidate); GBV's skewed draft differs
    from q, so it may reject, and is only checked for finiteness here."""
    paths, q, _ = _multi_inputs(8)
    p = np.concatenate([q, q[:, :, -1:]], axis=2)                   # p_i = q_i, bonus row = q_L-1
    for s in range(4):
        n, y, _ = _check_result(_call(name, jax.random.PRNGKey(s), paths, q, p), B, L,
                                K if name in MULTI else 1)
        if name != "gbv":
            np.testing.assert_array_equal(n, L)


@pytest.mark.parametrize("name", ["tokenwise", "block"] + SAMPLING_MULTI)
def test_one_hot_rows(name):
    """Temperature-0 rows on both sides: a draft on the target's token is accepted, and at the
    first disagreement the next token is the target's (its residual is the target's point mass)."""
    chain = np.array([2, 7, 7, 1, 4])
    p_rows = np.eye(V, dtype=np.float32)[chain]                     # [L+1, V]
    agree = np.broadcast_to(chain[:L], (B, K, L)).copy()
    for b, stop in enumerate([0, 1, 3, 4]):                         # row b disagrees at `stop`
        if stop < L:
            agree[b, :, stop] = (chain[stop] + 1) % V
    q = np.eye(V, dtype=np.float32)[agree]
    p = np.broadcast_to(p_rows, (B, K, L + 1, V)).copy()
    n, y, _ = _check_result(_call(name, jax.random.PRNGKey(0), agree, q, p), B, L,
                            K if name in MULTI else 1)
    np.testing.assert_array_equal(n, [0, 1, 3, 4])
    np.testing.assert_array_equal(y, chain[[0, 1, 3, 4]])


def test_zeros_never_emit_zero_probability_tokens():
    """Target zeros where the draft has mass and the reverse: no emitted token ever has target
    probability 0, over many keys."""
    rng = np.random.default_rng(9)
    paths, q, p = _multi_inputs(9)
    q = np.where(rng.random(q.shape) < 0.4, 0.0, q)
    q[..., 0] += 1e-3
    q /= q.sum(-1, keepdims=True)
    p = np.where(rng.random(p.shape) < 0.4, 0.0, p)
    p[..., 1] += 1e-3
    p /= p.sum(-1, keepdims=True)
    # keep the shared-prefix rows identical after masking
    for b in range(B):
        for k in range(1, K):
            for d in range(L + 1):
                same = [j for j in range(k) if np.array_equal(paths[b, j, :d], paths[b, k, :d])]
                if same:
                    p[b, k, d] = p[b, same[0], d]
                    if d < L:
                        q[b, k, d] = q[b, same[0], d]
    for name in ["tokenwise", "block"] + SAMPLING_MULTI:
        for s in range(50):
            n, y, idx = (np.asarray(f) for f in _call(name, jax.random.PRNGKey(s), paths, q, p))
            assert np.all(p[np.arange(B), idx, n, y] > 0), name


def test_large_vocabulary_many_paths_long_drafts():
    """V = 152,064 (Qwen2), K = 8, L = 16, float32: verdicts valid, internals finite."""
    b, k, l, v = 1, 8, 16, 152_064
    key = jax.random.PRNGKey(0)
    kq, kp, kd = jax.random.split(key, 3)
    q_root = jax.nn.softmax(6.0 * jax.random.normal(kq, (b, 1, l, v)), axis=-1)
    p_root = jax.nn.softmax(6.0 * jax.random.normal(kp, (b, 1, l + 1, v)), axis=-1)
    # every path identical: the rows trivially repeat, and all verifiers exercise full depth
    paths = jnp.broadcast_to(jax.random.categorical(kd, jnp.log(q_root)).astype(jnp.int32), (b, k, l))
    q = jnp.broadcast_to(q_root, (b, k, l, v))
    p = jnp.broadcast_to(p_root, (b, k, l + 1, v))
    for name in SINGLE + MULTI:
        _check_result(_call(name, key, paths, q, p), b, l, k if name in MULTI else 1)
    h, residual = verify.block_tables(paths[:, 0], q[:, 0], p[:, 0])
    assert np.all(np.isfinite(h)) and np.all((np.asarray(h) >= 0) & (np.asarray(h) <= 1))
    assert np.all(np.isfinite(residual))
    _, _, q_tilde, _ = verify.skewed_draft(paths, q, p)
    q_tilde = np.asarray(q_tilde)
    assert np.all(np.isfinite(q_tilde)) and np.all(q_tilde >= 0)
    np.testing.assert_allclose(q_tilde.sum(-1), 1.0, atol=1e-4)
    # q = p at this size: the 0/0 residuals stay harmless and everything is accepted
    same = verify.block(key, paths[:, 0], q[:, 0], jnp.concatenate([q[:, 0], q[:, 0, -1:]], axis=1))
    assert int(same.num_accepted[0]) == l


def test_gbv_sort_orders_agree():
    """The CPU radix order and the key/value-sort order (other platforms) are both the
    (key, token id) order, ties included."""
    from ssd_jax.verify._order import _pair_sort_order, _radix_order

    rng = np.random.default_rng(12)
    for v in (1, 5, 300, 40_000):
        keys = rng.integers(0, 2 ** 32, v, dtype=np.uint64).astype(np.uint32)
        keys[rng.random(v) < 0.3] = keys[0]                        # a large tie group
        want = np.lexsort((np.arange(v), keys))
        np.testing.assert_array_equal(_radix_order(jnp.asarray(keys)), want)
        np.testing.assert_array_equal(_pair_sort_order(jnp.asarray(keys)), want)
