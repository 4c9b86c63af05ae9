"""Shadow evidence (`ssd_jax.loop.shadow`): walking a retrieval draft with the tokens plain
decoding drew gives the accepted count's law of a speculative step on that draft; a draft model
reading those tokens scores its acceptance at each of them."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import ssd_jax
from ssd_jax.tuning.cost_model import AutoPlan
from ssd_jax.loop.decoder import make_parts
from ssd_jax.loop.shadow import chain_counts, matched_depth, shadow_counts
from ssd_jax.models.kv_cache import commit, init_cache
from ssd_jax.models.transformer import forward_cached, forward_full
from ssd_jax.sampling import SamplingParams, probabilities
from spec_models import law_pair, noisy_copy
from ssd_jax.verify.point_tree import point_mass_tree

V = 3
# A LogitSpec-like tree over tokens 0..2: the root, a chain 1 -> 2 -> 0 and a branch 2 -> 2.
PARENTS = np.array([-1, 0, 1, 2, 0, 4])
TOKENS = np.array([0, 1, 2, 0, 2, 2])


def test_matched_depth_follows_the_tree_and_the_emitted_count():
    tokens = jnp.broadcast_to(jnp.asarray(TOKENS), (6, 6))
    valid = jnp.ones((6, 6), bool).at[5, 3].set(False)
    emitted = jnp.asarray([[1, 2, 0], [2, 2, 1], [2, 1, 0], [0, 1, 2], [1, 2, 0], [1, 2, 0]])
    emitted_len = jnp.asarray([3, 3, 3, 3, 1, 3])
    depth = matched_depth(tokens, valid, PARENTS, emitted, emitted_len)
    # Row 2: token 1 under the root's child 2 is no child there (only node 5, token 2, is); row
    # 4 drew one token; row 5's third node is invalid.
    assert depth.tolist() == [3, 2, 1, 0, 1, 2]


def test_shadow_counts_only_positions_the_block_shows():
    tokens = jnp.asarray([[7, 1, 2, 3], [7, 1, 2, 3], [7, 0, 0, 0]])
    valid = jnp.asarray([[True] * 4, [True] * 4, [True, False, False, False]])
    parents = np.array([-1, 0, 1, 2])
    emitted = jnp.asarray([[1, 2], [1, 5], [4, 4]])
    reached, hit = shadow_counts(tokens, valid, parents, emitted, jnp.asarray([2, 2, 2]), draft_len=3)
    # Row 0 matched both drawn tokens: position 3 was reached but its outcome is unknown, so not
    # counted. Row 2 drafted nothing: a miss at position 1.
    assert reached.tolist() == [[1, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert hit.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
    # Rows left out (a gated step would not have verified their trees) count nothing.
    reached, hit = shadow_counts(tokens, valid, parents, emitted, jnp.asarray([2, 2, 2]), draft_len=3,
                                 counted=jnp.asarray([True, False, False]))
    assert reached.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert hit.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]


def test_shadow_depth_has_the_law_of_the_verified_accepted_count():
    """The exact law of the shadow depth (every 3-token continuation weighted by the target's
    probability) against 20000 point-mass tree verifications of the same tree: a walk that
    ignored the tree's parents would put 0.1-0.3 of mass elsewhere."""
    rng = np.random.default_rng(0)
    table = {pre: rng.dirichlet(np.full(V, 0.7)) for n in range(4) for pre in itertools.product(range(V), repeat=n)}
    continuations = list(itertools.product(range(V), repeat=3))
    weights = np.array([np.prod([table[x[:i]][x[i]] for i in range(3)]) for x in continuations])
    n = len(continuations)
    depth = matched_depth(jnp.broadcast_to(jnp.asarray(TOKENS), (n, 6)), jnp.ones((n, 6), bool), PARENTS,
                          jnp.asarray(continuations), jnp.full((n,), 3))
    shadow_law = np.bincount(np.asarray(depth), weights=weights, minlength=4)

    paths = {0: ()}
    for node in range(1, len(PARENTS)):
        paths[node] = paths[PARENTS[node]] + (int(TOKENS[node]),)
    p = np.stack([table[paths[node]] for node in range(len(PARENTS))])
    samples = 20000
    verdict = point_mass_tree(jax.random.PRNGKey(1), jnp.broadcast_to(jnp.asarray(TOKENS), (samples, 6)),
                              jnp.ones((samples, 6), bool), PARENTS,
                              jnp.broadcast_to(jnp.asarray(p, jnp.float32), (samples, 6, V)), greedy=False)
    verified_law = np.bincount(np.asarray(verdict.num_accepted), minlength=4) / samples
    assert np.abs(shadow_law - verified_law).max() < 4 * np.sqrt(0.25 / samples)

    wrong = np.bincount([sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(x, (1, 2, 0))))
                         for x in continuations], weights=weights, minlength=4)
    assert np.abs(wrong - verified_law).max() > 0.02   # the check tells a chain-only walk apart


def test_chain_counts_start_a_step_at_every_known_position():
    acceptance = jnp.asarray([[1.0, 1.0, 0.0, 1.0], [0.5, 0.5, 1.0, 1.0]])
    known = jnp.asarray([[True] * 4, [False, True, True, True]])
    reached, hit, steps = chain_counts(acceptance, known, draft_len=2)
    # Row 0: 4 steps reach position 1 (3 accepted); 3 have position 2 in view, reaching it with
    # 1 + 1 + 0 and accepting it with 1 + 0 + 0. Row 1 starts at 1: 3 and 2 steps.
    np.testing.assert_allclose(np.asarray(reached), [[4, 2], [3, 1.5]])
    np.testing.assert_allclose(np.asarray(hit), [[3, 1], [2.5, 1.5]])
    assert steps.tolist() == [4, 3]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scored_resync_scores_each_drawn_token_against_the_draft_law_before_it(temperature):
    """The draft reads a context whose last tokens plain steps drew: each such token y at slot
    j + 1 is scored min(1, q_j(y) / p(y)), q_j the draft's law after slot j (a full forward over
    the text), p(y) the law recorded for it; the draft ends holding all but cur."""
    target, draft = law_pair(5)
    sampling = SamplingParams(temperature=temperature)
    method = ssd_jax.SD(draft_len="auto")
    parts = make_parts(method, target, draft, sampling, 8, 16, plan=AutoPlan(draft_len=2, threshold=None, capped=True))
    assert parts.learns_while_plain
    text = np.asarray([[0, 2, 1, 3, 0, 4, 1, 2, 2, 3], [4, 4, 0, 1, 2, 3, 0, 1, 4, 0]], np.int32)
    read = 3   # the draft holds text[:, :3]; the pending tokens are text[:, 3:]
    positions = jnp.broadcast_to(jnp.arange(read), (2, read))
    _, cache = forward_cached(parts.dparams, draft.config, jnp.asarray(text[:, :read]), positions,
                              init_cache(draft.config, 2, 40))
    cache = commit(cache, jnp.full((2,), read))
    width = parts.pending_width
    pending = np.zeros((2, width), np.int32)
    pending_len = np.asarray([7, 5])
    for b in range(2):
        pending[b, :pending_len[b]] = text[b, read:read + pending_len[b]]
    laws = np.zeros((2, width), np.float32)
    laws[:, 2:] = np.where(np.arange(width - 2) % 2 == 0, 0.25, 0.75)   # slots 2.. drawn by plain steps
    inner = dict(dcache=cache, chunk=jnp.zeros((2, 2), jnp.int32), chunk_len=jnp.ones((2,), jnp.int32))
    inner, acceptance, known = jax.jit(parts.scored_resync)(inner, jnp.asarray(pending), jnp.asarray(pending_len),
                                                           jnp.asarray(laws), jnp.zeros((2, 2), jnp.uint32))
    q = probabilities(forward_full(draft.params, draft.config, jnp.asarray(text)), sampling)
    for b in range(2):
        n = pending_len[b]
        assert np.asarray(known[b]).tolist() == [1 <= j < n - 1 for j in range(width - 1)]
        for j in range(1, n - 1):
            y = pending[b, j + 1]
            expected = min(1.0, float(q[b, read + j, y]) / laws[b, j + 1])
            np.testing.assert_allclose(float(acceptance[b, j]), expected, rtol=1e-5)
        assert int(inner["dcache"].lengths[b]) == read + n - 1
        assert int(inner["chunk"][b, 0]) == pending[b, n - 1] and int(inner["chunk_len"][b]) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cascade_scores_its_largest_drafter_on_the_phase_tokens(temperature):
    """CSD's pending buffer holds the phase's tokens from slot 1 (the context holds them too):
    the largest drafter is scored after each, as SD's draft is, and every drafter ends holding
    all but cur."""
    target, draft = law_pair(5)
    smaller = noisy_copy(target, 2.0, 7)
    sampling = SamplingParams(temperature=temperature)
    plan = AutoPlan(draft_len=3, threshold=None, capped=True)
    # T=0's default lenient review (2) passes near-argmax tokens the target rejects: no scoring.
    lenient = make_parts(ssd_jax.CSD(max_draft_tokens="auto"), target, (draft, smaller), sampling, 8, 16, plan=plan)
    assert lenient.learns_while_plain == (temperature > 0)
    parts = make_parts(ssd_jax.CSD(max_draft_tokens="auto", lenience=1.0), target, (draft, smaller), sampling, 8, 16,
                       plan=plan)
    assert parts.learns_while_plain
    text = np.asarray([[0, 2, 1, 3, 0, 4, 1, 2, 2, 3], [4, 4, 0, 1, 2, 3, 0, 1, 4, 0]], np.int32)
    read, pending_len = 3, np.asarray([7, 5])
    inner = parts.init(jnp.asarray(text[:, :read]), jnp.full((2,), read), jnp.asarray(text[:, read]), None)
    width = parts.pending_width
    pending, laws = np.zeros((2, width), np.int32), np.zeros((2, width), np.float32)
    context = np.array(inner.context)
    for b in range(2):
        n = pending_len[b]
        pending[b, 1:n] = text[b, read + 1:read + n]
        laws[b, 1:n] = np.where(np.arange(1, n) % 2 == 0, 0.25, 0.75)
        context[b, read + 1:read + n] = pending[b, 1:n]
    inner = inner.replace(context=jnp.asarray(context), length=jnp.asarray(read + pending_len))
    inner, acceptance, known = jax.jit(parts.scored_resync)(inner, jnp.asarray(pending), jnp.asarray(pending_len),
                                                           jnp.asarray(laws), jnp.zeros((2, 2), jnp.uint32))
    q = probabilities(forward_full(draft.params, draft.config, jnp.asarray(text)), sampling)
    for b in range(2):
        n = pending_len[b]
        assert np.asarray(known[b]).tolist() == [j < n - 1 for j in range(width - 1)]
        for j in range(n - 1):
            expected = min(1.0, float(q[b, read + j, pending[b, j + 1]]) / laws[b, j + 1])
            np.testing.assert_allclose(float(acceptance[b, j]), expected, rtol=1e-5)
        assert [int(c.lengths[b]) for c in inner.caches] == [read + n - 1] * 2
