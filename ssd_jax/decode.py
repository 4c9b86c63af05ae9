"""`decode`: every synchronous method as one pure, traceable function that runs inside a user's
`jax.jit`; and the checks of models and drafters that `decode` and `generate` share.

Checks. `decode` checks everything static (types, method/draft pairing, tokenizers, shapes,
`max_new_tokens`) always, and the values of tokens and lengths (ids in the vocabulary, 1 <=
lengths <= width, positions within max_position_embeddings) only when they are concrete: under
the user's jit they are traced, so `decode` trusts them there (`generate` always checks them, on
the host, before calling the compiled program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.eagle.head import EagleHead, check_head_params
from ssd_jax.loop.decoder import DecodeOutput, decode_arrays, split_cascade
from ssd_jax.runtime.prompts import row_keys
from ssd_jax.errors import InputError
from ssd_jax.methods import CSD, EAGLE, SSD, Method, as_method, for_target
from ssd_jax.model import Model
from ssd_jax.runtime.pairing import check_same_tokenizer
from ssd_jax.plan import Plan
from ssd_jax.sampling import SamplingParams
from ssd_jax.tuning.auto_shape import shaped
from ssd_jax.tuning.cost_model import prior_plan
from ssd_jax.tuning.tuner import Tuner

__all__ = ["DecodeOutput", "decode", "check_models", "draft_margin"]


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _model(name: str, value) -> Model:
    if isinstance(value, Method):
        raise InputError(f"{name} must be an ssd_jax Model, got the method object {value!r}; "
                         f"pass methods as method=...")
    if not isinstance(value, Model):
        raise InputError(f"{name} must be an ssd_jax Model (see ssd_jax.load), got {type(value).__name__}")
    return value


def check_models(method: Method, target: Model, draft, sampling: SamplingParams):
    """Checks target and draft against the method; returns the draft to decode with: None, a
    Model, or for CSD a tuple (models largest first, then a MaxGram when the schedule uses one;
    the shipped table is added for a target with the embedded tokenizer)."""
    from ssd_jax.draft.maxgram import MaxGram

    _model("target", target)
    if isinstance(draft, Method):
        raise InputError(f"draft must be a Model (or, for CSD, a tuple of them), got the method object {draft!r}; "
                         f"pass methods as method=...")
    if not method.drafts_with_model:
        if draft is not None:
            raise InputError(f"method {type(method).__name__} drafts without a model and takes no draft; "
                             f"got draft={type(draft).__name__}")
        return None
    if isinstance(method, EAGLE) or isinstance(draft, EagleHead):
        return _checked_head(method, target, draft)
    if draft is None:
        raise InputError(f"method {type(method).__name__} drafts with a model and they need a draft model: "
                         f"pass draft=ssd_jax.load(...)"
                         + (" or a tuple of them, largest first" if isinstance(method, CSD) else ""))
    if isinstance(method, CSD):
        models, maxgram = split_cascade(draft)
        for i, m in enumerate(models):
            _model(f"draft[{i}]", m)
            check_same_tokenizer(target, m)
        from ssd_jax.loop.cascade import cascade_lenience, cascade_schedule

        cascade_lenience(method, sampling)
        if cascade_schedule(method, len(models), sampling).uses_maxgram and maxgram is None:
            maxgram = MaxGram.for_target(target)
        return models + ((maxgram,) if maxgram is not None else ())
    if isinstance(draft, (tuple, list)):
        raise InputError(f"method {type(method).__name__} takes one draft model, got a tuple of {len(draft)}; "
                         f"a tuple of drafters is for CSD")
    _model("draft", draft)
    check_same_tokenizer(target, draft)
    return draft


def _checked_head(method: Method, target: Model, head):
    """The head of an EAGLE call, checked against the target; InputError for a head passed to
    another method, or a draft model (or anything else) passed to EAGLE."""
    if not isinstance(method, EAGLE):
        raise InputError(f"draft is a feature-level head (EagleHead), which only method EAGLE takes; method "
                         f"{type(method).__name__} takes a draft model (ssd_jax.load(...))")
    if not isinstance(head, EagleHead):
        raise InputError(f"method EAGLE takes a feature-level head as draft= (ssd_jax.eagle.load_head(...) or "
                         f"ssd_jax.default_eagle_head()), got {type(head).__name__}")
    head.check_target(target)
    check_head_params(head, target.config)
    return head


def draft_margin(method: Method, sampling: SamplingParams, draft) -> int:
    """Positions past prompt + max_new_tokens a method's models may see (for position checks)."""
    from ssd_jax.draft.tree_layout import logitspec_layout

    name = method.name
    if name == "ar":
        return 0
    if name == "pld":
        return method.max_len + 1
    if name == "logitspec":
        return max(logitspec_layout(n, method.topk, method.tree_size).num_nodes for n in range(1, method.max_len + 1))
    if name == "csd":
        from ssd_jax.loop.cascade import cascade_schedule

        schedule = cascade_schedule(method, len(split_cascade(draft)[0]), sampling)
        return schedule.width + schedule.max_pending + 1
    if name == "ssd":
        return 2 * method.max_len + 2
    if name == "eagle":
        return method.max_len + 1
    return method.max_len


def check_positions(method: Method, target: Model, draft, sampling: SamplingParams, longest: int,
                    max_new_tokens: int) -> None:
    """Every model must have positions for the longest prompt, the outputs and the method's margin."""
    needed = longest + int(max_new_tokens) + draft_margin(method, sampling, draft)
    models = [("the target", target)]
    if isinstance(draft, Model):
        models.append(("the draft", draft))
    elif isinstance(draft, tuple):
        models += [(f"draft {i}", m) for i, m in enumerate(split_cascade(draft)[0])]
    for name, model in models:
        if needed > model.config.max_position_embeddings:
            raise InputError(f"method {type(method).__name__} needs up to {needed} positions, beyond {name}'s "
                             f"max_position_embeddings={model.config.max_position_embeddings}")


def _static_count(max_new_tokens) -> int:
    if _is_traced(max_new_tokens):
        raise InputError("max_new_tokens must be a static Python int (it sets output shapes), got a traced value; "
                         "close over it or list it in jax.jit's static_argnames")
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def _check_values(target: Model, tokens, lengths) -> None:
    """Concrete-only checks of token ids and lengths."""
    lengths_np = np.asarray(lengths)
    width = tokens.shape[1]
    bad = np.flatnonzero((lengths_np < 1) | (lengths_np > width))
    if bad.size:
        b = int(bad[0])
        raise InputError(f"lengths[{b}] = {int(lengths_np[b])} must be in [1, {width}] (tokens' width)")
    tokens_np = np.asarray(tokens)
    valid = np.arange(width)[None, :] < lengths_np[:, None]
    outside = valid & ((tokens_np < 0) | (tokens_np >= target.config.vocab_size))
    if outside.any():
        b, t = map(int, np.argwhere(outside)[0])
        raise InputError(f"tokens[{b}, {t}] = {int(tokens_np[b, t])} is outside the vocabulary "
                         f"[0, {target.config.vocab_size})")


def decode(target: Model, tokens, lengths, *, method, max_new_tokens: int, key, draft=None,
           sampling: SamplingParams = SamplingParams(), eos_ids: tuple = (), plan: Plan | None = None,
           **host_only) -> DecodeOutput:
    """Decodes right-padded prompts with any synchronous method; pure and traceable.

    target: a Model (its params may be traced); tokens int32 [B, T] right-padded; lengths int32
    [B] (1 <= lengths <= T); method: a method object (or its name) other than SSD; max_new_tokens:
    a static int; key: a PRNG key shared by every row, or one per row ([B] typed or [B, 2] raw);
    draft: a Model for SD/BV/SpecInfer/SpecTr/GBV, a tuple (models largest first, optionally a
    `MaxGram` last) for CSD, None otherwise; sampling: `SamplingParams` (static); eos_ids: static
    ids that end a row (() = none; pass `target.config.eos_token_ids` for the model's).
    plan: the `Plan` a `generate` call ran (`GenerateOutput.plan`, for the same method, models'
    shapes, sampling and max_new_tokens): decode then runs that call's program, with its shapes,
    lengths and cost inputs, and with the same key and prompts gives `generate`'s tokens. Without
    a plan, draft_len="auto" runs the fixed prior (`ssd_jax.tuning.cost_model.prior_plan`: fixed
    relative costs and the prior acceptance; LogitSpec's tree size and the multi-path methods'
    paths from the same), deterministic and the same on every machine: what `generate` runs with
    `Tuner(deterministic=True)`. Under `SamplingParams(coupling="gumbel")` every plan, and no
    plan, gives coupled autoregressive sampling's tokens for the key (`ssd_jax.coupling`), so
    decode equals `generate` without one. decode has no host: it reads no process memory and
    measures nothing (a `tuner=` is an InputError).
    Inside `jax.jit`, keep method, max_new_tokens, sampling, eos_ids and plan static (or closed over).
    Returns `DecodeOutput(tokens int32 [B, max_new_tokens], num_tokens, finish_reason, counters)`.
    """
    if "tuner" in host_only:
        raise InputError("decode runs inside jit and has no host to tune on: it takes no tuner=; pass "
                         "plan=out.plan from a generate(..., tuner=...) call, or no plan for the fixed prior")
    if host_only:
        raise InputError(f"decode() got unexpected keyword argument(s) {', '.join(sorted(host_only))}")
    if isinstance(method, Tuner):
        raise InputError("method must be a method object or name, got a Tuner")
    method = as_method(method)
    if isinstance(method, SSD):
        raise InputError("method SSD is host-driven across two device groups and cannot run inside decode; "
                         "use ssd_jax.generate(target, prompts, method=SSD(...), draft=...)")
    if not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling must be ssd_jax.SamplingParams, got {type(sampling).__name__}")
    max_new = _static_count(max_new_tokens)
    if isinstance(eos_ids, (int, np.integer)):
        eos_ids = (eos_ids,)
    eos_ids = tuple(int(e) for e in eos_ids)
    draft = check_models(method, target, draft, sampling)
    if plan is not None and not isinstance(plan, Plan):
        raise InputError(f"plan must be the ssd_jax.Plan of a generate call (GenerateOutput.plan), "
                         f"got {type(plan).__name__}")
    if plan is not None:
        plan.check(method, target, draft, sampling, max_new)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    if tokens.ndim != 2 or tokens.shape[1] < 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"tokens must be integers [batch, length >= 1], got shape {tokens.shape} {tokens.dtype}")
    program, loop_plan, costs = _program(plan, method, target, draft, sampling, tokens.shape[0],
                                         tokens.shape[1] + max_new // 2)
    if lengths.shape != tokens.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise InputError(f"lengths must be integers [{tokens.shape[0]}] (one per row of tokens), "
                         f"got shape {lengths.shape} {lengths.dtype}")
    if not _is_traced(tokens) and not _is_traced(lengths):
        _check_values(target, tokens, lengths)
    if not _is_traced(lengths):
        check_positions(program, target, draft, sampling, int(np.max(np.asarray(lengths))), max_new)
    return decode_arrays(target, draft if program.drafts_with_model else None, tokens, lengths,
                         row_keys(key, tokens.shape[0], sampling), max_new, method=program, sampling=sampling, eos_ids=eos_ids,
                         out_size=max_new, plan=loop_plan, costs=costs)


def _program(plan: Plan | None, method: Method, target: Model, draft, sampling: SamplingParams, batch: int,
             context: int) -> tuple:
    """(the method the decode runs, the adaptive loop's plan, its cost inputs): the plan's, else
    for "auto" the fixed prior (shapes with no tuner, `prior_plan`), else the method as given
    (both None)."""
    if plan is not None:
        return plan.program, plan.loop, None if plan.costs is None else np.asarray(plan.costs, np.float32)
    program = for_target(shaped(None, method, target, draft, sampling, batch, context), target)
    if not program.adaptive:
        return program, None, None
    loop_plan, costs = prior_plan(program, target, draft, sampling)
    return program, loop_plan, costs
