"""Shadow evidence: what a draft would have had accepted, read off plain decoding.

A retrieval draft (prompt lookup's chain, LogitSpec's tree) is a point mass, and its exact
verification is a walk of the tree that draws each next token from the target and descends while
the draw is a child (`ssd_jax.verify.point_tree`). Plain decoding draws the same tokens from the
same distributions, so walking the draft made at a plain block's first step with the tokens the
block emitted gives a depth with the law a speculative step's accepted count has (at every
temperature): the adaptive loop learns the acceptance while it decodes plainly, and needs no
probes (speculative steps run only to measure, each costing several plain steps in a batch).

A draft model's proposals are not known during plain steps (drafting is what plain decoding
saves), but when the draft reads the tokens it missed (the loop's resync, one forward) its law q_j
at every position j comes out with them. Token-wise verification accepts the draft's token at j
with probability sum_x min(p_j(x), q_j(x)) given the text before it, and min(1, q_j(y) / p_j(y)),
y the token plain decoding drew from p_j, estimates that without bias (at T=0: whether the
draft's argmax is the target's). A speculative step from j would reach position k with the
product of those estimates over j..j+k-2 (`chain_counts`; exact at T=0, where acceptances are 0
or 1, and at T > 0 up to how accepted tokens' law differs from p_j's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.sampling import SamplingParams, argmax_first, probabilities


def matched_depth(tree_tokens: jax.Array, valid: jax.Array, parents: np.ndarray, emitted: jax.Array,
                  emitted_len: jax.Array) -> jax.Array:
    """The depth the exact walk of each row's tree reaches on its emitted tokens, int32 [B].

    tree_tokens int32 [B, N] (node 0: the root, the last token before the block), valid bool
    [B, N], parents: int [N] (static, -1 at the root); emitted int32 [B, K]: the tokens drawn after
    the root; emitted_len int32 [B]: how many of them each row drew (a row that finished draws fewer).
    """
    parents = jnp.asarray(parents, jnp.int32)[None, :]
    node = jnp.zeros(tree_tokens.shape[:1], jnp.int32)
    depth = jnp.zeros_like(node)
    alive = jnp.ones(node.shape, bool)
    for d in range(emitted.shape[1]):
        children = valid & (parents == node[:, None]) & (tree_tokens == emitted[:, d, None])
        alive = alive & (d < emitted_len) & jnp.any(children, axis=1)
        node = jnp.where(alive, jnp.argmax(children, axis=1).astype(jnp.int32), node)
        depth = depth + alive.astype(jnp.int32)
    return depth


def shadow_counts(tree_tokens: jax.Array, valid: jax.Array, parents: np.ndarray, emitted: jax.Array,
                  emitted_len: jax.Array, draft_len: int,
                  counted: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(reached, accepted) float32 [B, draft_len]: the per-position counts
    (`ssd_jax.loop.acceptance.position_counts`) of a speculative step whose draft was the
    tree (arguments as `matched_depth`), over the positions whose outcome the block shows, k <=
    emitted_len: a row that drew K tokens and matched all K reached K + 1 with its outcome unknown.
    A row whose tree holds no draft counts as reaching 1 and missing there, as in a real step.
    counted bool [B] (None: every row): the rows whose speculative step would have verified its
    tree; the rest count nothing (a gated step would have run as a plain one)."""
    depth = matched_depth(tree_tokens, valid, parents, emitted, emitted_len)
    drafted = jnp.sum(valid, axis=1) - 1
    k = jnp.arange(1, draft_len + 1, dtype=jnp.int32)[None, :]
    known = k <= emitted_len[:, None]
    if counted is not None:
        known = known & counted[:, None]
    reached = known & ((drafted[:, None] >= k) | (k == 1)) & (depth[:, None] >= k - 1)
    hit = known & (depth[:, None] >= k)
    return reached.astype(jnp.float32), hit.astype(jnp.float32)


def scored_tokens(logits: jax.Array, pending: jax.Array, laws: jax.Array, pending_len: jax.Array,
                  sampling: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """A draft's acceptance at each token plain steps drew, `chain_counts`' inputs.

    logits float32 [B, W - 1, V] (target vocabulary): the draft's logits after pending slot j,
    given the text up to it; pending int32 [B, W]: the tokens the draft had not read; laws float32
    [B, W]: the target's probability of each token a plain step drew (0 for the rest);
    pending_len int32 [B]. Returns (acceptance float32 [B, W - 1]: at j, min(1, q_j(y) / p(y)) for
    y in slot j + 1, exactly whether q_j's argmax is y at T=0; known bool [B, W - 1])."""
    drawn, law = pending[:, 1:], laws[:, 1:]
    known = (law > 0) & (jnp.arange(1, pending.shape[1])[None, :] < pending_len[:, None])
    if sampling.by_argmax:
        return (argmax_first(logits) == drawn).astype(jnp.float32), known
    q = jnp.take_along_axis(probabilities(logits, sampling), drawn[..., None], axis=-1)[..., 0]
    return jnp.minimum(1.0, q / jnp.where(known, law, 1.0)), known


def chain_counts(acceptance: jax.Array, known: jax.Array, draft_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expected per-position counts of speculative steps starting at every known position.

    acceptance float32 [B, J]: the estimated acceptance of a draft token at position j given the
    text before it; known bool [B, J]: where that estimate exists (the token at j was drawn by a
    plain step). A step from j reaches position k (1 <= k <= draft_len) with the product of
    acceptance[j..j+k-2] and has its k-th token accepted with the product over j..j+k-1; both
    count only where every position up to j+k-1 is known. Returns (reached, accepted) float32
    [B, draft_len], sums over the steps, and steps float32 [B], how many steps started.
    """
    batch, width = acceptance.shape
    acceptance = jnp.where(known, acceptance, 0.0)
    # After k rounds, reach[:, j]: the product over j..j+k-1; seen: whether j..j+k are all known.
    reach = jnp.ones((batch, width), jnp.float32)
    seen = jnp.ones((batch, width), bool)
    reached, accepted = [], []
    for k in range(draft_len):
        shifted = jnp.pad(acceptance, ((0, 0), (0, k)))[:, k:]
        shifted_known = jnp.pad(known, ((0, 0), (0, k)))[:, k:]
        seen = seen & shifted_known
        reached.append(jnp.sum(jnp.where(seen, reach, 0.0), axis=1))
        reach = reach * shifted
        accepted.append(jnp.sum(jnp.where(seen, reach, 0.0), axis=1))
    return jnp.stack(reached, axis=1), jnp.stack(accepted, axis=1), jnp.sum(known, axis=1).astype(jnp.float32)
