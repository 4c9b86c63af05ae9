"""Cascade Speculative Drafting (method "csd")'s parts for the decode skeleton.

Each step: the cascade (`ssd_jax.draft.cascade`) appends a draft of up to W_0 tokens to every
row's context, the drafters reviewing the blocks of the levels below them -> the draft is cut at
the static max_draft_tokens (default W_0) -> the target scores [cur, draft] in one forward ->
greedy (temperature 0) or token-wise verification against each draft token's law, capped at
the row's valid count (all valid tokens kept: the bonus comes from the target's law at the valid
count with a fresh key) -> the target cache commits the accepted tokens + cur, the next token
overwrites the context after them, every drafter cache is cut back to the new text.

Invariant at the top of a step, per row: the context holds the prompt and every emitted token
(the last one, cur, at position P); the target cache holds context[:P] (all but cur); each drafter
cache holds context[:l] for some l <= P (the tokens after l are that drafter's pending tokens,
processed with its next review; the schedule bounds how many there can be).

Exactness: every drafted token was drawn from the law recorded for it given the text before it,
and whether a position exists in the draft is decided before its token is drawn (a review's
stopping point depends only on earlier tokens and fresh randomness); token-wise verification of
such a draft emits the target's law (see `ssd_jax.draft.cascade_review`). Rows that are done keep
their text and caches (nothing is committed for them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.draft.cascade import CascadeDrafter, CascadeState, ReviewCounters
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.cascade_review import greedy_review, sampled_review
from ssd_jax.draft.cascade_schedule import CascadeSchedule
from ssd_jax.draft.vocab import align_logits
from ssd_jax.loop.caps import at_narrowest, pending_width, switched_caps, unread_count_only, with_one
from ssd_jax.loop.autoregressive import ARParts
from ssd_jax.loop.shadow import scored_tokens
from ssd_jax.loop.skeleton import DecodeState, Verdict, fold_rows, prefill
from ssd_jax.metrics import SpecCounters
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, rollback
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities


@dataclasses.dataclass(frozen=True)
class CascadeParts:
    """The schedule, lenience (temperature 0), Max-Gram's largest n-gram and table (int32 [V];
    any table without Max-Gram ops), the drafters' params and configs (largest first), buffer
    sizes; pending_width: > 0 under adaptive speculation (`ar_step`, `resync`); capped: each
    step's verified draft cut at the adaptive loop's cap (`takes_cap`). inner state:
    `CascadeState` (context, drafter caches, laws, review counters)."""

    schedule: CascadeSchedule
    lenience: float
    max_ngram: int
    bigram: jax.Array
    tparams: dict
    tcfg: ModelConfig
    dparams: tuple
    dcfgs: tuple
    sampling: SamplingParams
    prompt_size: int
    out_size: int
    pending_width: int = 0
    capped: bool = False

    @property
    def capacity(self) -> int:
        """KV cache and context slots: prompt + outputs + two drafts + the widest pending window
        (+ a plain phase's, under adaptive speculation)."""
        return (self.prompt_size + self.out_size + 2 * (self.schedule.width + 1) + self.schedule.max_pending + 4
                + self.pending_width)

    @property
    def room(self) -> int:
        return self.schedule.width + self.schedule.max_pending + 2

    chain_writes = True   # the target verifies the block causally (`ssd_jax.loop.skeleton`)

    @property
    def counter_width(self) -> int:
        return self.schedule.target_width

    def _drafter(self) -> CascadeDrafter:
        return CascadeDrafter(self.dparams, self.dcfgs, self.schedule, self.sampling, self.lenience, self.bigram,
                              self.max_ngram, self.tcfg.vocab_size)

    def init(self, tokens, lengths, first, logits):
        b, prompt_width = tokens.shape
        capacity, width, vocab = self.capacity, self.schedule.width, self.tcfg.vocab_size
        caches = tuple(prefill(p, c, tokens, lengths, capacity)[1] for p, c in zip(self.dparams, self.dcfgs))
        context = jnp.zeros((b, capacity), jnp.int32).at[:, :prompt_width].set(tokens)
        context = context.at[jnp.arange(b), lengths].set(first)
        laws = None if self.sampling.by_argmax else jnp.zeros((b, width, vocab), jnp.float32)
        return CascadeState(context=context, length=lengths + 1, caches=caches, base=lengths + 1, laws=laws,
                            counters=ReviewCounters.zeros(self.schedule.num_drafters, b))

    @property
    def takes_cap(self) -> bool:
        """Whether `step` honours a per-step cap on the draft the target verifies (the adaptive
        loop's choice): under "auto"."""
        return self.capped

    @property
    def verify_caps(self) -> tuple[int, ...]:
        width = self.schedule.target_width
        return switched_caps(width, self.tparams) if self.takes_cap else (width,)

    def dispatch_caps(self, batch: int) -> tuple[int, ...] | None:
        """The caps the adaptive loop compiles one step for and dispatches on once per run of steps
        at that cap (`step(width=n)`), at batch >= 2 where verification has several compiled
        widths; None (batch 1, or one width) where each step picks its width (`step`). A switch
        per step passes the target's KV cache through the conditional, which XLA:CPU copies every
        step. The cascade is then compiled once per cap, so the caps are kept few to bound the
        compile time: the compiled caps but 1 (a cap of 1 verifies at 2, as the calibration's
        cap-1 run does) and a power of two just below the widest (8 of 9): at T=0 2, 4, 9."""
        if not self.takes_cap or batch < 2 or len(self.verify_caps) == 1:
            return None
        widest = self.verify_caps[-1]
        return tuple(n for n in self.verify_caps if n > 1 and (n == widest or widest - n > 1))

    def gates(self, batch: int) -> bool:
        """Never: a step's cap already verifies only what the cascade drafted."""
        return False

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap: jax.Array | None = None,
             width: int | None = None) -> Verdict:
        """One cascade step; cap int32 []: the most draft tokens the target verifies (`takes_cap`:
        the narrowest compiled width holding every active row's capped draft, a choice made from
        the drafts alone, or `width` (static, >= cap) where the loop dispatches per cap). The
        cascade drafts as scheduled at every cap. At a batch of several rows a wide verification
        costs several narrow ones, so verifying the whole default cap where rows accept little
        loses to plain decoding; the cap lets the loop verify only what pays."""
        checked = self.schedule.target_width  # the target verifies at most the first `checked` tokens of the block
        capacity, dstate = self.capacity, state.inner
        rows = jnp.arange(keys.shape[0])
        position = state.tcache.lengths  # of cur
        base = position + 1
        # Every valid draft position gets its law written this step; the rest are never read as
        # valid, so last step's values can stay.
        dstate = self._drafter().draft(dstate.replace(base=base), keys, active)
        limit = checked if cap is None or not self.takes_cap else jnp.clip(cap, 1, checked if width is None else width)
        valid = jnp.minimum(dstate.length - base, limit)
        block_positions = position[:, None] + jnp.arange(checked + 1, dtype=jnp.int32)[None, :]
        block = jnp.take_along_axis(dstate.context, jnp.clip(block_positions, 0, capacity - 1), axis=1)

        def verify_width(n: int, tcache):
            """The target's verdict on the first n draft tokens (every row's valid count <= n)."""
            logits, tcache = forward_cached(self.tparams, self.tcfg, block[:, :n + 1], block_positions[:, :n + 1],
                                            tcache)
            draft = block[:, 1:n + 1]
            if self.sampling.by_argmax:
                logits = decision_logits(logits, keys, block_positions[:, :n + 1] + 1, self.sampling)
                accepted, next_token = greedy_review(logits, draft, valid)
            else:
                accepted, next_token = sampled_review(fold_rows(keys, 0), draft, valid, dstate.laws[:, :n],
                                                      probabilities(logits, self.sampling))
            return accepted, next_token, commit(tcache, jnp.where(active, accepted + 1, 0)), \
                jnp.asarray(n - 1, jnp.int32)

        caps = self.verify_caps
        if width is not None:
            caps = (width,)
        elif len(caps) > 1:
            caps = with_one(caps)
        accepted, next_token, tcache, forwards = at_narrowest(
            caps, jnp.max(jnp.where(active, valid, 0)), verify_width, state.tcache)

        # The text becomes context[:base + accepted] + [next]; a finished row keeps its text.
        end = jnp.where(active, base + accepted, position)
        context = dstate.context.at[rows, jnp.where(active, end, capacity)].set(next_token, mode="drop")
        caches = tuple(rollback(c, end) for c in dstate.caches)
        dstate = dstate.replace(context=context, length=end + 1, caches=caches)
        return Verdict(tcache=tcache, inner=dstate, chosen=block[:, 1:], accepted=accepted, next_token=next_token,
                       drafted=valid, draft_forwards=forwards if self.takes_cap else None)

    # ------------------------------------------------------------ adaptive speculation's fallback

    drafts_with_model = False   # the loop's draft-forward cost is folded into the measured step
    shadow_tree = None          # the drafters' proposals are not known during plain steps

    @property
    def draft_len(self) -> int:
        return self.schedule.target_width

    def ar_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """A plain decoding step: the target reads cur, the token it samples joins the context;
        the drafters fall behind (`resync`)."""
        plain = ARParts(tparams=self.tparams, tcfg=self.tcfg, sampling=self.sampling, capacity=self.capacity)
        verdict = plain.step(state, keys, active, with_law=self.learns_while_plain)
        dstate, capacity = state.inner, self.capacity
        rows = jnp.arange(keys.shape[0])
        end = state.tcache.lengths + 1   # the new token's position
        context = dstate.context.at[rows, jnp.where(active, end, capacity)].set(verdict.next_token, mode="drop")
        return verdict.replace(inner=dstate.replace(context=context, length=jnp.where(active, end + 1, dstate.length)))

    def pending(self, inner) -> tuple[jax.Array, jax.Array]:
        """The missed tokens are in the context: the buffer only bounds plain phases."""
        return unread_count_only(inner.length.shape[0], self.pending_width)

    @property
    def learns_while_plain(self) -> bool:
        """Whether plain steps record their tokens' target probabilities for `scored_resync`: the
        largest drafter reviews last, so a draft has its law (at T=0 with lenience 1 its greedy
        continuation), and scoring it on the tokens plain steps drew tells the loop what
        speculating would have had accepted (`ssd_jax.loop.shadow`). Not with a lenient review
        (T=0's default), which lets near-argmax tokens into the drafts that the target rejects, so
        scoring the drafter's own argmax would overstate their acceptance; nor without a model."""
        return len(self.dparams) > 0 and self.lenience == 1.0

    def resync(self, inner, pending: jax.Array, pending_len: jax.Array):
        """Every drafter reads the context up to cur (not included), as after a speculative step."""
        return self._read_context(inner, None)[0]

    def scored_resync(self, inner, pending: jax.Array, pending_len: jax.Array, laws: jax.Array, keys: jax.Array):
        """`resync`, scoring the largest drafter on the tokens plain steps drew (arguments and
        returns as `ssd_jax.loop.speculative.SpeculativeParts.scored_resync`): pending slot
        k >= 1 holds the k-th token of the phase, the last (cur) at context position length - 1."""
        slots = jnp.arange(pending.shape[1] - 1, dtype=jnp.int32)[None, :]
        scored_positions = inner.length[:, None] - pending_len[:, None] + slots
        inner, logits = self._read_context(inner, scored_positions)
        logits = decision_logits(align_logits(logits, self.tcfg.vocab_size), keys, scored_positions + 1, self.sampling)
        return (inner, *scored_tokens(logits, pending, laws, pending_len, self.sampling))

    def _read_context(self, inner, scored_positions: jax.Array | None):
        """(inner with every drafter's cache up to cur, the largest drafter's logits float32
        [B, M, V] after each of scored_positions int32 [B, M], or None)."""
        width, capacity = self.pending_width + self.schedule.max_pending + 1, self.capacity
        cur_position = inner.length - 1
        caches, scored = [], None
        for level, (params, config, cache) in enumerate(zip(self.dparams, self.dcfgs, inner.caches)):
            start = cache.lengths
            positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
            tokens = jnp.take_along_axis(inner.context, jnp.clip(positions, 0, capacity - 1), axis=1)
            # Slots past what is committed are never read; clamped for learned position tables.
            positions = jnp.minimum(positions, config.max_position_embeddings - 1)
            if level == 0 and scored_positions is not None:
                indices = jnp.clip(scored_positions - start[:, None], 0, width - 1)
            else:
                indices = jnp.zeros((start.shape[0], 1), jnp.int32)
            logits, cache = forward_cached(params, config, tokens, positions, cache, logit_indices=indices)
            scored = logits if level == 0 else scored
            caches.append(commit(cache, jnp.maximum(cur_position - start, 0)))
        return inner.replace(caches=tuple(caches)), scored if scored_positions is not None else None


def cascade_parts(method, tparams: dict, tcfg: ModelConfig, dparams: tuple, dcfgs: tuple, bigram,
                  sampling: SamplingParams, prompt_width: int, out_size: int, plan=None) -> CascadeParts:
    """method: a CSD object (its schedule is built for len(dparams) drafters and the temperature);
    plan: its `AutoPlan` when max_draft_tokens is "auto" (then the parts can fall back to plain
    decoding)."""
    return CascadeParts(schedule=cascade_schedule(method, len(dparams), sampling), lenience=cascade_lenience(method, sampling),
                        max_ngram=method.max_ngram, bigram=bigram, tparams=tparams, tcfg=tcfg, dparams=tuple(dparams),
                        dcfgs=tuple(dcfgs), sampling=sampling, prompt_size=prompt_width, out_size=out_size,
                        pending_width=pending_width(plan), capped=plan is not None and plan.capped)


def cascade_schedule(method, num_drafters: int, sampling: SamplingParams) -> CascadeSchedule:
    from ssd_jax.draft.cascade_schedule import build_schedule

    return build_schedule(method.k_matrix, num_drafters, method.cap, sampling.by_argmax)


def cascade_lenience(method, sampling: SamplingParams) -> float:
    from ssd_jax.draft.cascade_options import check_lenience, default_lenience

    return check_lenience(default_lenience(sampling) if method.lenience is None else method.lenience, sampling)


def cascade_stats(schedule: CascadeSchedule, lenience: float, counters: SpecCounters, reviews: ReviewCounters) -> dict:
    """Cascade-specific stats: the k-matrix, the cap, per-drafter calls, review rounds, reviewed and
    kept tokens (lists over drafters 1..n)."""
    steps = int(counters.target_calls) - 1  # loop steps (target_calls counts the prefill)
    rounds, reviewed, kept = (np.asarray(x).sum(axis=1) for x in (reviews.rounds, reviews.reviewed, reviews.accepted))
    return dict(
        k_matrix=[list(row) for row in schedule.k_matrix], lenience=lenience, num_drafters=schedule.num_drafters,
        draft_width=schedule.width, max_draft_tokens=schedule.target_width,
        drafter_calls=[1 + steps * k for k in schedule.rounds_per_level],
        review_rounds=rounds.tolist(), reviewed_tokens=reviewed.tolist(), review_accepted_tokens=kept.tolist(),
        review_acceptance_rate=[float(k / r) if r else 0.0 for k, r in zip(kept, reviewed)],
    )
