"""One review of a cascade: a reviewer (a drafter, or the target at the top) decides how much of
a block drafted by the levels below it to keep, and adds one token.

Both functions work on a batch with a per-row valid count: block int32 [B, W] holds valid tokens
in [0, valid[b]) and garbage after; the reviewer's scores are given at the W + 1 block positions
(row j conditions on the prefix and block[:j]). They return (accepted int32 [B] in [0, valid],
next_token int32 [B]): the row emits block[:accepted] + [next_token].

- `greedy_review` (temperature 0): keep b_j while lenience * r_j(b_j) >= max r_j, where r_j is the
  reviewer's softmax at temperature 1 (lenience 1: b_j is the argmax, ties to the lowest id);
  next_token = argmax at the stop position. With lenience 1 this is greedy verification.
- `sampled_review` (temperature > 0): token-wise speculative sampling (`ssd_jax.verify.tokenwise`)
  with the block's own proposal laws q_below, capped at the valid count: if every valid token is
  kept, the next token is drawn from the reviewer's law at the valid count with a fresh key. The
  emitted tokens then have exactly the reviewer's law given the prefix, position by position,
  whatever the law of the block (as long as block[j] was drawn from q_below[j] given the text
  before it and the valid count was decided before block[j] was drawn).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ssd_jax.verify._common import argmax_first, leading_true_count, sample_from_weights
from ssd_jax.verify.tokenwise import tokenwise


def greedy_review(logits: jax.Array, block: jax.Array, valid: jax.Array, lenience: float = 1.0):
    """logits float32 [B, W+1, V]; block int32 [B, W]; valid int32 [B]; lenience >= 1 (static).
    Returns (accepted int32 [B], next_token int32 [B])."""
    top = argmax_first(logits)  # [B, W+1]
    width = block.shape[1]
    if lenience == 1.0:
        keep = block == top[:, :width]
    else:
        chosen = jnp.take_along_axis(logits[:, :width], block[..., None], axis=-1)[..., 0]
        keep = chosen + math.log(lenience) >= jnp.max(logits[:, :width], axis=-1)
    keep = keep & (jnp.arange(width)[None, :] < valid[:, None])
    accepted = leading_true_count(keep)
    return accepted, jnp.take_along_axis(top, accepted[:, None], axis=1)[:, 0]


def _sampled_row(key, block, valid, q_below, q):
    k_verify, k_bonus = jax.random.split(key)
    bonus = sample_from_weights(k_bonus, q[valid], fallback=q[valid])
    if block.shape[0] == 0:
        return jnp.zeros((), jnp.int32), bonus
    verdict = tokenwise(k_verify, block[None], q_below[None], q[None])
    num, token = verdict.num_accepted[0], verdict.next_token[0]
    all_valid = num >= valid
    return jnp.where(all_valid, valid, num).astype(jnp.int32), jnp.where(all_valid, bonus, token)


def sampled_review(keys: jax.Array, block: jax.Array, valid: jax.Array, q_below: jax.Array, q: jax.Array):
    """keys uint32 [B, 2] (one per row); block int32 [B, W]; valid int32 [B] in [0, W];
    q_below float32 [B, W, V]: the law block[:, j] was drawn from; q float32 [B, W+1, V]: the
    reviewer's processed probabilities. Returns (accepted int32 [B], next_token int32 [B])."""
    return jax.vmap(_sampled_row)(keys, block, valid, q_below, q)
