"""The static widths a speculative step is compiled for, shared by the parts and the adaptive loop:
the caps a step's verification is compiled at, the switch that picks among them, and the buffer a
plain phase of the adaptive loop fills while the draft falls behind."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.backend import policy_for

# The most tokens a plain phase of the adaptive loop emits before the draft catches up (and the
# loop may probe again).
PENDING_WIDTH = 24


def pending_width(plan) -> int:
    """The parts' pending_width: PENDING_WIDTH under adaptive speculation (plan: an AutoPlan), else 0."""
    return PENDING_WIDTH if plan is not None else 0


def unread_count_only(batch: int, width: int) -> tuple[jax.Array, jax.Array]:
    """`pending` for parts whose missed tokens are already in their context (retrieval, CSD):
    the buffer only bounds the plain phase. int32 [batch, width] zeros, int32 [batch] ones."""
    return jnp.zeros((batch, width), jnp.int32), jnp.ones((batch,), jnp.int32)


def compiled_caps(max_len: int) -> tuple[int, ...]:
    """The draft lengths a capped step's verification is compiled for: 2, 4, 8, ... below
    max_len, then max_len (`lax.switch` picks the narrowest holding the step's drafts). A verified
    token costs about as much as a draft forward on CPU, so verifying at the full width when drafts
    stopped short wastes work; powers of two keep the programs few while a width for every length
    measured no faster (docs/benchmarks.md)."""
    caps, n = [], 2
    while n < max_len:
        caps.append(n)
        n *= 2
    return tuple(caps) + (max_len,)


def with_one(caps: tuple[int, ...]) -> tuple[int, ...]:
    """1 and the compiled caps above it: the caps a step runs at (a one-token draft is its own
    program)."""
    return (1,) + tuple(n for n in caps if n > 1)


def narrowest(widths: tuple[int, ...], longest: jax.Array) -> jax.Array:
    """The index (int32 []) of the narrowest of the ascending compiled widths holding longest
    (int32 []; the last width when none does): the branch a `lax.switch` over widths takes."""
    return jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < longest).astype(jnp.int32)


def at_narrowest(widths: tuple[int, ...], longest: jax.Array, branch: Callable, *operands):
    """branch(n, *operands) for n the narrowest of the ascending widths holding longest (int32
    []): a `lax.switch` over one branch per width, or the branch itself where there is one width.
    The caller's longest comes from the drafts alone, so each row's verdict stays exact."""
    if len(widths) == 1:
        return branch(widths[0], *operands)
    return jax.lax.switch(narrowest(widths, longest), [functools.partial(branch, n) for n in widths], *operands)


def switched_caps(max_len: int, where) -> tuple[int, ...]:
    """The widths a step picks its verification among per step (PLD's chain, CSD's block):
    `compiled_caps` where the backend policy lets a step switch (CPU, TPU), else max_len alone.
    On GPU a `lax.switch` reads its index back to the host before the branch launches, which costs
    more per step than the wider verification it saves. where: the target's params
    (`ssd_jax.backend.policy_for`)."""
    return compiled_caps(max_len) if policy_for(where).adaptive_switch_per_step else (max_len,)
