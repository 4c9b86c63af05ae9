"""The decode loop of adaptive speculation: speculative steps while they pay, plain decoding
while they do not, all inside one jitted program (no host round trip).

    while some row runs:
        speculative steps while they pay (at least one, a probe, unless backing off), each
            drafting up to the length that pays best
        plain decoding steps while speculation does not pay, the draft falling behind by at
            most `pending_width` tokens
        the draft reads the tokens it missed (one forward)

The loop keeps, per draft position k, decayed sums of how often a step's draft reached k (R_k)
and had its k-th token accepted (A_k), averaged over the lagging rows (the running rows with
the fewest tokens so far: a batch runs until its slowest row is done, so the slowest row's
tokens per step are the batch's; at batch 8, averaging over every row chose caps of 4-8 where
only 2 paid, 0.6-1.07x AR, because the mean row emitted 4.6 tokens per step at cap 8 while the
call took 128 / 51 = 2.5 steps' worth per token); alpha_k = A_k / R_k is the
acceptance at k given k was reached, and a draft capped at l tokens emits

    E(l) = 1 + sum_{k<=l} prod_{j<=k} alpha_j      tokens per step.

With the measured costs c = (AR step, speculative step with no draft forward after its catch-up,
one draft forward) (`ssd_jax.engine.adaptive.loop_inputs`), rho the running share of the cap's
draft forwards that ran (the early stop ends drafts sooner), a step capped at l costs
c_spec + rho (l - 1) c_draft, and

    cap = the longest l with E(l) / cost(l) >= CAP_TOLERANCE max_l E(l) / cost(l) at batch 1,
          the best l at larger batches (long memory; parts with `takes_cap`, else their static L)
    pays:  (E(cap) + Z sd(cap) / sqrt(n)) c_ar >= c_spec + rho (cap - 1) c_draft

with sd(cap) the spread of a step's tokens under the same model and n the short memory's
effective number of steps (times the lagging rows): the noise allowance keeps a chance dip of a
few steps from stopping speculation that pays on average, while a draft that is truly bad (E
near 1, small spread) falls back after a few steps.

The sums are a short memory (DECAY per speculative step) that reverts to a long one (LONG_DECAY)
during plain steps: a bad stretch of text sends the loop to plain decoding, and it probes again
once the short memory is back near the long one (at once where speculation pays on average,
after up to `pending_width` - 1 tokens where it does not). A probe (one speculative step) that
does not pay doubles the number of plain phases before the next probe, up to MAX_BACKOFF, so
text where speculation never pays costs few probes. Both memories start from PRIOR_STEPS steps
at the plan's acceptance. Each alpha_k is shrunk towards the acceptance pooled over positions
by POOLING steps' worth, so a position whose estimate fell low by chance (and that shorter caps
then stop measuring) drifts back and is tried again.

The choices use only past steps and the costs, never the current step's target probabilities,
so the output law is the target's whatever they decide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.engine.skeleton import DecodeState, advance, fold_rows, start
from ssd_jax.models.config import ModelConfig
from ssd_jax.sampling import SamplingParams

# Weight of the past in the running sums and averages (per speculative step), and how many
# steps' worth of evidence the prior acceptance counts for.
DECAY = 0.9
LONG_DECAY = 0.98
PRIOR_STEPS = 2.0
# The fall back's noise allowance, in standard errors of the short memory's tokens per step (at
# T=1 a step's tokens vary by ~1.5 around ~3, so a 10-step memory dips below break-even by
# chance; without it SD fell back on 20-30% of the steps of sets where every fixed L paid).
Z = 1.0
# Steps' worth of pull of each position's acceptance towards the pooled one (POOLING = 2 left
# SD's caps at 3.2 where L = 4-5 measured best at T=1; 8 brought them to 4.2).
POOLING = 8.0
# E(l) / cost(l) is flat near its maximum, and the estimates lean short (a position's acceptance
# is measured less often the further it is); the cap is the longest within this share of the best.
# Not at batch > 1: there the batch waits for its unluckiest row, which longer caps (more spread
# per step) make later, so the best score itself is taken (SD at batch 8, T=0, code: 0.91x AR
# with the tolerance, 1.05x without; badguess: 0.82x and 1.01x).
CAP_TOLERANCE = 0.97
MAX_BACKOFF = 8
# The most tokens a plain phase emits before the draft catches up (and the loop may probe).
PENDING_WIDTH = 24


def pending_width(plan) -> int:
    """The parts' pending_width: PENDING_WIDTH under adaptive speculation (plan: an AutoPlan), else 0."""
    return PENDING_WIDTH if plan is not None else 0


def unread_count_only(batch: int, width: int) -> tuple[jax.Array, jax.Array]:
    """`pending` for parts whose missed tokens are already in their context (retrieval, CSD):
    the buffer only bounds the plain phase. int32 [batch, width] zeros, int32 [batch] ones."""
    return jnp.zeros((batch, width), jnp.int32), jnp.ones((batch,), jnp.int32)


# Cost inputs, float32 [5]: AR step, speculative step without draft forwards, one draft forward,
# the prior acceptance, and a forced cap (0: the loop chooses; > 0: every step speculates with
# that cap, for calibration).
NUM_COST_INPUTS = 5


@struct.dataclass
class AdaptiveState:
    """decode: the skeleton's DecodeState; reached, accepted float32 [L]: decayed sums over
    speculative steps of the share of running rows whose draft reached position k / had its k-th
    token accepted; long_reached, long_accepted: the same with the long memory, over long_steps
    float32 [] steps; forward_share float32 []: running average of the draft forwards a step ran
    over the cap's cap - 1; spec_steps int32 []: speculative steps of the current phase; wait
    int32 []: phases left before the next probe; backoff int32 []: phases between probes after
    the last failed one; pending int32 [B, P], pending_len int32 [B]: tokens the draft has not
    read (ending with cur); cap int32 [], pays bool []: the next step's cap and whether
    speculating pays, from the memories above (computed once per update)."""

    decode: DecodeState
    reached: jax.Array
    accepted: jax.Array
    long_reached: jax.Array
    long_accepted: jax.Array
    long_steps: jax.Array
    forward_share: jax.Array
    spec_steps: jax.Array
    wait: jax.Array
    backoff: jax.Array
    pending: jax.Array
    pending_len: jax.Array
    cap: jax.Array
    pays: jax.Array


def reach_probabilities(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """P(a step emits more than k tokens) = prod_{j<=k} alpha_j for k = 1..L, float32 [L], from
    the per-position sums, each shrunk towards the acceptance pooled over all positions by
    POOLING steps' worth (no evidence at all: the prior acceptance). Without the pull, a position
    whose estimate fell low by chance is no longer drafted, so never corrected: the caps would
    drift short."""
    tiny = 1e-6
    pooled = (jnp.sum(accepted) + tiny * prior) / (jnp.sum(reached) + tiny)
    alpha = jnp.clip((accepted + POOLING * pooled) / (reached + POOLING), 0.0, 1.0)
    return jnp.cumprod(alpha)


def expected_tokens_by_cap(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """E(l) for l = 1..L, float32 [L]."""
    return 1 + jnp.cumsum(reach_probabilities(reached, accepted, prior))


def tokens_mean_and_spread(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                           cap: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E, sd) of the tokens a step capped at `cap` emits, under the per-position model:
    E = 1 + sum_k P_k, E[T^2] = 1 + sum_k (2k + 1) P_k over k <= cap."""
    k = jnp.arange(1, reached.shape[0] + 1, dtype=jnp.float32)
    p = jnp.where(k <= cap, reach_probabilities(reached, accepted, prior), 0.0)
    mean = 1 + jnp.sum(p)
    second = 1 + jnp.sum((2 * k + 1) * p)
    return mean, jnp.sqrt(jnp.maximum(second - mean * mean, 0.0))


def lagging_rows(num_out: jax.Array, active: jax.Array) -> jax.Array:
    """bool [B]: the running rows with the fewest tokens emitted (num_out int32 [B]), the rows
    the batch waits for."""
    fewest = jnp.min(jnp.where(active, num_out, jnp.iinfo(jnp.int32).max))
    return active & (num_out == fewest)


def position_counts(verdict, active: jax.Array, draft_len: int) -> tuple[jax.Array, jax.Array]:
    """This step's share of the rows in `active` (bool [B]) whose draft reached each position
    1..L and whose token there was accepted, float32 [L] each (a row reaches k when it proposed k
    tokens and the first k - 1 were accepted)."""
    k = jnp.arange(1, draft_len + 1, dtype=jnp.int32)[None, :]
    drafted = verdict.drafted if verdict.drafted is not None else jnp.full_like(verdict.accepted, draft_len)
    accepted = verdict.accepted[:, None]
    rows = active[:, None]
    n_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    reached = jnp.sum(rows & (drafted[:, None] >= k) & (accepted >= k - 1), axis=0) / n_active
    hit = jnp.sum(rows & (accepted >= k), axis=0) / n_active
    return reached.astype(jnp.float32), hit.astype(jnp.float32)


def run_adaptive(parts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, keys: jax.Array,
                 max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array, *, sampling: SamplingParams,
                 out_size: int, stream: bool, placement=None) -> DecodeState:
    """`ssd_jax.engine.skeleton.run` with the per-step cap and the fallback to plain decoding.
    parts: `SpeculativeParts`, `RetrievalParts` or `CascadeParts` with pending_width > 0; costs
    float32 [NUM_COST_INPUTS] (`ssd_jax.engine.adaptive.loop_inputs`). Returns the final DecodeState."""
    state = start(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, sampling=sampling,
                  out_size=out_size, stream=stream, placement=placement)
    costs = costs.astype(jnp.float32)
    c_ar, c_spec, c_draft, prior_acceptance, forced_cap = (costs[i] for i in range(NUM_COST_INPUTS))
    L = parts.draft_len
    takes_cap = getattr(parts, "takes_cap", False)
    # A step's verification runs at the narrowest compiled width holding its drafts, so a cap
    # between two compiled caps verifies at the wider one's cost: only 1 and the compiled caps
    # are chosen (the linear cost below is right at those, and under-prices the caps between).
    candidate = jnp.isin(jnp.arange(1, L + 1), jnp.asarray((1,) + tuple(getattr(parts, "verify_caps", (L,)))))
    forced = forced_cap > 0
    batch = tokens.shape[0]
    lengths_1_to_L = jnp.arange(1, L + 1, dtype=jnp.float32)
    pending, pending_len = parts.pending(state.inner)
    a = jnp.clip(prior_acceptance, 0.0, 0.999)
    prior_reached = PRIOR_STEPS * a ** (lengths_1_to_L - 1)
    prior_accepted = PRIOR_STEPS * a ** lengths_1_to_L
    zero = jnp.zeros((), jnp.int32)
    initial = AdaptiveState(decode=state, reached=prior_reached, accepted=prior_accepted,
                            long_reached=prior_reached, long_accepted=prior_accepted,
                            long_steps=jnp.asarray(PRIOR_STEPS, jnp.float32),
                            forward_share=jnp.ones((), jnp.float32),
                            spec_steps=zero, wait=zero, backoff=jnp.ones((), jnp.int32),
                            pending=pending, pending_len=pending_len, cap=zero, pays=jnp.zeros((), bool))

    def running(s: AdaptiveState):
        return ~jnp.all(s.decode.outputs.done)

    def decide(s: AdaptiveState) -> AdaptiveState:
        """s with its cap (from the long memory: per-position estimates from a few steps are
        too noisy to pick a length with) and whether it pays (from the short memory)."""
        forwards = s.forward_share * (lengths_1_to_L - 1) if parts.drafts_with_model else 0 * lengths_1_to_L
        cost = c_spec + forwards * c_draft
        if takes_cap:
            # The longest candidate cap within CAP_TOLERANCE of the best score (zero costs, under
            # forced inputs: the longest).
            score = expected_tokens_by_cap(s.long_reached, s.long_accepted, a) / jnp.maximum(cost, 1e-30)
            score = jnp.where(candidate, score, 0.0)
            if batch == 1:
                index = L - 1 - jnp.argmax((score >= CAP_TOLERANCE * jnp.max(score))[::-1])
            else:
                index = jnp.argmax(score)
        else:
            index = L - 1
        # Pays unless the short memory's E is below the break-even by more than its noise: Z
        # standard errors, with (1 + DECAY) R_1 the decayed sums' effective number of steps.
        mean, sd = tokens_mean_and_spread(s.reached, s.accepted, a, index + 1)
        outputs = s.decode.outputs
        rows = jnp.maximum(jnp.sum(lagging_rows(outputs.num_out, ~outputs.done)), 1).astype(jnp.float32)
        samples = jnp.maximum((1 + DECAY) * s.reached[0] * rows, 1.0)
        gain = (mean + Z * sd / jnp.sqrt(samples)) * c_ar
        cap = jnp.where(forced, jnp.minimum(forced_cap, L).astype(jnp.int32), index + 1)
        return s.replace(cap=cap, pays=forced | (gain >= cost[index]))

    def speculative(s: AdaptiveState) -> AdaptiveState:
        d = s.decode
        active = ~d.outputs.done
        lagging = lagging_rows(d.outputs.num_out, active)
        cap = s.cap
        step_keys = fold_rows(keys, d.step)
        verdict = parts.step(d, step_keys, active, cap=cap) if takes_cap else parts.step(d, step_keys, active)
        d, _ = advance(parts, d, verdict, active, max_new, eos_ids, stream=stream, drafted=True)
        reached, hit = position_counts(verdict, lagging, L)
        if verdict.draft_forwards is None or L == 1:
            share = s.forward_share
        else:
            ran = verdict.draft_forwards.astype(jnp.float32) / jnp.maximum(cap - 1, 1).astype(jnp.float32)
            share = jnp.where(cap > 1, DECAY * s.forward_share + (1 - DECAY) * ran, s.forward_share)
        return decide(s.replace(decode=d, spec_steps=s.spec_steps + 1,
                                reached=DECAY * s.reached + reached, accepted=DECAY * s.accepted + hit,
                                long_reached=LONG_DECAY * s.long_reached + reached,
                                long_accepted=LONG_DECAY * s.long_accepted + hit,
                                long_steps=LONG_DECAY * s.long_steps + 1, forward_share=share))

    def plain(s: AdaptiveState) -> AdaptiveState:
        d = s.decode
        active = ~d.outputs.done
        verdict = parts.ar_step(d, fold_rows(keys, d.step), active)
        d, _ = advance(parts, d, verdict, active, max_new, eos_ids, stream=stream, drafted=False)
        rows = jnp.arange(s.pending.shape[0])
        slot = jnp.where(active, s.pending_len, s.pending.shape[1])
        pending = s.pending.at[rows, slot].set(verdict.next_token, mode="drop")
        # The short memory moves towards the long one's per-step means at the speculative pace.
        return decide(s.replace(decode=d, pending=pending, pending_len=s.pending_len + active.astype(jnp.int32),
                                reached=DECAY * s.reached + s.long_reached / s.long_steps,
                                accepted=DECAY * s.accepted + s.long_accepted / s.long_steps))

    def phase(s: AdaptiveState) -> AdaptiveState:
        probe = s.wait <= 0
        s = jax.lax.while_loop(lambda s: running(s) & ((probe & (s.spec_steps == 0)) | s.pays), speculative,
                               s.replace(spec_steps=zero))
        # A probe that did not pay doubles the phases until the next one (up to MAX_BACKOFF); any
        # speculation that paid resets it.
        failed = probe & (s.spec_steps == 1)
        backoff = jnp.where(failed, jnp.minimum(2 * s.backoff, MAX_BACKOFF),
                            jnp.where(s.spec_steps > 0, 1, s.backoff))
        wait = jnp.where(s.spec_steps > 0, backoff - 1, s.wait - 1)
        s = s.replace(backoff=backoff, wait=wait)
        pending, pending_len = parts.pending(s.decode.inner)
        s = s.replace(pending=pending, pending_len=pending_len)
        width = s.pending.shape[1]
        s = jax.lax.while_loop(lambda s: running(s) & ~s.pays & (jnp.max(s.pending_len) < width), plain, s)
        inner = parts.resync(s.decode.inner, s.pending, s.pending_len)
        return s.replace(decode=s.decode.replace(inner=inner))

    return jax.lax.while_loop(running, phase, decide(initial)).decode
