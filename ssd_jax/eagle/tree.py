"""The head's draft tree, EAGLE-2 style, over static shapes.

Expansion: depth 1 holds the top `topk` tokens of the head's law after the root; each next depth
holds the `topk` best children (by cumulative draft log-probability, the sum along the path) of
the nodes of the depth before, so the tree grows where the head is confident. Reranking: of the
depth * topk drafted nodes the `tree_size - 1` with the highest cumulative log-probability
(shallower first among equals) form the tree the target verifies; a node's score is at most its
parent's, so the kept set holds every kept node's ancestors.

The tree is a deterministic function of the text (no sampling): the point-mass tree walk
(`ssd_jax.verify.point_tree`) verifies it exactly at any temperature, drawing each token from the
target and descending while the draw is a child.

Buffers are depth-major: drafted node j sits at depth j // topk + 1. The head's entry of a node
at depth e is at position P + e - 1 (P: the root's position) and reads its parent's entry output
(the root's: the head's output at P - 1) plus the node's token embedding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ssd_jax.eagle.forward import head_forward_cached, head_logits
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.sampling import SamplingParams, probabilities, sample

TIE_BREAK = 1e-4   # per depth: among equal scores the shallower node ranks first


class DraftTree(NamedTuple):
    """tokens int32 [B, N] (node 0: the root); parents int32 [B, N] (-1 at the root; parents
    precede children); depth int32 [B, N]; mask bool [B, N, N] (node j is node i or an ancestor
    of it); drafted int32 [B]: the nodes below the root."""

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    mask: jax.Array
    drafted: jax.Array


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """parents int32 [B, N] (-1 at the root) -> bool [B, N, N]: node j is node i or an ancestor."""
    b, n = parents.shape
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    up = jnp.maximum(parents, 0)
    mask = eye
    for _ in range(max_depth):
        mask = eye | jnp.take_along_axis(mask, up[:, :, None], axis=1) & (parents >= 0)[:, :, None]
    return mask


def draft_tree(head_params: dict, target_params: dict, layer_config: ModelConfig, cache: KVCache,
               root_hidden: jax.Array, root: jax.Array, *, depth: int, topk: int, tree_size: int) -> DraftTree:
    """Drafts the tree after root int32 [B] (at position P = cache.lengths: the head's cache holds
    the entries before it, uncommitted entries past it are overwritten). root_hidden [B, D]: the
    head's output at P - 1. depth, topk, tree_size: static; tree_size - 1 <= depth * topk.
    Runs depth - 1 head forwards (depth e's over the nodes of depths 1..e: each drafted node's
    entry sees its ancestors' entries, which is the tree mask of that block)."""
    b = root.shape[0]
    position = cache.lengths
    logp = jax.nn.log_softmax(head_logits(head_params, target_params, layer_config, root_hidden[:, None])[:, 0],
                              axis=-1)
    score, tokens = jax.lax.top_k(logp, topk)                                    # [B, topk]
    scores, all_tokens = [score], [tokens]
    parents = [jnp.full((b, topk), -1, jnp.int32)]
    hidden = [jnp.broadcast_to(root_hidden[:, None], (b, topk, root_hidden.shape[-1]))]
    vocab = logp.shape[-1]
    for e in range(1, depth):   # expand the nodes of depth e
        count = e * topk
        block_tokens = jnp.concatenate(all_tokens, axis=1)                        # [B, count]
        block_parents = jnp.concatenate(parents, axis=1)
        node_depth = jnp.repeat(jnp.arange(1, e + 1, dtype=jnp.int32), topk)
        positions = position[:, None] + node_depth[None, :] - 1
        mask = ancestor_mask(block_parents, e)
        logits, _, out = head_forward_cached(
            head_params, target_params, layer_config, jnp.concatenate(hidden, axis=1), block_tokens, positions,
            cache, tree_mask=mask,
            logit_indices=jnp.broadcast_to(jnp.arange(count - topk, count, dtype=jnp.int32), (b, topk)))
        child = scores[-1][:, :, None] + jax.nn.log_softmax(logits, axis=-1)     # [B, topk, V]
        score, flat = jax.lax.top_k(child.reshape(b, topk * vocab), topk)
        scores.append(score)
        all_tokens.append((flat % vocab).astype(jnp.int32))
        parent_in_depth = flat // vocab
        parents.append((count - topk + parent_in_depth).astype(jnp.int32))
        hidden.append(jnp.take_along_axis(out[:, count - topk:], parent_in_depth[:, :, None], axis=1))
    return _reranked(jnp.concatenate(all_tokens, axis=1), jnp.concatenate(parents, axis=1),
                     jnp.concatenate(scores, axis=1), root, depth=depth, topk=topk, tree_size=tree_size)


def sampled_paths(head_params: dict, target_params: dict, layer_config: ModelConfig, cache: KVCache,
                  root_hidden: jax.Array, keys: jax.Array, *, depth: int, paths: int, sampling: SamplingParams):
    """K = paths i.i.d. draft paths of `depth` tokens after the root, each token drawn from the
    head's processed law (`probabilities` under sampling) given its path so far: what SpecInfer's
    recursive rejection verifies exactly (`ssd_jax.verify.specinfer`). The entries are as in
    `draft_tree` (each path's entry sees its own earlier entries). keys uint32 [B, 2]: the step's
    draft keys (one draw per row, path and depth from them). Returns (tokens int32 [B, K, depth],
    q float32 [B, K, depth, V]: the law each token was drawn from)."""
    b = keys.shape[0]
    position = cache.lengths
    draws = jax.vmap(lambda k: jax.random.split(k, depth * paths).reshape(depth, paths, 2))(keys)   # [B, L, K, 2]

    def draw(logits, d):
        """Row b path k's token from logits [B, K, V] at depth d (0-based), and its law."""
        law = probabilities(logits, sampling)
        token = jax.vmap(jax.vmap(lambda k, w: sample(k, w)))(draws[:, d], law)
        return token.astype(jnp.int32), law

    root_logits = head_logits(head_params, target_params, layer_config, root_hidden[:, None])   # [B, 1, V]
    token, law = draw(jnp.broadcast_to(root_logits, (b, paths, root_logits.shape[-1])), 0)
    tokens, laws = [token], [law]
    hidden = [jnp.broadcast_to(root_hidden[:, None], (b, paths, root_hidden.shape[-1]))]
    for e in range(1, depth):   # each path's entry of depth e, then its token of depth e + 1
        count = e * paths
        node_depth = jnp.repeat(jnp.arange(1, e + 1, dtype=jnp.int32), paths)
        same_path = jnp.tile(jnp.arange(paths), e)
        mask = (same_path[:, None] == same_path[None, :]) & (node_depth[:, None] >= node_depth[None, :])
        logits, _, out = head_forward_cached(
            head_params, target_params, layer_config, jnp.concatenate(hidden, axis=1),
            jnp.concatenate(tokens, axis=1), position[:, None] + node_depth[None, :] - 1, cache,
            tree_mask=jnp.broadcast_to(mask, (b, count, count)),
            logit_indices=jnp.broadcast_to(jnp.arange(count - paths, count, dtype=jnp.int32), (b, paths)))
        token, law = draw(logits, e)
        tokens.append(token)
        laws.append(law)
        hidden.append(out[:, count - paths:])
    return jnp.stack(tokens, axis=2), jnp.stack(laws, axis=2)


def _reranked(tokens, parents, scores, root, *, depth: int, topk: int, tree_size: int) -> DraftTree:
    """The tree of the tree_size - 1 best drafted nodes (tokens, parents into the drafted buffer,
    cumulative scores: [B, depth * topk]) under root, in buffer order (parents first)."""
    b, m = tokens.shape
    node_depth = jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), topk)
    keep = tree_size - 1
    _, picked = jax.lax.top_k(scores - TIE_BREAK * node_depth[None, :], keep)
    picked = jnp.sort(picked, axis=1)                                             # [B, keep] buffer slots
    new_index = jnp.zeros((b, m), jnp.int32).at[jnp.arange(b)[:, None], picked].set(
        jnp.arange(1, keep + 1, dtype=jnp.int32)[None, :])
    old_parent = jnp.take_along_axis(parents, picked, axis=1)
    parent = jnp.where(old_parent < 0, 0, jnp.take_along_axis(new_index, jnp.maximum(old_parent, 0), axis=1))
    tree_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    tree_tokens = jnp.concatenate([root[:, None].astype(jnp.int32), jnp.take_along_axis(tokens, picked, axis=1)],
                                  axis=1)
    tree_depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), node_depth[picked]], axis=1)
    return DraftTree(tokens=tree_tokens, parents=tree_parents, depth=tree_depth,
                     mask=ancestor_mask(tree_parents, depth), drafted=jnp.full((b,), keep, jnp.int32))
