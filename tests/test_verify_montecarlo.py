"""Exactness of the verifiers' sampling, end to end, in float32, by Monte Carlo.

The sampled-law check of every verifier against the exact target law (N = 200,000 steps, the
G-test of `ssd_jax.testing.g_test` at a false-failure rate of 1e-6) and its power against broken
verifiers live in test_law_kit.py. Here: Sun et al.'s toy sampled (mean acceptances), and the
two-stage token sampler that large vocabularies use, checked by the same G-test. The keys are
fixed, so a run is reproducible.
"""

from __future__ import annotations

import math

import pytest

from ssd_jax import testing as kit

N_KEYS, ROWS = 50, 4000
N = N_KEYS * ROWS


@pytest.mark.parametrize("name,expected", [("tokenwise", 10 / 9), ("block", 11 / 9)])
def test_block_toy_mean_accepted(name, expected):
    """Sun et al.'s toy, sampled: Hoeffding with accepted counts in [0, 2] gives
    |mean - E| <= 2 sqrt(ln(2 / 1e-6) / (2 N)) with probability >= 1 - 1e-6."""
    t = kit.iid_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2)
    sample = kit.sampled_counts(name, t, n_keys=N_KEYS, rows=ROWS, seed=5)
    mean = sample.mean_emitted - 1                       # the step emits the kept tokens + 1
    assert abs(mean - expected) <= 2 * math.sqrt(math.log(2 / 1e-6) / (2 * N))


def test_two_stage_token_sampler_law():
    """Large vocabularies draw the next token in two stages (a chunk of 512, then a token in it);
    its law must be the normalised weights: zeros, an all-zero chunk, a ragged last chunk and a
    heavy tail included. The G-test over the V outcomes (false-failure rate <= 1e-6)."""
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
    kit.assert_sampled(counts, law)
