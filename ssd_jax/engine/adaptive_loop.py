"""The decode loop of adaptive speculation: speculative steps while they pay, plain decoding
while they do not, all inside one jitted program (no host round trip).

    while some row runs:
        speculative steps while they pay (at least one, a probe, unless backing off)
        plain decoding steps while speculation does not pay, the draft falling behind by at
            most `pending_width` tokens
        the draft reads the tokens it missed (one forward)

"Pays": with decayed sums of the draft tokens accepted per running row (A) and of speculative
steps (S), E = 1 + A / S the tokens a step emits; with a running average of the draft forwards a
step ran (F); and the measured costs c = (AR step, speculative step without its draft forwards,
one draft forward) (`ssd_jax.engine.adaptive.loop_inputs`):

    E * c_ar >= MARGIN * (c_spec + F * c_draft)

A and S are a short memory (DECAY per speculative step) that reverts to a long one (LONG_DECAY)
during plain steps: a bad stretch of text sends the loop to plain decoding, and it probes again
once the short memory is back near the long one (at once where speculation pays on average,
after up to `pending_width` - 1 tokens where it does not). A probe (one speculative step) that
does not pay doubles the number of plain phases before the next probe, up to MAX_BACKOFF, so
text where speculation never pays costs few probes. Both memories start from PRIOR_STEPS steps
at the plan's acceptance (E(L) of the geometric model). MARGIN < 1 leans towards speculating: a
wrong fall back costs plain steps, a wrong speculative step only itself.

The choice uses only past steps and the costs, never the current step's target probabilities,
so the output law is the target's whatever it decides.
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
MARGIN = 0.9
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


@struct.dataclass
class AdaptiveState:
    """decode: the skeleton's DecodeState; accepted, steps float32 []: decayed sums of accepted
    tokens per running row and of speculative steps; long_accepted, long_steps: the same with the
    long memory; forwards_per_step float32 []: running average over speculative steps;
    spec_steps int32 []: speculative steps of the current phase; wait int32 []: phases left
    before the next probe; backoff int32 []: phases between probes after the last failed one;
    pending int32 [B, P], pending_len int32 [B]: tokens the draft has not read (ending with cur)."""

    decode: DecodeState
    accepted: jax.Array
    steps: jax.Array
    long_accepted: jax.Array
    long_steps: jax.Array
    forwards_per_step: jax.Array
    spec_steps: jax.Array
    wait: jax.Array
    backoff: jax.Array
    pending: jax.Array
    pending_len: jax.Array


def run_adaptive(parts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, keys: jax.Array,
                 max_new: jax.Array, eos_ids: jax.Array, costs: jax.Array, *, sampling: SamplingParams,
                 out_size: int, stream: bool, placement=None) -> DecodeState:
    """`ssd_jax.engine.skeleton.run` with the fallback to plain decoding. parts: `SpeculativeParts`
    or `RetrievalParts` with pending_width > 0; costs float32 [4] (`loop_inputs`). Returns the final DecodeState."""
    state = start(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, sampling=sampling,
                  out_size=out_size, stream=stream, placement=placement)
    costs = costs.astype(jnp.float32)
    c_ar, c_spec, c_draft, prior_acceptance = costs[0], costs[1], costs[2], costs[3]
    L = parts.draft_len
    pending, pending_len = parts.pending(state.inner)
    a = jnp.clip(prior_acceptance, 0.0, 0.999)
    prior_tokens = (1 - a ** (L + 1)) / (1 - a)
    zero = jnp.zeros((), jnp.int32)
    prior_accepted, prior_steps = PRIOR_STEPS * (prior_tokens - 1), jnp.asarray(PRIOR_STEPS, jnp.float32)
    initial = AdaptiveState(decode=state, accepted=prior_accepted, steps=prior_steps,
                            long_accepted=prior_accepted, long_steps=prior_steps,
                            forwards_per_step=jnp.asarray(L - 1 if parts.drafts_with_model else 0, jnp.float32),
                            spec_steps=zero, wait=zero, backoff=jnp.ones((), jnp.int32),
                            pending=pending, pending_len=pending_len)

    def running(s: AdaptiveState):
        return ~jnp.all(s.decode.outputs.done)

    def pays(s: AdaptiveState):
        expected = 1 + s.accepted / s.steps
        return expected * c_ar >= MARGIN * (c_spec + s.forwards_per_step * c_draft)

    def speculative(s: AdaptiveState) -> AdaptiveState:
        d = s.decode
        active = ~d.outputs.done
        verdict = parts.step(d, fold_rows(keys, d.step), active)
        d, _ = advance(parts, d, verdict, active, max_new, eos_ids, stream=stream, drafted=True)
        # Retrieval drafting runs no draft forwards.
        forwards = jnp.zeros((), jnp.float32) if verdict.draft_forwards is None \
            else verdict.draft_forwards.astype(jnp.float32)
        n_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
        mean = lambda x: jnp.sum(jnp.where(active, x, 0)).astype(jnp.float32) / n_active  # noqa: E731
        average = lambda old, new: DECAY * old + (1 - DECAY) * new  # noqa: E731
        accepted = mean(verdict.accepted)
        return s.replace(decode=d, spec_steps=s.spec_steps + 1,
                         accepted=DECAY * s.accepted + accepted, steps=DECAY * s.steps + 1,
                         long_accepted=LONG_DECAY * s.long_accepted + accepted, long_steps=LONG_DECAY * s.long_steps + 1,
                         forwards_per_step=average(s.forwards_per_step, forwards))

    def plain(s: AdaptiveState) -> AdaptiveState:
        d = s.decode
        active = ~d.outputs.done
        verdict = parts.ar_step(d, fold_rows(keys, d.step), active)
        d, _ = advance(parts, d, verdict, active, max_new, eos_ids, stream=stream, drafted=False)
        rows = jnp.arange(s.pending.shape[0])
        slot = jnp.where(active, s.pending_len, s.pending.shape[1])
        pending = s.pending.at[rows, slot].set(verdict.next_token, mode="drop")
        # The short memory moves towards the long one's per-step mean at the speculative pace.
        long_mean = s.long_accepted / s.long_steps
        return s.replace(decode=d, pending=pending, pending_len=s.pending_len + active.astype(jnp.int32),
                         accepted=DECAY * s.accepted + long_mean, steps=DECAY * s.steps + 1)

    def phase(s: AdaptiveState) -> AdaptiveState:
        probe = s.wait <= 0
        s = jax.lax.while_loop(lambda s: running(s) & ((probe & (s.spec_steps == 0)) | pays(s)), speculative,
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
        s = jax.lax.while_loop(lambda s: running(s) & ~pays(s) & (jnp.max(s.pending_len) < width), plain, s)
        inner = parts.resync(s.decode.inner, s.pending, s.pending_len)
        return s.replace(decode=s.decode.replace(inner=inner))

    return jax.lax.while_loop(running, phase, initial).decode
