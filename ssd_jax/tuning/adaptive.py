"""Adaptive speculation's cost model: measured step costs, the acceptance the loops report, and
the draft length they imply.

    E(L)  = (1 - a^(L+1)) / (1 - a)         expected tokens per step (acceptance a per position)
    T(L)  = target(K L + 1) + L draft       seconds per step (the draft's catch-up forward and
                                            L - 1 forwards for the path)
    speedup(L) = E(L) target(1) / T(L)      over plain decoding; L* = argmax over 1..max_draft_len

`target(w)` = fixed + per_token * w and `draft` come from `measure_costs`: a jitted loop of 16
forwards per width (no host dispatch inside it, like the decode loop), once per model pair,
batch, context bucket and backend, kept for the process. The acceptance `a` comes from the loop's
own counters (`acceptance_of`) and is remembered per (pair, method, temperature) in
`ACCEPTANCE` for the next call; before any call it is `PRIOR_ACCEPTANCE`. L* is the static
length of the multi-path methods and SSD; single-path SD and BV compile max_draft_len and the
loop caps each step (`ssd_jax.loop.adaptive_loop`).

`calibrated_inputs` measures the loop's own step costs on its compiled program (forced runs):
the AR step, the speculative step without draft forwards, and one draft forward inside the loop.
With them and running per-position acceptance the loop chooses each step's cap and whether
speculation pays or it falls back to plain decoding. Exactness never depends on any of this: a
step's length uses only what is known before its verification.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.runtime import calibration_store
from ssd_jax.runtime import program_store
from ssd_jax.runtime.compile_cache import signature
from ssd_jax.progress import notice

PRIOR_ACCEPTANCE = 0.7    # per-position acceptance assumed before a pair has run
ACCEPTANCE_MEMORY = 0.5   # weight of the previous calls in the remembered acceptance
_LOOP_FORWARDS = 16
_REPEATS = 5


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
        return np.asarray([self.target(1), self.target(verify_width) + self.draft, self.draft], np.float32)


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


class Recent(collections.OrderedDict):
    """A dict that keeps its `limit` most recently used entries (one small entry per program or
    model pair: the caches below must not grow with a long-lived process's history)."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def lookup(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def store(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class ParamsIdentity:
    """Which weights a remembered value belongs to: equal only to an identity of the very same
    (still living) param arrays, so a new model reusing a collected one's ids starts afresh."""

    def __init__(self, *params):
        leaves = [jax.tree.leaves(p)[0] for p in params]
        self._ids = tuple(id(x) for x in leaves)
        self._refs = tuple(None if isinstance(x, jax.core.Tracer) else weakref.ref(x) for x in leaves)

    def _alive(self) -> tuple:
        return tuple(None if r is None else r() for r in self._refs)

    def __hash__(self) -> int:
        return hash(self._ids)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ParamsIdentity) or self._ids != other._ids:
            return False
        mine, theirs = self._alive(), other._alive()
        return all(a is not None and a is b for a, b in zip(mine, theirs))


class DecayedMeans:
    """Per key: a mean of the values added, each weighted `weight` against those before it; the
    most recent keys only. Thread-safe. running_start: the n-th value (n < 1 / weight) weighs
    1 / n instead, so that the first values are a plain mean: decayed from the first value, the
    first call of a program kept weight 0.75^n for n calls after it (SSD at batch 4 on short
    prompts at T=0, one CPU device: a first call at 1.31x plain decoding's cost sent the next 20
    calls plain where fixed L=4 ran 1.10x AR, each probe at 0.7-0.8x moving the mean a quarter)."""

    def __init__(self, weight: float, limit: int = 256, running_start: bool = False):
        self.weight = weight
        self.running_start = running_start
        self._values = Recent(limit)   # key -> (mean, values added)
        self._lock = threading.Lock()

    def lookup(self, key, default=None):
        with self._lock:
            entry = self._values.lookup(key)
        return default if entry is None else entry[0]

    def add(self, key, value: float, share: float = 1.0) -> float:
        """Adds a value counted as `share` (0, 1] of one (a value that says less: it moves the mean
        as a share of an add would, weight 1 - (1 - weight)^share, and in the running start
        share / (shares so far + share)); returns the key's new mean."""
        with self._lock:
            mean, count = self._values.lookup(key, (0.0, 0.0))
            weight = self.weight if share == 1 else 1.0 - (1.0 - self.weight) ** share
            if self.running_start or count == 0:
                weight = max(weight, share / (count + share))
            mean = (1.0 - weight) * mean + weight * float(value)
            self._values.store(key, (mean, count + share))
            return mean

    def means(self) -> dict:
        """key -> its mean, for every key kept."""
        with self._lock:
            return {key: entry[0] for key, entry in self._values.items()}

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


class AcceptanceMemory:
    """Per-position acceptance of past calls, per key (the pair's weights, the method, greedy or
    not); the most recent keys only."""

    def __init__(self, limit: int = 256):
        self._means = DecayedMeans(1.0 - ACCEPTANCE_MEMORY, limit)

    def get(self, key) -> float:
        """The remembered acceptance (PRIOR_ACCEPTANCE before any, and always under
        SSD_JAX_DETERMINISTIC_AUTO=1, where a call must not depend on the calls before it)."""
        if not timings_allowed():
            return PRIOR_ACCEPTANCE
        return self._means.lookup(key, PRIOR_ACCEPTANCE)

    def known(self, key) -> float | None:
        """The remembered acceptance, None before any call (and under SSD_JAX_DETERMINISTIC_AUTO=1)."""
        if not timings_allowed():
            return None
        return self._means.lookup(key)

    def update(self, key, observed: float | None, share: float = 1.0) -> None:
        """Adds a call's observed acceptance, counted as `share` of a call (`DecayedMeans.add`)."""
        if observed is not None:
            self._means.add(key, observed, share)

    def clear(self) -> None:
        self._means.clear()


ACCEPTANCE = AcceptanceMemory()
_COSTS = Recent()
_COSTS_LOCK = threading.Lock()
# Held while measuring (`forward_seconds`, `calibrated_inputs`, `against_ar.ar_step_ratio`): two
# threads' first calls of one program measured it twice at once, each timing the other's runs
# too (the two calibrations' draft forwards 2x apart), and the last one was kept on disk.
MEASURING = threading.RLock()


def remembered(memory: Recent, key):
    """memory's value for key (None: none), under the lock of the in-process memories."""
    with _COSTS_LOCK:
        return memory.lookup(key)


def measured_once(memory: Recent, key, measure: Callable[[], Any]):
    """memory's value for key, else measure()'s, remembered: measured one at a time (MEASURING),
    and read again once the lock is held (another thread may have measured it meanwhile)."""
    with MEASURING:
        value = remembered(memory, key)
        if value is None:
            value = measure()
            with _COSTS_LOCK:
                memory.store(key, value)
    return value


def _model_key(model) -> tuple:
    from ssd_jax.backend import platform_of

    leaf = jax.tree.leaves(model.params)[0]
    platform = platform_of(model)   # traced params (a user's jit): the default platform
    # The rules too: on one mesh, a model split over "model" and one replicated run other programs.
    placement = None if model.placement is None else (repr(model.placement.mesh.shape), model.placement.rules)
    return (model.config, str(leaf.dtype), platform, placement)


def pair_key(target, draft) -> tuple:
    """What a pair's costs and acceptance are remembered under (configs, dtypes, backend, mesh and
    sharding rules; params by identity for acceptance, since other weights accept differently)."""
    return _model_key(target) + (_model_key(draft) if draft is not None else ("retrieval",))


def context_bucket(length: int) -> int:
    return max(64, 1 << int(np.ceil(np.log2(max(length, 1)))))


def _loop_seconds(params, config, batch: int, width: int, context: int) -> float:
    """Seconds per forward of `width` tokens over a cache holding `context` tokens, timed as a
    jitted loop of _LOOP_FORWARDS forwards (best of _REPEATS); kept on disk per loop and machine
    (`ssd_jax.runtime.calibration_store`), so a new process reads it back (instead of ~1 s
    compiling and timing it), named without lowering the loop (0.15 s each) where
    `program_store.describe` can say what decides it."""
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.transformer import forward_cached

    per_layer = isinstance(params["layers"], (tuple, list))
    capacity = context + width + 1

    @jax.jit
    def loop(params):
        cache = init_cache(config, batch, capacity, params["embed"].dtype, per_layer=per_layer)
        cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))

        def body(i, acc):
            tokens = (jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width) + i) % config.vocab_size
            positions = context + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
            logits, _ = forward_cached(params, config, tokens, positions, cache)
            return acc + logits[:, -1, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, _LOOP_FORWARDS, body, jnp.zeros((batch,), jnp.float32))

    described = program_store.describe(f"{__name__}._loop_seconds", (config, batch, width, context, per_layer,
                                                                     _LOOP_FORWARDS), signature(params))
    lowered = None if described is not None else loop.lower(params)
    stored = calibration_store.path_for_text("forward", described or lowered.as_text())
    kept = calibration_store.load(stored)
    if kept is not None and len(kept) == 1 and kept[0] > 0:
        return kept[0]
    with notice(f'timing a forward of {width} token{"s" if width > 1 else ""} for draft_len="auto" (once per machine)'):
        compiled = (lowered or loop.lower(params)).compile()
        jax.block_until_ready(compiled(params))
        best = np.inf
        for _ in range(_REPEATS):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params))
            best = min(best, time.perf_counter() - start)
    seconds = best / _LOOP_FORWARDS
    calibration_store.save(stored, (seconds,))
    return seconds


DETERMINISTIC_ENV = "SSD_JAX_DETERMINISTIC_AUTO"


def timings_allowed() -> bool:
    """False when the environment sets SSD_JAX_DETERMINISTIC_AUTO=1: "auto" then decides from the
    fixed relative costs UNMEASURED instead of timings, and from the prior acceptance instead of
    the remembered one, so a call gives the same tokens on every run and machine (with sampling,
    timings otherwise steer the lengths, hence which random draws are used; the law is the
    target's either way) and no time goes to measuring. The test suite
    runs this way, but for the tests of the measurements."""
    return os.environ.get(DETERMINISTIC_ENV, "") != "1"


def agreed(values: np.ndarray) -> np.ndarray:
    """values as process 0 has them: a program spanning several processes (jax.distributed) must
    get the same plan and loop inputs on each, and timings differ between hosts."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values)))


_SECONDS = Recent()


def forward_seconds(model, batch: int, width: int, context: int, measure: bool = True) -> float | None:
    """Seconds per forward of `width` tokens at this batch and context (rounded up to a power of
    two), measured once per machine (`_loop_seconds`, kept on disk) and remembered for the
    process; None when timings are not allowed
    (`timings_allowed`), or not yet measured and measure is False (traced calls). Under
    jax.distributed every process gets process 0's number."""
    from ssd_jax.runtime.loop_params import loop_params

    if not timings_allowed():
        return None
    key = (_model_key(model), batch, context_bucket(context), width)
    known = remembered(_SECONDS, key)
    if known is not None or not measure:
        return known

    def seconds() -> float:
        measured = _loop_seconds(loop_params(model), model.config, batch, width, context_bucket(context))
        return float(agreed(np.asarray([measured]))[0])

    return measured_once(_SECONDS, key, seconds)


def measure_costs(target, draft, batch: int, context: int, max_draft_len: int) -> StepCosts:
    """The pair's StepCosts at this batch and context (rounded up to a power of two), measured
    once per process (target at 1 and max_draft_len + 1 tokens, draft at 1; draft None, for
    retrieval drafting: no draft forwards, draft cost 0); UNMEASURED when timings are not allowed
    (`timings_allowed`). Under jax.distributed every process gets process 0's numbers."""
    if not timings_allowed():
        return UNMEASURED
    key = (pair_key(target, draft), batch, context_bucket(context), max_draft_len)
    with _COSTS_LOCK:
        known = _COSTS.lookup(key)
    if known is not None:
        return known
    one = forward_seconds(target, batch, 1, context)
    wide = forward_seconds(target, batch, max_draft_len + 1, context)
    per_token = max(wide - one, 0.0) / max_draft_len
    draft_cost = 0.0 if draft is None else forward_seconds(draft, batch, 1, context)
    costs = StepCosts(target_fixed=max(one - per_token, 1e-9), target_per_token=per_token, draft=draft_cost)
    with _COSTS_LOCK:
        _COSTS.store(key, costs)
    return costs


def cached_costs(target, draft, batch: int, context: int, max_draft_len: int) -> StepCosts:
    """Measured costs if this process has them (no measuring: for traced decodes), else UNMEASURED."""
    key = (pair_key(target, draft), batch, context_bucket(context), max_draft_len)
    with _COSTS_LOCK:
        return _COSTS.lookup(key, UNMEASURED)


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
    """The loop's traced cost inputs, float32 [5 + draft_len] (`ssd_jax.loop.adaptive_loop`):
    `StepCosts.loop_array`, the acceptance its running estimates start from, 0 (no forced cap:
    the loop chooses each step's), and the seconds of a speculative step by cap 1..draft_len, all
    0 (unmeasured: the loop prices caps linearly; `calibrated_inputs` measures them)."""
    return np.concatenate([costs.loop_array(verify_width), np.asarray([acceptance, 0.0], np.float32),
                           np.zeros(draft_len, np.float32)])


def draft_models(draft) -> tuple:
    """The draft models of a method's draft argument (None, a Model, CSD's tuple)."""
    drafts = draft if isinstance(draft, (tuple, list)) else (draft,)
    return tuple(d for d in drafts if d is not None and hasattr(d, "params"))


def acceptance_key(target, draft, method, sampling) -> tuple:
    weights = (target.params,) + tuple(d.params for d in draft_models(draft))
    return (ParamsIdentity(*weights), method.name, getattr(method, "paths", 1), sampling.greedy)


def cost_width(method) -> int:
    """The max_draft_len `measure_costs` gets (it times verifying that + 1 tokens): the method's,
    or for CSD, which has none, the draft-model methods' default."""
    from ssd_jax.methods import DEFAULTS

    return getattr(method, "max_draft_len", DEFAULTS["sd"]["max_draft_len"])


def cost_draft(method, draft):
    """The model whose forward `measure_costs` times as the draft cost: the draft of draft-model
    methods; None for retrieval and CSD (their drafting is inside the calibrated step time)."""
    return draft if getattr(method, "drafts_with_model", False) and method.name != "csd" else None


def logitspec_branch(method) -> int:
    """LogitSpec's root branch under "auto": as long as allowed (max_draft_len), leaving the
    next-next guesses at least one node of its tree (its tree's width does not depend on it)."""
    return max(1, min(method.max_draft_len, method.tree_size - 2))


def plan(method, target, draft, sampling, costs: StepCosts) -> tuple[AutoPlan, np.ndarray]:
    """(AutoPlan, loop_inputs) for an adaptive method on this pair with these costs. Single-path
    draft-model methods: max_draft_len with the early stop (the loop caps each step's length at
    the one that pays best, from its own per-position acceptance); multi-path: L* of the cost
    model (their tree is static). PLD: max_draft_len, the loop capping each step (a wider
    verification is the cost of a longer cap).
    CSD: its cascade's cap, the loop capping each step's verified draft.
    LogitSpec: its tree's width does not depend on the root branch, so the branch is as long as
    allowed (max_draft_len, leaving the next-next guesses at least one node)."""
    from ssd_jax.loop.retrieval import retrieval_layout

    acceptance = ACCEPTANCE.get(acceptance_key(target, draft, method, sampling))
    paths = getattr(method, "paths", 1)
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
    threshold = method.early_stop(sampling.greedy) if cost_draft(method, draft) is not None and paths == 1 else None
    capped = threshold is not None or method.name in ("pld", "csd")
    return (AutoPlan(draft_len=draft_len, threshold=threshold, capped=capped),
            loop_inputs(costs, acceptance, width, draft_len))


def table_caps(method, auto_plan: AutoPlan) -> tuple[int, ...]:
    """The caps whose step `calibrated_inputs` times whole: those a capped loop drafting with a
    model (single-path SD and BV, CSD) may run at (`ssd_jax.loop.adaptive_loop.with_one` of
    `compiled_caps`); none for retrieval, whose calibration text may propose fewer tokens than
    the cap, so a timed step would price long caps low."""
    from ssd_jax.loop.adaptive_loop import compiled_caps, with_one

    if not auto_plan.capped or not method.drafts_with_model:
        return ()
    return with_one(compiled_caps(auto_plan.draft_len))


def default_plan(method, target, draft, sampling, batch: int, context: int) -> tuple[AutoPlan, np.ndarray]:
    """(AutoPlan, loop_inputs) from what this process already knows (costs measured by an earlier
    `generate` of the pair, else UNMEASURED; remembered acceptance, else the prior): for traced
    decodes, which cannot measure."""
    return plan(method, target, draft, sampling, cached_costs(target, cost_draft(method, draft), batch, context,
                                                              cost_width(method)))


_CALIBRATION = Recent()
_CALIBRATION_TOKENS = 48
_CALIBRATION_ROUNDS = 7
# Loop inputs that make every step speculate (with the longest cap) / fall back (but for one
# probe per phase, where the loop probes); see `ssd_jax.loop.adaptive_loop.NUM_COST_INPUTS`.
FORCE_SPECULATION = np.asarray([1.0, 0.0, 0.0, 0.5, 1e6], np.float32)
FORCE_PLAIN = np.asarray([0.0, 1.0, 0.0, 0.5, 0.0], np.float32)


def _calibrate(executable, args: tuple, costs: StepCosts, takes_cap: bool,
               table_caps: tuple[int, ...] = ()) -> tuple[float, ...]:
    """(AR step, speculative step without draft forwards, one draft forward, then the seconds of
    a speculative step by cap 1..L: measured for table_caps, 0 for the others) in seconds, from
    interleaved forced runs (see `calibrated_inputs`). A change to what this returns must bump
    `calibration_store.FORMAT`, or calibrations kept on disk would be read with the new meaning."""
    size = int(np.shape(args[-1])[0])
    draft_len = size - len(FORCE_SPECULATION)

    def runner(forced, max_new):
        return timed_run(executable, args, max_new, forced)

    setup = runner(FORCE_SPECULATION, 1)
    tokens = calibration_tokens(setup()[1])
    plain_run = runner(FORCE_PLAIN, tokens)
    # A plain run opens and closes each round: the AR step is every price's denominator, and its
    # noise moved all of a round's prices together (see `calibrated_inputs`).
    runs = dict(plain=plain_run, setup=setup, spec=runner(FORCE_SPECULATION, tokens))
    if takes_cap:
        runs["one"] = runner(force_cap(1), tokens)
    middle = tuple(c for c in table_caps if 1 < c < draft_len)
    for cap in middle:
        runs[f"cap{cap}"] = runner(force_cap(cap), tokens)
    counts = {}
    for name, run in runs.items():   # warm, and the step counts (the same every round)
        counters = jax.device_get(run()[1].counters["spec"])
        steps = max(int(counters.target_calls) - 1, 1)
        plain = int(np.max(counters.ar_steps))
        # Draft forwards per speculative step as the loop counts them (a step drafts until its
        # last row stops: at batch 8 that is near the cap while the mean row drafts far fewer).
        forwards = float(counters.draft_forwards) / max(steps - plain, 1)
        counts[name] = (steps, plain, forwards)
    runs["plain_end"] = plain_run   # timed each round, after the others; warmed and counted as "plain"
    forwards = counts["spec"][2]
    measured_cap = takes_cap and forwards >= 0.5
    # The caps whose step is timed whole: the longest (spec), 1 (one) and the middle ones.
    timed = {cap: name for cap, name in ((1, "one"), (draft_len, "spec"), *((c, f"cap{c}") for c in middle))
             if measured_cap and cap in table_caps}
    rounds = []
    for _ in range(_CALIBRATION_ROUNDS):
        seconds = {name: run()[0] for name, run in runs.items()}
        setup = seconds["setup"]

        def per_step(name):
            return max(seconds[name] - setup, 1e-9) / counts[name][0]

        t_spec = per_step("spec")
        p_steps, p_plain, _ = counts["plain"]
        t_ar = float(np.mean([max(seconds[name] - setup - (p_steps - p_plain) * t_spec, 1e-9) / max(p_plain, 1)
                              for name in ("plain", "plain_end")]))
        # Unmeasured slope: a draft forward (and, for a capped loop, a verified token) per token.
        c_draft = (costs.draft + (costs.target_per_token if takes_cap else 0.0)) * t_ar / costs.target(1)
        if measured_cap:
            c_draft = max(t_spec - per_step("one"), 0.0) / forwards
        table = [per_step(timed[cap]) / t_ar if cap in timed else 0.0 for cap in range(1, draft_len + 1)]
        rounds.append((t_ar, t_spec / t_ar, c_draft / t_ar, *table))
    t_ar, spec_ratio, draft_ratio, *table = (trimmed_mean(column) for column in zip(*rounds))
    return (t_ar, max((spec_ratio - forwards * draft_ratio) * t_ar, 1e-9), draft_ratio * t_ar,
            *(ratio * t_ar for ratio in table))


def calibration_tokens(output) -> int:
    """The tokens a calibration's runs of a decode program decode (output: one run's
    `DecodeOutput`, tokens int32 [B, out_size]): as many as its output holds, up to
    _CALIBRATION_TOKENS. Not the call's max_new: what is measured is kept for every call of the
    program, whose max_new may be anything up to out_size (a call of one token timed only noise,
    and its calibration priced the next calls' steps)."""
    return min(int(np.shape(output.tokens)[1]), _CALIBRATION_TOKENS)


def timed_run(executable, args: tuple, max_new: int, forced: np.ndarray | None = None):
    """A function that runs the compiled `executable` once on `args` with max_new replaced (the
    last argument; where `forced` is given, the one before, and the loop's cost inputs, the last,
    replaced by forced zero-padded to their length) and returns (seconds, output)."""
    if forced is None:
        run_args = args[:-1] + (jax.device_put(np.asarray(max_new, np.int32), args[-1].sharding),)
    else:
        forced = np.concatenate([forced, np.zeros(int(np.shape(args[-1])[0]) - len(forced), np.float32)])
        run_args = args[:-2] + (jax.device_put(np.asarray(max_new, np.int32), args[-2].sharding),
                                jax.device_put(forced, args[-1].sharding))

    def run():
        start = time.perf_counter()
        out = jax.block_until_ready(executable(*run_args))
        return time.perf_counter() - start, out

    return run


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


def force_cap(cap: int) -> np.ndarray:
    """Loop inputs that make every step speculate with its draft capped at `cap` tokens."""
    forced = FORCE_SPECULATION.copy()
    forced[4] = cap
    return forced


def calibration_length(num_inputs: int) -> int:
    """The entries of a calibration (`_calibrate`: three costs, then one step time per cap) of a
    loop taking num_inputs cost inputs (`ssd_jax.loop.adaptive_loop.NUM_COST_INPUTS` + L)."""
    return num_inputs - len(FORCE_SPECULATION) + 3


def usable_calibration(calibration: tuple[float, ...] | None, size: int) -> bool:
    """Whether a calibration read from disk can be one `_calibrate` made for a loop of
    `calibration_length` size: as many entries, and an AR step and a speculative step above 0
    (measured ones are at least 1e-9 s; a plain step priced 0 would never let speculation pay)."""
    return calibration is not None and len(calibration) == size and min(calibration[:2]) > 0


def _kept_or_measured(executable, args: tuple, program_key, costs: StepCosts, size: int, takes_cap: bool,
                      table_caps: tuple[int, ...]) -> tuple[float, ...]:
    """The program's calibration (`calibrated_inputs`' arguments; size: its `calibration_length`):
    another thread's, else the one kept on disk, else measured (and kept); remembered for the
    process."""
    def kept_or_measured() -> tuple[float, ...]:
        stored = calibration_store.path_for(executable, key=program_key)
        calibration = calibration_store.load(stored)
        if not usable_calibration(calibration, size):
            with notice('timing the decode program\'s steps for draft_len="auto" (once per program and machine)'):
                calibration = tuple(float(x) for x in agreed(np.asarray(
                    _calibrate(executable, args, costs, takes_cap, table_caps))))
            calibration_store.save(stored, calibration)
        return calibration

    return measured_once(_CALIBRATION, program_key, kept_or_measured)


def calibrated_inputs(executable, args: tuple, program_key, costs: StepCosts, planned: np.ndarray,
                      takes_cap: bool = False, table_caps: tuple[int, ...] = ()) -> np.ndarray:
    """loop_inputs with the AR and speculative step times measured on the compiled program itself (args:
    its arguments, the last one the cost inputs; max_new, the one before, set to `calibration_tokens`): a
    run of one token (prefill and setup, subtracted from the others), a short run with
    FORCE_SPECULATION and one with FORCE_PLAIN (which still probes, but for retrieval, which
    measures during plain steps). takes_cap (a loop that caps each step's draft): one more run
    capped at one token, so the step time without draft forwards and one draft forward's in-loop
    time are both measured (the slope between the two caps); otherwise the draft forward's cost is
    the per-forward measurement scaled like the AR step. table_caps (capped loops drafting with a
    model): the caps whose whole step is timed (forced runs at each), which the loop then prices as
    measured instead of linearly: on CPU a step's cost grows faster than linearly with its cap (SD
    at batch 1, code, T=0: 1.27, 1.52 and 2.30 AR steps at caps 2, 4 and 8, where the line through
    caps 1 and 8 gave 1.32, 1.67, 2.37, pricing cap 8 within 1% of cap 4's speed where it ran 7%
    slower). The runs are interleaved in _CALIBRATION_ROUNDS rounds, each opened and closed by a plain
    run (the round's AR step is their mean), and each cost is the trimmed mean over rounds of its
    ratio to the same round's AR step (times the trimmed mean AR step): this machine's speed drifts
    by tens of percent within seconds, which separate best-of timings took for differences between
    the programs. Against 5 rounds with one plain run and medians, six calibrations of one program
    each (AMD EPYC, 2 cores) priced the caps with a spread of 3.5% instead of 5.8% (CSD, batch 1,
    short prompts, T=1) and 3.3% instead of 7.5% (SD, batch 8, code, T=0; coefficients of
    variation, mean over the timed caps). Kept per program (program_key) for the process, and on
    disk per program and machine (`ssd_jax.runtime.calibration_store`), so a new process finds it;
    the prior acceptance stays the plan's. Under SSD_JAX_DETERMINISTIC_AUTO=1 (`timings_allowed`): `planned`,
    unmeasured."""
    if not timings_allowed():
        return np.asarray(planned, np.float32)
    calibration = remembered(_CALIBRATION, program_key)
    if calibration is None:
        calibration = _kept_or_measured(executable, args, program_key, costs, calibration_length(len(planned)),
                                        takes_cap, table_caps)
    t_ar, t_spec_fixed, c_draft, *table = calibration
    return np.asarray([t_ar, t_spec_fixed, c_draft, planned[3], 0.0, *nondecreasing(table)], np.float32)
