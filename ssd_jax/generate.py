"""`generate`: the one entry point of every decoding method."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ssd_jax.draft.cascade_options import (DEFAULT_MAX_NGRAM, check_lenience, check_max_ngram, default_lenience,
                                           resolve_bigram)
from ssd_jax.draft.cascade_schedule import build_schedule
from ssd_jax.engine.autoregressive import generate_ar
from ssd_jax.engine.cascade import generate_cascade
from ssd_jax.engine.output import GenerateOutput
from ssd_jax.engine.prompts import PromptBatch, prepare_prompts
from ssd_jax.engine.retrieval import RETRIEVAL_METHODS, generate_retrieval
from ssd_jax.engine.speculative import SPECULATIVE_METHODS, generate_speculative
from ssd_jax.engine.ssd import generate_ssd
from ssd_jax.engine.ssd_options import ssd_options
from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.pairing import check_same_tokenizer
from ssd_jax.sampling import SamplingParams

METHODS = ("ar",) + tuple(SPECULATIVE_METHODS) + RETRIEVAL_METHODS + ("csd", "ssd")
DEFAULT_NUM_DRAFT_TOKENS = 5
DEFAULT_NUM_PATHS = 2  # benchmarks/results/speculative_sweep.json: K=2 beats K=3 wall-clock on CPU
# Retrieval drafting (method -> option -> default).
RETRIEVAL_DEFAULTS = {
    "pld": dict(num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS, prompt_lookup_min=1, prompt_lookup_max=3),
    "logitspec": dict(num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS, logitspec_topk=16, tree_capacity=64, max_ngram=3),
}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _speculative_options(method: str, options: dict) -> tuple[int, int]:
    unknown = sorted(set(options) - {"num_draft_tokens", "num_paths"})
    if unknown:
        raise InputError(f"method {method!r} does not take option(s) {', '.join(unknown)}; "
                         f"it takes num_draft_tokens and num_paths")
    multi = SPECULATIVE_METHODS[method][1]
    length = _positive_int("num_draft_tokens", options.get("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS))
    paths = _positive_int("num_paths", options.get("num_paths", DEFAULT_NUM_PATHS if multi else 1))
    if not multi and paths > 1:
        multi_names = ", ".join(m for m, (_, is_multi) in SPECULATIVE_METHODS.items() if is_multi)
        raise InputError(f"method {method!r} drafts a single path; num_paths={paths} needs one of {multi_names}")
    return length, paths


def _retrieval_options(method: str, options: dict) -> dict:
    defaults = RETRIEVAL_DEFAULTS[method]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise InputError(f"method {method!r} does not take option(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(defaults)}")
    values = {name: _positive_int(name, options.get(name, default)) for name, default in defaults.items()}
    if method == "pld":
        if values["prompt_lookup_max"] < values["prompt_lookup_min"]:
            raise InputError(f"prompt_lookup_max={values['prompt_lookup_max']} is below "
                             f"prompt_lookup_min={values['prompt_lookup_min']}")
        return dict(num_draft_tokens=values["num_draft_tokens"], ngram_min=values["prompt_lookup_min"],
                    ngram_max=values["prompt_lookup_max"], logitspec_topk=0, tree_capacity=values["num_draft_tokens"] + 1)
    if values["tree_capacity"] < 2:
        raise InputError(f"tree_capacity must be >= 2 (the root and one draft token), got {values['tree_capacity']}")
    return dict(num_draft_tokens=values["num_draft_tokens"], ngram_min=1, ngram_max=values["max_ngram"],
                logitspec_topk=values["logitspec_topk"], tree_capacity=values["tree_capacity"])


def _check_draft(target: Model, draft, batch: PromptBatch, max_new_tokens: int, length: int) -> None:
    if draft is None:
        raise InputError("speculative methods need a draft model: pass draft=ssd_jax.load(...)")
    if not isinstance(draft, Model):
        raise InputError(f"draft must be an ssd_jax Model (see ssd_jax.load), got {type(draft).__name__}")
    check_same_tokenizer(target, draft)
    needed = batch.max_length + max_new_tokens + length
    if needed > draft.config.max_position_embeddings:
        raise InputError(f"the draft sees up to {needed} positions, beyond its "
                         f"max_position_embeddings={draft.config.max_position_embeddings}")


CASCADE_OPTIONS = ("drafts", "k_matrix", "max_draft_tokens", "lenience", "bigram", "max_ngram")


def _cascade_options(target: Model, draft, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams,
                     options: dict) -> dict:
    """Checks method "csd"'s options; returns generate_cascade's keyword arguments."""
    unknown = sorted(set(options) - set(CASCADE_OPTIONS))
    if unknown:
        raise InputError(f"method 'csd' does not take option(s) {', '.join(unknown)}; "
                         f"it takes draft or {', '.join(CASCADE_OPTIONS)}")
    drafts = options.get("drafts")
    if drafts is not None and draft is not None:
        raise InputError("method 'csd' takes draft=model or drafts=[model, ...] (largest first), not both")
    if drafts is None:
        if draft is None:
            raise InputError("method 'csd' needs drafters: pass drafts=[model, ...] (largest first) or draft=model")
        drafts = [draft]
    if isinstance(drafts, Model) or not isinstance(drafts, (list, tuple)):
        raise InputError(f"drafts must be a list of ssd_jax Models, largest first; got {type(drafts).__name__}")
    schedule = build_schedule(options.get("k_matrix"), len(drafts), options.get("max_draft_tokens"), sampling.greedy)
    for model in drafts:
        _check_draft(target, model, batch, max_new_tokens, schedule.width + schedule.max_pending + 1)
    needed = batch.max_length + max_new_tokens + schedule.width + 1
    if needed > target.config.max_position_embeddings:
        raise InputError(f"method 'csd' needs up to {needed} positions, beyond the target's "
                         f"max_position_embeddings={target.config.max_position_embeddings}")
    bigram = resolve_bigram(target, options.get("bigram")) if schedule.uses_maxgram else np.zeros((1,), np.int32)
    lenience = options.get("lenience")
    lenience = check_lenience(default_lenience(sampling) if lenience is None else lenience, sampling)
    max_ngram = check_max_ngram(options.get("max_ngram", DEFAULT_MAX_NGRAM))
    return dict(drafts=tuple(drafts), schedule=schedule, lenience=lenience, bigram=bigram, max_ngram=max_ngram)


def generate(
    target: Model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    method: str = "ar",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    draft: Model | None = None,
    stream=None,
    **method_options,
) -> GenerateOutput:
    """Generates up to max_new_tokens per prompt with the target's exact output law.

    target: the model whose output law is reproduced. prompt_ids: a batch of token-id lists
    (ragged). method: "ar" (autoregressive), or with a `draft` model "sd" (tokenwise speculative
    sampling), "bv" (block verification), "specinfer", "spectr", "gbv" (K i.i.d. draft paths);
    without a draft model "pld" (prompt lookup) and "logitspec" (retrieval + next-next guesses
    from the last logit, a token tree); "csd" (a cascade of drafters reviewing each other's drafts
    down to Max-Gram).
    method_options: num_draft_tokens (L, default 5) and num_paths (K, default 2 for multi-path
    methods); pld: num_draft_tokens, prompt_lookup_min (1), prompt_lookup_max (3); logitspec:
    num_draft_tokens (the root's retrieved branch), logitspec_topk (16), tree_capacity (64
    nodes), max_ngram (3); csd (Cascade Speculative Drafting, see `ssd_jax.draft.cascade`):
    drafts=[model, ...] (largest first; draft=model means [model]), k_matrix ((n+2) x (n+2)
    nested ints, rows/columns: target, drafts, Max-Gram; default per temperature:
    `ssd_jax.draft.cascade_schedule.default_cascade`), max_draft_tokens (the target verifies at
    most this many of the cascade's draft tokens per step; default: the default cascade's cap
    without a k_matrix, else all), lenience (> 1 only at temperature 0; default 2 there, else 1),
    bigram (Max-Gram's table: int32 [V] or a path; default: the shipped table when the target has
    the embedded tokenizer), max_ngram (4).
    temperature 0 is greedy (every method then verifies greedily); top_k / top_p filter
    as in transformers, identically for draft and target. key: a jax PRNG key shared by every row
    (a row's output does not depend on its batch), or one key per row; None means PRNGKey(0).
    stream: optional callable sink(new_tokens int32 [B, N], counts int32 [B]) called as tokens
    are produced (row b produced new_tokens[b, :counts[b]]); it costs a small host copy per step.
    method "ssd" (speculative speculative decoding / Saguaro, with a draft model; see
    `ssd_jax.engine.ssd`): num_draft_tokens (4), fanout_budget (10 speculations per step), fanout
    ("geometric" or "uniform"), saguaro_c (1.0 = plain sampling), fallback ("jit", "ngram" or
    "auto"), target_devices / draft_devices (default: the visible devices split in two),
    fanout_acceptance / fanout_exponent (Saguaro's a and r; default: estimated online).
    Returns GenerateOutput(tokens, finish_reasons, stats). Raises InputError on bad arguments.
    """
    if not isinstance(target, Model):
        raise InputError(f"target must be an ssd_jax Model (see ssd_jax.load), got {type(target).__name__}")
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    if stream is not None and not callable(stream):
        raise InputError(f"stream must be a callable sink(new_tokens, counts), got {type(stream).__name__}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = prepare_prompts(prompt_ids, target.config, max_new_tokens)
    if method == "ar":
        if method_options:
            raise InputError(f"method 'ar' takes no options, got {', '.join(sorted(method_options))}")
        return generate_ar(target, batch, int(max_new_tokens), sampling, key, stream=stream)
    if method in RETRIEVAL_METHODS:
        if draft is not None:
            raise InputError(f"method {method!r} drafts by retrieval from the context and takes no draft model")
        options = _retrieval_options(method, method_options)
        needed = batch.max_length + int(max_new_tokens) + options["tree_capacity"]
        if needed > target.config.max_position_embeddings:
            raise InputError(f"method {method!r} needs up to {needed} positions, beyond the target's "
                             f"max_position_embeddings={target.config.max_position_embeddings}")
        return generate_retrieval(target, batch, int(max_new_tokens), sampling, key, method=method, stream=stream,
                                  **options)
    if method == "csd":
        options = _cascade_options(target, draft, batch, int(max_new_tokens), sampling, method_options)
        return generate_cascade(target, options.pop("drafts"), batch, int(max_new_tokens), sampling, key,
                                stream=stream, **options)
    if method == "ssd":  # speculative speculative decoding (Saguaro): see ssd_jax.engine.ssd
        options = ssd_options(target, batch, int(max_new_tokens), method_options)
        _check_draft(target, draft, batch, int(max_new_tokens), 2 * options["num_draft_tokens"] + 2)
        return generate_ssd(target, draft, batch, int(max_new_tokens), sampling, key, stream=stream, **options)
    length, paths = _speculative_options(method, method_options)
    _check_draft(target, draft, batch, int(max_new_tokens), length)
    return generate_speculative(target, draft, batch, int(max_new_tokens), sampling, key, method=method,
                                num_draft_tokens=length, num_paths=paths, stream=stream)
