"""The device programs of SSD (speculative speculative decoding), one jit-able function each.

Target group: `target_prefill`, `target_verify`, `target_plain`. Draft group: `draft_prefill`, `draft_build`
(the speculation cache), `select_next` (the cache lookup: the next speculation, drafted by
`fallback_model` / `fallback_ngram` on a miss), `draft_read` (the draft catching up on a stretch
decoded plainly). The host loop in `ssd_jax.ssd.host_loop` dispatches them asynchronously.

Invariants at the top of step s, per row (P = target cache length):
- target cache: every emitted token but the last, `cur` (at position P);
- draft state: its cache holds the same text minus `pending`, the n_adv tokens cur_{s-1},
  d_{s-1}[:k] whose K/V the previous build already wrote (uncommitted) right after the committed
  slots; its context buffer (n-gram fallback) holds the text up to cur_{s-1} and lacks `emitted`
  = d_{s-1}[:k] + [cur] (n_adv tokens). Both catch up at the start of the next draft program.
- speculation d_s int32 [B, L] with q_s float32 [B, L, V], the distributions it was sampled from.

Random keys, per row key r: first token fold_in(r, 0); verify of step s fold_in(fold_in(r, s), 2);
build of step s, slot i: split(fold_in(fold_in(r, s), 1), S)[i]; fallback drafting the
speculation of step s: fold_in(fold_in(r, s), 3); plain decoding step s ("auto"): fold_in(fold_in(r, s), 4). Distinct streams keep the draft of a speculation
independent of every verification that decides which speculation is used, so decoding is exact.
Under the Gumbel coupling (`ssd_jax.coupling`) every decision is the argmax of logits perturbed by
noise keyed by r and the token's position, on both groups: no stream is drawn from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax import verify
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.ngram import append_tokens, find_continuation, suffix_queries
from ssd_jax.draft.saguaro import draft_chain, fork_tokens
from ssd_jax.draft.vocab import align_logits
from ssd_jax.loop.autoregressive import draw_rows, prefill
from ssd_jax.loop.emission import Outputs, append, stop_rows
from ssd_jax.loop.skeleton import step_keys
from ssd_jax.metrics import SpecCounters
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, commit
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, argmax_first, probabilities

# The verifier at temperature 0 and above (tests swap in a broken one to show their power).
VERIFIERS = {"greedy": verify.greedy, "sampling": verify.tokenwise}
# Columns of the packed per-step outcome the host blocks on.
OUT_ACCEPTED, OUT_NEXT, OUT_APPENDED, OUT_DONE = range(4)


def verifier_for(sampling: SamplingParams):
    return VERIFIERS["greedy" if sampling.by_argmax else "sampling"]


def _fold(keys: jax.Array, *data: int | jax.Array, sampling: SamplingParams | None = None) -> jax.Array:
    """fold_in applied row by row: keys uint32 [B, 2] -> [B, 2]; the row keys themselves under
    the Gumbel coupling (sampling given and coupled), whose decisions draw nothing."""
    if sampling is not None and sampling.coupled:
        return keys
    for d in data:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, d)
    return keys


# ---------------------------------------------------------------------------------- target group

def target_prefill(tparams, tokens, lengths, keys, max_new, eos_ids, *, tcfg: ModelConfig,
                   sampling: SamplingParams, capacity: int, out_size: int, num_draft_tokens: int):
    """Prompts int32 [B, T] (lengths [B]) -> (target state, packed int32 [B, 4]: 0, first token,
    appended, done). The state: cache, outputs, counters, keys, max_new, eos."""
    b = tokens.shape[0]
    logits, cache = prefill(tparams, tcfg, tokens, lengths, capacity)
    first = draw_rows(sampling, step_keys(sampling, keys, 0), logits, lengths)
    ones = jnp.ones((b,), jnp.int32)
    outputs, appended = append(Outputs.empty(b, out_size), first[:, None], ones, max_new, eos_ids)
    state = dict(cache=cache, outputs=outputs, counters=SpecCounters.zeros(b, num_draft_tokens), keys=keys,
                 max_new=max_new, eos=eos_ids)
    packed = jnp.stack([jnp.zeros_like(first), first, appended, outputs.done.astype(jnp.int32)], axis=1)
    return state, packed


def target_verify(tparams, state, cur, drafted, q, step, *, tcfg: ModelConfig, sampling: SamplingParams,
                  capacity: int, verifier):
    """One verification: the target scores [cur, d] in one forward and the verifier decides.

    cur int32 [B]; drafted int32 [B, L]; q float32 [B, L, V] (None at temperature 0); step int32 [].
    Commits cur and the accepted tokens, appends d[:k] + [t] to the outputs, records counters.
    Returns (state, packed int32 [B, 4]: k, t, tokens appended, done).
    """
    cache: KVCache = state["cache"]
    outputs: Outputs = state["outputs"]
    b, length = drafted.shape
    active = ~outputs.done
    block = jnp.concatenate([cur[:, None], drafted], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(length + 1, dtype=jnp.int32)[None, :]
    logits, cache = forward_cached(tparams, tcfg, block, positions, cache)
    if sampling.by_argmax:
        # Greedy verification reads argmax p only: the logits have the same argmax (lowest id on
        # ties, as `probabilities`' one-hot), and q is never read.
        p = decision_logits(logits, state["keys"], positions + 1, sampling)
        q = jnp.zeros((b, length, logits.shape[-1]), jnp.float32)
    else:
        p = probabilities(logits, sampling)
    keys = _fold(state["keys"], step, 2)
    result = jax.vmap(lambda k, d, qq, pp: verifier(k, d[None], qq[None], pp[None]))(keys, drafted, q, p)
    accepted, next_token = result.num_accepted[:, 0], result.next_token[:, 0]
    cache = commit(cache, jnp.where(active, accepted + 1, 0))
    emitted = emitted_tokens(drafted, accepted, next_token)
    outputs, appended = append(outputs, emitted, accepted + 1, state["max_new"], state["eos"])
    # A verify dispatched ahead of the host's knowing that every row had ended (at an EOS) counts nothing.
    counters = jax.tree.map(lambda new, old: jnp.where(jnp.any(active), new, old),
                            state["counters"].record(active, accepted), state["counters"])
    # A row whose cache could not take another step ends with reason "length".
    outputs = stop_rows(outputs, cache.lengths + length + 1 > capacity)
    state = dict(state, cache=cache, outputs=outputs, counters=counters)
    packed = jnp.stack([accepted, next_token, appended, outputs.done.astype(jnp.int32)], axis=1)
    return state, packed.astype(jnp.int32)


def target_plain(tparams, state, cur, step, *, tcfg: ModelConfig, sampling: SamplingParams, capacity: int,
                 chunk: int, keep_law: bool = True):
    """Up to `chunk` plain decoding steps (the target alone), stopping early once every row is
    done: SSD under draft_len="auto" decodes a call's stretches this way where it measures slower
    than plain decoding. cur int32 [B] as in `target_verify`; step int32 []: the first plain
    step's index (keys fold_in(fold_in(r, step + i), 4), a stream no speculative step uses).
    Returns (state, emitted int32 [B, chunk] (row b's first appended[b] are new), appended int32
    [B], done bool [B], cur int32 [B], chosen float32 [B, chunk]: the target's probability of each
    emitted token (1 where decisions are argmaxes, or keep_law is False: no draft reads the
    chunk), which `draft_read` prices the draft against)."""
    b = cur.shape[0]

    def body(carry):
        i, state, cur, emitted, chosen, appended = carry
        cache: KVCache = state["cache"]
        outputs: Outputs = state["outputs"]
        active = ~outputs.done
        logits, cache = forward_cached(tparams, tcfg, cur[:, None], cache.lengths[:, None], cache)
        token = draw_rows(sampling, _fold(state["keys"], step + i, 4, sampling=sampling), logits[:, 0],
                          cache.lengths + 1)
        if sampling.by_argmax or not keep_law:
            p_token = jnp.ones((b,), jnp.float32)
        else:
            p_token = jnp.take_along_axis(probabilities(logits[:, 0], sampling), token[:, None], axis=1)[:, 0]
        cache = commit(cache, active.astype(jnp.int32))
        outputs, n = append(outputs, token[:, None], jnp.ones((b,), jnp.int32), state["max_new"], state["eos"])
        outputs = stop_rows(outputs, cache.lengths + 1 > capacity)
        slots = jnp.where(n > 0, appended, chunk)
        emitted = emitted.at[jnp.arange(b), slots].set(token, mode="drop")
        chosen = chosen.at[jnp.arange(b), slots].set(p_token, mode="drop")
        state = dict(state, cache=cache, outputs=outputs, counters=state["counters"].record_ar_step(active))
        return i + 1, state, jnp.where(active, token, cur), emitted, chosen, appended + n

    def more(carry):
        return (carry[0] < chunk) & ~jnp.all(carry[1]["outputs"].done)

    zeros = jnp.zeros((b,), jnp.int32)
    _, state, cur, emitted, chosen, appended = jax.lax.while_loop(
        more, body, (jnp.zeros((), jnp.int32), state, cur, jnp.zeros((b, chunk), jnp.int32),
                     jnp.zeros((b, chunk), jnp.float32), zeros))
    return state, emitted, appended, state["outputs"].done, cur, chosen


# ---------------------------------------------------------------------------------- draft group

def draft_prefill(dparams, tokens, lengths, first, keys, *, dcfg: ModelConfig, capacity: int, context_capacity: int):
    """The draft state after the prompt: cache holding the prompt (cur = first is pending),
    context = prompt + first (int32 [B, context_capacity]), keys uint32 [B, 2]."""
    b, width = tokens.shape
    _, cache = prefill(dparams, dcfg, tokens, lengths, capacity)
    context = jnp.zeros((b, context_capacity), jnp.int32).at[:, :width].set(tokens)
    context = jnp.where(jnp.arange(context_capacity)[None, :] < lengths[:, None], context, 0)
    context, context_len = append_tokens(context, lengths, first[:, None], jnp.ones((b,), jnp.int32))
    return dict(cache=cache, context=context, context_len=context_len, keys=keys)


def _catch_up(state, emitted, n_adv):
    """Commits the pending n_adv tokens (whose K/V the last build wrote) and appends emitted
    [B, L+1] (n_adv of them: d[:k] + [t]) to the context, which then ends with the new root."""
    cache = commit(state["cache"], n_adv)
    context, context_len = append_tokens(state["context"], state["context_len"], emitted, n_adv)
    return cache, context, context_len


def draft_read(dparams, state, emitted, n_adv, root, plain, chosen, count, *, dcfg: ModelConfig,
               sampling: SamplingParams, target_vocab: int):
    """The draft reads a stretch the target decoded plainly (`target_plain`), so that SSD can
    resume after it, and says how well it would have drafted it.

    emitted int32 [B, L+1], n_adv int32 [B]: the pending catch-up (module docstring); root int32
    [B]: the root before the stretch; plain int32 [B, C]: the stretch (row b's first count[b]
    tokens), chosen float32 [B, C]: the target's probability of each. One draft forward over
    [root, plain[:, :C-1]] writes and commits root and the stretch but its last token, which
    becomes the new root (no catch-up is then pending: emitted and n_adv are zeros).
    Returns (state, agreement float32 [B, C]): per token, the probability that the draft's
    speculation there would have been accepted, given the text before it: where decisions are
    argmaxes, whether the draft's decision is the token; else min(1, q(x) / p(x)), whose mean over
    tokens drawn from p is the draft's acceptance sum_x min(p, q) (0 past count)."""
    b, width = plain.shape
    cache, context, context_len = _catch_up(state, emitted, n_adv)
    block = jnp.concatenate([root[:, None], plain[:, :-1]], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    logits, cache = forward_cached(dparams, dcfg, block, positions, cache)
    aligned = align_logits(logits, target_vocab)
    if sampling.by_argmax:
        decided = argmax_first(decision_logits(aligned, state["keys"], positions + 1, sampling))
        agreement = (decided == plain).astype(jnp.float32)
    else:
        q = jnp.take_along_axis(probabilities(aligned, sampling), plain[:, :, None], axis=-1)[..., 0]
        agreement = jnp.minimum(1.0, q / jnp.maximum(chosen, 1e-30))
    counted = jnp.arange(width)[None, :] < count[:, None]
    cache = commit(cache, count)
    context, context_len = append_tokens(context, context_len, plain, count)
    return dict(state, cache=cache, context=context, context_len=context_len), jnp.where(counted, agreement, 0.0)


def _repeat_rows(cache: KVCache, times: int, lengths: jax.Array) -> KVCache:
    """Each row's K/V repeated `times` times (row b's copies at b*times + i), with new lengths int32 [B*times]."""
    axis = 0 if cache.per_layer else 1  # stacked buffers are [layers, B, ...]
    repeat = lambda x: jnp.repeat(x, times, axis=axis)  # noqa: E731
    k = tuple(map(repeat, cache.k)) if cache.per_layer else repeat(cache.k)
    v = tuple(map(repeat, cache.v)) if cache.per_layer else repeat(cache.v)
    return KVCache(k=k, v=v, lengths=lengths.astype(jnp.int32))


def draft_build(dparams, state, emitted, n_adv, cur, drafted, slot_depth, slot_rank, fanout, step, *,
                dcfg: ModelConfig, sampling: SamplingParams, target_vocab: int, saguaro_c: float, rmax: int):
    """Builds the speculation cache for the outcomes of verifying `drafted` (while the target does).

    emitted int32 [B, L+1], n_adv int32 [B]: the catch-up (see module docstring). cur int32 [B]
    and drafted int32 [B, L]: the speculation under verification. slot_depth, slot_rank int32 [S],
    fanout int32 [L+1]: the slot layout (`fanout.SlotLayout`). step int32 [].
    One draft forward over [cur, d] gives the draft's logits at depths 0..L (its K/V stays in the
    cache, uncommitted, for the next catch-up); every slot forks on its candidate token and drafts
    L tokens from there on its own copy of the cache (B*S rows in one batched chain).
    Returns (state, candidates int32 [B, S, 1+L]: each slot's fork token then its L drafted
    tokens (one array, so the host fetches it in one transfer), q float32 [B, S, L, V] or None).
    """
    b, length = drafted.shape
    num_slots = slot_depth.shape[0]
    cache, context, context_len = _catch_up(state, emitted, n_adv)
    block = jnp.concatenate([cur[:, None], drafted], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(length + 1, dtype=jnp.int32)[None, :]
    logits, cache = forward_cached(dparams, dcfg, block, positions, cache)
    scores = decision_logits(align_logits(logits, target_vocab), state["keys"], positions + 1, sampling)
    fork = fork_tokens(scores, drafted, slot_depth, slot_rank, rmax=rmax)

    # Slot copies: the committed text plus cur, d[:depth] (already written by the forward above).
    copies = _repeat_rows(cache, num_slots, (cache.lengths[:, None] + 1 + slot_depth[None, :]).reshape(-1))
    if sampling.coupled:
        keys = jnp.repeat(state["keys"], num_slots, axis=0)
    else:
        keys = jax.vmap(lambda k: jax.random.split(k, num_slots))(_fold(state["keys"], step, 1)).reshape(-1, 2)
    tokens, q = draft_chain(dparams, dcfg, copies, fork.reshape(-1, 1), jnp.ones((b * num_slots,), jnp.int32),
                            keys, fanout, num_draft_tokens=length, sampling=sampling, target_vocab=target_vocab,
                            saguaro_c=saguaro_c, rmax=rmax)
    candidates = jnp.concatenate([fork[:, :, None], tokens.reshape(b, num_slots, length)], axis=2)
    q = None if q is None else q.reshape(b, num_slots, length, -1)
    state = dict(state, cache=cache, context=context, context_len=context_len)
    return state, candidates, q


def fallback_model(dparams, state, emitted, n_adv, root, fanout, step, *, dcfg: ModelConfig,
                   sampling: SamplingParams, target_vocab: int, saguaro_c: float, rmax: int, num_draft_tokens: int):
    """Just-in-time drafting of step `step`'s speculation with the draft model, for every row
    (the host uses it for the rows that missed). root int32 [B]: the new cur.
    Returns (tokens int32 [B, L], q float32 [B, L, V] or None); the state is not changed."""
    cache, _, _ = _catch_up(state, emitted, n_adv)
    return draft_chain(dparams, dcfg, cache, root[:, None], jnp.ones_like(root),
                       _fold(state["keys"], step, 3, sampling=sampling),
                       fanout, num_draft_tokens=num_draft_tokens, sampling=sampling, target_vocab=target_vocab,
                       saguaro_c=saguaro_c, rmax=rmax)


def fallback_ngram(state, emitted, n_adv, *, sampling: SamplingParams, target_vocab: int, num_draft_tokens: int,
                   n_min: int = 1, n_max: int = 3):
    """Prompt-lookup drafting: the L tokens that followed the last earlier occurrence of the text's
    final n-gram (n_max..n_min) in prompt + emitted text; a short match is padded with the root.
    The draft is a point mass: q = one-hot of each token (None at temperature 0).
    Returns (tokens int32 [B, L], q); the state is not changed."""
    _, context, context_len = _catch_up(state, emitted, n_adv)
    query, query_len = suffix_queries(context, context_len, n_max)
    found, count, _ = find_continuation(context, context_len, query, query_len, n_min=n_min, n_max=n_max,
                                        num_tokens=num_draft_tokens)
    root = jnp.take_along_axis(context, jnp.maximum(context_len - 1, 0)[:, None], axis=1)
    tokens = jnp.where(jnp.arange(num_draft_tokens)[None, :] < count[:, :1], found[:, 0], root).astype(jnp.int32)
    if sampling.by_argmax:
        return tokens, None
    return tokens, jax.nn.one_hot(tokens, target_vocab, dtype=jnp.float32)


def ngram_fallback(dparams, state, emitted, n_adv, root, fanout, step, **options):
    """`fallback_ngram` with `fallback_model`'s arguments (it reads neither the draft's weights,
    the root, which ends its context, the fan-out nor the step)."""
    del dparams, root, fanout, step
    return fallback_ngram(state, emitted, n_adv, **options)


# Columns of the per-step report `select_next` hands the host (after the verify's OUT_* columns).
INFO_HIT, INFO_MISSED = 4, 5
INFO_EMITTED = 6   # then the L+1 emitted tokens


def emitted_tokens(drafted, accepted, next_token):
    """What a verification emitted per row: d[:k], then t, then zeros. drafted int32 [B, L];
    accepted, next_token int32 [B]. Returns int32 [B, L+1]."""
    j = jnp.arange(drafted.shape[1] + 1)[None, :]
    padded = jnp.concatenate([drafted, jnp.zeros_like(drafted[:, :1])], axis=1)
    return jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None], next_token[:, None], 0))


def select_next(dparams, state, packed, candidates, spec_q, drafted, was_done, slot_depth, fanout, step, *,
                fallback, num_draft_tokens: int, target_vocab: int):
    """Step 4, on the draft group and without the host: the next speculation of every row.

    packed int32 [B, 4]: the verify's outcome (OUT_* columns), moved to this group; candidates
    int32 [B, S, 1+L] and spec_q float32 [B, S, L, V] (None at temperature 0): the cache that
    `draft_build` made for that verify (state: its draft state); drafted int32 [B, L]: the
    speculation verified; was_done bool [B]: the rows done before it; slot_depth int32 [S],
    fanout int32 [L+1]: the cache's layout; step int32 []: the next step's index.
    A row whose outcome (k, t) the cache holds takes that slot's speculation. If any live row
    missed, `fallback(dparams, state, emitted, n_adv, root, fanout, step)` drafts every row from
    its new root t (one call, under lax.cond: a step where every row hit skips it) and the rows
    that missed take its speculation.
    Returns (cur int32 [B], drafted int32 [B, L], q float32 [B, L, V] or None, emitted int32
    [B, L+1] and n_adv int32 [B]: the draft's catch-up, done bool [B], report int32
    [B, INFO_EMITTED + L + 1]: packed, hit, missed, emitted; one array, so the host reads a
    step in one transfer)."""
    accepted, next_token = packed[:, OUT_ACCEPTED], packed[:, OUT_NEXT]
    done = packed[:, OUT_DONE].astype(bool)
    emitted = emitted_tokens(drafted, accepted, next_token).astype(jnp.int32)
    n_adv = jnp.where(was_done, 0, accepted + 1).astype(jnp.int32)
    fork, tokens = candidates[:, :, 0], candidates[:, :, 1:]
    match = (slot_depth[None, :] == accepted[:, None]) & (fork == next_token[:, None])
    hit, slot = jnp.any(match, axis=1), jnp.argmax(match, axis=1)
    rows = jnp.arange(drafted.shape[0])
    missed = ~hit & ~done
    b = drafted.shape[0]
    with_q = spec_q is not None

    def fallback_draft():
        out_tokens, out_q = fallback(dparams, state, emitted, n_adv, next_token, fanout, step)
        return (out_tokens.astype(jnp.int32), out_q) if with_q else (out_tokens.astype(jnp.int32), None)

    def no_draft():
        q_zero = jnp.zeros((b, num_draft_tokens, target_vocab), jnp.float32) if with_q else None
        return jnp.zeros((b, num_draft_tokens), jnp.int32), q_zero

    fallback_tokens, fallback_q = jax.lax.cond(jnp.any(missed), fallback_draft, no_draft)
    next_drafted = jnp.where(missed[:, None], fallback_tokens, tokens[rows, slot]).astype(jnp.int32)
    next_q = None
    if with_q:
        next_q = jnp.where(missed[:, None, None], fallback_q, spec_q[rows, slot])
    report = jnp.concatenate([packed.astype(jnp.int32), hit[:, None].astype(jnp.int32),
                              missed[:, None].astype(jnp.int32), emitted], axis=1)
    return next_token.astype(jnp.int32), next_drafted, next_q, emitted, n_adv, done, report
