"""Whether the verifiers' small loops run as XLA loops or unrolled, chosen per platform.

The multi-path verifiers loop over a few static steps: the walk over draft depths (L), SpecInfer's
candidates at a node (K), GBV's selection over depths, SpecTr's search for rho*. XLA:GPU runs each
turn of a `while_loop` by reading its predicate back to the host (`ssd_jax.backend`), which
waits for the GPU to drain: rolled, SpecTr's 24 bisection steps at each of L depths make its
verification cost more than a small target's forward. Elsewhere than on CPU these loops are
therefore unrolled into straight-line code and SpecTr's search evaluates 15 points a round
(`ssd_jax.verify.spectr.spectr_rho`); on CPU, where a loop turn costs nothing and the extra points
cost compute, they stay loops. Both forms compute the same values, SpecTr's rho* to the rounding
of its balance equation: in float32 within 5e-7 over random and near-equal target and draft
laws (k = 2-8), 3e-4 relative where they barely overlap (beta ~ 1e-4: the balance is flat near
rho* = k), both on its exact side to rounding. A verdict differs only where a uniform falls that
close to its threshold."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from ssd_jax.backend import per_platform


def rolled_on_cpu(fn: Callable, *args):
    """fn(*args, unrolled=False) in programs compiled for CPU, fn(*args, unrolled=True) elsewhere."""
    return per_platform(*args, cpu=functools.partial(fn, unrolled=False),
                        default=functools.partial(fn, unrolled=True))


def rows_rolled_on_cpu(row_fn: Callable, *args):
    """`jax.vmap(row_fn)(*args)` (axis 0 of every arg: the batch), row_fn taking `unrolled` as
    `rolled_on_cpu` chooses it."""
    rows = lambda *a, unrolled: jax.vmap(functools.partial(row_fn, unrolled=unrolled))(*a)
    return rolled_on_cpu(rows, *args)
