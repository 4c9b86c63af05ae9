"""Exactness of the sampling verifiers end to end, in float32, by Monte Carlo.

Each check runs N = 200,000 independent speculative steps (50 vmapped keys x 4,000 batch rows,
one jit): sample the draft path(s) from prefix-dependent draft tables, verify against the
target tables, extend the emitted sequence to length L+1 with target samples, and compare the
counts of the V^(L+1) outcomes with the exact target law by a Bernstein bound per outcome and a
union bound (verify_helpers.bernstein_check). The probability that a correct verifier fails one
of these checks is at most 1e-6, so the whole file fails spuriously with probability < 2e-5; the
keys are fixed, so a run is reproducible. The same check must fail on deliberately broken
verifiers (power).
"""

from __future__ import annotations

import math

import pytest

from ssd_jax import verify

import verify_helpers as vh

N_KEYS, ROWS = 50, 4000
N = N_KEYS * ROWS

# Seeds chosen (among tables that all have zeros and special nodes) so that the broken verifiers
# are far from exact on them: TV 0.10 (argmax acceptance) and 0.41 (GBV without skew, K = 4).
SINGLE_TABLES = vh.random_tables(100, V=3, L=3)
MULTI_TABLES = vh.random_tables(105, V=3, L=2)


@pytest.mark.parametrize("name", ["tokenwise", "block"])
def test_single_path_law(name):
    counts, _ = vh.mc_counts(SINGLE_TABLES, getattr(verify, name), None, N_KEYS, ROWS, seed=1)
    ok, worst = vh.bernstein_check(counts, vh.target_law(SINGLE_TABLES))
    assert ok, f"{name}: worst deviation {worst:.2f} x threshold"


@pytest.mark.parametrize("name", ["specinfer", "spectr", "gbv"])
def test_multi_path_law(name):
    K = 4   # exact enumeration covers K = 1..4 in float64; here K = 4 over V = 3 means duplicates
    counts, _ = vh.mc_counts(MULTI_TABLES, getattr(verify, name), K, N_KEYS, ROWS, seed=2)
    ok, worst = vh.bernstein_check(counts, vh.target_law(MULTI_TABLES))
    assert ok, f"{name} K={K}: worst deviation {worst:.2f} x threshold"


def test_power_argmax_acceptance_fails_the_check():
    """The check that tokenwise passes on SINGLE_TABLES rejects argmax acceptance there."""
    counts, _ = vh.mc_counts(SINGLE_TABLES, vh.broken_argmax_tokenwise, None, N_KEYS, ROWS, seed=1)
    ok, worst = vh.bernstein_check(counts, vh.target_law(SINGLE_TABLES))
    assert not ok and worst > 3, worst


def test_power_gbv_with_unskewed_draft_fails_the_check():
    """The check that gbv (K = 4) passes on MULTI_TABLES rejects GBV verified with q, not q~."""
    counts, _ = vh.mc_counts(MULTI_TABLES, vh.broken_gbv_unskewed, 4, N_KEYS, ROWS, seed=2)
    ok, worst = vh.bernstein_check(counts, vh.target_law(MULTI_TABLES))
    assert not ok and worst > 3, worst


@pytest.mark.parametrize("name,expected", [("tokenwise", 10 / 9), ("block", 11 / 9)])
def test_block_toy_mean_accepted(name, expected):
    """Sun et al.'s toy, sampled: Hoeffding with accepted counts in [0, 2] gives
    |mean - E| <= 2 sqrt(ln(2 / 1e-6) / (2 N)) with probability >= 1 - 1e-6."""
    t = vh.iid_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2)
    _, mean = vh.mc_counts(t, getattr(verify, name), None, N_KEYS, ROWS, seed=5)
    assert abs(mean - expected) <= 2 * math.sqrt(math.log(2 / 1e-6) / (2 * N))


def test_two_stage_token_sampler_law():
    """Large vocabularies draw the next token in two stages (a chunk of 512, then a token in it);
    its law must be the normalised weights: zeros, an all-zero chunk, a ragged last chunk and a
    heavy tail included. Same Bernstein check over the V outcomes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.verify._common import sample_from_weights

    v = 1500                                                   # 3 chunks, the last one ragged
    rng = np.random.default_rng(50)
    w = rng.pareto(1.5, size=v) * (rng.random(v) < 0.7)
    w[512:1024] = 0.0                                          # an empty chunk
    w[1499] = 40.0                                             # heavy token in the ragged chunk
    law = w / w.sum()
    keys = jax.random.split(jax.random.PRNGKey(0), N)
    draws = jax.jit(jax.vmap(lambda k: sample_from_weights(k, jnp.asarray(w * 3.0, jnp.float32),
                                                           jnp.ones(v, jnp.float32))))(keys)
    counts = np.bincount(np.asarray(draws), minlength=v)
    ok, worst = vh.bernstein_check(counts, law)
    assert ok, worst
