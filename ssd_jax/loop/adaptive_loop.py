"""The decode loop of adaptive speculation: speculative steps while they pay, plain decoding
while they do not, all inside one jitted program (no host round trip).

    while some row runs:
        speculative steps while they pay (at least one, a probe, unless backing off; parts that
            measure while decoding plainly never probe), each
            drafting up to the length that pays best (parts with `dispatch_caps`: one compiled
            step per cap, chosen once per run of steps at the same cap)
        plain decoding steps while speculation does not pay (checked every PLAIN_BLOCK steps,
            single steps near the end), the draft falling behind by at most `pending_width` tokens
        the draft reads the tokens it missed (one forward; parts with `learns_while_plain` score
            it on them there)

The loop keeps, per row and draft position k, decayed sums of how often a step's draft reached
k (R_k) and had its k-th token accepted (A_k); alpha_k = A_k / R_k is the row's acceptance at k
given k was reached, and a draft capped at l tokens emits

    E(l) = 1 + sum_{k<=l} prod_{j<=k} alpha_j      tokens per step (sd(l) its spread).

With the measured costs c = (AR step, speculative step with no draft forward after its catch-up,
one draft forward) (`ssd_jax.tuning.cost_model.loop_inputs`), rho the running share of the cap's
draft forwards that ran (the early stop ends drafts sooner), a step capped at l costs
cost(l) = c_spec + rho (l - 1) c_draft, or where the calibration timed the step at cap l
itself (parts drafting with a model), that time. A batch runs until its slowest row is done, so
a cap is judged by the steps the batch still needs, the most any running row needs for its r
remaining tokens:

    steps(l) = max_rows  r / E(l) + z_B sqrt(r) sd(l) / E(l)^1.5

(the renewal count's mean and its spread; z_B the expected largest of B standard normals, B the
running rows: 0 for one row; E and sd those of cap min(l, r - 1), the tokens the row can keep,
`within_remaining`). Rows differ: at batch 8 on held-out code one prompt's row needed
57 steps at L=4 where the mean row needed 36, so a cap chosen from the mean row's acceptance
(4-8) lost to L=2 by 20-30%.

    cap = the l with the least steps(l) cost(l) (long memory; where a batch of rows caps its
          drafts with a model at T=0, a shorter one, CAP_DECAY; at batch 1 each alpha_k past the
          current cap raised by EXPLORE standard errors), or the current one unless that is
          SWITCH_MARGIN faster where caps are dispatched per run of steps, and there at batch > 1
          the next cap up for a run of steps whenever what the batch knows of the first position
          the current cap never reaches has decayed and the next cap is priced near it
          (`probe_up`); parts with `takes_cap`, else their static L: SD and BV with one path, PLD
          and CSD, whose longer caps verify wider, c_draft then being a verified token's cost
    pays:  steps(cap) cost(cap) <= max_rows r c_ar, with each row's E(cap) raised by Z sd / sqrt(n)
           (not for retrieval, which keeps measuring while it decodes plainly: below)

(at batch > 1 each row's sums are pulled towards the batch's mean row by ROW_POOLING steps,
RETRIEVAL_ROW_POOLING for retrieval, and for draft models a position's pull towards the row's
pooled acceptance is scaled by the batch's acceptance there over its pooled one,
`position_shape`), with n the row's short memory's effective number of steps: the noise
allowance keeps a chance dip of a few steps from stopping speculation that pays on average,
while a draft that is truly bad (E near 1, small spread) falls back after a few steps.
At batch 1 these are the ratios E(l) / cost(l) against the break-even 1 / c_ar. Where the loop
checks every step and dispatches caps per run, the cap and whether it pays are decided after a
phase's first speculative step and every DECIDE_EVERY-th; elsewhere after every step (on GPU,
after a phase's first step, run alone, and then every check: `speculative_run`).

The sums are a short memory (DECAY per speculative step) that reverts to a long one (LONG_DECAY)
during plain steps: a bad stretch of text sends the loop to plain decoding, and it probes again
once the short memory is back near the long one (at once where speculation pays on average,
after up to `pending_width` - 1 tokens where it does not). A probe (one speculative step) that
does not pay doubles the number of plain phases before the next probe, up to MAX_BACKOFF, so
text where speculation never pays costs few probes. Retrieval (`shadow_tree`: drafts that are
point masses read off the context) needs none: each block of plain steps walks the draft made at
its start with the tokens the block drew, which has the law of a speculative step's verdict
(`ssd_jax.loop.shadow`), so the memories keep measuring while the loop decodes plainly, the
cap and whether to speculate are decided after every block, and speculation resumes where the
text turns copyable (PLD at batch 8 on CPU, paired: short prompts at T=0 1.05x AR against 0.99x
with probes; LogitSpec on held-out code at T=0 1.03x against 0.91x). Draft models need none where
their acceptance is token-wise (SD; every method at T=0; CSD's largest drafter, whose review
gives the draft its law): plain steps record the target's probability of each token they draw,
and when the draft catches up it scores itself on them (`chain_counts`: every token a speculative
step starting there, each worth 1 / PLAIN_BLOCK steps), then the loop decides. Both memories
start from PRIOR_STEPS steps at the plan's acceptance (the long one from BATCH_PRIOR_STEPS where a
batch of rows caps its drafts with a model). Each alpha_k is shrunk towards the
acceptance pooled over positions by POOLING steps' worth, so a position whose estimate fell low
by chance (and that shorter caps then stop measuring) drifts back and is tried again.

The choices use only past steps and the costs, never the current step's target probabilities,
so the output law is the target's whatever they decide.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.backend import policy_for
# compiled_caps, with_one and PENDING_WIDTH are re-exported for `ssd_jax.tuning` and the tests.
from ssd_jax.loop.caps import PENDING_WIDTH, compiled_caps, narrowest, with_one  # noqa: F401
from ssd_jax.loop.costs import NUM_COST_INPUTS, LoopCosts  # noqa: F401  (NUM_COST_INPUTS re-exported)
from ssd_jax.loop.shadow import chain_counts, shadow_counts
from ssd_jax.loop.skeleton import AdaptiveParts, DecodeState, Verdict, advance, fold_rows, paused, room_gated, start
from ssd_jax.models.config import ModelConfig
from ssd_jax.sampling import SamplingParams

# Weight of the past in the running sums and averages (per speculative step), and how many
# steps' worth of evidence the prior acceptance counts for.
DECAY = 0.9
LONG_DECAY = 0.98
PRIOR_STEPS = 2.0
# ... and for the long memory, which chooses the cap, where a batch of rows drafts with a model
# and caps its drafts: the plan's acceptance is what earlier calls of the pair measured, and at
# batch > 1 (no EXPLORE, caps dispatched per run of steps) a switch made on a call's first steps
# holds. Short prompts accept less over their first ~12 steps (CSD at batch 8, T=0: the mean row's
# E(4) fell from 3.32 to 2.77), and with 2 steps' worth of prior the loop left cap 4 for cap 2 and
# stayed there: 56 steps where fixed L=4 took 44 (0.93 of it); with 4 steps' worth, 44. SD at
# batch 8 on badguess went from 74 to 65 steps (fixed L=2: 64); 3 steps' worth was not enough
# (short 57); 6 drafted longer on badguess, where L=4 buys nothing (mean draft 3.70 against 2.79
# at the same 63 steps). Step counts with one calibration shared by the runs (AMD VM). `probe_up`
# still counts the prior at PRIOR_STEPS' worth (`extra_prior`): what it waits for is measurement.
BATCH_PRIOR_STEPS = 4.0
# The fall back's noise allowance, in standard errors of the short memory's tokens per step (at
# T=1 a step's tokens vary by ~1.5 around ~3, so a 10-step memory dips below break-even by
# chance; without it SD fell back on 20-30% of the steps of sets where every fixed L paid).
Z = 1.0
# Weight of the past in the memory that chooses the cap where a batch of rows caps its drafts with a
# model at T=0 (SD, BV, CSD at batch > 1; elsewhere the long memory chooses it). The batch runs at its
# slowest row's pace, and on short prompts the row that sets it accepts far less over its first
# ~20 tokens than over the rest (CSD at batch 8, T=0: E(2) 1.91 and E(4) 2.20 after 8 steps, where
# its whole call took 58 steps at L=2 and 44 at L=4): the long memory's ~50 steps held the batch
# at cap 2 for 43 of 57 steps where fixed L=4 took 44. A memory of ~12 steps lets that start fade.
# The long memory stays what the fall back reverts to and what `probe_up` reads: with 0.92 for both,
# CSD's short prompts read 0.976 of L=4 but a call on badguess fell back for 75% of its steps (0.79
# of L=2); with the probes reading this memory, badguess read 0.936. Priced under one replayed
# calibration per method (batch 8, T=0, the 12 cells of SD, BV and CSD): worst cell 0.943 against
# 0.912, mean 0.981 against 0.972 (benchmarks/adaptive_notes.md, twelfth session). Not at T > 0,
# where each step's acceptance also carries the sampling's noise, which ~12 steps of 8 rows do not
# average out: SD at batch 8 on code at T=1 went to cap 1 (mean draft 1.09), 0.955 of fixed L=2,
# where the long memory keeps cap 2 (1.00 of it).
CAP_DECAY = 0.92
# Steps' worth of pull of each position's acceptance towards the pooled one (POOLING = 2 left
# SD's caps at 3.2 where L = 4-5 measured best at T=1; 8 brought them to 4.2).
POOLING = 8.0
MAX_BACKOFF = 8
# At batch 1 the cap is chosen with each position's acceptance raised by this many standard errors
# of its long-memory estimate: positions past the current cap are not measured, so a few unlucky
# steps at cap 4 left SD at cap 2 for most of a call where 4 paid 45% more (held-out code, T=0: 48
# steps at a mean draft of 2.9 against fixed L=4's 33); as their evidence decays the bonus grows
# and the longer cap is tried again. (It replaced leaning to the longest cap within 3% of the
# best, which drafted too long: mean 5.4 where L=4 won.) Only the positions past the current cap:
# raising the measured ones too lifted a long cap's estimate by a few percent per position, and at
# T=1 SD drafted 5.5-6.2 where fixed L=4 won (0.94-0.96 of it on short and repeat; 0.98 now, AMD
# VM, 7 paired rounds). Not at batch > 1, where 8 rows measure the positions and longer caps make
# the batch wait for its unluckiest row.
EXPLORE = 0.5
# Steps' worth of pull of each row's sums towards the batch's mean row (batch > 1): the largest
# of 8 rows' few-step estimates is mostly chance, and it would stop speculation that pays.
ROW_POOLING = 4.0
# ... and for retrieval, whose rows' acceptance drifts towards the batch's over a call (the text a
# row generates becomes copyable as it grows): at batch 8 on badguess at T=0 the rows the loop
# measured lowest (1.5 tokens per step at cap 2) set the batch's pace and kept it at cap 1, where
# fixed L=2, whose slowest row averaged 1.9, ran 1.2x faster (AMD VM, 7 paired rounds: auto 1.14x
# AR at 4, 1.31-1.33x at 8 against L=2's 1.34x, 1.25-1.35x at 16, 1.14x at 32, capping longer).
RETRIEVAL_ROW_POOLING = 8.0
# Parts that dispatch their caps once per run of steps (`dispatch_caps`) change cap only for one
# that is faster by this share: leaving one compiled step's loop for another's passes the KV caches
# through a conditional, and between two caps of nearly equal speed the loop flipped every few steps.
SWITCH_MARGIN = 0.05
# Where caps are dispatched per run of steps at batch > 1 (no EXPLORE there), a run at the next cap
# up whenever the batch's long-memory evidence at the first position the current cap never reaches
# has decayed below this many steps' worth (`probe_up`): DECIDE_EVERY steps every ~50 at cap c + 1.
# BV at batch 8 on CPU then left cap 1 (0.89-1.03 of the best fixed length, six sets below 0.95
# before, two after); over SD's and BV's cells, 0.982 of the best at T=0 against 0.963 before,
# 0.975 at T=1 against 0.966 (benchmarks/adaptive_notes.md).
PROBE_BELOW = 1.0
# ... and only where the model prices the next cap within this share of the current one: a probe
# settles near ties, and a dearer cap's probe only costs. CSD at batch 8 probed its longest cap
# (8 at T=0, 6 at T=1) from cap 4, a step 1.2-1.5x as long: without probes its four cells on code
# and short read 0.93-0.97 of the best fixed length, 0.88-0.91 with them (7 paired rounds each).
PROBE_WITHIN = 0.1
# Where the loop checks every step (`adaptive_steps_per_check` 1) and dispatches its caps per run
# of steps, the speculative steps between its choices of cap and fall back: the choice is ~60
# small ops, which at batch 1 on CPU cost 8% of SD's step (code, T=0, forced cap 4 with caps
# dispatched: 0.89 of fixed L=4; 0.97 without the choice), and a dispatched cap changes seldom
# anyway. Where each step picks its own width (PLD, LogitSpec), the choice follows bursts of
# text that retrieval copies: PLD on code at T=0 ran 0.94 of L=4 choosing every 4 steps, 1.00
# every step.
DECIDE_EVERY = 4
# Plain steps between checks of whether speculation pays, on every backend (each check is a few
# tens of small ops: at batch 8 on CPU, checking every plain step cost PLD's fallback ~3% of AR).
PLAIN_BLOCK = 4


def probe_up(index: jax.Array, candidate: jax.Array, long_reached: jax.Array, running: jax.Array,
             seconds: jax.Array) -> jax.Array:
    """The cap index to run (int32 []): the next candidate above `index` (int32 []; candidate
    bool [L]) where the running rows' (bool [B]) mean long-memory evidence at that cap's first
    new position (long_reached float32 [B, L]) has decayed below PROBE_BELOW steps' worth and
    its seconds to finish the batch (seconds float32 [L]) are within PROBE_WITHIN of index's,
    else index. A step at cap c never reaches position c + 1, so what the loop knows of it is pooled
    from the positions it measures; acceptance clusters (a token after an accepted one is the
    likelier accepted), so the pooled guess runs low and a near tie between c and the next cap
    stays at c (at batch 8, caps near 1 where fixed L=2 ran 10-15% faster)."""
    later = candidate & (jnp.arange(candidate.shape[0]) > index)
    has_next = jnp.any(later)
    nxt = jnp.where(has_next, jnp.argmax(later), index).astype(jnp.int32)
    weight = running.astype(jnp.float32) / jnp.maximum(jnp.sum(running), 1)
    evidence = jnp.sum(long_reached[:, jnp.minimum(index + 1, candidate.shape[0] - 1)] * weight)
    near = seconds[nxt] <= (1 + PROBE_WITHIN) * seconds[index]
    return jnp.where(has_next & (evidence < PROBE_BELOW) & near, nxt, index).astype(jnp.int32)


def cap_index(seconds: jax.Array, current: jax.Array, sticky: bool) -> jax.Array:
    """The index (int32 []) of the cap a step runs at, from the seconds to finish the batch by
    cap (float32 [L], inf where l is no candidate): the fastest (the longest of exact ties), or
    where `sticky` (caps dispatched once per run of steps) the current index (int32 []) unless the
    fastest is SWITCH_MARGIN faster than it."""
    index = seconds.shape[-1] - 1 - jnp.argmin(seconds[::-1])
    if sticky:
        index = jnp.where(seconds[current] * (1 - SWITCH_MARGIN) <= seconds[index], current, index)
    return jnp.asarray(index, jnp.int32)


@struct.dataclass
class AdaptiveState:
    """decode: the skeleton's DecodeState; reached, accepted float32 [B, L]: decayed sums over
    speculative steps of whether the row's draft reached position k / had its k-th token
    accepted; long_reached, long_accepted: the same with the long memory, over long_steps
    float32 [] steps; cap_reached, cap_accepted: the same with the memory that chooses the cap
    (CAP_DECAY where a batch caps its drafts with a model at T=0; elsewhere unused, the long
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


def pooled_acceptance(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """The acceptance pooled over all positions, float32 [..., 1], from per-position sums float32
    [..., L] (no evidence at all: the prior acceptance)."""
    tiny = 1e-6
    return ((jnp.sum(accepted, axis=-1, keepdims=True) + tiny * prior)
            / (jnp.sum(reached, axis=-1, keepdims=True) + tiny))


def reach_probabilities(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                        optimism: float | jax.Array = 0.0, shape: jax.Array | None = None) -> jax.Array:
    """P(a step emits more than k tokens) = prod_{j<=k} alpha_j for k = 1..L, float32 [..., L],
    from the per-position sums float32 [..., L] (a row's, or one per row), each shrunk towards
    the acceptance pooled over all positions by POOLING steps' worth (no evidence at all: the
    prior acceptance), times shape_k where given (float32 [L], `position_shape`). Without the
    pull, a position whose estimate fell low by chance is no longer drafted, so never corrected:
    the caps would drift short. optimism: each alpha_k raised by that many standard errors,
    sqrt(alpha (1 - alpha) / n_k) with n_k = R_k + POOLING."""
    pooled = pooled_acceptance(reached, accepted, prior)
    if shape is not None:
        pooled = jnp.clip(pooled * shape, 0.0, 1.0)
    alpha = jnp.clip((accepted + POOLING * pooled) / (reached + POOLING), 0.0, 1.0)
    alpha = jnp.minimum(alpha + optimism * jnp.sqrt(alpha * (1 - alpha) / (reached + POOLING)), 1.0)
    return jnp.cumprod(alpha, axis=-1)


def expected_tokens_by_cap(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """E(l) for l = 1..L, float32 [..., L]."""
    return 1 + jnp.cumsum(reach_probabilities(reached, accepted, prior), axis=-1)


def tokens_moments(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                   optimism: float | jax.Array = 0.0, shape: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(E(l), sd(l)) for l = 1..L, float32 [..., L] each: the mean and spread of the tokens a step
    capped at l emits, under the per-position model (`reach_probabilities`): E = 1 + sum_k P_k,
    E[T^2] = 1 + sum_k (2k + 1) P_k over k <= l."""
    p = reach_probabilities(reached, accepted, prior, optimism, shape)
    k = jnp.arange(1, reached.shape[-1] + 1, dtype=jnp.float32)
    mean = 1 + jnp.cumsum(p, axis=-1)
    second = 1 + jnp.cumsum((2 * k + 1) * p, axis=-1)
    return mean, jnp.sqrt(jnp.maximum(second - mean * mean, 0.0))


def tokens_mean_and_spread(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                           cap: jax.Array, shape: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(E, sd) of the tokens a step capped at `cap` emits, float32 [...] each."""
    mean, sd = tokens_moments(reached, accepted, prior, shape=shape)
    return mean[..., cap - 1], sd[..., cap - 1]


def within_remaining(mean: jax.Array, sd: jax.Array, remaining: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E(l), sd(l)) by cap l = 1..L, float32 [B, L] each, of the tokens a step emits that its row
    keeps: a row with r tokens left (remaining int32 [B]) keeps at most r, and min(T_l, r) =
    T_min(l, r - 1), so cap l counts as cap min(l, r - 1) there (cap 0: one token, no spread).
    Without it the call's last steps priced a long cap's tokens the row can never keep: at one
    token left SD drafted 8 tokens for it (a step at r / E(8) < 1 steps), where a plain step
    costs half as much."""
    length = mean.shape[-1]
    caps = jnp.minimum(jnp.arange(1, length + 1)[None, :], jnp.clip(remaining, 1, length + 1)[:, None] - 1)
    index = jnp.maximum(caps - 1, 0)
    kept = jnp.where(caps > 0, jnp.take_along_axis(mean, index, axis=-1), 1.0)
    return kept, jnp.where(caps > 0, jnp.take_along_axis(sd, index, axis=-1), 0.0)


def expected_largest_normal(count: jax.Array) -> jax.Array:
    """The expected largest of `count` standard normal draws (Blom's approximation,
    Phi^-1((n - 0.375) / (n + 0.25))): 0 for one, 0.59 for two, 1.43 for eight (exactly: 1.42)."""
    n = jnp.maximum(count, 1).astype(jnp.float32)
    return jax.scipy.special.ndtri((n - 0.375) / (n + 0.25))


def batch_steps(mean: jax.Array, sd: jax.Array, remaining: jax.Array, running: jax.Array) -> jax.Array:
    """The steps the batch still needs, float32 [...]: the most any running row needs for its
    remaining tokens at mean +- sd tokens per step (mean, sd float32 [B, ...]; remaining int32 [B];
    running bool [B]): r / mean + z_B sqrt(r) sd / mean^1.5, with z_B the expected largest of the
    running rows' standardised spreads (`expected_largest_normal`), at most r (a step emits at
    least one token: at a large batch the spread term alone had counted more)."""
    extra = (mean.ndim - 1) * (None,)
    r = jnp.maximum(remaining, 0).astype(jnp.float32)[(slice(None),) + extra]
    mean = jnp.maximum(mean, 1.0)
    z = expected_largest_normal(jnp.sum(running))
    steps = jnp.minimum(r / mean + z * jnp.sqrt(r) * sd / mean ** 1.5, r)
    return jnp.max(jnp.where(running[(slice(None),) + extra], steps, 0.0), axis=0)


def toward_batch(reached: jax.Array, accepted: jax.Array, running: jax.Array,
                 pooling: float = ROW_POOLING) -> tuple[jax.Array, jax.Array]:
    """Per-row sums float32 [B, L] with `pooling` steps of the running rows' (bool [B]) mean
    row added to each row's."""
    weight = running.astype(jnp.float32)[:, None] / jnp.maximum(jnp.sum(running), 1)
    mean_reached = jnp.sum(reached * weight, axis=0)
    mean_accepted = jnp.sum(accepted * weight, axis=0)
    per_step = pooling / jnp.maximum(mean_reached[0], 1e-6)
    return reached + per_step * mean_reached, accepted + per_step * mean_accepted


def position_shape(reached: jax.Array, accepted: jax.Array, running: jax.Array, prior: jax.Array) -> jax.Array:
    """The batch's acceptance at each position over its acceptance pooled over positions, float32
    [L], from the running rows' (bool [B]) sums float32 [B, L] (each position shrunk towards the
    pooled one by POOLING of the batch's steps): what a row's estimates are pulled towards, times
    the row's own pooled acceptance. Acceptance clusters (a token after an accepted one is the
    likelier accepted), so a row's pooled acceptance, mostly position 1's, prices the positions
    past a cap low; a step at cap c never reaches c + 1, and after a few steps' probe there the
    rows' own few reaches left that low guess outweighing what the 8 rows measured: a batch of 8
    settled at cap 1 where L=2 ran 9% faster."""
    rows = running.astype(jnp.float32)[:, None]
    batch_reached = jnp.sum(reached * rows, axis=0)
    batch_accepted = jnp.sum(accepted * rows, axis=0)
    pooled = pooled_acceptance(batch_reached, batch_accepted, prior)
    alpha = (batch_accepted + POOLING * pooled) / (batch_reached + POOLING)
    return alpha / jnp.maximum(pooled, 1e-6)


def position_counts(verdict, active: jax.Array, draft_len: int) -> tuple[jax.Array, jax.Array]:
    """Whether each row in `active` (bool [B]) had its draft reach each position 1..L this step
    and its token there accepted, float32 [B, L] each (a row reaches k when it proposed k tokens
    and the first k - 1 were accepted). A row that proposed nothing (retrieval that found no
    match, a draft unsure of its first token) counts as reaching 1 and missing there: its step
    emitted one token at a speculative step's cost, and a model that took it for no evidence
    kept PLD speculating at T=1 on batches of 8 where 36% of its steps proposed anything."""
    k = jnp.arange(1, draft_len + 1, dtype=jnp.int32)[None, :]
    drafted = verdict.drafted if verdict.drafted is not None else jnp.full_like(verdict.accepted, draft_len)
    accepted = verdict.accepted[:, None]
    rows = active[:, None]
    reached = rows & ((drafted[:, None] >= k) | (k == 1)) & (accepted >= k - 1)
    hit = rows & (accepted >= k)
    return reached.astype(jnp.float32), hit.astype(jnp.float32)


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
    def batch_caps_with_model(self) -> bool:
        """Whether a batch of rows caps its drafts with a model (SD, BV and CSD at batch > 1)."""
        return self.batch > 1 and self.takes_cap and not self.shadows

    @property
    def long_prior(self) -> float:
        """The steps' worth of prior the long memory starts from (`BATCH_PRIOR_STEPS`)."""
        return BATCH_PRIOR_STEPS if self.batch_caps_with_model else PRIOR_STEPS

    @property
    def separate_cap_memory(self) -> bool:
        """Whether a memory of its own (CAP_DECAY) chooses the cap: a batch capping its drafts with
        a model at T=0; elsewhere the long memory chooses it."""
        return self.batch_caps_with_model and self.sampling.greedy

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
    def plain_block(self) -> int:
        """Plain steps between checks of whether speculation pays."""
        return max(self.steps_per_check, PLAIN_BLOCK)


@struct.dataclass
class LoopInputs:
    """The adaptive loop's traced inputs, the same at every step, and what it derives from them
    once on entry. keys uint32 [B, 2], max_new int32 [], eos_ids int32 [E]: as the skeleton's
    `run`; pause_at int32 [] or None: as `resume_adaptive`'s; costs: `LoopCosts`; candidate bool
    [L]: the caps the loop may choose, 1 and the compiled caps (a step verifies at the narrowest
    compiled width holding its drafts, so a cap between two compiled ones costs the wider one's
    step, which the linear price under-prices); forced bool []: costs.forced_cap > 0; positions
    float32 [L]: 1..L; acceptance float32 []: costs.acceptance clipped to [0, 0.999];
    prior_reached, prior_accepted float32 [B, L]: one step's worth of sums at that acceptance
    (a^(k-1) and a^k at position k); zero int32 []."""

    keys: jax.Array
    max_new: jax.Array
    eos_ids: jax.Array
    pause_at: jax.Array | None
    costs: LoopCosts
    candidate: jax.Array
    forced: jax.Array
    positions: jax.Array
    acceptance: jax.Array
    prior_reached: jax.Array
    prior_accepted: jax.Array
    zero: jax.Array


def loop_inputs(c: LoopConfig, keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array,
                pause_at: jax.Array | None) -> LoopInputs:
    """The loop's `LoopInputs` from the cost vector float32 [NUM_COST_INPUTS (+ L)]
    (`LoopCosts.from_vector`) and the rest as `resume_adaptive` takes them."""
    L = c.draft_len
    named = LoopCosts.from_vector(costs, L)
    candidate = jnp.isin(jnp.arange(1, L + 1), jnp.asarray(with_one(c.parts.verify_caps)))
    forced = named.forced_cap > 0
    positions = jnp.arange(1, L + 1, dtype=jnp.float32)
    a = jnp.clip(named.acceptance, 0.0, 0.999)
    prior_reached = jnp.broadcast_to(a ** (positions - 1), (c.batch, L))
    prior_accepted = jnp.broadcast_to(a ** positions, (c.batch, L))
    return LoopInputs(keys=keys, max_new=max_new, eos_ids=eos_ids, pause_at=pause_at, costs=named,
                      candidate=candidate, forced=forced, positions=positions, acceptance=a,
                      prior_reached=prior_reached, prior_accepted=prior_accepted, zero=jnp.zeros((), jnp.int32))


def initial_state(c: LoopConfig, x: LoopInputs, state: DecodeState) -> AdaptiveState:
    """The loop's state on entry from the skeleton's: the memories at the prior (PRIOR_STEPS'
    worth; the long one and the cap's `LoopConfig.long_prior`), nothing pending but the draft's
    chunk, no choice made yet."""
    pending, pending_len = c.parts.pending(state.inner)
    prior_reached, prior_accepted, long_prior, zero = x.prior_reached, x.prior_accepted, c.long_prior, x.zero
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
    forwards = e.forward_share * (x.positions - 1) if c.priced else 0 * x.positions
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
    seconds = jnp.where(x.candidate, batch_steps(mean, sd, e.remaining, e.running) * cost, jnp.inf)
    best = cap_index(seconds, e.chosen, sticky=c.dispatch is not None)
    probes = c.dispatch is not None and c.batch > 1
    index = probe_up(best, x.candidate, e.probe_reached, e.running, seconds) if probes else best
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
    step_keys = fold_rows(x.keys, d.step)
    if not c.takes_cap:
        verdict = parts.step(d, step_keys, active)
    elif width is None:
        verdict = parts.step(d, step_keys, active, cap=cap)
    else:
        verdict = parts.step(d, step_keys, active, cap=cap, width=width)
    d = advance(parts, d, verdict, active, x.max_new, x.eos_ids, drafted=True)
    d = d.replace(counters=d.counters.record_cap(cap if c.takes_cap else jnp.asarray(c.draft_len, jnp.int32)))
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
    verdict = c.parts.ar_step(d, fold_rows(x.keys, d.step), active)
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
    block, `ssd_jax.loop.shadow`), then a new choice; else whether speculation pays now."""
    if c.scored:
        return repeated(functools.partial(plain_step, c, x), s, count)
    if not c.shadows:
        return recheck(c, x, repeated(functools.partial(plain_step, c, x), s, count))
    tree_tokens, valid, parents = c.parts.shadow_tree(s.decode.inner)
    start_len = s.pending_len
    s = repeated(functools.partial(plain_step, c, x), s, count)
    slots = jnp.minimum(start_len[:, None] + jnp.arange(count)[None, :], s.pending.shape[1] - 1)
    emitted = jnp.take_along_axis(s.pending, slots, axis=1)
    counts = shadow_counts(tree_tokens, valid, parents, emitted, s.pending_len - start_len, c.draft_len)
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
    s = s.replace(spec_steps=x.zero)
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
    inner, acceptance, known = parts.scored_resync(s.decode.inner, s.pending, s.pending_len, s.pending_law)
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
                 keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array, *,
                 sampling: SamplingParams, out_size: int, placement=None) -> DecodeState:
    """`ssd_jax.loop.skeleton.run` with the per-step cap and the fallback to plain decoding.
    parts: `SpeculativeParts`, `RetrievalParts` or `CascadeParts` with pending_width > 0; costs
    float32 [NUM_COST_INPUTS (+ L)] (`LoopCosts.from_vector`). Returns the final DecodeState."""
    state = begin_adaptive(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, costs, sampling=sampling,
                           out_size=out_size, placement=placement)
    return resume_adaptive(parts, tparams, keys, max_new, eos_ids, costs, state, sampling=sampling).decode


def begin_adaptive(parts: AdaptiveParts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                   keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array, *,
                   sampling: SamplingParams, out_size: int, placement=None) -> AdaptiveState:
    """Prefill, the first token and the adaptive loop's state on entry (its memories at the prior,
    the first choice made): `run_adaptive`'s arguments, no step taken."""
    state = start(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, sampling=sampling,
                  out_size=out_size, placement=placement)
    c = LoopConfig.make(parts, tparams, sampling, tokens.shape[0])
    x = loop_inputs(c, keys, max_new, eos_ids, costs, pause_at=None)
    return decide(c, x, initial_state(c, x, state))


def resume_adaptive(parts: AdaptiveParts, tparams: dict, keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array,
                    costs: jax.Array, state: AdaptiveState, pause_at: jax.Array | None = None, *,
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
