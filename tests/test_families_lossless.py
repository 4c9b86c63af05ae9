"""Every method is lossless on the Gemma 1/2/3, Phi-3 and Mixtral families: greedy output equals
autoregressive output token for token, with a target and a draft of each family.

The fast matrix runs every method once and every family at least once as target and as draft
(drafts are noisy copies, so most steps accept a few tokens; one pair mixes families); the full
family x method matrix runs with `pytest -m slow`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from hf_models import NEW_FAMILY_CONFIGS
from spec_models import noisy_copy
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params

DRAFT_METHODS = ("sd", "bv", "gbv", "specinfer", "spectr", "csd")
RETRIEVAL_METHODS = ("pld", "logitspec")
_MODELS: dict = {}
# Draft noise per family: enough that drafts get rejected, little enough that they get accepted
# (a random MoE's routing is fragile).
NOISE = {"gemma": 0.2, "gemma2": 0.2, "gemma3_text": 0.2, "phi3": 0.1, "mixtral": 0.05}


def family_model(name: str, seed: int = 0) -> ssd_jax.Model:
    """A random tiny model of family `name` (the parity test's shapes), cached per process."""
    if (name, seed) not in _MODELS:
        hf = dict(NEW_FAMILY_CONFIGS[name], bos_token_id=1, eos_token_id=None, pad_token_id=0)
        if name in ("gemma2", "gemma3_text"):
            # Tied and scaled by sqrt(hidden), random embeddings dominate the sandwich-normed residual
            # and these models repeat their input token forever; an untied head makes real text.
            hf["tie_word_embeddings"] = False
        config = ModelConfig.from_hf(hf)
        if config.final_logit_softcap is not None:
            # The parity configs' low caps saturate these random logits into ties; Gemma 2's is 30.
            config = dataclasses.replace(config, final_logit_softcap=30.0)
        params = init_params(config, jax.random.PRNGKey(seed), scale=0.3)
        _MODELS[name, seed] = ssd_jax.Model(config=config, params=params)
    return _MODELS[name, seed]


def _prompts():
    rng = np.random.default_rng(1)
    # Repeated text gives the retrieval methods something to find.
    return [rng.integers(3, 96, 7).tolist() * 2, rng.integers(3, 96, 3).tolist()]


def _check_lossless(target_name: str, draft_name: str | None, method: str) -> None:
    target = family_model(target_name)
    draft = None
    if draft_name == target_name:
        draft = noisy_copy(target, NOISE[target_name], 1)
    elif draft_name is not None:
        draft = family_model(draft_name, seed=2)
    prompts = _prompts()
    reference = ssd_jax.generate(target, prompts, max_new_tokens=24)
    if method == "csd":  # Max-Gram (the cascade's last drafter) needs a table: these models have no tokenizer
        draft = (draft, ssd_jax.MaxGram(bigram=jnp.asarray(np.roll(np.arange(96, dtype=np.int32), -1))))
    out = ssd_jax.generate(target, prompts, max_new_tokens=24, method=method, draft=draft)
    assert out.tokens == reference.tokens, (target_name, draft_name, method)
    assert out.finish_reasons == reference.finish_reasons
    if draft_name == target_name:  # a noisy copy agrees often: rollbacks and compactions happen
        assert out.stats["num_accepted_tokens"] > 0


FAST = [
    ("gemma", "gemma", "sd"),
    ("gemma2", "gemma2", "bv"),
    ("gemma3_text", "gemma3_text", "gbv"),
    ("phi3", "phi3", "specinfer"),
    ("mixtral", "mixtral", "spectr"),
    ("gemma2", "mixtral", "csd"),
    ("gemma3_text", None, "pld"),
    ("phi3", None, "logitspec"),
]


@pytest.mark.parametrize("target_name, draft_name, method", FAST)
def test_greedy_equals_autoregressive(target_name, draft_name, method):
    _check_lossless(target_name, draft_name, method)


FULL = [(name, name, m) for name in sorted(NEW_FAMILY_CONFIGS) for m in DRAFT_METHODS] + [
    (name, None, m) for name in sorted(NEW_FAMILY_CONFIGS) for m in RETRIEVAL_METHODS
]


@pytest.mark.slow
@pytest.mark.parametrize("target_name, draft_name, method", [c for c in FULL if c not in FAST])
def test_greedy_equals_autoregressive_every_family_and_method(target_name, draft_name, method):
    """32 more runs (about 5 minutes here): only with `pytest -m slow`."""
    _check_lossless(target_name, draft_name, method)
