"""Size- and backend-aware shapes of the tree methods under draft_len="auto": LogitSpec's node
budget and the multi-path methods' path count, from measured target forwards and acceptance,
where the user left them None.

LogitSpec: the largest of TREE_SIZES nodes, at most the backend policy's `logitspec_tree_size`,
whose target forward costs at most 1 + TREE_TOLERANCE times one token's
(`measure.forward_seconds`, per model, batch, context bucket and backend). A wider tree never
lowers the tokens a step accepts; what it costs is the forward, so a CPU, where a few tokens
already cost noticeably more than one, gets the smallest. But not only the forward: building and
verifying the tree grow with its nodes too, which a GPU's forward hides least, so the policy's
size, the best measured on its backend (docs/benchmarks.md), caps the forward's choice.

SpecInfer / SpecTr / GBV: K in PATH_CHOICES maximising the cost model's speedup
    E(a_K, L) target(1) / (target(K L + 1) + L draft(K rows)),    best L for each K,
where a_K is the per-position acceptance remembered for K paths, or before any call with K
paths 1 - (1 - a_1)^(K^PATH_GAIN_EXPONENT). K i.i.d. draws from one draft are far from
independent guesses (that would be the exponent K); 0.2 fits the embedded pair's measured gain
from more paths (docs/benchmarks.md). The loop's counters then report the real a_K, which the
next call uses. At temperature 0 the K paths are copies of the argmax path, so K = 1. Where the
backend policy chooses per call (`ssd_jax.tuning.per_call`, a GPU at one row), K is chosen there
instead, each call, from the programs' measured prices: this model leaves out the verification
and sampling that grow with K, which on a GPU, where the forwards of 4 paths cost one path's,
decide it.

Nothing here touches exactness: the shapes are fixed before the call's first verification.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ssd_jax.backend import policy_for
from ssd_jax.tuning import cost_model, measure

TREE_SIZES = (8, 16, 32, 64)
TREE_TOLERANCE = 0.10
PATH_CHOICES = (1, 2, 4)
PATH_GAIN_EXPONENT = 0.2
MULTI_PATH = ("specinfer", "spectr", "gbv")

def tree_size_for(tuner, target, batch: int, context: int, largest: int | None = None) -> int | None:
    """LogitSpec's node budget on this target, batch and context (module docstring), at most
    largest (None: the target's backend policy's `logitspec_tree_size`); None when nothing is
    measured, as by a deterministic tuner or none (the caller keeps the backend policy's)."""
    one = None if tuner is None else measure.forward_seconds(tuner, target, batch, 1, context)
    if one is None:
        return None
    largest = policy_for(target.params).logitspec_tree_size if largest is None else largest
    chosen = TREE_SIZES[0]
    for size in (n for n in TREE_SIZES[1:] if n <= largest):
        seconds = measure.forward_seconds(tuner, target, batch, size, context)
        if seconds is None or seconds > (1 + TREE_TOLERANCE) * one:
            break
        chosen = size
    return chosen


def path_acceptance(remembered: dict[int, float | None], paths: int) -> float:
    """a_K: the acceptance remembered for K paths, else 1 - (1 - a_1)^(K^PATH_GAIN_EXPONENT) from
    one path's (remembered, or the prior)."""
    if remembered.get(paths) is not None:
        return remembered[paths]
    single = remembered.get(1)
    single = cost_model.PRIOR_ACCEPTANCE if single is None else single
    return 1.0 - (1.0 - single) ** (paths ** PATH_GAIN_EXPONENT)


def open_paths(method, sampling) -> bool:
    """Whether "auto" chooses this multi-path method's path count (left None, sampled: at
    temperature 0 it is 1, where paths would all be the draft's argmax; under the Gumbel coupling
    they branch on the draft's best first tokens, `ssd_jax.draft.model_chain.draft_paths`)."""
    return (method.adaptive and method.name in MULTI_PATH and method.paths is None
            and not sampling.greedy)


def path_acceptances(tuner, method, target, draft, sampling) -> dict[int, float]:
    """K -> a_K for every K in PATH_CHOICES (`path_acceptance`, from what calls of the method with
    K paths remembered by the tuner; None: none)."""
    def known(paths: int) -> float | None:
        key = cost_model.acceptance_key(target, draft, dataclasses.replace(method, paths=paths), sampling)
        return None if tuner is None else tuner.known_acceptance(key)

    remembered = {k: known(k) for k in PATH_CHOICES}
    return {k: path_acceptance(remembered, k) for k in PATH_CHOICES}


def paths_speedup(costs: cost_model.StepCosts, draft_seconds: float, acceptance: float, paths: int,
                  max_draft_len: int) -> float:
    """The cost model's best predicted speedup over plain decoding with `paths` paths (draft
    forwards over paths rows costing draft_seconds each)."""
    path_costs = dataclasses.replace(costs, draft=draft_seconds)
    return max(cost_model.predicted_speedup(path_costs, acceptance, n, paths) for n in range(1, max_draft_len + 1))


def choose_paths(tuner, method, target, draft, sampling, batch: int, context: int) -> int:
    """K for a multi-path method with paths=None under "auto" (module docstring), from the tuner's
    measurements; with none (tuner None or deterministic) the relative costs
    `cost_model.UNMEASURED` (draft forwards at K rows as dear as at one) and the prior acceptance."""
    if sampling.greedy:
        return 1
    width = method.max_draft_len
    costs = cost_model.UNMEASURED if tuner is None else measure.measure_costs(tuner, target, draft, batch, context,
                                                                              width)
    acceptances = path_acceptances(tuner, method, target, draft, sampling)
    speedups = []
    for k in PATH_CHOICES:
        rows = measure.forward_seconds(tuner, draft, batch * k, 1, context) if k > 1 and costs.measured else None
        draft_seconds = costs.draft if rows is None else rows
        speedups.append(paths_speedup(costs, draft_seconds, acceptances[k], k, width))
    return PATH_CHOICES[int(np.argmax(np.round(speedups, 6)))]


def shaped(tuner, method, target, draft, sampling, batch: int, context: int, paths: bool = True):
    """The method with the shape fields left None that "auto" chooses here filled in (LogitSpec's
    tree_size, the multi-path methods' paths: not with paths False, where the caller chooses them,
    `ssd_jax.tuning.per_call`); unchanged for fixed lengths and set fields. What stays None,
    `ssd_jax.methods.for_target` fills from the backend policy. tuner: whose measurements and
    memories decide; None: the fixed prior (what `ssd_jax.decode` uses without a plan)."""
    if not method.adaptive:
        return method
    if method.name == "logitspec" and method.tree_size is None:
        size = tree_size_for(tuner, target, batch, context)
        if size is not None:
            method = dataclasses.replace(method, tree_size=size)
    if paths and method.name in MULTI_PATH and method.paths is None:
        method = dataclasses.replace(method, paths=choose_paths(tuner, method, target, draft, sampling, batch,
                                                                context))
    return method
