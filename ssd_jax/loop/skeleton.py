"""The one decode skeleton under every synchronous method: prefill, the first token, then one
`lax.while_loop` whose body asks the method for its step (draft -> target forward -> verify ->
commit) and does the rest once: emission of the step's tokens, EOS and length limits, finish
reasons and counters. The loop can also stop early and go on in a later program (`loop`'s
pause_at): how `generate` streams, chunk by chunk, with programs that hold no host callback.

A method supplies a `Parts` object (see `ssd_jax.loop.decoder.make_parts`); the adaptive loop's
parts are `AdaptiveParts`, which add what that loop reads.
Rows that are done must keep their caches (a method commits nothing for them).

Random keys, per row key r: the first token is drawn with fold_in(r, 0); step s gets fold_in(r, s).
Under the Gumbel coupling (`ssd_jax.coupling`) every step gets r itself: its decisions are
argmaxes of logits perturbed by noise keyed by r and the position, and need no other randomness.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.backend import policy_for
from ssd_jax.coupling import coupled_tokens
from ssd_jax.loop.emission import Outputs, append, emitted_tokens, stop_rows
from ssd_jax.metrics import SpecCounters
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, sample_from_logits


@struct.dataclass
class DecodeState:
    """The loop state of every method.

    tcache: the target's KV cache (every emitted token but `cur`); outputs: `Outputs` (tokens
    int32 [B, N], counts, finish reasons, done); counters: `SpecCounters`; cur int32 [B]: the last
    emitted token; step int32 []: the loop step (1 on entry); inner: the method's own state.
    """

    tcache: KVCache
    outputs: Outputs
    counters: SpecCounters
    cur: jax.Array
    step: jax.Array
    inner: Any


@struct.dataclass
class Verdict:
    """A method step's outcome. tcache: the target cache with the accepted tokens committed;
    inner: the method's new state; chosen int32 [B, M]: the path the accepted tokens are its
    first `accepted`; accepted int32 [B]; next_token int32 [B]: the correction or bonus token;
    drafted int32 [B] tokens proposed, or None for `counter_width` per row; draft_forwards int32
    []: the draft forwards the step ran after its catch-up (adaptive speculation's cost input);
    token_law float32 [B]: a plain step's probability of next_token under the target's law, from
    parts whose resync scores the draft (`ssd_jax.loop.shadow.chain_counts`), else None;
    verified bool []: whether a gated step (`AdaptiveParts.gates`) verified its draft or, finding
    nothing worth verifying, ran as a plain step; None: a step that always verifies."""

    tcache: KVCache
    inner: Any
    chosen: jax.Array
    accepted: jax.Array
    next_token: jax.Array
    drafted: jax.Array | None = None
    draft_forwards: jax.Array | None = None
    token_law: jax.Array | None = None
    verified: jax.Array | None = None


class Parts(Protocol):
    """What the skeleton (and `ssd_jax.loop.decoder`) reads of a method's parts.

    tparams: the target's params the steps run on (`ssd_jax.loop.autoregressive.in_loop_params`);
    sampling: the call's `SamplingParams` (its coupling decides the keys a step gets, `step_keys`);
    capacity: KV cache slots of the method's buffers (the target's cache takes at most the prompt,
        the outputs and one step's room: `target_capacity`);
    room: slots one step may need past the committed text (a row without them ends with finish
        reason "length");
    chain_writes: whether a step writes the token at depth i of its draft to target slot
        lengths + i (one chain, no tree): then the target's cache needs no room past the prompt and
        the outputs (`target_capacity`);
    pending_width: > 0 where the parts run under the adaptive loop, which decodes plainly while a
        tree step lacks room (`room_gated`); 0 elsewhere;
    counter_width: draft positions counted per step (0: no draft, only target calls count);
    init(tokens, lengths, first, logits) -> inner: the method's own loop state (a pytree);
    step(state, keys, active) -> Verdict: one step; keys uint32 [B, 2] are this step's per-row keys
        (`step_keys`: fold_in(row key, step), under the Gumbel coupling the row keys); active bool
        [B] the running rows.
    """

    tparams: dict
    sampling: SamplingParams
    capacity: int
    room: int
    chain_writes: bool
    pending_width: int
    counter_width: int

    def init(self, tokens: jax.Array, lengths: jax.Array, first: jax.Array, logits: jax.Array) -> Any: ...

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict: ...


class AdaptiveParts(Parts, Protocol):
    """What the adaptive loop (`ssd_jax.loop.adaptive_loop`) reads besides `Parts`: the parts of a
    method with draft_len "auto" (`SpeculativeParts`, `RetrievalParts`, `CascadeParts`).

    draft_len: L, the longest draft a step verifies (the loop keeps acceptance by position 1..L);
    drafts_with_model: whether a step runs draft forwards the loop prices per drafted token;
    takes_cap: whether `step` honours a per-step cap on the draft (`step(cap=)`), the loop then
        choosing it; else every step drafts up to L;
    verify_caps: the draft lengths verification is compiled for (ascending, the last L);
    dispatch_caps(batch): the caps the loop compiles one step for and picks once per run of steps
        at the same cap (`step(width=)`), or None where each step picks its own width;
    gates(batch): whether `step(gate=)` runs a step whose draft holds nothing worth verifying as a
        plain one (`Verdict.verified`): it then costs a plain step and teaches the loop nothing;
    learns_while_plain: whether plain steps record their tokens' target probabilities
        (`Verdict.token_law`) and the draft scores itself on them when it catches up
        (`scored_resync`);
    shadow_tree(inner) -> (tokens, valid, parents), or None: the draft a speculative step would
        verify now, for drafts that are point masses known without a draft model (retrieval): the
        loop walks it with the tokens plain steps draw (`ssd_jax.loop.shadow`);
    ar_step(state, keys, active) -> Verdict: a plain step (the target alone), the draft left behind;
    pending(inner) -> (pending int32 [B, pending_width], pending_len int32 [B]): the tokens the
        draft has not read, where plain steps append theirs;
    resync(inner, pending, pending_len) -> inner: the draft reads the tokens it missed;
    scored_resync(inner, pending, pending_len, laws, keys) -> (inner, acceptance, known): `resync`
        that also scores the draft on them (`learns_while_plain` parts; keys uint32 [B, 2]: the row
        keys, the noise keys of the Gumbel coupling).
    """

    draft_len: int
    drafts_with_model: bool
    takes_cap: bool
    verify_caps: tuple[int, ...]
    learns_while_plain: bool
    shadow_tree: Callable[[Any], tuple[jax.Array, jax.Array, np.ndarray]] | None

    def dispatch_caps(self, batch: int) -> tuple[int, ...] | None: ...

    def gates(self, batch: int) -> bool: ...

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap: jax.Array | None = None,
             width: int | None = None, gate: jax.Array | None = None) -> Verdict: ...

    def ar_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict: ...

    def pending(self, inner: Any) -> tuple[jax.Array, jax.Array]: ...

    def resync(self, inner: Any, pending: jax.Array, pending_len: jax.Array) -> Any: ...

    def scored_resync(self, inner: Any, pending: jax.Array, pending_len: jax.Array, laws: jax.Array,
                      keys: jax.Array) -> tuple[Any, jax.Array, jax.Array]: ...


def prefill(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, capacity: int,
            placement=None, feature_layers: tuple[int, ...] = ()):
    """Runs right-padded prompts through a fresh cache.

    tokens int32 [B, T]; lengths int32 [B]. Returns (float32 logits [B, V] at each row's last
    prompt token, cache with lengths = prompt lengths). Pad slots are written but not committed.
    With per-layer params (`decode_params`, `unstack_layers`) the cache is per-layer too.
    placement: the model's `ssd_jax.sharding.Placement` (None: unsharded); its cache sharding
    (batch over "data", KV heads over "model") is pinned on the new cache.
    feature_layers: also return the features [B, T, K, D] of every prompt position after those
    layers (`forward_cached`), as (logits, cache, features): what a feature-level head reads.
    """
    from ssd_jax.sharding import constrain_cache

    from ssd_jax.models.kv_cache import init_cache

    b, t = tokens.shape
    per_layer = isinstance(params["layers"], (tuple, list))
    cache = constrain_cache(init_cache(config, b, capacity, params["embed"].dtype, per_layer=per_layer), config,
                            placement)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    policy = policy_for(params)
    fused = policy.prefill_attention != "reference" and t >= policy.fused_prefill_min_tokens
    out = forward_cached(params, config, tokens, positions, cache, logit_indices=(lengths - 1)[:, None],
                         prefill_attention=policy.prefill_attention if fused else "reference",
                         feature_layers=feature_layers)
    logits, cache = out[0][:, 0], out[1].replace(lengths=lengths)
    return (logits, cache, out[2]) if feature_layers else (logits, cache)


def sample_rows(sampling: SamplingParams, keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row with that row's key: keys uint32 [B, 2], logits [B, V] -> int32 [B]."""
    return jax.vmap(lambda k, l: sample_from_logits(k, l, sampling))(keys, logits)


def draw_rows(sampling: SamplingParams, keys: jax.Array, logits: jax.Array, positions: jax.Array) -> jax.Array:
    """One token per row: keys uint32 [B, 2] (`step_keys`), logits [B, V], positions int32 [B] of
    the tokens drawn -> int32 [B]; under the Gumbel coupling the coupled draw."""
    if sampling.coupled:
        return coupled_tokens(logits, keys, positions, sampling)
    return sample_rows(sampling, keys, logits)


def step_keys(sampling: SamplingParams, keys: jax.Array, step) -> jax.Array:
    """The keys of loop step `step` (0: the first token) from the row keys uint32 [B, 2]:
    fold_in(row key, step), or under the Gumbel coupling the row keys themselves."""
    return keys if sampling.coupled else fold_rows(keys, step)


def fold_rows(keys: jax.Array, data) -> jax.Array:
    """fold_in(keys[b], data) for every row: uint32 [B, 2] -> [B, 2] (data: a scalar)."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, data)


def target_capacity(parts: Parts, prompt_width: int, out_size: int) -> int:
    """The target KV cache's slots: the parts' capacity, at most the prompt and the outputs
    (`chain_writes` or `room_gated` parts) or those and one step's room (+2). Parts size their
    capacity for a draft's cache and context too (SD's and CSD's drafters lag by up to a plain
    phase's tokens under adaptive speculation), which the target never writes; and a decode step
    reads every slot of its cache, so slots the target never uses slow every step (the more so
    past a size where the host's caches stop holding them).

    A chain needs no room: a row with n tokens out holds its prompt and n - 1 of them, and the
    step's query at depth i, at slot lengths + i, gives the law of output n + 1 + i, kept only up
    to max_new <= out_size, so every kept query's slot and the slots it reads are below
    prompt + out_size. Writes past the cache are dropped (`ssd_jax.models.kv_cache`) and only the
    queries past the last kept token see the loss. A tree writes node j at slot lengths + j
    whatever its depth, so it needs the room, or (`room_gated`) a loop that decodes plainly while
    a running row lacks it, or (`trims_to_room`) steps that keep only the nodes with a slot."""
    if parts.chain_writes or room_gated(parts) or trims_to_room(parts):
        return min(parts.capacity, prompt_width + out_size)
    return min(parts.capacity, prompt_width + out_size + parts.room + 2)


def room_gated(parts: Parts) -> bool:
    """Whether the parts' steps run only while every running row has `room` slots left: trees
    under the adaptive loop, which decodes plainly otherwise, so the target's cache needs no room
    past the prompt and the outputs (a tree's last ~room tokens decode plainly instead). Parts
    with `keeps_room` (EAGLE) keep the room instead: there a row's steps would depend on the
    prompt's padding (a row shorter than the batch's widest prompt has room to the end), and a
    call's tokens at T > 0 on how it was padded."""
    return (not parts.chain_writes and parts.pending_width > 0 and not getattr(parts, "keeps_room", False)
            and not trims_to_room(parts))


def trims_to_room(parts: Parts) -> bool:
    """Whether the parts' tree steps drop the nodes past the end of the target's cache, so they
    run in any room (LogitSpec under "auto": `RetrievalParts.trims_to_room`)."""
    return bool(getattr(parts, "trims_to_room", False))


def step_room(parts: Parts, outputs: Outputs, max_new: jax.Array) -> jax.Array | int:
    """Slots a running row needs past its committed text for the loop's next step: a chain's
    room, at most the tokens the row may still emit; a gated tree's plain step's one, as a
    trimmed tree's root's; else the room (int32 [B] or int)."""
    if parts.chain_writes:
        return jnp.minimum(parts.room, max_new - outputs.num_out)
    return 1 if room_gated(parts) or trims_to_room(parts) else parts.room


def start(parts: Parts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, keys: jax.Array,
          max_new: jax.Array, eos_ids: jax.Array, *, sampling: SamplingParams, out_size: int,
          placement=None) -> DecodeState:
    """Prefill, the first token and the loop state on entry (step 1)."""
    b = tokens.shape[0]
    ones = jnp.ones((b,), jnp.int32)
    feature_layers = getattr(parts, "feature_layers", ())   # a feature-level head's parts read the prompt's
    logits, tcache, *features = prefill(tparams, tcfg, tokens, lengths,
                                        target_capacity(parts, tokens.shape[1], out_size), placement, feature_layers)
    first = draw_rows(sampling, step_keys(sampling, keys, 0), logits, lengths)
    outputs, _ = append(Outputs.empty(b, out_size), first[:, None], ones, max_new, eos_ids)
    inner = parts.init(tokens, lengths, first, logits, *features)
    return DecodeState(tcache=tcache, outputs=outputs, counters=SpecCounters.zeros(b, parts.counter_width),
                       cur=first, step=jnp.ones((), jnp.int32), inner=inner)


def advance(parts: Parts, state: DecodeState, verdict: Verdict, active: jax.Array, max_new: jax.Array,
            eos_ids: jax.Array, *, drafted: bool) -> DecodeState:
    """Everything after a step: emission, EOS and length limits, counters (drafted:
    whether the step verified a draft), rows out of cache room."""
    emitted = emitted_tokens(verdict.chosen, verdict.accepted, verdict.next_token)
    outputs, _ = append(state.outputs, emitted, verdict.accepted + 1, max_new, eos_ids)
    counters = state.counters
    if drafted:
        recorded = counters.record(active, verdict.accepted, verdict.drafted, verdict.draft_forwards)
        if verdict.verified is not None:   # a gated step that ran as a plain one counts as one
            recorded = jax.tree.map(functools.partial(jnp.where, verdict.verified), recorded,
                                    counters.record_ar_step(active))
        counters = recorded
    else:
        counters = counters.record_ar_step(active)
    # A row whose cache could not take another step ends with reason "length".
    outputs = stop_rows(outputs, verdict.tcache.lengths + step_room(parts, outputs, max_new) > verdict.tcache.capacity)
    return DecodeState(tcache=verdict.tcache, outputs=outputs, counters=counters, cur=verdict.next_token,
                       step=state.step + 1, inner=verdict.inner)


def paused(outputs: Outputs, pause_at: jax.Array | None) -> jax.Array:
    """bool []: whether the decode loop stops: every row done, or where pause_at (int32 []) is
    given, every row done or holding at least pause_at tokens (a pause: a later program goes on
    from the state, `loop`)."""
    if pause_at is None:
        return jnp.all(outputs.done)
    return jnp.all(outputs.done | (outputs.num_out >= pause_at))


def loop(parts: Parts, keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, state: DecodeState,
         pause_at: jax.Array | None = None) -> DecodeState:
    """The decode loop from `state` (keys uint32 [B, 2], max_new int32 [], eos_ids int32 [E] as
    `run`'s) until every row is done, or pauses (`paused`). A paused state goes on exactly where
    it stopped: each step's keys come from the state's step count, so the tokens are those of
    one unpaused loop."""

    def body(state: DecodeState) -> DecodeState:
        active = ~state.outputs.done
        verdict = parts.step(state, step_keys(parts.sampling, keys, state.step), active)
        return advance(parts, state, verdict, active, max_new, eos_ids, drafted=bool(parts.counter_width))

    return jax.lax.while_loop(lambda s: ~paused(s.outputs, pause_at), body, state)


def run(parts: Parts, tparams: dict, tcfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, keys: jax.Array,
        max_new: jax.Array, eos_ids: jax.Array, *, sampling: SamplingParams, out_size: int,
        placement=None) -> DecodeState:
    """Decodes right-padded prompts tokens int32 [B, T] (lengths int32 [B]) with per-row keys
    uint32 [B, 2], at most max_new (int32 []) tokens per row into out_size slots, stopping rows at
    any of eos_ids int32 [E]. placement: the target's (see `prefill`). Returns the final DecodeState."""
    state = start(parts, tparams, tcfg, tokens, lengths, keys, max_new, eos_ids, sampling=sampling,
                  out_size=out_size, placement=placement)
    return loop(parts, keys, max_new, eos_ids, state)
