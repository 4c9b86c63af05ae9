"""The draft's read of an SSD "auto" call that a plain verdict decoded with AR's loop from the start:
how often the draft's speculation would have been accepted on the call's text.

A call that starts plain runs no draft at all, so nothing in it measures the pair's acceptance, and
a plain verdict is reprobed early only where the acceptance rose since its SSD calls
(`ssd_jax.ssd.auto.acceptance_rose`). Where other calls of the pair (SD's) measure it, they feed
the rise; where SSD is the pair's only method, nothing did: prose after code stayed plain at 1.04x
AR where fixed L=6 ran 1.47x (the 1/5 cost regime, batch 1, T=0, one CPU device). One draft
forward over the call's prompt and text measures it instead, as SSD's own plain stretches do
(`ssd_jax.ssd.steps.draft_read`).

That forward is a draft prefill over the whole text, compute-bound where decoding is not: at the 1/5
cost regime on one CPU device it took 0.15-0.4 s of 2 s calls. So a program's reads spend at most
READ_SHARE of its plain calls' seconds (`read_due`): the first plain call is read, the next
ones once their seconds pay for another read.

Only where decisions are argmaxes (`SamplingParams.by_argmax`): the agreement of a token is then
whether the draft's decision is the token. Under rejection sampling it is min(1, q(x) / p(x)),
and AR's loop keeps no p(x).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.coupling import decision_logits
from ssd_jax.draft.vocab import align_logits
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.transformer import hidden_full, lm_head
from ssd_jax.runtime.compile_cache import PROGRAMS
from ssd_jax.runtime.output import GenerateOutput
from ssd_jax.runtime.prompts import PromptBatch, row_keys
from ssd_jax.sampling import SamplingParams, argmax_first
from ssd_jax.sharding.placement import place_array
from ssd_jax.tuning.ssd_memory import SSDMemory


READ_SHARE = 0.03   # of a program's plain calls' seconds, what its reads may spend


def read_due(memory: SSDMemory, key) -> bool:
    """Whether the plain call of the program `key` that just ran is read: its reads so far spent
    at most READ_SHARE of its plain calls' seconds, this call's included (`spent`)."""
    with memory.lock:
        plain_s, read_s = memory.plain_reads.lookup(key, (0.0, 0.0))
    return read_s <= READ_SHARE * plain_s


def spent(memory: SSDMemory, key, call_s: float, read_s: float) -> None:
    """Adds a plain call's seconds (`read_due` counts them before it decides) and its read's (0.0: none)."""
    with memory.lock:
        plain_s, reads_s = memory.plain_reads.lookup(key, (0.0, 0.0))
        memory.plain_reads.store(key, (plain_s + float(call_s), reads_s + float(read_s)))


def text_agreement(params: dict, text: jax.Array, prompt_lengths: jax.Array, continuation: jax.Array,
                   generated: jax.Array, keys: jax.Array, *, config: ModelConfig, sampling: SamplingParams,
                   target_vocab: int) -> tuple[jax.Array, jax.Array]:
    """How often the draft decides a call's generated tokens.

    text int32 [B, P + N]: row b's prompt (prompt_lengths int32 [B] tokens), then its generated
    tokens continuation int32 [B, N] (the first generated int32 [B] of them), then padding; keys
    uint32 [B, 2]: the rows' noise keys (`ssd_jax.runtime.prompts.row_keys`). One draft forward
    over the text, the head on the N positions before generated tokens only. Returns (agreement
    int32 [B]: how many of row b's generated tokens are the draft's decision given the text before
    them; count int32 [B]: generated)."""
    hidden, _ = hidden_full(params, config, text)
    steps = jnp.arange(continuation.shape[1], dtype=jnp.int32)
    before = prompt_lengths[:, None] - 1 + steps[None, :]   # the position whose output decides each token
    logits = lm_head(params, config, jnp.take_along_axis(hidden, before[:, :, None], axis=1))
    decided = argmax_first(decision_logits(align_logits(logits, target_vocab), keys, before + 1, sampling))
    counted = steps[None, :] < generated[:, None]
    agreement = jnp.sum(jnp.where(counted, decided == continuation, False), axis=1, dtype=jnp.int32)
    return agreement, jnp.sum(counted, axis=1, dtype=jnp.int32)


def read_call(draft: Model, target_vocab: int, batch: PromptBatch, max_new_tokens: int, out: GenerateOutput,
              sampling: SamplingParams, key) -> tuple[float | None, float, float]:
    """(the acceptance the draft would have met on the call's text: its agreement over every
    row's generated tokens pooled, None where the call's sampling is not decided by argmaxes, the
    draft spans several processes or the call generated nothing; the read's seconds but its
    compile; the compile's seconds, 0.0 once the program is in the compile cache). out: the
    call's output (AR's loop, at most max_new_tokens a row), key: its key."""
    start = time.perf_counter()
    if not sampling.by_argmax or not all(leaf.is_fully_addressable for leaf in jax.tree.leaves(draft.params)):
        return None, 0.0, 0.0   # (a mesh over several processes: every process would have to join the read)
    generated = np.asarray([len(row) for row in out.tokens], np.int32)
    if generated.sum() == 0:
        return None, 0.0, 0.0
    width = int(max_new_tokens)   # not the call's longest row: one program per prompt bucket
    continuation = np.zeros((batch.batch_size, width), np.int32)
    text = np.zeros((batch.batch_size, batch.tokens.shape[1] + width), np.int32)
    for row, tokens in enumerate(out.tokens):
        length = int(batch.lengths[row])
        continuation[row, :len(tokens)] = tokens
        text[row, :length] = batch.tokens[row, :length]
        text[row, length:length + len(tokens)] = tokens
    arrays = (text, np.asarray(batch.lengths, np.int32), continuation, generated,
              row_keys(key, batch.batch_size, sampling))
    if draft.placement is not None:
        arrays = tuple(place_array(x, draft.placement.replicated()) for x in arrays)
    program = functools.partial(text_agreement, config=draft.config, sampling=sampling, target_vocab=target_vocab)
    executable, compile_s = PROGRAMS.compiled(program, ("ssd_plain_read", draft.config, sampling, target_vocab),
                                              draft.params, *arrays)
    agreement, count = executable(draft.params, *arrays)
    acceptance = float(np.sum(np.asarray(agreement))) / float(np.sum(np.asarray(count)))
    return acceptance, time.perf_counter() - start - compile_s, compile_s
