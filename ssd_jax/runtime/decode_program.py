"""The compiled decode program of a `generate` call: the models as the program takes them (decode
layout, colocated with a sharded target), its array arguments, its key in the one compile cache,
and its runs: whole, timed, to another token budget, or streamed in pieces."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.eagle.head import EagleHead
from ssd_jax.loop.decoder import begin_arrays, decode_arrays, resume_arrays, split_cascade
from ssd_jax.methods import AR, Method
from ssd_jax.model import Model
from ssd_jax.runtime.compile_cache import PROGRAMS, signature
from ssd_jax.runtime.loop_params import loop_params
from ssd_jax.runtime.prompts import bucket, row_keys
from ssd_jax.runtime.streaming import stream_pieces
from ssd_jax.sampling import SamplingParams
from ssd_jax.sharding import colocate
from ssd_jax.sharding.placement import place_array


def bare(model: Model) -> Model:
    """The model as the compiled program takes it: decode-layout params, no tokenizer or path
    (so reloading a checkpoint finds the same program)."""
    return Model(config=model.config, params=loop_params(model), placement=model.placement)


def bare_draft(draft):
    if isinstance(draft, Model):
        return bare(draft)
    if isinstance(draft, tuple):
        models, maxgram = split_cascade(draft)
        return tuple(bare(m) for m in models) + ((maxgram,) if maxgram is not None else ())
    return draft


def colocated(method: Method, target: Model, draft):
    """The draft (a Model, CSD's tuple or an EAGLE head) placed to run in one program with a
    sharded target."""
    if isinstance(draft, Model):
        return colocate(target, draft, type(method).__name__)
    if isinstance(draft, EagleHead):   # small: replicated over a sharded target's mesh
        return replicated(target, draft)
    if isinstance(draft, tuple):
        return tuple(colocate(target, d, type(method).__name__) if isinstance(d, Model)
                     else replicated(target, d) for d in draft)
    return draft


def scalar_arg(target: Model, x: np.ndarray) -> jax.Array:
    """A small host array as a program argument: on the default device, or replicated on a
    sharded target's mesh (a global array, so the program also runs across processes)."""
    return jnp.asarray(x) if target.placement is None else place_array(x, target.placement.replicated())


def replicated(target: Model, tree):
    """A pytree of arrays (e.g. a MaxGram's table) replicated on a sharded target's mesh."""
    if target.placement is None:
        return tree
    return jax.tree.map(lambda x: place_array(x, target.placement.replicated()), tree)


def program(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams, key) -> tuple:
    """A call's decode program before any adaptive costs: (fn, args, the program key's parts), the
    draft already colocated. The key's last part, the adaptive plan, is the caller's."""
    out_size = bucket(max_new_tokens)
    eos_ids = tuple(target.config.eos_token_ids or ())
    args = (bare(target), bare_draft(draft)) + inputs(target, batch, key, max_new_tokens, sampling)
    fn = functools.partial(_decode, method=method, sampling=sampling, eos_ids=eos_ids, out_size=out_size)
    return fn, args, ("decode", method, sampling, eos_ids, out_size)


def inputs(target: Model, batch, key, max_new_tokens: int, sampling: SamplingParams) -> tuple:
    """The decode program's array arguments after the models: tokens, lengths, row keys
    (`row_keys`, which the sampling's coupling decides), max_new."""
    arrays = (batch.tokens, batch.lengths, row_keys(key, batch.batch_size, sampling), np.asarray(max_new_tokens, np.int32))
    if target.placement is None:
        return tuple(map(jnp.asarray, arrays))
    # Global arrays, so the program also runs when the mesh spans several processes.
    return tuple(place_array(x, target.placement.replicated()) for x in arrays)


def with_budget(target: Model, args: tuple, tokens: int) -> tuple:
    """A decode program's arguments with another token budget (the last one, `inputs`' max_new),
    placed as `inputs` places it."""
    return args[:-1] + (scalar_arg(target, np.asarray(tokens, np.int32)),)


def run_seconds(executable, args: tuple) -> float:
    """Seconds of one run of a compiled program on args (none donated), its output dropped."""
    start = time.perf_counter()
    jax.block_until_ready(executable(*args))
    return time.perf_counter() - start


def first_run_s(executable, args: tuple) -> float:
    """Runs a newly compiled (or loaded) program once on its call's arguments (none donated) and
    drops the output: the seconds it took. An executable's first run costs more than its later
    ones, so where the backend policy's `warm_new_programs` says so, that first run is part of
    preparing the program, reported with its compile time, and the call's own run is a steady
    one, which per-call "auto" can price at once (`per_call.record`)."""
    return run_seconds(executable, args)


def fixed_executable(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams,
                     key) -> tuple:
    """The compiled program `_generate_sync` runs for a method at a fixed length (no adaptive
    plan) on a call's inputs: (executable, args, program key, seconds compiling it now: 0.0 when
    cached)."""
    fn, args, key_parts = program(method, target, colocated(method, target, draft), batch, max_new_tokens,
                                  sampling, key)
    program_key = key_parts + (None,)   # _generate_sync's without a plan
    executable, compile_s = PROGRAMS.compiled(fn, program_key, *args)
    return executable, args, program_key, compile_s


def ar_executable(target: Model, batch, max_new_tokens: int, sampling: SamplingParams, key) -> tuple:
    """AR's compiled program on a call's inputs, the one a plain-from-start call runs: (executable,
    args, program key, seconds compiling it now: 0.0 when cached)."""
    return fixed_executable(AR(), target, None, batch, max_new_tokens, sampling, key)


def streamed(options: dict, program_key: tuple, args: tuple, sink, target: Model, calibrate=None,
             timed: bool = True) -> tuple:
    """A decode streamed to sink in pieces (`ssd_jax.runtime.streaming.stream_pieces`) by two
    programs from the compile cache, begin and resume (`decode_arrays`' options and arguments;
    resume's state donated). calibrate (an "auto" call's, else None): calibrate(program, args,
    key) -> the loop's cost inputs measured on the two programs run whole (`InPieces`). timed:
    the pieces grow by their times (`stream_pieces`). Returns (output, wall seconds, seconds
    compiling)."""
    begin, compile_s = PROGRAMS.compiled(functools.partial(_begin, **options), ("begin",) + program_key[1:], *args)
    resume_key = ("resume",) + program_key[1:]
    resume, spent = PROGRAMS.compiled(functools.partial(_resume, **options), resume_key, begin.out_info[0],
                                      scalar_arg(target, np.asarray(0, np.int32)), *args,
                                      donate_argnums=(0,))
    compile_s += spent
    if calibrate is not None:
        whole = InPieces(begin, resume, scalar_arg(target, np.asarray(1 << 30, np.int32)))
        args = args[:-1] + (calibrate(whole, args, (resume_key, signature(args))),)

    def next_piece(state, piece: int):
        return resume(state, scalar_arg(target, np.asarray(piece, np.int32)), *args)

    output, wall = stream_pieces(lambda: begin(*args), next_piece, sink, timed)
    return output, wall, compile_s


@dataclasses.dataclass
class InPieces:
    """A streamed call's begin and resume programs run to the end, as one callable with the
    unstreamed program's arguments and output (`DecodeOutput`): what "auto"'s calibration times
    (`ssd_jax.tuning.measure.calibrated_inputs`) and, by the two programs' text, keys on disk."""

    begin: object
    resume: object
    never: jax.Array   # a piece longer than any decode

    def __call__(self, *args):
        return self.resume(self.begin(*args)[0], self.never, *args)[1]

    def as_text(self) -> str:
        return self.begin.as_text() + "\n" + self.resume.as_text()


def _decode(target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`decode_arrays` with the adaptive loop's cost inputs as an argument ("auto"; else none)."""
    return decode_arrays(target, draft, tokens, lengths, keys, max_new, costs=costs, **options)


def _begin(target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`begin_arrays`, arguments as `_decode`'s."""
    return begin_arrays(target, draft, tokens, lengths, keys, max_new, costs=costs, **options)


def _resume(state, piece, target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`resume_arrays` from state for a piece of `piece` tokens, the other arguments as `_decode`'s."""
    return resume_arrays(target, draft, tokens, lengths, keys, max_new, state, piece, costs=costs, **options)
