"""From a method object to its parts for the decode skeleton, and the traced decode every
synchronous method runs (`decode_arrays`): the body of `ssd_jax.decode` and of `generate`'s
compiled program."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.backend import policy_for
from ssd_jax.loop.autoregressive import ar_parts, in_loop_params
from ssd_jax.loop.cascade import cascade_parts
from ssd_jax.loop.retrieval import retrieval_parts
from ssd_jax.loop.adaptive_loop import AdaptiveState, begin_adaptive, resume_adaptive, run_adaptive
from ssd_jax.loop.skeleton import DecodeState, Parts, loop, run, start
from ssd_jax.loop.speculative import speculative_parts
from ssd_jax.methods import CSD, EAGLE, AR, LogitSpec, Method, PLD
from ssd_jax.model import Model
from ssd_jax.sampling import SamplingParams


@struct.dataclass
class DecodeOutput:
    """tokens int32 [B, N]: row b's generated ids in tokens[b, :num_tokens[b]] (zeros after);
    num_tokens int32 [B]; finish_reason int32 [B] (1 = eos, 2 = length; `FINISH_NAMES`);
    counters: dict "spec" -> `SpecCounters` (vLLM counters, target calls), and for CSD
    "reviews" -> `ReviewCounters`."""

    tokens: jax.Array
    num_tokens: jax.Array
    finish_reason: jax.Array
    counters: dict


def split_cascade(draft) -> tuple[tuple, object]:
    """CSD's draft tuple -> (neural drafters, largest first; the MaxGram drafter or None)."""
    from ssd_jax.draft.maxgram import MaxGram

    drafts = tuple(draft) if isinstance(draft, (tuple, list)) else (draft,)
    maxgram = drafts[-1] if drafts and isinstance(drafts[-1], MaxGram) else None
    return (drafts[:-1] if maxgram is not None else drafts), maxgram


def make_parts(method: Method, target: Model, draft, sampling: SamplingParams, prompt_width: int, out_size: int,
               plan=None) -> Parts:
    """The skeleton parts of `method` for these models (traced params inside) and static sizes;
    plan: the `AutoPlan` of a method with draft_len "auto"."""
    tparams, tcfg = in_loop_params(target), target.config
    if isinstance(method, AR):
        return ar_parts(tparams, tcfg, sampling, prompt_width, out_size)
    if isinstance(method, (PLD, LogitSpec)):
        return retrieval_parts(method, tparams, tcfg, sampling, prompt_width, out_size, plan=plan)
    if isinstance(method, EAGLE):
        from ssd_jax.loop.eagle import eagle_parts

        return eagle_parts(method, draft, tparams, tcfg, sampling, prompt_width, out_size, plan=plan)
    if isinstance(method, CSD):
        models, maxgram = split_cascade(draft)
        bigram = maxgram.bigram if maxgram is not None else jnp.zeros((1,), jnp.int32)
        return cascade_parts(method, tparams, tcfg, tuple(in_loop_params(m) for m in models),
                             tuple(m.config for m in models), bigram, sampling, prompt_width, out_size, plan=plan)
    return speculative_parts(method, tparams, tcfg, in_loop_params(draft), draft.config,
                             sampling, prompt_width, out_size, plan=plan)


def decode_state(state: DecodeState | AdaptiveState) -> DecodeState:
    """The skeleton's state of a loop state: itself, or the adaptive loop's `decode`."""
    return state.decode if isinstance(state, AdaptiveState) else state


def _extra_rows(rows: int, method: Method, target: Model) -> int:
    """Copies of row 0 to add: up to the policy's min_decode_rows for AR, and up to a multiple
    of the placement's batch axis size (`decode_arrays`; a decode run in pieces adds none)."""
    padded = max(rows, policy_for(target).min_decode_rows) if isinstance(method, AR) else rows
    if target.placement is not None:
        ways = target.placement.batch_ways()
        padded = -(-padded // ways) * ways
    return padded - rows


def decode_arrays(target: Model, draft, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, max_new: jax.Array,
                  *, method: Method, sampling: SamplingParams, eos_ids: tuple, out_size: int,
                  plan=None, costs=None) -> DecodeOutput:
    """Traced decode of right-padded tokens int32 [B, T] (lengths int32 [B]) with per-row keys
    uint32 [B, 2]; at most max_new (int32 []) tokens per row in out_size slots; inputs trusted.

    AR with fewer rows than the backend policy's `min_decode_rows` runs on copies of row 0 added
    up to that many (rows are independent, so row 0's copies change nothing) and returns the
    real rows: on GPU a one-row decode step is slower than a two-row one (`ssd_jax.backend`).
    Likewise, with a target sharded over a "data" axis of size d, the batch is padded with copies
    of row 0 to a multiple of d so its rows split evenly over "data".
    A method with draft_len "auto" runs the adaptive loop (`ssd_jax.loop.adaptive_loop`) with
    plan (static `AutoPlan`) and costs (float32 [5 + L], `ssd_jax.loop.costs.LoopCosts.from_vector`),
    both required: the loop reads no memory of its own."""
    rows = tokens.shape[0]
    extra = _extra_rows(rows, method, target)
    if extra:
        tokens, lengths, keys = (jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)]) for x in (tokens, lengths, keys))
    setup = _setup(target, draft, tokens, lengths, keys, max_new, method, sampling, eos_ids, out_size, plan, costs)
    if setup.costs is not None:
        state = run_adaptive(*setup.loop_args, setup.costs, **setup.loop_options)
    else:
        state = run(*setup.loop_args, **setup.loop_options)
    return _output(state, method, target, rows, extra)


def begin_arrays(target: Model, draft, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, max_new: jax.Array,
                 *, method: Method, sampling: SamplingParams, eos_ids: tuple, out_size: int, plan=None, costs=None):
    """The state `decode_arrays`' loop starts from (prefill, the first token; the adaptive loop's
    memories and first choice), for a decode run in pieces (`resume_arrays`): how `generate`
    streams. `decode_arrays`' arguments; no rows are added. Returns (state, `DecodeOutput` of the
    first token)."""
    setup = _setup(target, draft, tokens, lengths, keys, max_new, method, sampling, eos_ids, out_size, plan, costs)
    if setup.costs is not None:
        state = begin_adaptive(*setup.loop_args, setup.costs, **setup.loop_options)
    else:
        state = start(*setup.loop_args, **setup.loop_options)
    return state, _output(state, method, target, tokens.shape[0], 0)


def resume_arrays(target: Model, draft, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, max_new: jax.Array,
                  state, piece: jax.Array, *, method: Method, sampling: SamplingParams, eos_ids: tuple,
                  out_size: int, plan=None, costs=None):
    """The decode from `state` (`begin_arrays`' or this function's) until every row is done or
    holds `piece` (int32 [], at most 2**30) tokens more than the running row with the fewest had
    (`ssd_jax.loop.skeleton.paused`), with `begin_arrays`' arguments. The bound is computed here,
    so the host may queue the next piece before it reads this one's tokens. Returns (state,
    `DecodeOutput` so far). Without "auto", the pieces' tokens are one `decode_arrays`' for the
    same key; with it, the adaptive loop's choices after a pause differ (the law is the target's
    either way)."""
    outputs = decode_state(state).outputs
    piece = jnp.asarray(piece, jnp.int32)
    pause_at = jnp.min(jnp.where(outputs.done, jnp.iinfo(jnp.int32).max - piece, outputs.num_out)) + piece
    setup = _setup(target, draft, tokens, lengths, keys, max_new, method, sampling, eos_ids, out_size, plan, costs)
    parts, tparams, _, _, _, keys, max_new, eos = setup.loop_args
    if setup.costs is not None:
        state = resume_adaptive(parts, tparams, keys, max_new, eos, setup.costs, state, pause_at, sampling=sampling)
    else:
        state = loop(parts, keys, max_new, eos, state, pause_at)
    return state, _output(state, method, target, tokens.shape[0], 0)


class _Setup(NamedTuple):
    loop_args: tuple       # the skeleton's: parts, target params and config, tokens, lengths, keys, max_new, eos
    loop_options: dict     # sampling, out_size, placement
    costs: jax.Array | None   # the adaptive loop's cost inputs (None: not "auto")


def _setup(target: Model, draft, tokens, lengths, keys, max_new, method: Method, sampling: SamplingParams,
           eos_ids: tuple, out_size: int, plan, costs) -> _Setup:
    """What the decode loops take: the method's parts and the loop's arguments (rows pinned to the
    target's placement), and for "auto" its cost inputs (None: not adaptive)."""
    if target.placement is not None:
        row_sharding = target.placement.rows(tokens.shape[0])
        tokens, lengths, keys = (jax.lax.with_sharding_constraint(x, row_sharding) for x in (tokens, lengths, keys))
    adaptive = method.adaptive
    if adaptive and (plan is None or costs is None):
        raise ValueError(f"{type(method).__name__} with draft_len='auto' needs its loop's plan and cost inputs "
                         "(ssd_jax.decode passes the fixed prior's, generate its tuner's)")
    parts = make_parts(method, target, draft, sampling, tokens.shape[1], out_size, plan=plan if adaptive else None)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    loop_args = (parts, parts.tparams, target.config, tokens.astype(jnp.int32), lengths.astype(jnp.int32), keys,
                 jnp.asarray(max_new, jnp.int32), eos)
    options = dict(sampling=sampling, out_size=out_size, placement=target.placement)
    return _Setup(loop_args=loop_args, loop_options=options,
                  costs=jnp.asarray(costs, jnp.float32) if adaptive else None)


def _output(state, method: Method, target: Model, rows: int, extra: int) -> DecodeOutput:
    """The DecodeOutput of a loop state (a DecodeState, or the adaptive loop's) of rows + extra
    rows, the extra ones (copies of row 0) dropped; replicated where the target is sharded."""
    state = decode_state(state)
    counters = dict(spec=state.counters)
    if isinstance(method, CSD):
        counters["reviews"] = state.inner.counters
    if extra:  # per-row counters of the added rows go; scalars (target calls) stay
        counters = jax.tree.map(lambda x: x[:rows] if x.ndim and x.shape[0] == rows + extra else x, counters)
    output = DecodeOutput(tokens=state.outputs.out[:rows], num_tokens=state.outputs.num_out[:rows],
                          finish_reason=state.outputs.finish[:rows], counters=counters)
    if target.placement is not None:  # whole outputs on every device, so every process can read them
        output = jax.lax.with_sharding_constraint(output, target.placement.replicated())
    return output
