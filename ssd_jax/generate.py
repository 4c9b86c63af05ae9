"""`generate`: the one entry point of every decoding method."""

from __future__ import annotations

from typing import Sequence

from ssd_jax.engine.autoregressive import generate_ar
from ssd_jax.engine.output import GenerateOutput
from ssd_jax.engine.prompts import prepare_prompts
from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.sampling import SamplingParams

METHODS = ("ar",)


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
    """Generates up to max_new_tokens per prompt.

    target: the model whose output law is reproduced. prompt_ids: a batch of token-id lists
    (ragged). method: one of METHODS. temperature 0 is greedy; top_k / top_p filter as in
    transformers. key: a jax PRNG key shared by every row (a row's output does not depend on its
    batch), or one key per row; None means PRNGKey(0). Returns GenerateOutput(tokens,
    finish_reasons, stats). Raises InputError on bad arguments.
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
    raise AssertionError(method)
