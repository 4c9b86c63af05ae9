"""The cost model of draft_len="auto": pure functions of named inputs (step costs, acceptance,
a method's static fields), no memory and no timing.

    E(L)  = (1 - a^(L+1)) / (1 - a)         expected tokens per step (acceptance a per position)
    T(L)  = target(K L + 1) + L draft       seconds per step (the draft's catch-up forward and
                                            L - 1 forwards for the path)
    speedup(L) = E(L) target(1) / T(L)      over plain decoding; L* = argmax over 1..max_draft_len

`target(w)` = fixed + per_token * w and `draft` are measured (`ssd_jax.tuning.measure`); the
acceptance `a` comes from the loop's own counters (`acceptance_of`), remembered by a `Tuner`;
before any call it is PRIOR_ACCEPTANCE. L* is the static length of the multi-path methods and
SSD; single-path SD and BV compile max_draft_len and the loop caps each step
(`ssd_jax.loop.adaptive_loop`). `prior_plan` is the plan from fixed relative costs and the prior
acceptance: what `ssd_jax.decode` uses without a plan, and a deterministic `Tuner` always.
Exactness never depends on any of this: a step's length uses only what is known before its
verification.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ssd_jax.loop.costs import cost_vector
from ssd_jax.tuning.memory import ParamsIdentity

PRIOR_ACCEPTANCE = 0.7    # per-position acceptance assumed before a pair has run


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per forward inside a decode loop: target(w) = target_fixed + target_per_token * w
    for w tokens verified at once; draft: one draft forward of one token. measured: False for the
    placeholder used where nothing could be measured (inside a user's jit)."""

    target_fixed: float
    target_per_token: float
    draft: float
    measured: bool = True

    def target(self, width: int) -> float:
        return self.target_fixed + self.target_per_token * width

    def spec_step(self, draft_len: int, paths: int = 1) -> float:
        """A step drafting draft_len tokens on each of `paths` paths (batched draft forwards) and
        verifying them in one tree."""
        return self.target(paths * draft_len + 1) + draft_len * self.draft

    def loop_array(self, verify_width: int) -> np.ndarray:
        """The costs the loop decides with, float32 [3]: (AR step, spec step without its draft
        forwards, one draft forward), for a loop verifying verify_width tokens at once."""
        return cost_vector(**self.loop_steps(verify_width), acceptance=0.0)[:3]

    def loop_steps(self, verify_width: int) -> dict:
        """`LoopCosts`' ar_step, spec_step and draft_forward (seconds) for a loop verifying
        verify_width tokens at once."""
        return dict(ar_step=self.target(1), spec_step=self.target(verify_width) + self.draft, draft_forward=self.draft)


# Relative costs used when nothing was measured: a draft ~10x cheaper than the target and a
# verification of 9 tokens ~1.3x one token (about what the embedded pair measures on CPU).
UNMEASURED = StepCosts(target_fixed=1.0, target_per_token=0.04, draft=0.1, measured=False)


def expected_tokens(acceptance: float, draft_len: int) -> float:
    """E(L): tokens per step when each draft token is accepted with probability a, independently."""
    a = min(max(float(acceptance), 0.0), 0.999)
    return (1 - a ** (draft_len + 1)) / (1 - a)


def predicted_speedup(costs: StepCosts, acceptance: float, draft_len: int, paths: int = 1,
                      step_overhead_s: float = 0.0) -> float:
    """E(L) target(1) / (T(L) + step_overhead_s): step_overhead_s is a method's own cost per step
    beyond the forwards (SSD's host loop and cache lookups, measured on its calls)."""
    return expected_tokens(acceptance, draft_len) * costs.target(1) / (costs.spec_step(draft_len, paths)
                                                                       + step_overhead_s)


def choose_draft_len(costs: StepCosts, acceptance: float, max_draft_len: int, paths: int = 1,
                     step_overhead_s: float = 0.0) -> int:
    """L* in 1..max_draft_len maximising the predicted speedup (ties: the shorter)."""
    speedups = [predicted_speedup(costs, acceptance, n, paths, step_overhead_s) for n in range(1, max_draft_len + 1)]
    return 1 + int(np.argmax(np.round(speedups, 6)))


def acceptance_of(num_accepted: int, num_rejected: int) -> float | None:
    """Per-position acceptance from a loop's counters: accepted / (accepted + rejections), the
    geometric model's estimate when drafts may stop early (None: no evidence)."""
    total = num_accepted + num_rejected
    return num_accepted / total if total else None


def model_key(model) -> tuple:
    from ssd_jax.backend import platform_of

    leaf = jax.tree.leaves(model.params)[0]
    platform = platform_of(model)   # traced params (a user's jit): the default platform
    # The rules too: on one mesh, a model split over "model" and one replicated run other programs.
    placement = None if model.placement is None else (repr(model.placement.mesh.shape), model.placement.rules)
    return (model.config, str(leaf.dtype), platform, placement)


def pair_key(target, draft) -> tuple:
    """What a pair's costs and acceptance are remembered under (configs, dtypes, backend, mesh and
    sharding rules; params by identity for acceptance, since other weights accept differently)."""
    return model_key(target) + (model_key(draft) if draft is not None else ("retrieval",))


def context_bucket(length: int) -> int:
    return max(64, 1 << int(np.ceil(np.log2(max(length, 1)))))


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """A call's static plan under draft_len="auto" (part of the compiled program's key): the
    length the loop drafts up to (its verification width is draft_len + 1), the early-stop
    threshold (None: no early stop) and whether the loop caps each step's draft (its
    verification then runs at the narrowest compiled width holding the step's drafts)."""

    draft_len: int
    threshold: float | None
    capped: bool = False


def loop_inputs(costs: StepCosts, acceptance: float, verify_width: int, draft_len: int) -> np.ndarray:
    """The loop's traced cost inputs (`ssd_jax.loop.costs.LoopCosts`, as the vector the program
    takes): the steps' costs, the acceptance its running estimates start from, no forced cap (the
    loop chooses each step's), and the seconds of a speculative step by cap 1..draft_len, all 0
    (unmeasured: the loop prices caps linearly; `measure.calibrated_inputs` measures them)."""
    return cost_vector(**costs.loop_steps(verify_width), acceptance=acceptance, forced_cap=0.0,
                       cap_seconds=np.zeros(draft_len))


def draft_models(draft) -> tuple:
    """The draft models of a method's draft argument (None, a Model, CSD's tuple)."""
    drafts = draft if isinstance(draft, (tuple, list)) else (draft,)
    return tuple(d for d in drafts if d is not None and hasattr(d, "params"))


# Methods whose per-position acceptance is another's, remembered under that one's name: SSD
# verifies one draft path token by token as SD does (a cache hit hands it the path the draft
# would have drafted after the outcome), so SD's calls of a pair tell SSD's first call what
# its steps will accept, and SSD's tell SD's.
SHARED_ACCEPTANCE = {"ssd": "sd"}


def acceptance_key(target, draft, method, sampling) -> tuple:
    weights = (target.params,) + tuple(d.params for d in draft_models(draft))
    # Acceptance is remembered per kind of decision: argmax at T=0, argmax of perturbed logits
    # under the Gumbel coupling (lower: noise splits near-ties), random at T > 0.
    kind = "greedy" if sampling.greedy else "coupled" if sampling.coupled else "sampled"
    name = SHARED_ACCEPTANCE.get(method.name, method.name)
    return (ParamsIdentity(*weights), name, getattr(method, "paths", 1), kind)


def cost_width(method) -> int:
    """The max_draft_len `measure_costs` gets (it times verifying that + 1 tokens): the method's,
    or for CSD, which has none, the draft-model methods' default."""
    from ssd_jax.methods import DEFAULTS

    return getattr(method, "max_draft_len", DEFAULTS["sd"]["max_draft_len"])


def cost_draft(method, draft, target=None):
    """The model whose forward `measure_costs` times as the draft cost: the draft of draft-model
    methods; for EAGLE the head as a one-layer model of target's (`ssd_jax.eagle.head_as_model`;
    target None: the head itself, for `plan`'s test of whether one drafts); None for retrieval
    and CSD (their drafting is inside the calibrated step time)."""
    if not getattr(method, "drafts_with_model", False) or method.name == "csd":
        return None
    if method.name == "eagle" and target is not None:
        from ssd_jax.eagle.forward import head_as_model

        return head_as_model(draft, target)
    return draft


def logitspec_branch(method) -> int:
    """LogitSpec's root branch under "auto": as long as allowed (max_draft_len), leaving the
    next-next guesses at least one node of its tree (its tree's width does not depend on it)."""
    return max(1, min(method.max_draft_len, method.tree_size - 2))


def plan(method, target, draft, sampling, costs: StepCosts, acceptance: float) -> tuple[AutoPlan, np.ndarray]:
    """(AutoPlan, loop_inputs) for an adaptive method on this pair with these costs. Single-path
    draft-model methods: max_draft_len with the early stop (the loop caps each step's length at
    the one that pays best, from its own per-position acceptance); multi-path: L* of the cost
    model (their tree is static). PLD: max_draft_len, the loop capping each step (a wider
    verification is the cost of a longer cap).
    CSD: its cascade's cap, the loop capping each step's verified draft.
    EAGLE: L* of the cost model at topk paths' width (its tree is static).
    LogitSpec: its tree's width does not depend on the root branch, so the branch is as long as
    allowed (max_draft_len, leaving the next-next guesses at least one node). acceptance: the
    per-position acceptance the loop's estimates start from."""
    from ssd_jax.loop.retrieval import retrieval_layout

    paths = getattr(method, "paths", 1)
    if method.name == "eagle":
        draft_len = choose_draft_len(costs, acceptance, method.max_draft_len, method.topk)
        return (AutoPlan(draft_len=draft_len, threshold=None),
                loop_inputs(costs, acceptance, method.nodes_at(draft_len), draft_len))
    if method.name == "csd":
        from ssd_jax.loop.cascade import cascade_schedule

        draft_len = cascade_schedule(method, len(draft_models(draft)), sampling).target_width
    elif method.name == "logitspec":
        draft_len = logitspec_branch(method)
    elif (cost_draft(method, draft) is not None and paths == 1) or method.name == "pld":
        draft_len = method.max_draft_len
    else:
        draft_len = choose_draft_len(costs, acceptance, method.max_draft_len, paths)
    if method.name in ("pld", "logitspec"):
        width = retrieval_layout(method, draft_len).num_nodes
    else:
        width = paths * draft_len + 1
    threshold = method.early_stop(sampling.by_argmax) if cost_draft(method, draft) is not None and paths == 1 else None
    capped = threshold is not None or method.name in ("pld", "csd")
    return (AutoPlan(draft_len=draft_len, threshold=threshold, capped=capped),
            loop_inputs(costs, acceptance, width, draft_len))


def prior_plan(method, target, draft, sampling) -> tuple[AutoPlan, np.ndarray]:
    """(AutoPlan, loop_inputs) from the fixed relative costs UNMEASURED and PRIOR_ACCEPTANCE: the
    same on every machine and in every process, read from no memory. What `ssd_jax.decode` runs
    without a plan, and what a deterministic `ssd_jax.Tuner` plans."""
    return plan(method, target, draft, sampling, UNMEASURED, PRIOR_ACCEPTANCE)


def table_caps(method, auto_plan: AutoPlan) -> tuple[int, ...]:
    """The caps whose step `calibrated_inputs` times whole: those a capped loop drafting with a
    model (single-path SD and BV, CSD) may run at (`ssd_jax.loop.adaptive_loop.with_one` of
    `compiled_caps`); none for retrieval, whose calibration text may propose fewer tokens than
    the cap, so a timed step would price long caps low."""
    from ssd_jax.loop.caps import compiled_caps, with_one

    if not auto_plan.capped or not method.drafts_with_model:
        return ()
    return with_one(compiled_caps(auto_plan.draft_len))


# Loop inputs that make every step speculate (with the longest cap) / fall back (but for one
# probe per phase, where the loop probes): `ssd_jax.loop.costs.LoopCosts`.
FORCE_SPECULATION = cost_vector(ar_step=1.0, spec_step=0.0, draft_forward=0.0, acceptance=0.5, forced_cap=1e6)
FORCE_PLAIN = cost_vector(ar_step=0.0, spec_step=1.0, draft_forward=0.0, acceptance=0.5, forced_cap=0.0)


def force_cap(cap: int) -> np.ndarray:
    """Loop inputs that make every step speculate with its draft capped at `cap` tokens."""
    return cost_vector(ar_step=1.0, spec_step=0.0, draft_forward=0.0, acceptance=0.5, forced_cap=cap)


def calibration_length(num_inputs: int) -> int:
    """The entries of a calibration (`_calibrate`: three costs, then one step time per cap) of a
    loop taking num_inputs cost inputs (`ssd_jax.loop.costs.NUM_COST_INPUTS` + L)."""
    return num_inputs - len(FORCE_SPECULATION) + 3


def usable_calibration(calibration: tuple[float, ...] | None, size: int) -> bool:
    """Whether a calibration read from disk can be one `_calibrate` made for a loop of
    `calibration_length` size: as many entries, and an AR step and a speculative step above 0
    (measured ones are at least 1e-9 s; a plain step priced 0 would never let speculation pay)."""
    return calibration is not None and len(calibration) == size and min(calibration[:2]) > 0


def trimmed_mean(values) -> float:
    """The mean of values without their smallest and largest (all of them when fewer than 3)."""
    ordered = np.sort(np.asarray(values, np.float64))
    return float(np.mean(ordered[1:-1] if len(ordered) > 2 else ordered))


def nondecreasing(seconds) -> np.ndarray:
    """Step seconds by cap 1..L (0: not measured) with the measured ones fitted by the closest
    nondecreasing sequence (least squares, pool-adjacent-violators): a longer cap drafts and
    verifies at least as much, so a longer cap priced below a shorter one is measurement noise
    (SD and CSD at batch 1 on CPU, five calibrations of one program: cap 4 priced 2.49-2.93 AR
    steps, twice below cap 2). Pooling such neighbours averages their noise instead of letting
    it pick the cap. float32 [L]."""
    seconds = np.asarray(seconds, np.float32).copy()
    measured = np.flatnonzero(seconds > 0)
    blocks: list[list[float]] = []   # [sum, count] per pooled block
    for value in seconds[measured]:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    seconds[measured] = fitted
    return seconds
