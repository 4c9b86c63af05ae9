"""Retrieval drafting without a draft model (prompt lookup, LogitSpec), as one jitted
`lax.while_loop`.

Each step: build a static-shaped draft tree from the on-device context buffer (prompt + emitted
text) -> the target scores every node in one tree forward -> the point-mass tree walk decides
the accepted path and the next token -> the accepted path is compacted into the target cache,
the emitted tokens are appended to the outputs and to the context buffer -> counters.

Invariant at the top of a step, per row: the target cache holds every emitted token but the last,
`cur` (the tree root), which sits at position P = cache length; the context buffer holds the
prompt and every emitted token including cur; last_logits are the target logits cur was drawn
from (LogitSpec's next-next guesses).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.draft.logitspec import logitspec_tree
from ssd_jax.draft.ngram import append_tokens
from ssd_jax.draft.prompt_lookup import prompt_lookup_tree
from ssd_jax.draft.tree_layout import TreeLayout, linear_layout, logitspec_layout
from ssd_jax.engine.autoregressive import loop_params, prefill, sample_rows
from ssd_jax.engine.emission import Outputs, append, stop_rows
from ssd_jax.engine.output import GenerateOutput
from ssd_jax.engine.prompts import PromptBatch, bucket, row_keys
from ssd_jax.engine.runner import run_compiled, speculative_output
from ssd_jax.engine.streaming import StreamSink, emit
from ssd_jax.metrics import SpecCounters
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import compact_path
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities
from ssd_jax.verify.point_tree import point_mass_tree

RETRIEVAL_METHODS = ("pld", "logitspec")


@dataclasses.dataclass(frozen=True)
class RetrievalPlan:
    """Static shape of a retrieval decode.

    method: "pld" or "logitspec"; num_draft_tokens: PLD's draft length, LogitSpec's root-branch
    length; ngram_min / ngram_max: retrieval n-gram orders; logitspec_topk, tree_capacity:
    LogitSpec's next-next candidates and node budget; out_size, capacity: buffer sizes.
    """

    method: str
    num_draft_tokens: int
    ngram_min: int
    ngram_max: int
    logitspec_topk: int
    tree_capacity: int
    out_size: int
    prompt_size: int

    @functools.cached_property
    def layout(self) -> TreeLayout:
        if self.method == "pld":
            return linear_layout(self.num_draft_tokens)
        return logitspec_layout(self.num_draft_tokens, self.logitspec_topk, self.tree_capacity)

    @property
    def cache_capacity(self) -> int:
        return self.prompt_size + self.out_size + self.layout.num_nodes + 2

    @property
    def context_capacity(self) -> int:
        return self.prompt_size + self.out_size + self.layout.max_depth + 2


def _draft_tree(plan: RetrievalPlan, context, context_len, last_logits):
    if plan.method == "pld":
        return prompt_lookup_tree(context, context_len, num_draft_tokens=plan.num_draft_tokens,
                                  n_min=plan.ngram_min, n_max=plan.ngram_max)
    return logitspec_tree(context, context_len, last_logits, plan.layout, max_ngram=plan.ngram_max)


def _decode(tparams, tokens, lengths, keys, max_new, eos_ids, *, tcfg: ModelConfig, sampling: SamplingParams,
            plan: RetrievalPlan, stream: bool):
    b, prompt_width = tokens.shape
    layout = plan.layout
    depth_of = jnp.asarray(layout.depth())
    tree_mask = jnp.asarray(layout.mask())
    n_nodes, max_depth = layout.num_nodes, layout.max_depth
    rows = jnp.arange(b)

    logits, tcache = prefill(tparams, tcfg, tokens, lengths, plan.cache_capacity)
    first = sample_rows(sampling, jax.vmap(jax.random.fold_in)(keys, jnp.zeros((b,), jnp.int32)), logits)
    outputs, _ = append(Outputs.empty(b, plan.out_size), first[:, None], jnp.ones((b,), jnp.int32), max_new, eos_ids)
    if stream:
        emit(first[:, None], jnp.ones((b,), jnp.int32))
    context = jnp.zeros((b, plan.context_capacity), jnp.int32).at[:, :prompt_width].set(tokens)
    context = jnp.where(jnp.arange(plan.context_capacity)[None, :] < lengths[:, None], context, 0)
    context, context_len = append_tokens(context, lengths, first[:, None], jnp.ones((b,), jnp.int32))

    def verify_row(key, tree_tokens, valid, scores):
        return point_mass_tree(key, tree_tokens[None], valid[None], np.asarray(layout.parents), scores[None],
                               greedy=sampling.greedy)

    def body(state):
        tcache, outputs = state["tcache"], state["outputs"]
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state["step"])
        active = ~outputs.done
        position = tcache.lengths  # of the root

        tree_tokens, valid = _draft_tree(plan, state["context"], state["context_len"], state["last_logits"])
        logits, tcache = forward_cached(tparams, tcfg, tree_tokens, position[:, None] + depth_of[None, :], tcache,
                                        tree_mask=jnp.broadcast_to(tree_mask, (b, n_nodes, n_nodes)))
        scores = logits if sampling.greedy else probabilities(logits, sampling)
        verdict = jax.vmap(verify_row)(step_keys, tree_tokens, valid, scores)
        verdict = jax.tree.map(lambda x: x[:, 0], verdict)
        accepted, next_token, nodes = verdict.num_accepted, verdict.next_token, verdict.nodes

        tcache = compact_path(tcache, nodes, jnp.where(active, accepted + 1, 0))
        j = jnp.arange(max_depth + 1)[None, :]
        path_tokens = jnp.take_along_axis(tree_tokens, jnp.concatenate([nodes[:, 1:], nodes[:, :1]], axis=1), axis=1)
        emitted = jnp.where(j < accepted[:, None], path_tokens, jnp.where(j == accepted[:, None], next_token[:, None], 0))
        outputs, appended = append(outputs, emitted, accepted + 1, max_new, eos_ids)
        if stream:
            emit(emitted, appended)
        context, context_len = append_tokens(state["context"], state["context_len"], emitted,
                                             jnp.where(active, accepted + 1, 0))
        counters = state["counters"].record(active, accepted, jnp.sum(valid, axis=1) - 1)
        last_logits = logits[rows, nodes[rows, accepted]]
        outputs = stop_rows(outputs, tcache.lengths + n_nodes > plan.cache_capacity)
        return dict(tcache=tcache, outputs=outputs, context=context, context_len=context_len,
                    last_logits=last_logits, counters=counters, step=state["step"] + 1)

    state = dict(tcache=tcache, outputs=outputs, context=context, context_len=context_len, last_logits=logits,
                 counters=SpecCounters.zeros(b, max_depth), step=jnp.ones((), jnp.int32))
    state = jax.lax.while_loop(lambda s: ~jnp.all(s["outputs"].done), body, state)
    out = state["outputs"]
    return out.out, out.num_out, out.finish, state["counters"]


def generate_retrieval(
    target: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key, *, method: str,
    num_draft_tokens: int, ngram_min: int, ngram_max: int, logitspec_topk: int, tree_capacity: int,
    stream: StreamSink | None = None,
) -> GenerateOutput:
    """Prompt lookup or LogitSpec decoding of a prepared batch (see `ssd_jax.generate`)."""
    plan = RetrievalPlan(method=method, num_draft_tokens=num_draft_tokens, ngram_min=ngram_min,
                         ngram_max=ngram_max, logitspec_topk=logitspec_topk, tree_capacity=tree_capacity,
                         out_size=bucket(max_new_tokens), prompt_size=batch.tokens.shape[1])
    eos = np.array(target.config.eos_token_ids or (-1,), np.int32)
    args = (loop_params(target), jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), row_keys(key, batch.batch_size),
            jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos))
    fn = functools.partial(_decode, tcfg=target.config, sampling=sampling, plan=plan, stream=stream is not None)
    static_key = ("retrieval", target.config, sampling, plan, stream is not None)
    (out, num_out, finish, counters), wall, compile_s = run_compiled(fn, static_key, args, stream)
    extra = dict(tree_nodes=plan.layout.num_nodes)
    return speculative_output(method, batch, out, num_out, finish, counters, wall, compile_s,
                              dict(num_draft_tokens_per_step=plan.layout.num_nodes - 1, **extra))
