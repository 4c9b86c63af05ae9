"""`GenerateOutput.plan` replayed by `decode(..., plan=)` inside a user's `jax.jit`: the tokens of a
`generate` call whose "auto" was decided by a measuring tuner (measured costs, calibrated loop
inputs, remembered acceptance); without a plan, `decode` runs the fixed prior, as a deterministic
tuner's `generate` does; plans from another call are refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.eagle import init_head
from ssd_jax.errors import InputError
from ssd_jax.loop.costs import NUM_COST_INPUTS
from ssd_jax.tuning import cost_model
from spec_models import pair

NEW = 20
PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [9, 2], [7, 7, 8]]
AUTO = [ssd_jax.AR(), ssd_jax.SD(), ssd_jax.BV(), ssd_jax.SpecInfer(), ssd_jax.SpecTr(), ssd_jax.GBV(),
        ssd_jax.PLD(), ssd_jax.LogitSpec(), ssd_jax.CSD(), ssd_jax.EAGLE()]


@pytest.fixture(scope="module")
def models():
    return pair(vocab=64, seed=0, noise=0.3, layers=1)


def _draft_for(method, target, draft):
    """The draft argument of method on the tiny pair: CSD's cascade ends with a Max-Gram table of
    its own (the target has no tokenizer to match the shipped one against); EAGLE's is a fresh
    head of the target."""
    if not method.drafts_with_model:
        return None
    if method.name == "csd":
        return (draft, ssd_jax.MaxGram.for_target(target, np.roll(np.arange(64, dtype=np.int32), 1)))
    if method.name == "eagle":
        return init_head(target)
    return draft


def _padded(rows) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows)) + 1   # not generate's bucket: the padding must not matter
    tokens = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def _decode_in_jit(target, draft, method, sampling, key, **options) -> list[list[int]]:
    """decode inside a user's jit on PROMPTS: the tokens of each row."""
    eos = tuple(target.config.eos_token_ids or ())

    @functools.partial(jax.jit, static_argnames=())
    def user(target, draft, tokens, lengths, key):
        out = ssd_jax.decode(target, tokens, lengths, method=method, max_new_tokens=NEW, key=key, draft=draft,
                             sampling=sampling, eos_ids=eos, **options)
        return out.tokens, out.num_tokens

    tokens, num = user(target, draft, *map(jnp.asarray, _padded(PROMPTS)), key)
    return [np.asarray(tokens)[b, :int(num[b])].tolist() for b in range(len(PROMPTS))]


# Every method at T=1; at T=0 (AR's tokens whatever the plan) SD and EAGLE, the rest with -m slow.
REPLAYS = [pytest.param(m, t, id=f"{m.name}-{t}", marks=() if t == 1.0 or m.name in ("sd", "eagle") else pytest.mark.slow)
           for m in AUTO for t in (0.0, 1.0)]


@pytest.mark.parametrize("method, temperature", REPLAYS)
def test_decode_replays_the_plan_of_a_measuring_generate(models, method, temperature):
    """The call after a first one (which measured the pair and calibrated the program, and whose
    acceptance the tuner then remembers): decode with its plan gives its tokens."""
    target, draft = models
    draft = _draft_for(method, target, draft)
    tuner = ssd_jax.Tuner(store=None)
    key = jax.random.PRNGKey(11)
    calls = [ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, method=method, draft=draft, key=key,
                              temperature=temperature, tuner=tuner) for _ in range(2)]
    out = calls[-1]
    plan = out.plan
    assert isinstance(plan, ssd_jax.Plan) and plan.method == method and plan.max_new_tokens == NEW
    if method.adaptive and not out.stats.get("plain_from_start"):
        prior = cost_model.prior_plan(plan.program, target, draft, ssd_jax.SamplingParams(temperature=temperature))[1]
        assert plan.loop is not None and len(plan.costs) == NUM_COST_INPUTS + plan.loop.draft_len
        assert plan.costs[:3] != pytest.approx(prior[:3].tolist())   # measured, not the prior's
    replayed = _decode_in_jit(target, draft, method, ssd_jax.SamplingParams(temperature=temperature), key,
                              plan=plan)
    assert replayed == out.tokens


@pytest.mark.parametrize("method", [ssd_jax.SD(), pytest.param(ssd_jax.CSD(), marks=pytest.mark.slow), ssd_jax.LogitSpec()],
                         ids=["sd", "csd", "logitspec"])
def test_decode_without_a_plan_is_a_deterministic_tuner_s_generate(models, method):
    """At T=1, in a process whose default tuner has measured and remembered the pair: decode
    without a plan reads none of it and gives what generate gives with a deterministic tuner."""
    target, draft = models
    draft = _draft_for(method, target, draft)
    key = jax.random.PRNGKey(3)
    measuring = ssd_jax.Tuner(store=None)
    for _ in range(2):
        ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, method=method, draft=draft, key=key, temperature=1.0,
                         tuner=measuring)
    fixed = ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, method=method, draft=draft, key=key,
                             temperature=1.0, tuner=ssd_jax.Tuner(deterministic=True))
    assert _decode_in_jit(target, draft, method, ssd_jax.SamplingParams(temperature=1.0), key) == fixed.tokens


def test_a_plan_from_another_call_is_refused(models):
    target, draft = models
    out = ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, method=ssd_jax.SD(), draft=draft, temperature=1.0)
    tokens, lengths = _padded(PROMPTS)
    sampling = ssd_jax.SamplingParams(temperature=1.0)

    def decode(**changes):
        options = dict(method=ssd_jax.SD(), max_new_tokens=NEW, key=jax.random.PRNGKey(0), draft=draft,
                       sampling=sampling, plan=out.plan)
        options.update(changes)
        return ssd_jax.decode(changes.pop("target", target), tokens, lengths,
                              **{k: v for k, v in options.items() if k != "target"})

    with pytest.raises(InputError, match="plan was made for method"):
        decode(method=ssd_jax.BV())
    with pytest.raises(InputError, match="plan was made for max_new_tokens=20, not 12"):
        decode(max_new_tokens=12)
    with pytest.raises(InputError, match="plan was made for sampling"):
        decode(sampling=ssd_jax.SamplingParams(temperature=0.5))
    other_target, other_draft = pair(vocab=64, seed=0, noise=0.3, layers=2)
    with pytest.raises(InputError, match="plan was made for models of other shapes.*the target differs in num_layers"):
        decode(target=other_target, draft=other_draft)
    with pytest.raises(InputError, match="plan must be the ssd_jax.Plan"):
        decode(plan={"draft_len": 4})
    with pytest.raises(InputError, match="takes no tuner="):
        decode(tuner=ssd_jax.Tuner())
    with pytest.raises(InputError, match="got a Tuner"):
        decode(method=ssd_jax.Tuner(), plan=None)
    with pytest.raises(InputError, match="got a Tuner; pass it as tuner="):
        ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, method=ssd_jax.Tuner())
    with pytest.raises(InputError, match="tuner must be an ssd_jax.Tuner or None, got SD"):
        ssd_jax.generate(target, PROMPTS, max_new_tokens=NEW, tuner=ssd_jax.SD())
