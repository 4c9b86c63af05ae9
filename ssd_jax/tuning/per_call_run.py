"""An "auto" call where the backend policy runs one fixed program chosen per call
(`ssd_jax.tuning.per_call`): the choice among the method's programs (and, where "auto" chooses
them, its path counts) and AR's, the reference runs it prices against, and what the tuner keeps
after the call."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from ssd_jax.methods import Method
from ssd_jax.model import Model
from ssd_jax.runtime.output import GenerateOutput
from ssd_jax.runtime.prompts import PromptBatch
from ssd_jax.sampling import SamplingParams
from ssd_jax.tuning import auto_call, cost_model, per_call
from ssd_jax.tuning.auto_shape import PATH_CHOICES, path_acceptance

# run(program) -> the call's GenerateOutput with that program: the method at a fixed length, or, for
# None, AR's program as a call that decodes plainly from the start
RunProgram = Callable[[Method | None], GenerateOutput]


def _candidates(tuner, method: Method, target: Model, draft, sampling: SamplingParams, batch: PromptBatch,
                max_new_tokens: int, verdict: tuple, paths_open: bool) -> tuple[tuple, list[per_call.Candidate]]:
    """(the group's short key, the call's Candidates): one per path count where "auto" chooses
    them (paths_open), else the method's; laid out once per group and context (the costs they
    are priced with are measured on a tuner's first call)."""
    memory = tuner.per_call
    context = batch.max_length + max_new_tokens // 2
    group = auto_call.verdict_key(dataclasses.replace(method, paths=None), target, draft, sampling, batch,
                                  max_new_tokens) if paths_open else verdict

    def build() -> list:
        candidates = []
        for candidate in ([dataclasses.replace(method, paths=k) for k in PATH_CHOICES] if paths_open else [method]):
            shape_key = auto_call.verdict_key(candidate, target, draft, sampling, batch, max_new_tokens) \
                if paths_open else verdict
            candidates.append(per_call.Candidate(
                candidate, cost_model.acceptance_key(target, draft, candidate, sampling), memory.compact(shape_key),
                per_call.menu_for(tuner, candidate, target, draft, sampling, batch.batch_size, context),
                getattr(candidate, "paths", 1) or 1))
        return candidates

    return memory.compact(group), memory.layout(group, context, build)


def generate_per_call(tuner, method: Method, target: Model, draft, batch: PromptBatch, max_new_tokens: int,
                      sampling: SamplingParams, key, streaming: bool, verdict: tuple, paths_open: bool,
                      run: RunProgram) -> GenerateOutput:
    """The call: the method at the chosen length (and, paths_open, path count), or AR's program
    (length 0), AR's program timed on these inputs first where the tuner has no price of it yet;
    the call's acceptance, tokens and seconds per target call are remembered for the next choice
    (the seconds not when streaming, whose host copies they would hold, nor on the call that
    compiled the program). run: runs a program on the call (`RunProgram`)."""
    start = time.perf_counter()
    memory = tuner.per_call
    group, candidates = _candidates(tuner, method, target, draft, sampling, batch, max_new_tokens, verdict,
                                    paths_open)
    if paths_open:
        remembered = {c.paths: tuner.known_acceptance(c.memory_key) for c in candidates}
        acceptances = [path_acceptance(remembered, c.paths) for c in candidates]
    else:
        acceptances = [tuner.acceptance_for(c.memory_key) for c in candidates]
    shapes = [per_call.Shape(c.key, c.menu, a, c.paths) for c, a in zip(candidates, acceptances)]
    unpriced = [shape.key for shape in shapes if memory.ar_unpriced(shape.key)]
    if unpriced:
        seconds, calls, fixed = auto_call.ar_reference(target, batch, max_new_tokens, sampling, key)
        for shape_key in unpriced:
            memory.record_fixed(shape_key, fixed)
            memory.record(shape_key, 0, seconds, calls)
    index, length = memory.choose_shape(group, shapes)
    chosen = candidates[index].method
    measure_s = time.perf_counter() - start
    out = run(per_call.fixed(chosen, length) if length else None)
    if length and not streaming and memory.fixed_part_unknown(shapes[index].key, length):
        # After the program's first run; not on a streamed call, which ran other programs (begin
        # and resume) and is not priced.
        fixed_start = time.perf_counter()
        memory.record_fixed(shapes[index].key, auto_call.fixed_seconds(per_call.fixed(chosen, length), target, draft,
                                                                       batch, max_new_tokens, sampling, key), length)
        measure_s += time.perf_counter() - fixed_start
    observed = _record(tuner, out.stats, shapes, index, length, streaming, candidates[index].memory_key)
    out.stats.update(method=method.name, adaptive=True, per_call=True, planned_draft_len=length,
                     remembered_acceptance=shapes[index].acceptance, observed_acceptance=observed,
                     cost_measure_time_s=measure_s)
    if paths_open:   # on a call of AR's program, the shape a probe would run is not what ran
        out.stats["chosen_paths"] = shapes[index].paths if length else None
    return out


def _record(tuner, stats: dict, shapes: list, index: int, length: int, streaming: bool, memory_key) -> float | None:
    """Keeps the call's price, tokens and acceptance in the tuner; the acceptance it observed
    (None: AR's program, or no draft verified). Not timed: a streamed call (its host copies) and
    a call that compiled its program, whose run is the executable's first (slower than later
    ones, which would price that length out for good), unless that first run was made apart
    (`decode_program.first_run_s`)."""
    timed = not streaming and (not stats.get("compile_time_s") or stats.get("first_run_warmed", False))
    observed = None
    if length:
        observed = cost_model.acceptance_of(stats["num_accepted_tokens"], stats["num_rejected"])
    for shape in (shapes if length == 0 else [shapes[index]]):   # AR's program is every shape's
        # No draft token verified (retrieval found nothing): the tokens read against the acceptance
        # the call was chosen with, which they then price down to what they were.
        tuner.per_call.record(shape.key, length, stats["wall_time_s"] if timed else None, stats["target_calls"],
                              stats["block_efficiency"] if length else None,
                              shapes[index].acceptance if observed is None else observed)
    if length:
        tuner.remember_acceptance(memory_key, observed, per_call.call_share(stats["target_calls"] - 1))
    return observed
