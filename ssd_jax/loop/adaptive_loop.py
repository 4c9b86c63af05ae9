"""The decode loop of adaptive speculation: speculative steps while they pay, plain decoding while
they do not, all inside one jitted program (no host round trip). Its design and rationale:
docs/adaptive.md.

    while some row runs (`phase`):
        speculative steps while they pay (at least one, a probe, unless backing off; parts that
            measure while decoding plainly never probe), each capped at the length that pays best
            (parts with `dispatch_caps`: one compiled step per cap, chosen once per run of steps)
        plain steps while speculation does not pay (checked every PLAIN_BLOCK steps, single
            steps near the end), the draft falling behind by at most `pending_width` tokens
        the draft reads the tokens it missed (one forward; `learns_while_plain` parts score it there)

The loop keeps, per row and draft position, decayed sums of how often a step's draft reached the
position and had its token accepted (`ssd_jax.loop.acceptance`: E(l) tokens per step at cap l,
sd(l) their spread). With the costs (`LoopCosts`) a step at cap l costs spec_step + rho (l - 1)
draft_forward (rho: the running share of the cap's draft forwards that ran), or the calibration's
time for that cap, and

    cap  = the candidate l with the least steps(l) cost(l)        (`best_cap_index`)
    pays = steps(cap) cost(cap) <= max_rows r ar_step             (`pays_at`)

where steps(l) is what the batch still needs for each running row's r remaining tokens
(`batch_steps`), each row's E raised by a noise allowance for `pays`. The sums are a short memory
(DECAY), which judges whether speculation pays and reverts to a long one (LONG_DECAY) during plain
steps, and the long memory, which chooses the cap (where rows cap their drafts with a model at T=0,
a memory of its own: CAP_DECAY). A probe that does not pay doubles the plain phases before
the next, up to MAX_BACKOFF. Retrieval needs no probes: each plain block walks the draft made at
its start with the tokens the block drew (`ssd_jax.loop.shadow`); nor do drafts whose acceptance
is token-wise (SD, every method at T=0, CSD with a strict review): plain steps record each token's
target probability and the draft scores itself on them when it catches up (`chain_counts`).

The choices use only past steps and the costs, never the current step's target probabilities, so
the output law is the target's whatever they decide.

The loop's functions take its static setup c (`LoopConfig`), its traced inputs x (`LoopInputs`)
and its state s (`AdaptiveState`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.backend import policy_for
from ssd_jax.loop.acceptance import (batch_steps, cap_index, position_counts, position_shape, probe_up,
                                     tokens_moments, toward_batch, within_remaining)
# compiled_caps, with_one and PENDING_WIDTH are re-exported for `ssd_jax.tuning` and the tests.
from ssd_jax.loop.caps import PENDING_WIDTH, compiled_caps, narrowest, with_one  # noqa: F401
from ssd_jax.loop.costs import NUM_COST_INPUTS, LoopCosts  # noqa: F401  (NUM_COST_INPUTS re-exported)
from ssd_jax.loop.shadow import chain_counts, shadow_counts
from ssd_jax.loop.skeleton import AdaptiveParts, DecodeState, Verdict, advance, paused, room_gated, start, step_keys
from ssd_jax.models.config import ModelConfig
from ssd_jax.sampling import SamplingParams

# Weight of the past in the short and the long memory (per speculative step), and how many steps'
# worth of evidence the prior acceptance counts for.
DECAY = 0.9
LONG_DECAY = 0.98
PRIOR_STEPS = 2.0
# ... and for the long memory, which chooses the cap, where a batch of rows caps its drafts with a
# model: the plan's acceptance is what earlier calls of the pair measured, and at batch > 1 (no
# EXPLORE, caps dispatched per run of steps) a switch made on a call's first steps holds. Short
# prompts accept less over their first steps, and with less prior the loop left a long cap on that
# start and stayed at a short one. `probe_up` still counts the prior at PRIOR_STEPS' worth
# (`extra_prior`): what it waits for is measurement.
BATCH_PRIOR_STEPS = 4.0
# The fall back's noise allowance, in standard errors of the short memory's tokens per step: at
# T=1 a step's tokens vary widely, so a memory of ~10 steps dips below break-even by chance, and
# without the allowance the loop fell back on text where speculation paid at every fixed length.
Z = 1.0
# Weight of the past in the memory that chooses the cap where rows cap their drafts with a model
# at T=0 (SD, BV, CSD; elsewhere the long memory chooses it). A call's first tokens accept far
# less than its rest (held-out code: 0.16 a position over the first 24 tokens, 0.66 over the
# call), and at batch > 1 the row that sets the batch's pace does: the long memory's ~50 steps
# held the call at a short cap long after that start, while ~12 steps let it fade (batch 1, the
# 1/5 cost regime: 24-32 of 41-48 steps at cap 2, 0.93 of fixed L=4; with this memory 1.08). The
# long memory stays what the fall back reverts to and what `probe_up` reads (with this one there,
# calls fell back on text where speculation paid). Not at T > 0, where each step's acceptance also
# carries the sampling's noise, which ~12 steps do not average out.
CAP_DECAY = 0.92
# The most plain phases between probes, after failed ones.
MAX_BACKOFF = 8
# At batch 1 the cap is chosen with each position past the current cap raised by this many
# standard errors of its long-memory estimate: a step never reaches those positions, so a few
# unlucky steps at a long cap would keep the loop at a short one for the rest of a call; as their
# evidence decays the bonus grows and the longer cap is tried again. Only those positions: raising
# the measured ones too drafted longer than paid. Not at batch > 1, where the rows measure the
# positions and a longer cap makes the batch wait for its unluckiest row.
EXPLORE = 0.5
# Steps' worth of pull of each row's sums towards the batch's mean row (batch > 1, `toward_batch`):
# the largest of a batch's few-step estimates is mostly chance, and it would stop speculation that
# pays.
ROW_POOLING = 4.0
# ... and for retrieval, whose rows' acceptance drifts towards the batch's over a call (the text a
# row generates becomes copyable as it grows): with less pull, the rows measured lowest early on
# set the batch's pace and held it at a cap shorter than pays.
RETRIEVAL_ROW_POOLING = 8.0
# Where the loop checks every step and dispatches its caps per run of steps, the speculative steps
# between its choices of cap and fall back: the choice is ~60 small ops, a share of a small model's
# step, and a dispatched cap changes seldom anyway. Where each step picks its own width (PLD,
# LogitSpec), the loop chooses after every step, following the bursts of text retrieval copies.
DECIDE_EVERY = 4
# Plain steps between checks of whether speculation pays, on every backend: each check is a few
# tens of small ops, a share of a plain step.
PLAIN_BLOCK = 4


@struct.dataclass
class AdaptiveState:
    """decode: the skeleton's DecodeState; reached, accepted float32 [B, L]: decayed sums over
    speculative steps of whether the row's draft reached position k / had its k-th token
    accepted; long_reached, long_accepted: the same with the long memory, over long_steps
    float32 [] steps; cap_reached, cap_accepted: the same with the memory that chooses the cap
    (CAP_DECAY where rows cap their drafts with a model at T=0; elsewhere unused, the long
    memory choosing the cap);
    extra_prior float32 []: the steps' worth of the long memory's prior beyond
    PRIOR_STEPS, decayed with it; forward_share float32 []: running average of the draft
    forwards a step ran over the cap's cap - 1; spec_steps int32 []: speculative steps of the current phase; wait
    int32 []: phases left before the next probe; backoff int32 []: phases between probes after
    the last failed one; pending int32 [B, P], pending_len int32 [B]: tokens the draft has not
    read (ending with cur); pending_law float32 [B, P]: the target's probability of each pending
    token a plain step drew (parts with `learns_while_plain`; else zeros); cap int32 [], pays
    bool []: the next step's cap and whether speculating pays, from the memories above (computed
    once per update); chosen int32 []: the cap the loop chose minus one (cap itself is the forced
    one under forced inputs)."""

    decode: DecodeState
    reached: jax.Array
    accepted: jax.Array
    long_reached: jax.Array
    long_accepted: jax.Array
    cap_reached: jax.Array
    cap_accepted: jax.Array
    long_steps: jax.Array
    extra_prior: jax.Array
    forward_share: jax.Array
    spec_steps: jax.Array
    wait: jax.Array
    backoff: jax.Array
    pending: jax.Array
    pending_len: jax.Array
    pending_law: jax.Array
    cap: jax.Array
    pays: jax.Array
    chosen: jax.Array


@struct.dataclass
class Evidence:
    """What the loop's choices read (`AdaptiveState`'s small part): running bool [B], remaining
    int32 [B] tokens left per row, the memories' sums float32 [B, L], probe_reached float32 [B, L]
    (long_reached with the prior counted at PRIOR_STEPS' worth: `probe_up`'s evidence),
    forward_share float32 [], chosen int32 [] (the last choice's cap index)."""

    running: jax.Array
    remaining: jax.Array
    reached: jax.Array
    accepted: jax.Array
    long_reached: jax.Array
    long_accepted: jax.Array
    cap_reached: jax.Array
    cap_accepted: jax.Array
    probe_reached: jax.Array
    forward_share: jax.Array
    chosen: jax.Array


# ----------------------------------------------------------------------------- the loop's setup


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The adaptive loop's static setup for one program. parts: the method's `AdaptiveParts` (its
    params traced inside); sampling; batch: the rows B; steps_per_check: steps between checks of
    the loop's conditions and choices (the backend policy's `adaptive_steps_per_check`: on GPU each
    check reads a predicate back to the host); dispatch: `parts.dispatch_caps(batch)`, the caps
    compiled one step each and chosen once per run of steps (None: each step picks its width)."""

    parts: AdaptiveParts
    sampling: SamplingParams
    batch: int
    steps_per_check: int
    dispatch: tuple[int, ...] | None

    @classmethod
    def make(cls, parts: AdaptiveParts, tparams: dict, sampling: SamplingParams, batch: int) -> "LoopConfig":
        """The config of a loop over `parts` on the target params tparams (the backend policy's)."""
        return cls(parts=parts, sampling=sampling, batch=batch, dispatch=parts.dispatch_caps(batch),
                   steps_per_check=policy_for(tparams).adaptive_steps_per_check)

    @property
    def draft_len(self) -> int:
        return self.parts.draft_len

    @property
    def takes_cap(self) -> bool:
        return self.parts.takes_cap

    @property
    def priced(self) -> bool:
        """Whether a longer cap costs more per step: draft forwards, or (capped parts without a
        draft model) a wider verification, `LoopCosts.draft_forward` then being that cost per token."""
        return self.parts.drafts_with_model or self.takes_cap

    @property
    def shadows(self) -> bool:
        """Whether the drafts are point masses read off the context (retrieval), which plain steps
        walk to measure the acceptance (`AdaptiveParts.shadow_tree`)."""
        return self.parts.shadow_tree is not None

    @property
    def scored(self) -> bool:
        """Whether the draft scores itself on the tokens plain steps drew when it catches up."""
        return self.parts.learns_while_plain

    @property
    def measures_plain(self) -> bool:
        """Whether the loop learns the acceptance while it decodes plainly (shadow walks or scoring
        at the catch-up): such parts never probe."""
        return self.shadows or self.scored

    @property
    def noise_allowance(self) -> float:
        """Z, the fall back's allowance in standard errors, but none for retrieval: falling back
        after a chance dip stops nothing from being measured, and the next plain block tells. A
        draft model keeps it: its evidence comes only when the pending buffer is full."""
        return 0.0 if self.shadows else Z

    @property
    def gated(self) -> bool:
        """Whether a speculative step with nothing worth verifying runs as a plain one
        (`AdaptiveParts.gates`; not under a forced cap, which times the verification)."""
        return self.parts.gates(self.batch)

    @property
    def batch_caps_with_model(self) -> bool:
        """Whether a batch of rows caps its drafts with a model (SD, BV and CSD at batch > 1)."""
        return self.batch > 1 and self.takes_cap and not self.shadows

    @property
    def long_prior(self) -> float:
        """The steps' worth of prior the long memory starts from (`BATCH_PRIOR_STEPS`)."""
        return BATCH_PRIOR_STEPS if self.batch_caps_with_model else PRIOR_STEPS

    @property
    def separate_cap_memory(self) -> bool:
        """Whether a memory of its own (CAP_DECAY) chooses the cap: rows capping their drafts with
        a model at T=0, at any batch; elsewhere the long memory chooses it."""
        return self.takes_cap and not self.shadows and self.sampling.by_argmax

    @property
    def shaped(self) -> bool:
        """Whether a row's estimates are pulled towards the batch's acceptance by position
        (`position_shape`): draft models at batch > 1. Retrieval keeps the flat pooled target: its
        first position also counts the rows whose lookup found nothing, and the shape made it cap
        longer and fall back more."""
        return self.batch > 1 and not self.shadows

    @property
    def row_pooling(self) -> float:
        return RETRIEVAL_ROW_POOLING if self.shadows else ROW_POOLING

    @property
    def candidate(self) -> np.ndarray:
        """bool [L]: the caps the loop may choose, 1 and the compiled caps. A step verifies at the
        narrowest compiled width holding its drafts, so a cap between two compiled ones costs the
        wider one's step, which the linear price (`step_costs`) would under-price."""
        return np.isin(np.arange(1, self.draft_len + 1), with_one(self.parts.verify_caps))

    @property
    def positions(self) -> np.ndarray:
        """float32 [L]: the draft positions (and caps) 1..L."""
        return np.arange(1, self.draft_len + 1, dtype=np.float32)

    @property
    def plain_block(self) -> int:
        """Plain steps between checks of whether speculation pays."""
        return max(self.steps_per_check, PLAIN_BLOCK)


@struct.dataclass
class LoopInputs:
    """The adaptive loop's traced inputs, the same at every step, and what it derives from them
    once on entry. keys uint32 [B, 2], max_new int32 [], eos_ids int32 [E]: as the skeleton's
    `run`; pause_at int32 [] or None: as `resume_adaptive`'s; costs: `LoopCosts`; forced bool []:
    costs.forced_cap > 0; acceptance float32 []: costs.acceptance clipped to [0, 0.999];
    prior_reached, prior_accepted float32 [B, L]: one step's worth of sums at that acceptance
    (a^(k-1) and a^k at position k)."""

    keys: jax.Array
    max_new: jax.Array
    eos_ids: jax.Array
    pause_at: jax.Array | None
    costs: LoopCosts
    forced: jax.Array
    acceptance: jax.Array
    prior_reached: jax.Array
    prior_accepted: jax.Array


def loop_inputs(c: LoopConfig, keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array,
                costs: jax.Array | LoopCosts, pause_at: jax.Array | None) -> LoopInputs:
    """The loop's `LoopInputs` from its costs (`LoopCosts`, or the cost vector float32
    [NUM_COST_INPUTS (+ L)] the compiled programs take: `LoopCosts.from_vector`) and the rest as
    `resume_adaptive` takes them."""
    named = costs if isinstance(costs, LoopCosts) else LoopCosts.from_vector(costs, c.draft_len)
    a = jnp.clip(named.acceptance, 0.0, 0.999)
    shape = (c.batch, c.draft_len)
    return LoopInputs(keys=keys, max_new=max_new, eos_ids=eos_ids, pause_at=pause_at, costs=named,
                      forced=named.forced_cap > 0, acceptance=a,
                      prior_reached=jnp.broadcast_to(a ** (c.positions - 1), shape),
                      prior_accepted=jnp.broadcast_to(a ** c.positions, shape))


def initial_state(c: LoopConfig, x: LoopInputs, state: DecodeState) -> AdaptiveState:
    """The loop's state on entry from the skeleton's: the memories at the prior (PRIOR_STEPS'
    worth; the long one and the cap's `LoopConfig.long_prior`), nothing pending but the draft's
    chunk, no choice made yet."""
    pending, pending_len = c.parts.pending(state.inner)
    prior_reached, prior_accepted, long_prior = x.prior_reached, x.prior_accepted, c.long_prior
    zero = jnp.zeros((), jnp.int32)
    return AdaptiveState(
        decode=state, reached=PRIOR_STEPS * prior_reached, accepted=PRIOR_STEPS * prior_accepted,
        long_reached=long_prior * prior_reached, long_accepted=long_prior * prior_accepted,
        cap_reached=long_prior * prior_reached, cap_accepted=long_prior * prior_accepted,
        long_steps=jnp.asarray(long_prior, jnp.float32), extra_prior=jnp.asarray(long_prior - PRIOR_STEPS, jnp.float32),
        forward_share=jnp.ones((), jnp.float32), spec_steps=zero, wait=zero, backoff=jnp.ones((), jnp.int32),
        pending=pending, pending_len=pending_len, pending_law=jnp.zeros(pending.shape, jnp.float32),
        cap=zero, pays=jnp.zeros((), bool), chosen=zero)


def running(x: LoopInputs, s: AdaptiveState) -> jax.Array:
    """bool []: whether the loop goes on (some row runs, and no pause: `paused`)."""
    return ~paused(s.decode.outputs, x.pause_at)


def fits(c: LoopConfig, s: AdaptiveState) -> jax.Array:
    """bool []: whether every running row has room for a speculative step (`room_gated` parts: a
    tree whose target cache has none past prompt + outputs; the rest always)."""
    if not room_gated(c.parts):
        return jnp.ones((), bool)
    cache = s.decode.tcache
    return jnp.all(s.decode.outputs.done | (cache.lengths + c.parts.room <= cache.capacity))


# ------------------------------------------------------------------------ the loop's decisions


def evidence(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> Evidence:
    """The small part of s the choices read (`Evidence`): the cap's memory is the long one unless
    it has its own (`LoopConfig.separate_cap_memory`)."""
    outputs = s.decode.outputs
    separate = c.separate_cap_memory
    return Evidence(running=~outputs.done, remaining=x.max_new - outputs.num_out, reached=s.reached,
                    accepted=s.accepted, long_reached=s.long_reached, long_accepted=s.long_accepted,
                    cap_reached=s.cap_reached if separate else s.long_reached,
                    cap_accepted=s.cap_accepted if separate else s.long_accepted,
                    probe_reached=s.long_reached - s.extra_prior * x.prior_reached,
                    forward_share=s.forward_share, chosen=s.chosen)


def pooled(c: LoopConfig, x: LoopInputs, reached: jax.Array, accepted: jax.Array, running_rows: jax.Array):
    """(reached, accepted, shape): per-row sums float32 [B, L], a row's own at batch 1, else pulled
    towards the running rows' (bool [B]) mean row (`toward_batch`), with (draft models) the
    batch's acceptance by position relative to its pooled one (`position_shape`; else None)."""
    if c.batch == 1:
        return reached, accepted, None
    shape = position_shape(reached, accepted, running_rows, x.acceptance) if c.shaped else None
    return *toward_batch(reached, accepted, running_rows, c.row_pooling), shape


def step_costs(c: LoopConfig, x: LoopInputs, e: Evidence) -> jax.Array:
    """Seconds of a speculative step by cap, float32 [L]: measured where the calibration timed the
    cap's step, else spec_step plus the draft forwards that ran (the cap's l - 1 times the running
    share, `AdaptiveState.forward_share`) at draft_forward each."""
    costs = x.costs
    forwards = e.forward_share * (c.positions - 1) if c.priced else 0 * c.positions
    linear = costs.spec_step + forwards * costs.draft_forward
    return linear if costs.cap_seconds is None else jnp.where(costs.cap_seconds > 0, costs.cap_seconds, linear)


def pays_at(c: LoopConfig, x: LoopInputs, e: Evidence, index: jax.Array, cost: jax.Array) -> jax.Array:
    """bool []: whether speculating at cap index + 1 (int32 []) pays, at step costs cost float32
    [L], from the short memory: the steps the batch needs times their cost against plain steps,
    each row's E raised by `noise_allowance` standard errors (with (1 + DECAY) R_1 the decayed
    sums' effective number of steps), so a chance dip of a few steps does not stop speculation
    that pays on average. Always under a forced cap."""
    reached, accepted, shape = pooled(c, x, e.reached, e.accepted, e.running)
    mean, sd = within_remaining(*tokens_moments(reached, accepted, x.acceptance, shape=shape), e.remaining)
    mean, sd = mean[:, index], sd[:, index]
    samples = jnp.maximum((1 + DECAY) * e.reached[:, 0], 1.0)
    steps = batch_steps(mean + c.noise_allowance * sd / jnp.sqrt(samples), sd, e.remaining, e.running)
    plain_steps = jnp.max(jnp.where(e.running, e.remaining, 0)).astype(jnp.float32)
    return x.forced | (steps * cost[index] <= plain_steps * x.costs.ar_step)


def best_cap_index(c: LoopConfig, x: LoopInputs, e: Evidence, cost: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(best, index) int32 []: the cap index finishing the batch soonest at step costs cost float32
    [L] (`cap_index`; zero costs under forced inputs: the longest), from the cap's memory, and the
    one to run: best, or where caps are dispatched at batch > 1 the next one up (`probe_up`). At
    batch 1 the positions past the current cap, which its steps never reach, are raised by EXPLORE
    standard errors; the ones it reaches are measured every step."""
    L = c.draft_len
    reached, accepted, shape = pooled(c, x, e.cap_reached, e.cap_accepted, e.running)
    unreached = jnp.arange(1, L + 1) > e.chosen + 1
    optimism = EXPLORE * unreached.astype(jnp.float32) if c.batch == 1 else 0.0
    mean, sd = within_remaining(*tokens_moments(reached, accepted, x.acceptance, optimism=optimism, shape=shape),
                                e.remaining)
    seconds = jnp.where(c.candidate, batch_steps(mean, sd, e.remaining, e.running) * cost, jnp.inf)
    best = cap_index(seconds, e.chosen, sticky=c.dispatch is not None)
    probes = c.dispatch is not None and c.batch > 1
    index = probe_up(best, c.candidate, e.probe_reached, e.running, seconds) if probes else best
    return best, index


def choose(c: LoopConfig, x: LoopInputs, e: Evidence) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cap int32 [], pays bool [], chosen int32 []): the cap (from the cap's memory: per-position
    estimates from a few steps are too noisy to pick a length with; parts that take no cap: L),
    whether speculation pays, judged at the best cap, not at a probe's (from the short memory),
    and the chosen cap's index. Under a forced cap, that cap."""
    cost = step_costs(c, x, e)
    if c.takes_cap:
        best, index = best_cap_index(c, x, e, cost)
    else:
        best = index = jnp.asarray(c.draft_len - 1, jnp.int32)
    cap = jnp.where(x.forced, jnp.minimum(x.costs.forced_cap, c.draft_len).astype(jnp.int32), index + 1)
    return cap, pays_at(c, x, e, best, cost), index


def decide(c: LoopConfig, x: LoopInputs, s: AdaptiveState, due: jax.Array | None = None) -> AdaptiveState:
    """s with its cap and whether it pays (`choose`), or where due (bool []) is False, s as it is.
    The `lax.cond` takes only the small `Evidence`: over s it would copy the KV caches."""
    if due is None:
        cap, pays, chosen = choose(c, x, evidence(c, x, s))
    else:
        cap, pays, chosen = jax.lax.cond(due, functools.partial(choose, c, x), lambda e: (s.cap, s.pays, s.chosen),
                                         evidence(c, x, s))
    return s.replace(cap=cap, pays=pays, chosen=chosen)


def recheck(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> AdaptiveState:
    """s with whether speculating pays at the last chosen cap: during plain steps the long memory,
    hence the cap, stays as it was, and a full `decide` per plain block costs more than it tells."""
    e = evidence(c, x, s)
    return s.replace(pays=pays_at(c, x, e, s.chosen, step_costs(c, x, e)))


def learn(c: LoopConfig, s: AdaptiveState, reached: jax.Array, hit: jax.Array,
          steps: jax.Array | None = None) -> AdaptiveState:
    """s with the memories updated by per-position counts float32 [B, L] worth `steps` float32 [B]
    speculative steps (None: one), the memories decayed once per step."""
    if steps is None:
        short, long, cap, weight = DECAY, LONG_DECAY, CAP_DECAY, 1.0
    else:
        short, long, cap, weight = (DECAY ** steps[:, None], LONG_DECAY ** steps[:, None],
                                    CAP_DECAY ** steps[:, None], jnp.max(steps))
    if c.separate_cap_memory:
        s = s.replace(cap_reached=cap * s.cap_reached + reached, cap_accepted=cap * s.cap_accepted + hit)
    return s.replace(reached=short * s.reached + reached, accepted=short * s.accepted + hit,
                     long_reached=long * s.long_reached + reached, long_accepted=long * s.long_accepted + hit,
                     long_steps=LONG_DECAY ** weight * s.long_steps + weight,
                     extra_prior=LONG_DECAY ** weight * s.extra_prior)


# --------------------------------------------------------------------------- the loop's steps


def forward_share(c: LoopConfig, s: AdaptiveState, verdict: Verdict) -> jax.Array:
    """float32 []: the running share of the cap's cap - 1 draft forwards a step ran (the early stop
    ends drafts sooner), updated by verdict's `draft_forwards` (kept where a step reports none)."""
    if verdict.draft_forwards is None or c.draft_len == 1:
        return s.forward_share
    ran = verdict.draft_forwards.astype(jnp.float32) / jnp.maximum(s.cap - 1, 1).astype(jnp.float32)
    return jnp.where(s.cap > 1, DECAY * s.forward_share + (1 - DECAY) * ran, s.forward_share)


def speculative_step(c: LoopConfig, x: LoopInputs, s: AdaptiveState, width: int | None = None) -> AdaptiveState:
    """One speculative step at the state's cap (parts that take one; width: the dispatched
    compiled cap, None: chosen per step), its tokens emitted and its counts learnt."""
    parts, d = c.parts, s.decode
    active = ~d.outputs.done
    cap = s.cap
    keys = step_keys(c.sampling, x.keys, d.step)
    if c.gated:
        verdict = parts.step(d, keys, active, gate=~x.forced)
    elif not c.takes_cap:
        verdict = parts.step(d, keys, active)
    elif width is None:
        verdict = parts.step(d, keys, active, cap=cap)
    else:
        verdict = parts.step(d, keys, active, cap=cap, width=width)
    d = advance(parts, d, verdict, active, x.max_new, x.eos_ids, drafted=True)
    recorded_cap = cap if c.takes_cap else jnp.asarray(c.draft_len, jnp.int32)
    if verdict.verified is not None:   # a gated step run plainly (one past L: not recorded)
        recorded_cap = jnp.where(verdict.verified, recorded_cap, c.draft_len + 1)
    d = d.replace(counters=d.counters.record_cap(recorded_cap))
    reached, hit = position_counts(verdict, active, c.draft_len)
    share = forward_share(c, s, verdict)
    return learn(c, s.replace(decode=d, spec_steps=s.spec_steps + 1, forward_share=share), reached, hit)


def plain_step(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> AdaptiveState:
    """One plain step (the target alone): its token emitted and appended to the pending buffer
    (with its target probability where the draft will score itself on it). Where nothing is
    measured while plain, the short memory moves towards the long one's per-step means at the
    speculative pace, so the loop probes again once they meet."""
    d = s.decode
    active = ~d.outputs.done
    verdict = c.parts.ar_step(d, step_keys(c.sampling, x.keys, d.step), active)
    d = advance(c.parts, d, verdict, active, x.max_new, x.eos_ids, drafted=False)
    rows = jnp.arange(s.pending.shape[0])
    slot = jnp.where(active, s.pending_len, s.pending.shape[1])
    pending = s.pending.at[rows, slot].set(verdict.next_token, mode="drop")
    s = s.replace(decode=d, pending=pending, pending_len=s.pending_len + active.astype(jnp.int32))
    if c.scored:
        s = s.replace(pending_law=s.pending_law.at[rows, slot].set(verdict.token_law, mode="drop"))
    if c.measures_plain:
        return s
    return s.replace(reached=DECAY * s.reached + s.long_reached / s.long_steps,
                     accepted=DECAY * s.accepted + s.long_accepted / s.long_steps)


def repeated(step: Callable, s: AdaptiveState, count: int) -> AdaptiveState:
    """`count` steps of `step` with no check between them: a loop whose trip count is static,
    which XLA:GPU runs without reading a predicate back to the host."""
    if count == 1:
        return step(s)
    return jax.lax.fori_loop(0, count, lambda _, s: step(s), s)


def speculative(c: LoopConfig, x: LoopInputs, s: AdaptiveState, width: int | None = None,
                count: int | None = None) -> AdaptiveState:
    """`count` speculative steps (None: a check's `steps_per_check`), then the choice of cap and
    whether speculation pays: after every block, or where the loop checks every step and dispatches
    its caps per run, after a phase's first step (a probe is judged on it) and every DECIDE_EVERY-th
    (the choice is many small ops, and a dispatched cap changes seldom)."""
    s = repeated(functools.partial(speculative_step, c, x, width=width), s,
                 c.steps_per_check if count is None else count)
    if c.steps_per_check > 1 or DECIDE_EVERY == 1 or c.dispatch is None:
        return decide(c, x, s)
    return decide(c, x, s, due=(s.spec_steps - 1) % DECIDE_EVERY == 0)


def room_for_a_block(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> jax.Array:
    """bool []: whether the running row with the most tokens left cannot finish inside a block of
    `steps_per_check` speculative steps at the current cap (the rest of its steps would run idle)."""
    outputs = s.decode.outputs
    left = jnp.max(jnp.where(outputs.done, 0, x.max_new - outputs.num_out))
    return left > (c.steps_per_check - 1) * (s.cap + 1)


def speculative_run(c: LoopConfig, x: LoopInputs, loop_while: Callable, s: AdaptiveState,
                    width: int | None = None) -> AdaptiveState:
    """Speculative steps while loop_while(s). Where checks come every few steps (GPU), a phase's
    first step runs alone and is decided on, as every backend decides after a phase's first step
    (a call's first cap comes from the prior, and a block there would weigh several steps before
    any choice), and the call's tail runs one step at a time once the running row with the most
    tokens left could finish inside a block (`room_for_a_block`). Each costs a read back per turn,
    for a few steps a call."""
    step = functools.partial(speculative, c, x, width=width)
    if c.steps_per_check == 1:
        return jax.lax.while_loop(loop_while, step, s)
    single = functools.partial(speculative, c, x, width=width, count=1)
    s = jax.lax.while_loop(lambda s: loop_while(s) & (s.spec_steps == 0), single, s)
    s = jax.lax.while_loop(lambda s: loop_while(s) & room_for_a_block(c, x, s), step, s)
    return jax.lax.while_loop(loop_while, single, s)


def plain(c: LoopConfig, x: LoopInputs, s: AdaptiveState, count: int) -> AdaptiveState:
    """A block of `count` plain steps, then what it teaches: nothing before the draft's scored
    catch-up (`scored` parts); for retrieval, the draft a speculative step would have verified at
    the block's start walked with the block's tokens (one speculative step's worth of evidence per
    block, `ssd_jax.loop.shadow`; none from a gated row whose draft retrieved nothing, which a
    speculative step would not have verified), then a new choice; else whether speculation pays
    now."""
    if c.scored:
        return repeated(functools.partial(plain_step, c, x), s, count)
    if not c.shadows:
        return recheck(c, x, repeated(functools.partial(plain_step, c, x), s, count))
    tree_tokens, valid, parents = c.parts.shadow_tree(s.decode.inner)
    start_len = s.pending_len
    s = repeated(functools.partial(plain_step, c, x), s, count)
    slots = jnp.minimum(start_len[:, None] + jnp.arange(count)[None, :], s.pending.shape[1] - 1)
    emitted = jnp.take_along_axis(s.pending, slots, axis=1)
    counted = c.parts.retrieved(valid) if c.gated else None
    counts = shadow_counts(tree_tokens, valid, parents, emitted, s.pending_len - start_len, c.draft_len, counted)
    return decide(c, x, learn(c, s, *counts))


def plain_blocks(c: LoopConfig, x: LoopInputs, s: AdaptiveState, count: int) -> AdaptiveState:
    """Blocks of `count` plain steps while speculation does not pay (or a tree lacks room), the
    block fits in the pending buffer and (blocks longer than a check's) before any running row
    would finish inside it."""
    room = s.pending.shape[1] - count

    def more(s: AdaptiveState) -> jax.Array:
        go = running(x, s) & (~s.pays | ~fits(c, s)) & (jnp.max(s.pending_len) <= room)
        if count > c.steps_per_check:
            outputs = s.decode.outputs
            go &= jnp.min(jnp.where(outputs.done, count, x.max_new - outputs.num_out)) >= count
        return go

    return jax.lax.while_loop(more, functools.partial(plain, c, x, count=count), s)


# -------------------------------------------------------------------------- the loop's phases


def speculating(c: LoopConfig, x: LoopInputs, probe: jax.Array, s: AdaptiveState) -> jax.Array:
    """bool []: whether the next step speculates: some row runs, every row has room, and the
    choice says it pays or (probe) the phase has not yet run its probe."""
    return running(x, s) & fits(c, s) & ((probe & (s.spec_steps == 0)) | s.pays)


def at_dispatched_width(c: LoopConfig, x: LoopInputs, loop_while: Callable, i: int,
                        s: AdaptiveState) -> AdaptiveState:
    """Speculative steps compiled at the i-th dispatched cap while loop_while(s) and the chosen
    cap's narrowest dispatched width is that one."""
    def here(s: AdaptiveState) -> jax.Array:
        return loop_while(s) & (narrowest(c.dispatch, s.cap) == i)

    return speculative_run(c, x, here, s, width=c.dispatch[i])


def speculative_phase(c: LoopConfig, x: LoopInputs, s: AdaptiveState, probe: jax.Array) -> AdaptiveState:
    """The phase's speculative steps while they pay (probe bool []: at least one, a probe). Parts
    that dispatch their caps get them chosen once per run of steps at the same cap (a `lax.switch`
    around a `while_loop`), not per step: a switch per step passes the KV caches through a
    conditional, which XLA:CPU copies, while the cap changes seldom."""
    loop_while = functools.partial(speculating, c, x, probe)
    s = s.replace(spec_steps=jnp.zeros((), jnp.int32))
    if c.dispatch is None:
        return speculative_run(c, x, loop_while, s)
    runs = [functools.partial(at_dispatched_width, c, x, loop_while, i) for i in range(len(c.dispatch))]
    return jax.lax.while_loop(loop_while, lambda s: jax.lax.switch(narrowest(c.dispatch, s.cap), runs, s), s)


def after_speculation(c: LoopConfig, x: LoopInputs, s: AdaptiveState, probe: jax.Array) -> AdaptiveState:
    """s after the phase's speculative steps: a probe that did not pay doubles the phases until
    the next one (up to MAX_BACKOFF), any speculation that paid resets it; the pending buffer
    starts from the draft's unread tokens."""
    failed = probe & (s.spec_steps == 1)
    if x.pause_at is not None:   # a probe that paid, stopped by a pause, did not fail
        failed &= ~s.pays | ~paused(s.decode.outputs, x.pause_at)
    backoff = jnp.where(failed, jnp.minimum(2 * s.backoff, MAX_BACKOFF), jnp.where(s.spec_steps > 0, 1, s.backoff))
    wait = jnp.where(s.spec_steps > 0, backoff - 1, s.wait - 1)
    s = s.replace(backoff=backoff, wait=wait)
    pending, pending_len = c.parts.pending(s.decode.inner)
    return s.replace(pending=pending, pending_len=pending_len, pending_law=jnp.zeros_like(s.pending_law))


def catch_up(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> AdaptiveState:
    """The draft reads the tokens it missed (`resync`). Parts that score it there learn from
    every token a plain step drew as a speculative step starting there, each worth 1 / PLAIN_BLOCK
    steps (as much evidence per plain token as retrieval's shadow walks), then choose again."""
    parts = c.parts
    if not c.scored:
        return s.replace(decode=s.decode.replace(inner=parts.resync(s.decode.inner, s.pending, s.pending_len)))
    inner, acceptance, known = parts.scored_resync(s.decode.inner, s.pending, s.pending_len, s.pending_law, x.keys)
    reached, hit, steps = chain_counts(acceptance, known, c.draft_len)
    s = learn(c, s.replace(decode=s.decode.replace(inner=inner)), reached / PLAIN_BLOCK, hit / PLAIN_BLOCK,
              steps / PLAIN_BLOCK)
    return decide(c, x, s)


def phase(c: LoopConfig, x: LoopInputs, s: AdaptiveState) -> AdaptiveState:
    """One turn of the loop: speculative steps while they pay (at least one, a probe, once the
    backoff's wait is over, unless the loop measures while plain), plain blocks while they do not
    (single check blocks near the end of the call and to fill the pending buffer), then the draft
    reads what it missed."""
    probe = (s.wait <= 0) & (not c.measures_plain)
    s = speculative_phase(c, x, s, probe)
    s = after_speculation(c, x, s, probe)
    s = plain_blocks(c, x, s, c.plain_block)
    if c.plain_block > c.steps_per_check:
        s = plain_blocks(c, x, s, c.steps_per_check)
    return catch_up(c, x, s)


# ------------------------------------------------------------------------------- entry points


def run_adaptive(parts: AdaptiveParts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                 keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array | LoopCosts, *,
                 sampling: SamplingParams, out_size: int, placement=None) -> DecodeState:
    """`ssd_jax.loop.skeleton.run` with the per-step cap and the fallback to plain decoding.
    parts: `SpeculativeParts`, `RetrievalParts` or `CascadeParts` with pending_width > 0; costs:
    `LoopCosts`, or the float32 vector [NUM_COST_INPUTS (+ L)] the compiled programs take
    (`LoopCosts.from_vector`). Returns the final DecodeState."""
    state = begin_adaptive(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, costs, sampling=sampling,
                           out_size=out_size, placement=placement)
    return resume_adaptive(parts, tparams, keys, max_new, eos_ids, costs, state, sampling=sampling).decode


def begin_adaptive(parts: AdaptiveParts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                   keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array | LoopCosts, *,
                   sampling: SamplingParams, out_size: int, placement=None) -> AdaptiveState:
    """Prefill, the first token and the adaptive loop's state on entry (its memories at the prior,
    the first choice made): `run_adaptive`'s arguments, no step taken."""
    state = start(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, sampling=sampling,
                  out_size=out_size, placement=placement)
    c = LoopConfig.make(parts, tparams, sampling, tokens.shape[0])
    x = loop_inputs(c, keys, max_new, eos_ids, costs, pause_at=None)
    return decide(c, x, initial_state(c, x, state))


def resume_adaptive(parts: AdaptiveParts, tparams: dict, keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array,
                    costs: jax.Array | LoopCosts, state: AdaptiveState, pause_at: jax.Array | None = None, *,
                    sampling: SamplingParams) -> AdaptiveState:
    """The adaptive loop from `state` (`begin_adaptive`'s, or a paused one) until every row is
    done, or where pause_at (int32 []) is given, until every row is done or holds pause_at tokens
    (`ssd_jax.loop.skeleton.paused`): the phase running then ends as at a call's end (the draft
    reads the tokens it missed), and a later call goes on from the state returned. A pause changes
    the loop's later choices, never what they may depend on: the output law stays the target's
    (at T=0 the tokens are the same)."""
    c = LoopConfig.make(parts, tparams, sampling, state.decode.cur.shape[0])
    x = loop_inputs(c, keys, max_new, eos_ids, costs, pause_at)
    return jax.lax.while_loop(functools.partial(running, x), functools.partial(phase, c, x), state)
