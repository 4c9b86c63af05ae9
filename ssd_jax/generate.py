"""`generate`: the host wrapper over `ssd_jax.decode` (prompt checks and bucketing, one compiled
program per static shape from the one compile cache, streaming, stats); SSD's host loop too."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backend import policy_for
from ssd_jax.decode import check_models, check_positions
from ssd_jax.tuning import per_call
from ssd_jax.tuning import plain_verdicts
from ssd_jax.ssd import auto as ssd_auto
from ssd_jax.tuning.adaptive import timings_allowed
from ssd_jax.tuning.auto_shape import open_paths, shaped
from ssd_jax.runtime.loop_params import loop_params
from ssd_jax.runtime.compile_cache import PROGRAMS, signature
from ssd_jax.loop.decoder import begin_arrays, decode_arrays, resume_arrays, split_cascade
from ssd_jax.runtime.output import GenerateOutput, generate_output
from ssd_jax.runtime.prompts import bucket, prepare_prompts, row_keys
from ssd_jax.runtime.streaming import stream_pieces
from ssd_jax.errors import InputError
from ssd_jax.methods import AR, DEFAULT_METHOD, METHOD_CLASSES, METHODS, SSD, Method, as_method, for_target  # noqa: F401
from ssd_jax.model import Model
from ssd_jax.sampling import SamplingParams
from ssd_jax.sharding import colocate
from ssd_jax.sharding.placement import place_array

AR_REFERENCE_RUNS = 2   # timed runs of AR's program for a per-call choice's baseline (the fastest kept)
# The keyword options generate() took before method objects: old name -> method field.
OLD_OPTIONS = dict(num_draft_tokens="draft_len", max_draft_len="max_draft_len", draft_threshold="threshold",
                   num_paths="paths", prompt_lookup_min="min_ngram",
                   prompt_lookup_max="max_ngram", logitspec_topk="topk", tree_capacity="tree_size",
                   max_ngram="max_ngram", k_matrix="k_matrix", lenience="lenience",
                   max_draft_tokens="max_draft_tokens", fanout_budget="fanout_budget", fanout="fanout",
                   saguaro_c="saguaro_c", fallback="fallback", fanout_acceptance="fanout_acceptance",
                   fanout_exponent="fanout_exponent", target_devices="target_devices", draft_devices="draft_devices")


def _old_options_error(method, options: dict) -> InputError:
    """The InputError for keyword options of the old API, naming the method object to use."""
    cls = type(method) if isinstance(method, Method) else METHOD_CLASSES.get(method, None)
    names = ", ".join(f"{k}=" for k in sorted(options))
    if "drafts" in options or "bigram" in options:
        return InputError(f"generate() no longer takes {names}; pass the cascade as draft=(model, ..., "
                          f"ssd_jax.MaxGram.for_target(target, bigram)) with method=CSD(...)")
    fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    mapped = {OLD_OPTIONS[k]: v for k, v in options.items() if OLD_OPTIONS.get(k) in fields}
    unknown = sorted(set(options) - {k for k in options if OLD_OPTIONS.get(k) in fields})
    name = cls.__name__ if cls is not None else "the method object"
    args = ", ".join(f"{k}={v!r}" for k, v in mapped.items())
    hint = f"use method={name}({args})"
    if unknown:
        hint += f"; {name} has no option for {', '.join(unknown)} (fields: " \
                f"{', '.join(f.name for f in dataclasses.fields(cls)) if cls else '-'})"
    return InputError(f"generate() no longer takes {names}; {hint}")


def _bare(model: Model) -> Model:
    """The model as the compiled program takes it: decode-layout params, no tokenizer or path
    (so reloading a checkpoint finds the same program)."""
    return Model(config=model.config, params=loop_params(model), placement=model.placement)


def _bare_draft(draft):
    if isinstance(draft, Model):
        return _bare(draft)
    if isinstance(draft, tuple):
        models, maxgram = split_cascade(draft)
        return tuple(_bare(m) for m in models) + ((maxgram,) if maxgram is not None else ())
    return draft


def _colocated(method: Method, target: Model, draft):
    """The draft (a Model or CSD's tuple) placed to run in one program with a sharded target."""
    if isinstance(draft, Model):
        return colocate(target, draft, type(method).__name__)
    if isinstance(draft, tuple):
        return tuple(colocate(target, d, type(method).__name__) if isinstance(d, Model)
                     else _replicated(target, d) for d in draft)
    return draft


def _device_scalar_or_vector(target: Model, x: np.ndarray) -> jax.Array:
    """A small host array as a program argument: on the default device, or replicated on a
    sharded target's mesh (a global array, so the program also runs across processes)."""
    return jnp.asarray(x) if target.placement is None else place_array(x, target.placement.replicated())


def _replicated(target: Model, tree):
    """A pytree of arrays (e.g. a MaxGram's table) replicated on a sharded target's mesh."""
    if target.placement is None:
        return tree
    return jax.tree.map(lambda x: place_array(x, target.placement.replicated()), tree)


def _method_stats(method: Method, draft, sampling: SamplingParams, output) -> dict:
    name = method.name
    if name in ("pld", "logitspec"):
        from ssd_jax.decode import draft_margin

        nodes = draft_margin(method, sampling, draft)
        return dict(num_draft_tokens_per_step=nodes - 1, tree_nodes=nodes) if name == "logitspec" else \
            dict(num_draft_tokens_per_step=method.max_len, tree_nodes=method.max_len + 1)
    if name == "csd":
        from ssd_jax.loop.cascade import cascade_lenience, cascade_schedule, cascade_stats

        schedule = cascade_schedule(method, len(split_cascade(draft)[0]), sampling)
        stats = dict(num_draft_tokens_per_step=schedule.target_width)
        stats.update(cascade_stats(schedule, cascade_lenience(method, sampling), jax.device_get(output.counters["spec"]),
                                   jax.device_get(output.counters["reviews"])))
        return stats
    if name == "ar":
        return {}
    return dict(num_draft_tokens_per_step=method.draft_len, num_paths=method.paths)


def generate(
    target: Model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    method=DEFAULT_METHOD,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    draft=None,
    stream=None,
    **old_options,
) -> GenerateOutput:
    """Generates up to max_new_tokens per prompt with the target's exact output law.

    target: the model whose output law is reproduced. prompt_ids: a batch of token-id lists
    (ragged). method: a method object (`ssd_jax.AR()`, `SD(draft_len=...)`, `BV`, `SpecInfer`,
    `SpecTr`, `GBV`, `PLD`, `LogitSpec`, `CSD`, `SSD`; see `ssd_jax.methods`) or a name for its
    default object ("gbv" is `GBV()`). draft: a Model for SD, BV, SpecInfer, SpecTr, GBV and SSD;
    for CSD a Model or a tuple of them, largest first, optionally ending with a `MaxGram`
    (default: the shipped table when the target has the embedded tokenizer).
    temperature 0 is greedy (every method then verifies greedily); top_k / top_p filter as in
    transformers, identically for draft and target. key: a jax PRNG key shared by every row (a
    row's output does not depend on its batch), or one key per row; None means PRNGKey(0); the
    same key gives the same tokens as `ssd_jax.decode`.
    stream: optional callable sink(new_tokens int32 [B, N], counts int32 [B]) called as tokens
    are produced (row b produced new_tokens[b, :counts[b]]): the decode runs in pieces of a few
    tokens, doubling while a piece takes under 0.1 s (`ssd_jax.runtime.streaming`), each piece one
    read back to the host, by programs the persistent compilation cache keeps. A
    fixed method streams the tokens of the unstreamed call; under draft_len "auto" each piece's
    end also ends the loop's phase, so at T > 0 the samples may differ (the law is the target's).
    Returns GenerateOutput(tokens, finish_reasons, stats). Raises InputError on bad arguments,
    including the keyword options of the old API (num_draft_tokens=, num_paths=, ...): the
    message names the method object to use instead.
    """
    if old_options:
        raise _old_options_error(method, old_options)
    method = as_method(method)
    if not isinstance(target, Model):
        return check_models(method, target, draft, SamplingParams())  # raises, naming the problem
    if stream is not None and not callable(stream):
        raise InputError(f"stream must be a callable sink(new_tokens, counts), got {type(stream).__name__}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = prepare_prompts(prompt_ids, target.config, max_new_tokens)
    draft = check_models(method, target, draft, sampling)
    paths_open = open_paths(method, sampling)
    chosen_per_call = per_call.applies(method, policy_for(target.params), batch.batch_size)
    method = for_target(shaped(method, target, draft, sampling, batch.batch_size,
                               batch.max_length + int(max_new_tokens) // 2,
                               paths=not (chosen_per_call and paths_open)), target)
    check_positions(method, target, draft, sampling, batch.max_length, int(max_new_tokens))
    if isinstance(method, SSD):
        verdict = _verdict_key(method, target, draft, sampling, batch, int(max_new_tokens))
        if not (method.adaptive and ssd_auto.starts_plain(verdict)):
            return _generate_ssd(method, target, draft, batch, int(max_new_tokens), sampling, key, stream, verdict)
        # "auto" remembers that SSD was slower than plain decoding for this program: AR's loop.
        return _plain_from_start(method, _ssd_target(method, target, draft), batch, int(max_new_tokens), sampling,
                                 key, stream, switched_to_plain_at_step=0, ssd_steps=0)
    if not getattr(method, "adaptive", False):
        return _generate_sync(method, target, draft, batch, int(max_new_tokens), sampling, key, stream)
    verdict = _verdict_key(method, target, draft, sampling, batch, int(max_new_tokens))
    if chosen_per_call:
        return _generate_per_call(method, target, draft, batch, int(max_new_tokens), sampling, key, stream, verdict,
                                  paths_open)
    # "auto" remembers a call whose loop decoded (nearly) every step plainly: AR's loop, but for probes.
    if plain_verdicts.starts_plain(verdict):
        return _plain_from_start(method, target, batch, int(max_new_tokens), sampling, key, stream)
    out = _generate_sync(method, target, draft, batch, int(max_new_tokens), sampling, key, stream)
    if out.stats["target_calls"] > 1:   # a call of the prefill alone (one token) judged nothing
        plain_verdicts.remember_share(verdict, out.stats["ar_fallback_share"], lost=out.stats.get("loses_to_ar", False))
    return out


def _ssd_target(method: SSD, target: Model, draft: Model) -> Model:
    """The target placed on SSD's target group (`ssd_jax.ssd.placement`), where a call that
    a remembered verdict decodes plainly runs AR's loop: where SSD measured plain decoding's step
    that the verdict weighed, and where the SSD options put the target (unplaced, AR ran on the
    default device: with target_devices=[1], draft_devices=[0], on the draft's device 0)."""
    from ssd_jax.ssd.placement import placed_model, resolve_groups

    target_devices, _ = resolve_groups(method.target_devices, method.draft_devices, target, draft)
    return placed_model(target, target_devices)


def _plain_from_start(method, target: Model, batch, max_new_tokens: int, sampling: SamplingParams, key, stream,
                      **stats) -> GenerateOutput:
    """An "auto" call that a remembered verdict runs with AR's jitted loop (no draft work at all):
    the AR tokens and stats, marked as the method's with plain_from_start (and `stats`), with the
    method's draft counters at what a run that drafted nothing reports (`_no_drafts`), so that the
    stats of every "auto" call hold the same keys."""
    out = _generate_sync(AR(), target, None, batch, max_new_tokens, sampling, key, stream)
    out.stats.update(method=method.name, adaptive=True, planned_draft_len=0, mean_draft_len=0.0,
                     ar_fallback_share=1.0, plain_from_start=True, **_no_drafts(), **stats)
    return out


def _no_drafts() -> dict:
    """The draft counters of a call that drafted nothing (`ssd_jax.metrics`' values for zero
    drafts; each target call gave each row one token), new lists each time."""
    return dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_rejected=0, acceptance_rate=0.0,
                mean_acceptance_length=0.0, block_efficiency=1.0, accepted_per_position=[], steps_by_cap=[],
                observed_acceptance=None)


def _generate_per_call(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams, key,
                       stream, verdict, paths_open: bool = False) -> GenerateOutput:
    """An "auto" call where the backend policy runs one fixed program chosen per call
    (`ssd_jax.tuning.per_call`): the method at the chosen length (and, paths_open, path count), or
    AR's program (length 0), AR's program timed on these inputs first where no run of it is priced
    yet; the call's acceptance, tokens and seconds per target call are remembered for the next
    choice (the seconds not when streaming, whose host copies they would hold, nor on the call that
    compiled the program)."""
    from ssd_jax.tuning import adaptive
    from ssd_jax.tuning.auto_shape import PATH_CHOICES, path_acceptance

    start = time.perf_counter()
    context = batch.max_length + max_new_tokens // 2
    group = _verdict_key(dataclasses.replace(method, paths=None), target, draft, sampling, batch, max_new_tokens) \
        if paths_open else verdict

    def build() -> list:
        candidates = []
        for candidate in ([dataclasses.replace(method, paths=k) for k in PATH_CHOICES] if paths_open else [method]):
            shape_key = _verdict_key(candidate, target, draft, sampling, batch, max_new_tokens) if paths_open else verdict
            candidates.append(per_call.Candidate(
                candidate, adaptive.acceptance_key(target, draft, candidate, sampling), per_call.compact(shape_key),
                per_call.menu_for(candidate, target, draft, sampling, batch.batch_size, context),
                getattr(candidate, "paths", 1) or 1))
        return candidates

    candidates = per_call.layout(group, context, build)
    if paths_open:
        remembered = {c.paths: adaptive.ACCEPTANCE.known(c.memory_key) for c in candidates}
        acceptances = [path_acceptance(remembered, c.paths) for c in candidates]
    else:
        acceptances = [adaptive.ACCEPTANCE.get(c.memory_key) for c in candidates]
    shapes = [per_call.Shape(c.key, c.menu, a, c.paths) for c, a in zip(candidates, acceptances)]
    unpriced = [shape.key for shape in shapes if per_call.ar_unpriced(shape.key)]
    if unpriced:
        seconds, calls, fixed = _ar_reference(target, batch, max_new_tokens, sampling, key)
        for shape_key in unpriced:
            per_call.record_fixed(shape_key, fixed)
            per_call.record(shape_key, 0, seconds, calls)
    group = per_call.compact(group)
    index, length = per_call.choose_shape(group, shapes)
    chosen = candidates[index].method
    measure_s = time.perf_counter() - start
    if length:
        out = _generate_sync(per_call.fixed(chosen, length), target, draft, batch, max_new_tokens, sampling, key,
                             stream)
        # After the program's first run; not on a streamed call, which ran other programs (begin
        # and resume) and is not priced.
        if stream is None and per_call.fixed_part_unknown(shapes[index].key, length):
            fixed_start = time.perf_counter()
            per_call.record_fixed(shapes[index].key, _fixed_seconds(per_call.fixed(chosen, length), target, draft,
                                                                    batch, max_new_tokens, sampling, key), length)
            measure_s += time.perf_counter() - fixed_start
    else:
        out = _plain_from_start(chosen, target, batch, max_new_tokens, sampling, key, stream)
    stats = out.stats
    # Not timed: a streamed call (its host copies) and a call that compiled its program, whose
    # run is the executable's first (CPU, CSD on short prompts: 9.3 ms per target call against
    # ~5 ms on later runs at the same length, which priced that length out for good), unless that
    # first run was made apart (`_first_run_s`).
    timed = stream is None and (not stats.get("compile_time_s") or stats.get("first_run_warmed", False))
    observed = None
    if length:
        observed = adaptive.acceptance_of(stats["num_accepted_tokens"], stats["num_rejected"])
    for shape in (shapes if length == 0 else [shapes[index]]):   # AR's program is every shape's
        # No draft token verified (retrieval found nothing): the tokens read against the acceptance
        # the call was chosen with, which they then price down to what they were.
        per_call.record(shape.key, length, stats["wall_time_s"] if timed else None, stats["target_calls"],
                        stats["block_efficiency"] if length else None,
                        shapes[index].acceptance if observed is None else observed)
    if length:
        adaptive.ACCEPTANCE.update(candidates[index].memory_key, observed,
                                   per_call.call_share(stats["target_calls"] - 1))
    stats.update(method=method.name, adaptive=True, per_call=True, planned_draft_len=length,
                 remembered_acceptance=shapes[index].acceptance, observed_acceptance=observed,
                 cost_measure_time_s=measure_s)
    if paths_open:   # on a call of AR's program, the shape a probe would run is not what ran
        stats["chosen_paths"] = shapes[index].paths if length else None
    return out


def _ar_executable(target: Model, batch, max_new_tokens: int, sampling: SamplingParams, key) -> tuple:
    """AR's compiled program on a call's inputs, the one a plain-from-start call runs: (executable,
    args, program key, seconds compiling it now: 0.0 when cached)."""
    return _fixed_executable(AR(), target, None, batch, max_new_tokens, sampling, key)


def _fixed_executable(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams,
                      key) -> tuple:
    """The compiled program `_generate_sync` runs for a method at a fixed length (no adaptive
    plan) on a call's inputs: (executable, args, program key, seconds compiling it now: 0.0 when
    cached)."""
    fn, args, key_parts = _program(method, target, _colocated(method, target, draft), batch, max_new_tokens,
                                   sampling, key)
    program_key = key_parts + (None,)   # _generate_sync's without a plan
    executable, compile_s = PROGRAMS.compiled(fn, program_key, *args)
    return executable, args, program_key, compile_s


def _fixed_seconds(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams,
                   key) -> float:
    """A fixed-length program's fixed part on a call's inputs (its run to one token, the fastest
    of AR_REFERENCE_RUNS; `per_call.record_fixed`), the program already compiled and run."""
    executable, args, _, _ = _fixed_executable(method, target, draft, batch, max_new_tokens, sampling, key)
    one_token = _with_budget(target, args, 1)
    return min(_run_seconds(executable, one_token) for _ in range(AR_REFERENCE_RUNS))


def _ar_reference(target: Model, batch, max_new_tokens: int, sampling: SamplingParams, key
                  ) -> tuple[float, int, float]:
    """AR's program (the one a plain-from-start call runs) on a per-call "auto" call's inputs:
    (the fastest of AR_REFERENCE_RUNS runs that are not the executable's first, its target calls,
    the fastest of as many runs to one token: the call's fixed part, `per_call.record_fixed`), the
    price of the choice's baseline. The fastest: the baseline is measured once and kept while
    the method's programs win, each of whose prices every call of it measures again; one slow run
    (another process, a clock ramping up) prices AR's program dear for good (the likely cause on
    an H200, PLD at T=1 on noise prompts: the lookup's programs ran 8% slower than AR's at 1.03
    tokens a call, and "auto" chose them on 11 calls of 12). The runs are the same executable
    with another token budget (an argument), interleaved: the whole runs at `_reference_budget`."""
    executable, args, _, compile_s = _ar_executable(target, batch, max_new_tokens, sampling, key)
    if compile_s:
        _first_run_s(executable, args)
    one_token = _with_budget(target, args, 1)
    whole = _with_budget(target, args, _reference_budget(target, batch, max_new_tokens))
    fastest = fixed = float("inf")
    for _ in range(AR_REFERENCE_RUNS):
        fixed = min(fixed, _run_seconds(executable, one_token))
        start = time.perf_counter()
        output = jax.block_until_ready(executable(*whole))
        fastest = min(fastest, time.perf_counter() - start)
    return fastest, int(jax.device_get(output.counters["spec"].target_calls)), fixed


def _reference_budget(target: Model, batch, max_new_tokens: int) -> int:
    """The tokens AR's reference runs decode: the program's output budget (`bucket`), which its
    price serves (every call of the key asks for at most that many), within the target's
    positions after the longest prompt, at least max_new_tokens. A call of one or two tokens
    would time the fixed part alone, or one step against it: noise that priced a key's steps
    23x too dear (CPU, a one-token call first, then 12-token calls)."""
    room = target.config.max_position_embeddings - batch.max_length
    return max(int(max_new_tokens), min(bucket(max_new_tokens), room))


def _with_budget(target: Model, args: tuple, tokens: int) -> tuple:
    """A decode program's arguments with another token budget (the last one, `_inputs`' max_new),
    placed as `_inputs` places it."""
    return args[:-1] + (_device_scalar_or_vector(target, np.asarray(tokens, np.int32)),)


def _generate_sync(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams, key,
                   stream) -> GenerateOutput:
    """`generate` of every method but SSD: one jitted decode program, or streamed, two run in
    pieces (`ssd_jax.runtime.streaming`)."""
    draft = _colocated(method, target, draft)
    streaming = stream is not None
    fn, args, key_parts = _program(method, target, draft, batch, max_new_tokens, sampling, key)
    auto = _auto_plan(method, args[0], args[1], sampling, batch, int(max_new_tokens)) \
        if getattr(method, "adaptive", False) else None
    if auto is not None:
        fn = functools.partial(fn.func, plan=auto.plan, **fn.keywords)
        args = args + (_device_scalar_or_vector(target, np.asarray(auto.loop_inputs, np.float32)),)
    program_key = key_parts + (auto and auto.plan,)
    warmed = False
    if streaming:
        output, wall, compile_s = _streamed(fn.keywords, program_key, args, stream, target, auto)
    else:
        executable, compile_s = PROGRAMS.compiled(fn, program_key, *args)
        warmed = bool(compile_s) and policy_for(target.params).warm_new_programs
        if warmed:
            compile_s += _first_run_s(executable, args)
        # Keyed like the executable (argument shapes too): a program for another batch, prompt bucket
        # or model pair has step costs of its own, and AR's step against its plain step.
        call_key = (program_key, signature(args)) if auto is not None else None
        if auto is not None:
            args = args[:-1] + (auto.calibrate(executable, args, call_key),)
        start = time.perf_counter()
        output = jax.block_until_ready(executable(*args))
        wall = time.perf_counter() - start
    stats = _method_stats(method, draft, sampling, output)
    if warmed:
        stats["first_run_warmed"] = True
    counters = output.counters["spec"]
    if auto is not None:
        counters = jax.device_get(counters)   # once: the plan's record and the stats read it
        stats.update(auto.record(counters))
        if not streaming and timings_allowed():
            stats.update(_against_ar(target, batch, max_new_tokens, sampling, key, stats["loop_costs"],
                                     counters, output.num_tokens, executable, args, call_key))
    return generate_output(method.name, output.tokens, output.num_tokens, output.finish_reason,
                           counters, wall, compile_s, stats, drafts=method.name != "ar")


def _first_run_s(executable, args: tuple) -> float:
    """Runs a newly compiled (or loaded) program once on its call's arguments (none donated) and
    drops the output: the seconds it took. An executable's first run costs more than its later
    ones (on an H200, per-call "auto" at batch 1: 30-40 ms against 12-24 ms on the same prompt),
    so where the backend policy's `warm_new_programs` says so, that first run is part of
    preparing the program, reported with its compile time, and the call's own run is a steady
    one, which per-call "auto" can price at once (`per_call.record`)."""
    return _run_seconds(executable, args)


def _run_seconds(executable, args: tuple) -> float:
    """Seconds of one run of a compiled program on args (none donated), its output dropped."""
    start = time.perf_counter()
    jax.block_until_ready(executable(*args))
    return time.perf_counter() - start


def _streamed(options: dict, program_key: tuple, args: tuple, sink, target: Model, auto) -> tuple:
    """A decode streamed to sink in pieces (`ssd_jax.runtime.streaming.stream_pieces`) by two
    programs from the compile cache, begin and resume (`decode_arrays`' options and arguments;
    resume's state donated), "auto"'s loop calibrated on the two run whole (`_InPieces`):
    (output, wall seconds, seconds compiling)."""
    begin, compile_s = PROGRAMS.compiled(functools.partial(_begin, **options), ("begin",) + program_key[1:], *args)
    resume_key = ("resume",) + program_key[1:]
    resume, spent = PROGRAMS.compiled(functools.partial(_resume, **options), resume_key, begin.out_info[0],
                                      _device_scalar_or_vector(target, np.asarray(0, np.int32)), *args,
                                      donate_argnums=(0,))
    compile_s += spent
    if auto is not None:
        whole = _InPieces(begin, resume, _device_scalar_or_vector(target, np.asarray(1 << 30, np.int32)))
        args = args[:-1] + (auto.calibrate(whole, args, (resume_key, signature(args))),)

    def next_piece(state, piece: int):
        return resume(state, _device_scalar_or_vector(target, np.asarray(piece, np.int32)), *args)

    output, wall = stream_pieces(lambda: begin(*args), next_piece, sink)
    return output, wall, compile_s


@dataclasses.dataclass
class _InPieces:
    """A streamed call's begin and resume programs run to the end, as one callable with the
    unstreamed program's arguments and output (`DecodeOutput`): what "auto"'s calibration times
    (`ssd_jax.tuning.adaptive.calibrated_inputs`) and, by the two programs' text, keys on disk."""

    begin: object
    resume: object
    never: jax.Array   # a piece longer than any decode

    def __call__(self, *args):
        return self.resume(self.begin(*args)[0], self.never, *args)[1]

    def as_text(self) -> str:
        return self.begin.as_text() + "\n" + self.resume.as_text()


def _program(method, target: Model, draft, batch, max_new_tokens: int, sampling: SamplingParams, key) -> tuple:
    """A call's decode program before any adaptive costs: (fn, args, the program key's parts), the
    draft already colocated. The key's last part, the adaptive plan, is the caller's."""
    out_size = bucket(max_new_tokens)
    eos_ids = tuple(target.config.eos_token_ids or ())
    args = (_bare(target), _bare_draft(draft)) + _inputs(target, batch, key, max_new_tokens)
    fn = functools.partial(_decode, method=method, sampling=sampling, eos_ids=eos_ids, out_size=out_size)
    return fn, args, ("decode", method, sampling, eos_ids, out_size)


def _inputs(target: Model, batch, key, max_new_tokens: int) -> tuple:
    """The decode program's array arguments after the models: tokens, lengths, row keys, max_new."""
    inputs = (batch.tokens, batch.lengths, row_keys(key, batch.batch_size), np.asarray(max_new_tokens, np.int32))
    if target.placement is None:
        return tuple(map(jnp.asarray, inputs))
    # Global arrays, so the program also runs when the mesh spans several processes.
    return tuple(place_array(x, target.placement.replicated()) for x in inputs)


def _against_ar(target: Model, batch, max_new_tokens: int, sampling: SamplingParams, key, loop_costs: list,
                counters, num_tokens, loop_executable, loop_args: tuple, loop_key) -> dict:
    """Stats of an "auto" call that speculated, priced against AR's own program
    (`ssd_jax.tuning.against_ar`; counters: the call's spec counters on the host): loses_to_ar (the
    next calls start plain), and where checked priced_speedup_vs_ar and ar_step_over_loop_plain.
    AR's program is the one a plain-from-start call runs, compiled here only for calls within
    `against_ar.GAIN_CHECK` of the loop's plain steps. Their step ratio is kept under loop_key (the
    loop's program key and argument signature, which fix AR's program too), so a later call does
    not build AR's program and inputs to find it (1.9 ms of host time a 128-token call, CPU), and
    on disk per loop program (`against_ar.stored_ratio`), so a later process does not either."""
    from ssd_jax.tuning import against_ar

    by_cap = np.asarray(counters.cap_steps).tolist()
    plain_steps = int(counters.target_calls) - 1 - int(sum(by_cap))
    ar_steps = int(np.max(np.asarray(num_tokens))) - 1

    def ar_ratio() -> float | None:
        known, ratio = against_ar.stored_ratio(loop_executable, loop_key)
        if not known:
            executable, args, _, _ = _ar_executable(target, batch, max_new_tokens, sampling, key)
            ratio = against_ar.ar_step_ratio(executable, args, loop_executable, loop_args, loop_key)
        found["ar_step_over_loop_plain"] = ratio
        return ratio

    found: dict = {}
    lost, speedup = against_ar.loses_to_ar(loop_costs, by_cap, plain_steps, ar_steps, ar_ratio)
    if speedup is not None:
        found["priced_speedup_vs_ar"] = speedup
    return dict(loses_to_ar=lost, **found)


def _decode(target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`decode_arrays` with the adaptive loop's cost inputs as an argument ("auto"; else none)."""
    return decode_arrays(target, draft, tokens, lengths, keys, max_new, costs=costs, **options)


def _begin(target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`begin_arrays`, arguments as `_decode`'s."""
    return begin_arrays(target, draft, tokens, lengths, keys, max_new, costs=costs, **options)


def _resume(state, piece, target, draft, tokens, lengths, keys, max_new, costs=None, **options):
    """`resume_arrays` from state for a piece of `piece` tokens, the other arguments as `_decode`'s."""
    return resume_arrays(target, draft, tokens, lengths, keys, max_new, state, piece, costs=costs, **options)


@dataclasses.dataclass
class _Auto:
    """A call's adaptive-speculation plan and what to remember after it."""

    plan: object
    loop_inputs: np.ndarray
    costs: object
    memory_key: tuple
    measure_s: float   # seconds this call spent measuring costs (0 where the process had them)
    table_caps: tuple = ()   # the caps whose step the calibration times whole

    def calibrate(self, executable, args: tuple, calibration_key) -> jax.Array:
        """The loop's cost inputs measured on the call's own compiled program (once per program,
        kept under calibration_key): a short run forced to speculate and one forced to decode
        plainly give the step times that the per-forward measurement misses (sampling,
        verification, bookkeeping)."""
        from ssd_jax.tuning.adaptive import calibrated_inputs

        start = time.perf_counter()
        inputs = calibrated_inputs(executable, args, calibration_key, self.costs, self.loop_inputs,
                                   takes_cap=self.plan.capped, table_caps=self.table_caps)
        self.measure_s += time.perf_counter() - start
        self.loop_inputs = inputs
        costs = args[-1]
        return jax.device_put(inputs, costs.sharding)

    def record(self, counters) -> dict:
        """Remembers the call's acceptance for the next plan; the stats of the plan."""
        from ssd_jax.tuning.adaptive import ACCEPTANCE, acceptance_of

        counters = jax.device_get(counters)
        observed = acceptance_of(int(np.sum(counters.num_accepted)), int(np.sum(counters.num_rejected)))
        ACCEPTANCE.update(self.memory_key, observed)
        return dict(adaptive=True, num_draft_tokens_per_step=self.plan.draft_len, planned_draft_len=self.plan.draft_len,
                    early_stop_threshold=self.plan.threshold, observed_acceptance=observed,
                    cost_measure_time_s=self.measure_s, loop_costs=[float(x) for x in self.loop_inputs])


def _auto_plan(method, target: Model, draft: Model, sampling: SamplingParams, batch, max_new_tokens: int) -> _Auto:
    """Measures the pair's costs (once per process and shape) and plans the call."""
    from ssd_jax.tuning import adaptive

    start = time.perf_counter()
    costs = adaptive.measure_costs(target, adaptive.cost_draft(method, draft), batch.batch_size,
                                   batch.max_length + max_new_tokens // 2, adaptive.cost_width(method))
    plan, loop_inputs = adaptive.plan(method, target, draft, sampling, costs)
    return _Auto(plan=plan, loop_inputs=loop_inputs, costs=costs,
                 memory_key=adaptive.acceptance_key(target, draft, method, sampling),
                 measure_s=time.perf_counter() - start, table_caps=adaptive.table_caps(method, plan))


def _verdict_key(method, target: Model, draft, sampling: SamplingParams, batch, max_new_tokens: int) -> tuple:
    """What a "decode plainly from the start" verdict is remembered under (`ssd_auto.starts_plain`,
    `plain_verdicts.starts_plain`): the pair's weights, the method, sampling and the call's shapes."""
    from ssd_jax.tuning.adaptive import acceptance_key

    return (acceptance_key(target, draft, method, sampling), method, sampling, batch.batch_size,
            batch.tokens.shape[1], bucket(max_new_tokens))


def _generate_ssd(method: SSD, target: Model, draft: Model, batch, max_new_tokens: int, sampling: SamplingParams,
                  key, stream, verdict_key) -> GenerateOutput:
    from ssd_jax.draft.fanout import max_budget
    from ssd_jax.tuning import adaptive
    from ssd_jax.ssd.host_loop import generate_ssd
    from ssd_jax.ssd.placement import resolve_groups

    if not method.adaptive:
        return generate_ssd(target, draft, batch, max_new_tokens, sampling, key, stream=stream,
                            **ssd_engine_options(method))
    # "auto": L from the cost model (the draft-model methods' one with the cache build's forwards
    # where both models share devices, plus SSD's own step overhead measured on the program's past
    # calls) and the acceptance of their batch's pace (before any: the remembered acceptance).
    start = time.perf_counter()
    context = batch.max_length + max_new_tokens // 2
    target_devices, draft_devices = resolve_groups(method.target_devices, method.draft_devices, target, draft)
    slots = min(method.fanout_budget, max_budget(method.max_draft_len, target.config.vocab_size))
    costs = ssd_auto.build_priced(adaptive.measure_costs(target, draft, batch.batch_size, context, method.max_draft_len),
                                  draft, batch.batch_size, context, slots, target_devices == draft_devices)
    memory = adaptive.acceptance_key(target, draft, method, sampling)
    paced = ssd_auto.pace_acceptance(verdict_key)
    acceptance = adaptive.ACCEPTANCE.get(memory) if paced is None else paced
    overhead = ssd_auto.step_overhead(verdict_key, costs.target(1))
    draft_len = ssd_auto.probe_length(
        verdict_key, adaptive.choose_draft_len(costs, acceptance, method.max_draft_len, step_overhead_s=overhead),
        lambda n: adaptive.predicted_speedup(costs, acceptance, n, step_overhead_s=overhead))
    ssd_auto.ran_length(verdict_key, draft_len)
    options = ssd_engine_options(method, draft_len)
    measure_s = time.perf_counter() - start
    out = generate_ssd(target, draft, batch, max_new_tokens, sampling, key, stream=stream, auto=True,
                       verdict_key=verdict_key, **options)
    observed = adaptive.acceptance_of(out.stats["num_accepted_tokens"], out.stats["num_rejected"])
    adaptive.ACCEPTANCE.update(memory, observed)
    if out.stats.get("judged_step_s") is not None:
        ssd_auto.remember_step(verdict_key, draft_len, out.stats["judged_step_s"], out.stats["call_pace_tokens"],
                               costs.spec_step(draft_len))
    out.stats.update(observed_acceptance=observed, cost_measure_time_s=out.stats["cost_measure_time_s"] + measure_s)
    return out


def ssd_engine_options(method: SSD, draft_len: int | None = None) -> dict:
    """`ssd_jax.ssd.host_loop.generate_ssd`'s keyword options from an SSD method object; draft_len:
    the length to decode with (None: the method's, which must then be fixed, not "auto")."""
    draft_len = method.draft_len if draft_len is None else draft_len
    if not isinstance(draft_len, int):
        raise TypeError(f"ssd_engine_options needs a fixed draft length, got {draft_len!r}: pass the chosen one")
    return dict(num_draft_tokens=draft_len, fanout_budget=method.fanout_budget, fanout=method.fanout,
                saguaro_c=method.saguaro_c, fallback=method.fallback, target_devices=method.target_devices,
                draft_devices=method.draft_devices, fanout_acceptance=method.fanout_acceptance,
                fanout_exponent=method.fanout_exponent)
