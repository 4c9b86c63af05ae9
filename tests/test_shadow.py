"""Shadow evidence (`ssd_jax.engine.shadow`): walking a retrieval draft with the tokens plain
decoding drew gives the accepted count's law of a speculative step on that draft."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.engine.shadow import matched_depth, shadow_counts
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
