"""Draft-model speculative decoding, single-path and multi-path, as one jitted `lax.while_loop`.

Each step: the draft catches up on last step's emitted tokens and drafts K paths of L tokens ->
the target scores them in one forward (a linear block for K = 1, a token tree otherwise) ->
a verifier decides (accepted count, next token, path) -> both caches are rolled back or the
accepted path compacted -> tokens are appended -> counters. No host round trip per step.

Invariant at the top of a step, per row: the target cache holds every emitted token but the last
one, `cur`, which sits at position P = target lengths. The draft cache holds the same text minus
the tokens in `chunk` (chunk[:chunk_len], ending with cur), which it processes first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax import verify
from ssd_jax.draft.model_chain import draft_paths
from ssd_jax.engine.autoregressive import loop_params, prefill, sample_rows
from ssd_jax.engine.emission import Outputs, append, stop_rows
from ssd_jax.engine.output import GenerateOutput
from ssd_jax.engine.prompts import PromptBatch, bucket, row_keys
from ssd_jax.engine.runner import run_compiled, speculative_output
from ssd_jax.engine.streaming import StreamSink, emit
from ssd_jax.metrics import SpecCounters
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, compact_path, rollback
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities
from ssd_jax.tree import build_tree, gather_path_rows, path_nodes

# method -> (verifier at temperature > 0, multi-path?)
SPECULATIVE_METHODS: dict[str, tuple[Callable, bool]] = {
    "sd": (verify.tokenwise, False),
    "bv": (verify.block, False),
    "specinfer": (verify.specinfer, True),
    "spectr": (verify.spectr, True),
    "gbv": (verify.gbv, True),
}


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """Static shape of a speculative decode: method, draft length L, paths K, buffer sizes."""

    method: str
    num_draft_tokens: int
    num_paths: int
    out_size: int
    capacity: int

    @property
    def multi_path(self) -> bool:
        return SPECULATIVE_METHODS[self.method][1]

    def verifier(self, sampling: SamplingParams) -> Callable:
        if sampling.greedy:
            return verify.greedy_multipath if self.multi_path else verify.greedy
        return SPECULATIVE_METHODS[self.method][0]


def _per_row(verifier: Callable, key, *arrays) -> verify.VerifyResult:
    """Runs a verifier row by row (each with its own key) so a row's verdict never depends on
    the batch it is in."""
    result = jax.vmap(lambda k, *xs: verifier(k, *[x[None] for x in xs]))(key, *arrays)
    return jax.tree.map(lambda x: x[:, 0], result)


def _emitted(chosen: jax.Array, num_accepted: jax.Array, next_token: jax.Array) -> jax.Array:
    """chosen int32 [B, L], accepted [B], next [B] -> int32 [B, L+1]: chosen[:a] + [next] + zeros."""
    length = chosen.shape[1]
    j = jnp.arange(length + 1)[None, :]
    padded = jnp.concatenate([chosen, jnp.zeros_like(chosen[:, :1])], axis=1)
    return jnp.where(j < num_accepted[:, None], padded, jnp.where(j == num_accepted[:, None], next_token[:, None], 0))


def _decode(tparams, dparams, tokens, lengths, keys, max_new, eos_ids, *, tcfg: ModelConfig, dcfg: ModelConfig,
            sampling: SamplingParams, plan: SpecPlan, stream: bool, return_caches: bool = False):
    b = tokens.shape[0]
    L, K = plan.num_draft_tokens, plan.num_paths
    vocab = tcfg.vocab_size
    verifier = plan.verifier(sampling)
    rows = jnp.arange(b)

    logits, tcache = prefill(tparams, tcfg, tokens, lengths, plan.capacity)
    _, dcache = prefill(dparams, dcfg, jnp.repeat(tokens, K, axis=0), jnp.repeat(lengths, K), plan.capacity)
    first = sample_rows(sampling, jax.vmap(jax.random.fold_in)(keys, jnp.zeros((b,), jnp.int32)), logits)
    outputs, _ = append(Outputs.empty(b, plan.out_size), first[:, None], jnp.ones((b,), jnp.int32), max_new, eos_ids)
    if stream:
        emit(first[:, None], jnp.ones((b,), jnp.int32))
    chunk_width = L + 1 if plan.multi_path else 2
    chunk = jnp.zeros((b, chunk_width), jnp.int32).at[:, 0].set(first)

    def cond(state):
        return ~jnp.all(state["outputs"].done)

    def body(state):
        tcache, dcache, outputs = state["tcache"], state["dcache"], state["outputs"]
        cur, chunk, chunk_len = state["cur"], state["chunk"], state["chunk_len"]
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state["step"])
        draft_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1), K))(step_keys).reshape(b * K, 2)
        verify_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(step_keys, 2)
        active = ~outputs.done
        position = tcache.lengths  # of cur

        paths, q, dcache = draft_paths(
            dparams, dcfg, dcache, jnp.repeat(chunk, K, axis=0), jnp.repeat(chunk_len, K), draft_keys,
            num_draft_tokens=L, sampling=sampling, target_vocab=vocab,
        )
        paths = paths.reshape(b, K, L)
        q = q.reshape(b, K, L, vocab)

        if plan.multi_path:
            tree = build_tree(cur, paths)
            logits, tcache = forward_cached(tparams, tcfg, tree.tokens, position[:, None] + tree.depth, tcache,
                                            tree_mask=tree.mask)
            p = gather_path_rows(probabilities(logits, sampling), tree)
            result = _per_row(verifier, verify_keys, paths, q, p)
            keep = jnp.where(active, result.num_accepted + 1, 0)
            tcache = compact_path(tcache, path_nodes(tree, result.path_index), keep)
        else:
            block = jnp.concatenate([cur[:, None], paths[:, 0]], axis=1)
            block_positions = position[:, None] + jnp.arange(L + 1, dtype=jnp.int32)[None, :]
            logits, tcache = forward_cached(tparams, tcfg, block, block_positions, tcache)
            p = probabilities(logits, sampling)
            result = _per_row(verifier, verify_keys, paths[:, 0], q[:, 0], p)
            tcache = commit(tcache, jnp.where(active, result.num_accepted + 1, 0))

        accepted, next_token = result.num_accepted, result.next_token
        chosen = paths[rows, result.path_index]
        emitted = _emitted(chosen, accepted, next_token)
        outputs, appended = append(outputs, emitted, accepted + 1, max_new, eos_ids)
        if stream:
            emit(emitted, appended)
        counters = state["counters"].record(active, accepted)

        if plan.multi_path:
            # Every path copy rolls back to just after cur and re-reads the accepted tokens.
            dcache = rollback(dcache, jnp.repeat(position + 1, K))
            chunk, chunk_len = emitted, accepted + 1
        else:
            # The draft cache holds cur and paths[:L-1]; when all L were accepted it still lacks
            # the last draft token, which joins the bonus token in the next chunk.
            all_accepted = accepted == L
            dcache = rollback(dcache, jnp.where(all_accepted, position + L, position + 1 + accepted))
            last = paths[:, 0, L - 1]
            chunk = jnp.where(all_accepted[:, None], jnp.stack([last, next_token], 1),
                              jnp.stack([next_token, next_token], 1))
            chunk_len = jnp.where(all_accepted, 2, 1).astype(jnp.int32)
        # A row whose cache could not take another full step ends with reason "length".
        outputs = stop_rows(outputs, tcache.lengths + (K * L + 1) > plan.capacity)
        return dict(tcache=tcache, dcache=dcache, outputs=outputs, cur=next_token, chunk=chunk,
                    chunk_len=chunk_len.astype(jnp.int32), counters=counters, step=state["step"] + 1)

    state = dict(tcache=tcache, dcache=dcache, outputs=outputs, cur=first, chunk=chunk,
                 chunk_len=jnp.ones((b,), jnp.int32), counters=SpecCounters.zeros(b, L),
                 step=jnp.ones((), jnp.int32))
    state = jax.lax.while_loop(cond, body, state)
    out = state["outputs"]
    if return_caches:  # for tests: the final target and draft caches
        return out.out, out.num_out, out.finish, state["counters"], state["tcache"], state["dcache"]
    return out.out, out.num_out, out.finish, state["counters"]


def generate_speculative(
    target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key, *,
    method: str, num_draft_tokens: int, num_paths: int, stream: StreamSink | None = None,
) -> GenerateOutput:
    """Speculative decoding of a prepared batch (see `ssd_jax.generate`)."""
    out_size = bucket(max_new_tokens)
    plan = SpecPlan(method=method, num_draft_tokens=num_draft_tokens, num_paths=num_paths, out_size=out_size,
                    capacity=batch.tokens.shape[1] + out_size + 2 * num_paths * num_draft_tokens + 4)
    eos = np.array(target.config.eos_token_ids or (-1,), np.int32)
    args = (loop_params(target), loop_params(draft), jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
            row_keys(key, batch.batch_size), jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos))
    streaming = stream is not None
    fn = functools.partial(_decode, tcfg=target.config, dcfg=draft.config, sampling=sampling, plan=plan,
                           stream=streaming)
    static_key = ("speculative", target.config, draft.config, sampling, plan, plan.verifier(sampling), streaming)
    (out, num_out, finish, counters), wall, compile_s = run_compiled(fn, static_key, args, stream)
    return speculative_output(method, batch, out, num_out, finish, counters, wall, compile_s,
                              dict(num_draft_tokens_per_step=num_draft_tokens, num_paths=num_paths))
