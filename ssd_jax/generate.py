"""`generate`: the host wrapper over the decode programs. It checks and buckets the prompts, asks
its `Tuner` for a plan where the method is "auto", gets the compiled program from the one compile
cache, runs it (whole, or streamed in pieces), lets the tuner record the call, and returns the
tokens, stats and the plan it ran (`GenerateOutput.plan`, which `decode(..., plan=)` replays)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np

from ssd_jax.backend import policy_for
from ssd_jax.decode import check_models, check_positions, draft_margin
from ssd_jax.errors import InputError
from ssd_jax.loop.decoder import split_cascade
from ssd_jax.methods import AR, DEFAULT_METHOD, METHOD_CLASSES, METHODS, SSD, Method, as_method, for_target  # noqa: F401
from ssd_jax.model import Model
from ssd_jax.plan import Plan, fixed_plan
from ssd_jax.runtime import decode_program
from ssd_jax.runtime.compile_cache import PROGRAMS, signature
from ssd_jax.runtime.output import GenerateOutput, generate_output
from ssd_jax.runtime.prompts import PromptBatch, prepare_prompts
from ssd_jax.sampling import SamplingParams
from ssd_jax.ssd.call import generate_ssd_call, pair_acceptance_key, priced_speedup, read_plain_call, ssd_target
from ssd_jax.ssd import auto as ssd_auto
from ssd_jax.tuning import auto_call, per_call, plain_verdicts
from ssd_jax.tuning.auto_shape import open_paths, shaped
from ssd_jax.tuning.per_call_run import generate_per_call
from ssd_jax.tuning.tuner import Tuner, as_tuner

# The keyword options generate() took before method objects: old name -> method field.
OLD_OPTIONS = dict(num_draft_tokens="draft_len", max_draft_len="max_draft_len", draft_threshold="threshold",
                   num_paths="paths", prompt_lookup_min="min_ngram",
                   prompt_lookup_max="max_ngram", logitspec_topk="topk", tree_capacity="tree_size",
                   max_ngram="max_ngram", k_matrix="k_matrix", lenience="lenience",
                   max_draft_tokens="max_draft_tokens", fanout_budget="fanout_budget", fanout="fanout",
                   saguaro_c="saguaro_c", fallback="fallback", fanout_acceptance="fanout_acceptance",
                   fanout_exponent="fanout_exponent", target_devices="target_devices", draft_devices="draft_devices")


@dataclasses.dataclass(frozen=True)
class _Call:
    """One `generate` call's inputs after checking: the models, the prompts, the token budget,
    sampling, key, stream sink and tuner."""

    target: Model
    draft: object
    batch: PromptBatch
    max_new_tokens: int
    sampling: SamplingParams
    key: object
    stream: object
    tuner: Tuner


def generate(
    target: Model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    method=DEFAULT_METHOD,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    coupling: str = "rejection",
    key=None,
    draft=None,
    stream=None,
    tuner: Tuner | None = None,
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
    transformers, identically for draft and target. coupling: "rejection" (speculative sampling:
    the output has the target's law, and which sample a key gives depends on the method, its
    draft and plan) or "gumbel" (`ssd_jax.coupling`: every method gives exactly autoregressive
    sampling's tokens for the key, whatever drafts, plans or batches it). key: a jax PRNG key
    shared by every row (a row's output does not depend on its batch; under "gumbel" row r uses
    fold_in(key, r)), or one key per row; None means PRNGKey(0).
    stream: optional callable sink(new_tokens int32 [B, N], counts int32 [B]) called as tokens
    are produced (row b produced new_tokens[b, :counts[b]]): the decode runs in pieces of a few
    tokens, growing while a piece is quick (`ssd_jax.runtime.streaming`), each piece one read back
    to the host. A fixed method streams the tokens of the unstreamed call; under draft_len "auto"
    each piece's end also ends the loop's phase, so at T > 0 the samples may differ (the law is
    the target's). tuner: the `ssd_jax.Tuner` whose measurements and memories decide "auto"
    (None: `ssd_jax.default_tuner()`); stats["calibration_time_s"] says how long the call spent
    on the tuner's calibrations, once per program and machine (`Tuner.calibrating`).
    Returns GenerateOutput(tokens, finish_reasons, stats, plan); `decode(..., plan=out.plan)` with
    the same key gives the same tokens for every method but SSD (and streamed "auto" calls).
    Raises InputError on bad arguments, including the keyword options of the old API
    (num_draft_tokens=, num_paths=, ...): the message names the method object to use instead.
    """
    if old_options:
        raise _old_options_error(method, old_options)
    if isinstance(method, Tuner):
        raise InputError("method must be a method object or name, got a Tuner; pass it as tuner=...")
    requested = as_method(method)
    tuner = as_tuner(tuner)
    calibrated_before = tuner.calibration_seconds()
    if not isinstance(target, Model):
        return check_models(requested, target, draft, SamplingParams())  # raises, naming the problem
    if stream is not None and not callable(stream):
        raise InputError(f"stream must be a callable sink(new_tokens, counts), got {type(stream).__name__}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, coupling=coupling)
    batch = prepare_prompts(prompt_ids, target.config, max_new_tokens)
    draft = check_models(requested, target, draft, sampling)
    call = _Call(target, draft, batch, int(max_new_tokens), sampling, key, stream, tuner)
    paths_open = open_paths(requested, sampling)
    chosen_per_call = per_call.applies(requested, policy_for(target.params), batch.batch_size)
    method = for_target(shaped(tuner, requested, target, draft, sampling, batch.batch_size,
                               batch.max_length + call.max_new_tokens // 2,
                               paths=not (chosen_per_call and paths_open)), target)
    check_positions(method, target, draft, sampling, batch.max_length, call.max_new_tokens)
    out, program, auto = _generate(call, method, chosen_per_call, paths_open)
    out.plan = fixed_plan(requested, program, target, draft, sampling, call.max_new_tokens,
                          loop=auto and auto.plan, costs=auto and auto.loop_inputs)
    # What this call spent on measurements kept per machine, which later processes read back.
    out.stats["calibration_time_s"] = tuner.calibration_seconds() - calibrated_before
    return out


def _generate(call: _Call, method: Method, chosen_per_call: bool, paths_open: bool) -> tuple:
    """The call decoded by the program its method and the tuner's memories choose: (output, the
    method the program ran, the `AutoCall` of an adaptive loop's run or None)."""
    verdict = auto_call.verdict_key(method, call.target, call.draft, call.sampling, call.batch, call.max_new_tokens)
    if isinstance(method, SSD):
        if method.adaptive and ssd_auto.starts_plain(
                call.tuner.ssd, verdict,
                call.tuner.known_acceptance(pair_acceptance_key(call.target, call.draft, method, call.sampling)),
                priced_speedup(call.tuner, method, call.target, call.draft, call.batch, call.max_new_tokens, verdict)):
            # The tuner remembers that SSD was slower than plain decoding for this program: AR's loop.
            placed = dataclasses.replace(call, target=ssd_target(method, call.target, call.draft))
            out = _plain_from_start(placed, method, switched_to_plain_at_step=0, ssd_steps=0)
            read_plain_call(call.tuner, method, call.target, call.draft, call.batch, call.max_new_tokens,
                            call.sampling, call.key, out, verdict)
            return out, AR(), None
        out, draft_len = generate_ssd_call(call.tuner, method, call.target, call.draft, call.batch,
                                           call.max_new_tokens, call.sampling, call.key, call.stream, verdict)
        return out, dataclasses.replace(method, draft_len=draft_len), None
    if not method.adaptive:
        return _run(call, method)
    if chosen_per_call:
        programs = []

        def run(program: Method | None) -> GenerateOutput:
            programs.append(program or AR())
            return _run(call, program)[0] if program is not None else _plain_from_start(call, method)

        out = generate_per_call(call.tuner, method, call.target, call.draft, call.batch, call.max_new_tokens,
                                call.sampling, call.key, call.stream is not None, verdict, paths_open, run)
        return out, programs[0], None
    # The tuner remembers a call whose loop decoded (nearly) every step plainly: AR's loop, but for probes.
    if plain_verdicts.starts_plain(call.tuner, verdict):
        return _plain_from_start(call, method), AR(), None
    out, program, auto = _run(call, method)
    if out.stats["target_calls"] > 1:   # a call of the prefill alone (one token) judged nothing
        plain_verdicts.remember_share(call.tuner, verdict, out.stats["ar_fallback_share"],
                                      lost=out.stats.get("loses_to_ar", False))
    return out, program, auto


def _plain_from_start(call: _Call, method: Method, **stats) -> GenerateOutput:
    """An "auto" call that a remembered verdict runs with AR's jitted loop (no draft work at all):
    the AR tokens and stats, marked as the method's with plain_from_start (and `stats`), with the
    method's draft counters at what a run that drafted nothing reports (`auto_call.no_drafts`),
    so that the stats of every "auto" call hold the same keys."""
    out, _, _ = _run(dataclasses.replace(call, draft=None), AR())
    out.stats.update(method=method.name, adaptive=True, planned_draft_len=0, mean_draft_len=0.0,
                     ar_fallback_share=1.0, plain_from_start=True, **auto_call.no_drafts(), **stats)
    return out


def _run(call: _Call, method: Method) -> tuple:
    """Every method but SSD: one jitted decode program, or streamed, two run in pieces
    (`ssd_jax.runtime.streaming`); an "auto" method's loop planned by the tuner and calibrated
    on its compiled program. Returns (output, method, the `AutoCall` or None)."""
    target, sampling = call.target, call.sampling
    draft = decode_program.colocated(method, target, call.draft)
    fn, args, key_parts = decode_program.program(method, target, draft, call.batch, call.max_new_tokens, sampling,
                                                 call.key)
    auto = auto_call.plan_call(call.tuner, method, args[0], args[1], sampling, call.batch, call.max_new_tokens) \
        if method.adaptive else None
    if auto is not None:
        fn = functools.partial(fn.func, plan=auto.plan, **fn.keywords)
        args = args + (decode_program.scalar_arg(target, np.asarray(auto.loop_inputs, np.float32)),)
    program_key = key_parts + (auto and auto.plan,)
    warmed, executable, call_key = False, None, None
    if call.stream is not None:
        output, wall, compile_s = decode_program.streamed(fn.keywords, program_key, args, call.stream, target,
                                                          auto and auto.calibrate, timed=call.tuner.measures)
    else:
        executable, compile_s = PROGRAMS.compiled(fn, program_key, *args)
        warmed = bool(compile_s) and policy_for(target.params).warm_new_programs
        if warmed:
            compile_s += decode_program.first_run_s(executable, args)
        if auto is not None:
            # Keyed like the executable (argument shapes too): a program for another batch, prompt
            # bucket or model pair has step costs of its own, and AR's step against its plain step.
            call_key = (program_key, signature(args))
            args = args[:-1] + (auto.calibrate(executable, args, call_key),)
        start = time.perf_counter()
        output = jax.block_until_ready(executable(*args))
        wall = time.perf_counter() - start
    stats = _method_stats(method, draft, sampling, output, depth=auto.plan.draft_len if auto is not None else None)
    if warmed:
        stats["first_run_warmed"] = True
    counters = output.counters["spec"]
    if auto is not None:
        counters = jax.device_get(counters)   # once: the record and the stats read it
        stats.update(auto.record(counters))
        if executable is not None and call.tuner.measures:
            stats.update(auto_call.against_ar_stats(call.tuner, target, call.batch, call.max_new_tokens, sampling,
                                                    call.key, stats["loop_costs"], counters, output.num_tokens,
                                                    executable, args, call_key))
    out = generate_output(method.name, output.tokens, output.num_tokens, output.finish_reason,
                          counters, wall, compile_s, stats, drafts=method.name != "ar")
    return out, method, auto


def _method_stats(method: Method, draft, sampling: SamplingParams, output, depth: int | None = None) -> dict:
    """The stats that say what a method's program drafted: draft tokens per step, tree nodes or
    paths, and CSD's cascade counters. depth: the draft length an "auto" plan chose (EAGLE's
    tree depth; None: the method's own)."""
    name = method.name
    if name in ("pld", "logitspec"):
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
    if name == "eagle":
        depth = depth or method.max_len
        return dict(num_draft_tokens_per_step=method.nodes_at(depth) - 1, tree_nodes=method.nodes_at(depth),
                    tree_depth=depth)
    return dict(num_draft_tokens_per_step=method.draft_len, num_paths=method.paths)


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


__all__ = ["generate", "Plan", "OLD_OPTIONS"]
