"""Cascade Speculative Drafting (method "csd") as one jitted `lax.while_loop`.

Each step: the cascade (`ssd_jax.draft.cascade`) appends a draft of up to W_0 tokens to every
row's context, the drafters reviewing the blocks of the levels below them -> the draft is cut at
the static max_draft_tokens (default W_0) -> the target scores [cur, draft] in one forward ->
greedy (temperature 0) or token-wise verification against each draft token's law, capped at
the row's valid count (all valid tokens kept: the bonus comes from the target's law at the valid
count with a fresh key) -> the target cache commits the accepted tokens + cur, the next token
overwrites the context after them, every drafter cache is cut back to the new text -> outputs
and counters.

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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.draft.cascade import CascadeDrafter, CascadeState, ReviewCounters
from ssd_jax.draft.cascade_review import greedy_review, sampled_review
from ssd_jax.draft.cascade_schedule import CascadeSchedule
from ssd_jax.engine.autoregressive import loop_params, prefill, sample_rows
from ssd_jax.engine.emission import Outputs, append, stop_rows
from ssd_jax.engine.output import GenerateOutput
from ssd_jax.engine.prompts import PromptBatch, bucket, row_keys
from ssd_jax.engine.runner import run_compiled, speculative_output
from ssd_jax.engine.streaming import StreamSink, emit
from ssd_jax.metrics import SpecCounters
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, rollback
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities


@dataclasses.dataclass(frozen=True)
class CascadePlan:
    """Static shape of a cascade decode: the schedule, lenience (temperature 0), Max-Gram's largest
    n-gram, output and prompt buffer sizes."""

    schedule: CascadeSchedule
    lenience: float
    max_ngram: int
    out_size: int
    prompt_size: int

    @property
    def capacity(self) -> int:
        """KV cache and context slots: prompt + outputs + two drafts + the widest pending window."""
        return self.prompt_size + self.out_size + 2 * (self.schedule.width + 1) + self.schedule.max_pending + 4


def _decode(tparams, dparams, bigram, tokens, lengths, keys, max_new, eos_ids, *, tcfg: ModelConfig,
            dcfgs: tuple, sampling: SamplingParams, plan: CascadePlan, stream: bool):
    b, prompt_width = tokens.shape
    schedule = plan.schedule
    width, vocab, n = schedule.width, tcfg.vocab_size, schedule.num_drafters
    checked = schedule.target_width  # the target verifies the first `checked` tokens of the block
    capacity = plan.capacity
    rows = jnp.arange(b)

    logits, tcache = prefill(tparams, tcfg, tokens, lengths, capacity)
    caches = tuple(prefill(p, c, tokens, lengths, capacity)[1] for p, c in zip(dparams, dcfgs))
    first = sample_rows(sampling, jax.vmap(jax.random.fold_in)(keys, jnp.zeros((b,), jnp.int32)), logits)
    outputs, _ = append(Outputs.empty(b, plan.out_size), first[:, None], jnp.ones((b,), jnp.int32), max_new, eos_ids)
    if stream:
        emit(first[:, None], jnp.ones((b,), jnp.int32))
    context = jnp.zeros((b, capacity), jnp.int32).at[:, :prompt_width].set(tokens)
    context = context.at[rows, lengths].set(first)
    drafter = CascadeDrafter(dparams, dcfgs, schedule, sampling, plan.lenience, bigram, plan.max_ngram, vocab)
    laws = None if sampling.greedy else jnp.zeros((b, width, vocab), jnp.float32)
    dstate = CascadeState(context=context, length=lengths + 1, caches=caches, base=lengths + 1, laws=laws,
                          counters=ReviewCounters.zeros(n, b))

    def body(state):
        tcache, outputs, dstate = state["tcache"], state["outputs"], state["dstate"]
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state["step"])
        active = ~outputs.done
        position = tcache.lengths  # of cur
        base = position + 1
        # Every valid draft position gets its law written this step; the rest are never read as
        # valid, so last step's values can stay.
        dstate = dstate.replace(base=base)
        dstate = drafter.draft(dstate, step_keys, active)
        valid = jnp.minimum(dstate.length - base, checked)

        block_positions = position[:, None] + jnp.arange(checked + 1, dtype=jnp.int32)[None, :]
        block = jnp.take_along_axis(dstate.context, jnp.clip(block_positions, 0, capacity - 1), axis=1)
        logits, tcache = forward_cached(tparams, tcfg, block, block_positions, tcache)
        draft = block[:, 1:]
        if sampling.greedy:
            accepted, next_token = greedy_review(logits, draft, valid)
        else:
            verify_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(step_keys, 0)
            accepted, next_token = sampled_review(verify_keys, draft, valid, dstate.laws[:, :checked],
                                                  probabilities(logits, sampling))
        tcache = commit(tcache, jnp.where(active, accepted + 1, 0))

        j = jnp.arange(checked + 1)[None, :]
        padded = jnp.concatenate([draft, jnp.zeros_like(draft[:, :1])], axis=1)
        emitted = jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None], next_token[:, None], 0))
        outputs, appended = append(outputs, emitted, accepted + 1, max_new, eos_ids)
        if stream:
            emit(emitted, appended)
        counters = state["counters"].record(active, accepted, valid)

        # The text becomes context[:base + accepted] + [next]; a finished row keeps its text.
        end = jnp.where(active, base + accepted, position)
        context = dstate.context.at[rows, jnp.where(active, end, capacity)].set(next_token, mode="drop")
        caches = tuple(rollback(c, end) for c in dstate.caches)
        dstate = dstate.replace(context=context, length=end + 1, caches=caches)
        # A row whose buffers could not take another full step ends with reason "length".
        outputs = stop_rows(outputs, tcache.lengths + width + schedule.max_pending + 2 > capacity)
        return dict(tcache=tcache, outputs=outputs, dstate=dstate, counters=counters, step=state["step"] + 1)

    state = dict(tcache=tcache, outputs=outputs, dstate=dstate, counters=SpecCounters.zeros(b, checked),
                 step=jnp.ones((), jnp.int32))
    state = jax.lax.while_loop(lambda s: ~jnp.all(s["outputs"].done), body, state)
    out = state["outputs"]
    return out.out, out.num_out, out.finish, state["counters"], state["dstate"].counters


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


def generate_cascade(
    target: Model, drafts: tuple, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key, *,
    schedule: CascadeSchedule, lenience: float, bigram: np.ndarray, max_ngram: int,
    stream: StreamSink | None = None,
) -> GenerateOutput:
    """Cascade speculative decoding of a prepared batch (see `ssd_jax.generate`, method "csd").

    drafts: the neural drafters, largest first (they match schedule.num_drafters); bigram int32
    [V]: Max-Gram's table (any table when the schedule has no Max-Gram op).
    """
    plan = CascadePlan(schedule=schedule, lenience=float(lenience), max_ngram=max_ngram,
                       out_size=bucket(max_new_tokens), prompt_size=batch.tokens.shape[1])
    eos = np.array(target.config.eos_token_ids or (-1,), np.int32)
    args = (loop_params(target), tuple(loop_params(d) for d in drafts), jnp.asarray(bigram, jnp.int32),
            jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), row_keys(key, batch.batch_size),
            jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos))
    dcfgs = tuple(d.config for d in drafts)
    streaming = stream is not None
    fn = functools.partial(_decode, tcfg=target.config, dcfgs=dcfgs, sampling=sampling, plan=plan, stream=streaming)
    static_key = ("cascade", target.config, dcfgs, sampling, plan, streaming)
    (out, num_out, finish, counters, reviews), wall, compile_s = run_compiled(fn, static_key, args, stream)
    output = speculative_output("csd", batch, out, num_out, finish, counters, wall, compile_s,
                                dict(num_draft_tokens_per_step=schedule.target_width))
    output.stats.update(cascade_stats(schedule, plan.lenience, counters, reviews))
    return output
