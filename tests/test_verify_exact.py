"""Exactness of every sampling verifier by exact enumeration in float64.

For tiny vocabularies and lengths, every draft path (every K-tuple of paths for multi-path
verifiers) is enumerated with its draft probability; the verifier's own deterministic part
(acceptance probabilities, block token probabilities h_i, residuals, GBV's selection and skewed
draft, SpecInfer/SpecTr node rules), run in float64, gives the law of its output given the draft;
the emitted sequence is extended to length L+1 with the target's conditionals and its law is
compared with the target's joint law. The enumeration is the exact-law kit's (`ssd_jax.testing`,
tests/test_law_kit.py); the sampling wiring (uniforms vs those probabilities, the token draw) is
checked against the same target law by the kit's sampled check in test_law_kit.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ssd_jax import testing as kit
from ssd_jax import verify
from ssd_jax.testing.controls import CONTROLS

EXACT_TOL = 1e-12

SINGLE_CASES = [(0, 3, 2), (1, 3, 3), (2, 2, 4), (3, 4, 2), (4, 3, 2)]   # (seed, V, L)
MULTI_CASES = [(10, 3, 2, 2), (11, 3, 2, 3), (12, 2, 3, 2), (13, 4, 2, 2), (14, 2, 2, 4)]  # (seed, V, L, K)


@pytest.mark.parametrize("seed,V,L", SINGLE_CASES)
def test_tokenwise_law_is_target(seed, V, L):
    t = kit.random_tables(seed, V, L)
    assert kit.law_distance(kit.exact_law("tokenwise", t), kit.target_law(t)) < EXACT_TOL


@pytest.mark.parametrize("seed,V,L", SINGLE_CASES)
def test_block_law_is_target(seed, V, L):
    t = kit.random_tables(seed, V, L)
    assert kit.law_distance(kit.exact_law("block", t), kit.target_law(t)) < EXACT_TOL


@pytest.mark.parametrize("seed,V,L,K", MULTI_CASES + [(15, 3, 2, 1)])
def test_gbv_law_is_target(seed, V, L, K):
    t = kit.random_tables(seed, V, L)
    assert kit.law_distance(kit.exact_law("gbv", t, K), kit.target_law(t)) < EXACT_TOL


@pytest.mark.parametrize("seed,V,L,K", MULTI_CASES)
def test_specinfer_law_is_target(seed, V, L, K):
    t = kit.random_tables(seed, V, L)
    assert kit.law_distance(kit.exact_law("specinfer", t, K), kit.target_law(t)) < EXACT_TOL


@pytest.mark.parametrize("unrolled", [False, True], ids=["bisection", "unrolled_search"])
@pytest.mark.parametrize("seed,V,L,K", MULTI_CASES)
def test_spectr_law_is_target(seed, V, L, K, unrolled):
    t = kit.random_tables(seed, V, L)
    # rho* comes from a bracket search (bisection on CPU, 15 points a round elsewhere); any rho on
    # the kept side of the bracket is exact, so the only error left is float64 rounding.
    assert kit.law_distance(kit.exact_law("spectr", t, K, unrolled=unrolled), kit.target_law(t)) < EXACT_TOL


# ----------------------------------------------------------------------------- power


@pytest.mark.parametrize("seed,V,L", SINGLE_CASES)
def test_argmax_acceptance_is_detected(seed, V, L):
    # Full-support rows: a one-hot draft on a non-argmax token would hide the bug at the root.
    t = kit.random_tables(seed, V, L, zero_prob=0.0, special_prob=0.0)
    law = CONTROLS["argmax_acceptance"].exact_law(t)
    assert kit.law_distance(law, kit.target_law(t)) > 1e-5   # vs EXACT_TOL = 1e-12


@pytest.mark.parametrize("seed,V,L,K", MULTI_CASES)
def test_gbv_without_skew_is_detected(seed, V, L, K):
    t = kit.random_tables(seed, V, L, zero_prob=0.0, special_prob=0.0)
    assert kit.law_distance(CONTROLS["gbv_unskewed"].exact_law(t, K), kit.target_law(t)) > 1e-5


# ----------------------------------------------------------------------------- GBV internals


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 2e-6)])
@pytest.mark.parametrize("seed,V,L,K", [(20, 3, 2, 2), (21, 3, 2, 3), (22, 2, 3, 3)])
def test_skewed_draft_is_the_law_of_the_selected_path(seed, V, L, K, dtype, tol):
    """Enumerate every K-tuple, take the path GBV selects, and compare the selection frequency of
    each path with prod_i q~_i(x_i): selection and the cumulative sums use one order."""
    t = kit.random_tables(seed, V, L, special_prob=0.5)
    paths, prob, q, p = kit.multi_path_inputs(t, K)
    q, p = q.astype(dtype), p.astype(dtype)
    if dtype == np.float64:
        _, x_star, q_tilde, _ = kit.x64(verify.skewed_draft, paths, q, p)
    else:
        _, x_star, q_tilde, _ = (np.asarray(a) for a in verify.skewed_draft(paths, q, p))
    flat = np.zeros(len(prob), np.int64)
    for i in range(L):
        flat = flat * V + x_star[:, i]
    selected = np.bincount(flat, weights=prob, minlength=V ** L)
    predicted = np.prod(np.take_along_axis(q_tilde, x_star[..., None], -1)[..., 0].astype(np.float64), axis=1)
    assert np.max(np.abs(selected[flat] - predicted)) < tol
    for row in range(len(prob)):      # X* is the greatest path: the max of the paths present
        assert tuple(x_star[row]) in {tuple(x) for x in paths[row]}


@pytest.mark.parametrize("seed,V,L,K", [(23, 3, 2, 3), (24, 4, 2, 2)])
def test_gbv_selects_the_greatest_path(seed, V, L, K):
    """Exactness holds for any order used consistently, so it cannot catch a wrong order; this
    checks the order itself against a plain reference: at the first depth where two paths differ,
    compare (log p - log q, token id) there; X* is the greatest path."""
    t = kit.random_tables(seed, V, L, zero_prob=0.0, special_prob=0.0)
    paths, prob, q, p = kit.multi_path_inputs(t, K)
    _, x_star, _, _ = kit.x64(verify.skewed_draft, paths, q, p)

    def sort_key(row, k):
        x = paths[row, k]
        return tuple((np.log(p[row, k, d, x[d]]) - np.log(q[row, k, d, x[d]]), x[d]) for d in range(L))

    for row in range(len(prob)):
        best = max(range(K), key=lambda k: sort_key(row, k))
        np.testing.assert_array_equal(x_star[row], paths[row, best])


def test_gbv_ties_follow_token_id():
    """p = q everywhere ties every key at 0: the order is the token id, X* is the
    lexicographically largest path, and the law is still exact."""
    V, L, K = 3, 2, 3
    rng = np.random.default_rng(5)
    row = rng.dirichlet(np.ones(V))
    t = kit.iid_tables(row, row, L)
    paths, prob, q, p = kit.multi_path_inputs(t, K)
    _, x_star, _, _ = kit.x64(verify.skewed_draft, paths, q, p)
    expected = np.array([max(tuple(x) for x in paths[r]) for r in range(len(prob))])
    np.testing.assert_array_equal(x_star, expected)
    assert kit.law_distance(kit.exact_law("gbv", t, K), kit.target_law(t)) < EXACT_TOL


def test_gbv_equal_keys_tie_by_token_id():
    """Tokens 1 and 2 have identical (p, q), hence identical keys: the larger id is greater, in
    the selection and in the cumulative sums alike."""
    p = np.array([0.1, 0.25, 0.25, 0.4])
    q = np.array([0.4, 0.15, 0.15, 0.3])       # p/q = 0.25, 5/3, 5/3, 4/3
    paths = np.array([[[1], [2]], [[2], [1]]], np.int32)          # B=2, K=2, L=1
    qq = np.broadcast_to(q, (2, 2, 1, 4))
    pp = np.broadcast_to(p, (2, 2, 2, 4))
    k_star, x_star, q_tilde, _ = kit.x64(verify.skewed_draft, paths, qq, pp)
    np.testing.assert_array_equal(x_star[:, 0], [2, 2])
    np.testing.assert_array_equal(k_star, [1, 0])
    # order 0, 3, 1, 2 -> F^- by token id = 0, 0.7, 0.85, 0.4; with K = 2, q~ = F^2 - (F^-)^2
    f_before = np.array([0.0, 0.7, 0.85, 0.4])
    np.testing.assert_allclose(q_tilde[0, 0], (f_before + q) ** 2 - f_before ** 2, rtol=1e-12)


# ----------------------------------------------------------------------------- closed forms


def test_block_toy_closed_forms():
    """p = [1/3, 2/3], q = [2/3, 1/3] at every position, L = 2 (Sun et al.'s example):
    E[accepted] = 10/9 for token-wise and 11/9 for block verification."""
    t = kit.iid_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2)
    drafts, prob, q, p = kit.single_path_inputs(t)
    accept, _ = kit.x64(verify.tokenwise_tables, drafts, q, p)
    h, _ = kit.x64(verify.block_tables, drafts, q, p)
    assert abs(kit.expected_accepted(kit.tokenwise_stop_prob(accept), prob) - 10 / 9) < 1e-14
    assert abs(kit.expected_accepted(kit.block_stop_prob(h), prob) - 11 / 9) < 1e-14


@pytest.mark.parametrize("seed,V,L", [(30, 5, 3), (31, 3, 4), (32, 6, 2)])
def test_tokenwise_matches_alpha_series_and_block_is_no_worse(seed, V, L):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    alpha = np.minimum(p, q).sum()
    t = kit.iid_tables(p, q, L)
    drafts, prob, qq, pp = kit.single_path_inputs(t)
    accept, _ = kit.x64(verify.tokenwise_tables, drafts, qq, pp)
    h, _ = kit.x64(verify.block_tables, drafts, qq, pp)
    e_tok = kit.expected_accepted(kit.tokenwise_stop_prob(accept), prob)
    e_blk = kit.expected_accepted(kit.block_stop_prob(h), prob)
    assert abs(e_tok - sum(alpha ** i for i in range(1, L + 1))) < 1e-13
    assert e_blk >= e_tok - 1e-13


@pytest.mark.parametrize("unrolled", [False, True], ids=["bisection", "unrolled_search"])
def test_spectr_rho_is_one_where_draft_equals_target(unrolled):
    """p = q: p_acc(rho) = 1 - (1 - 1/rho)^k <= 1 = rho beta for every rho >= 1, so rho* = 1 and
    every candidate is accepted. Computed as 1 - (1 - beta)^k - rho beta, the excess cancelled to
    rounding noise and the bisection stopped at rho up to 1.13 (float32, k = 8): 11% of the
    acceptances lost at such a node, exact still. Near-equal laws stay within a few ulps of the
    two searches' common answer."""
    rng = np.random.default_rng(41)
    spectr_rho = functools.partial(verify.spectr_rho, unrolled=unrolled)
    for vocab in (4, 50, 4096):
        for _ in range(5):
            p = rng.dirichlet(np.full(vocab, 0.5)).astype(np.float32)
            for k in (2, 4, 8):
                assert float(spectr_rho(p, p, np.float32(k))) < 1 + 1e-6
    for _ in range(20):
        q = rng.dirichlet(np.full(50, 0.5))
        p = q * np.exp(10.0 ** rng.uniform(-9, -1) * rng.normal(size=50))
        p, q = (p / p.sum()).astype(np.float32), q.astype(np.float32)
        for k in (2, 4, 8):
            rho = float(spectr_rho(p, q, np.float32(k)))
            other = float(verify.spectr_rho(p, q, np.float32(k), unrolled=not unrolled))
            assert abs(rho - other) < 1e-6


@pytest.mark.parametrize("unrolled", [False, True], ids=["bisection", "unrolled_search"])
def test_spectr_rho_solves_the_balance_equation(unrolled):
    rng = np.random.default_rng(40)
    for k in (2, 3, 8):
        p, q = rng.dirichlet(np.ones(50)), rng.dirichlet(np.ones(50))
        rho = float(kit.x64(functools.partial(verify.spectr_rho, unrolled=unrolled), p, q, np.float64(k)))
        beta = np.minimum(p / rho, q).sum()
        p_acc = 1 - (1 - beta) ** k
        assert 1 <= rho <= k
        assert p_acc <= rho * beta + 1e-12            # kept side: exact
        assert rho * beta - p_acc < 1e-5              # and tight: (near-)optimal
