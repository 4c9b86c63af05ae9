"""The Gumbel coupling (`coupling="gumbel"`): every method returns coupled autoregressive sampling's
tokens for the key (at its defaults, with timings on, on a ragged batch; at T=1 and at T=0.7 with
top_p 0.9); a row's tokens do not depend on its companions; decode inside a user's jit equals
generate without a plan; a draft equal to the target is always accepted (the drafters' noise is
the target's, position for position); coupled AR's first token has the target's law; bad input.
Sharded equals unsharded: tests/test_mesh.py (`mesh_checks.check_coupling`)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.coupling import decision_logits, gumbel_noise, log_law
from ssd_jax.errors import InputError
from ssd_jax.runtime.prompts import row_keys
from ssd_jax.sampling import SamplingParams, processed_law
from ssd_jax.testing import g_test
from ssd_jax.tuning.tuner import Tuner

NEW = 24
METHODS = ["sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd", "ssd", "eagle"]
LAWS = {"t1": dict(temperature=1.0), "t07-p09": dict(temperature=0.7, top_p=0.9)}
# Every method at T=1; at T=0.7 with top_p 0.9 (the same noise through another processed law)
# SD and SSD in the default run, the rest with -m slow.
DEFAULT_CASES = [(name, "t1") for name in METHODS] + [("sd", "t07-p09"), ("ssd", "t07-p09")]
CASES = DEFAULT_CASES + [pytest.param(name, "t07-p09", marks=pytest.mark.slow) for name in METHODS
                         if (name, "t07-p09") not in DEFAULT_CASES]
TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n        self."]


@pytest.fixture(scope="module")
def pair():
    return ssd_jax.default_models()


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair[0].tokenizer.encode(t).ids for t in TEXTS]


def _draft(name: str, draft):
    if name in ("ar", "pld", "logitspec"):
        return None
    if name == "eagle":
        return ssd_jax.default_eagle_head()
    return (draft,) if name == "csd" else draft


def _tokens(out) -> list[list[int]]:
    return [list(map(int, row)) for row in out.tokens]


@pytest.fixture(scope="module")
def coupled_ar(pair, prompts):
    """Coupled AR's tokens per law, the reference of every method."""
    return {law: _tokens(ssd_jax.generate(pair[0], prompts, max_new_tokens=NEW, coupling="gumbel",
                                          key=jax.random.PRNGKey(7), **kw)) for law, kw in LAWS.items()}


@pytest.mark.parametrize("name, law", CASES)
def test_every_method_at_its_defaults_gives_coupled_ar_tokens(pair, prompts, coupled_ar, name, law):
    target, draft = pair
    out = ssd_jax.generate(target, prompts, method=name, draft=_draft(name, draft), max_new_tokens=NEW,
                           coupling="gumbel", key=jax.random.PRNGKey(7), tuner=Tuner(), **LAWS[law])
    assert _tokens(out) == coupled_ar[law]


def test_rejection_sampling_is_not_drafter_invariant(pair, prompts, coupled_ar):
    """The control: under the default coupling the same key gives other tokens with a draft."""
    target, draft = pair
    ar = ssd_jax.generate(target, prompts, max_new_tokens=NEW, temperature=1.0, key=jax.random.PRNGKey(7))
    sd = ssd_jax.generate(target, prompts, method=ssd_jax.SD(draft_len=4), draft=draft, max_new_tokens=NEW,
                          temperature=1.0, key=jax.random.PRNGKey(7))
    assert _tokens(ar) != _tokens(sd)


@pytest.mark.slow   # ~60 s (three calls of the embedded pair); per verifier: tests/test_verify_api.py
def test_a_row_s_tokens_do_not_depend_on_its_companions(pair, prompts):
    target, draft = pair
    key = jax.random.PRNGKey(11)
    kw = dict(method="sd", draft=draft, max_new_tokens=NEW, temperature=1.0, coupling="gumbel", key=key)
    alone = _tokens(ssd_jax.generate(target, prompts[:1], **kw))
    # other companions, one with a longer prompt (another bucket width, more padding on row 0)
    longer = prompts[2] * 6
    with_others = _tokens(ssd_jax.generate(target, [prompts[0], longer, prompts[1]], **kw))
    assert with_others[0] == alone[0]
    # row r's key is fold_in(key, r): row 1 of a batch is the row alone with that key
    twice = _tokens(ssd_jax.generate(target, [prompts[1], prompts[1]], **kw))
    second = _tokens(ssd_jax.generate(target, [prompts[1]], **dict(kw, key=jax.random.fold_in(key, 1)[None])))
    assert twice[1] == second[0]
    assert twice[0] != twice[1]   # equal prompts in one batch are independent draws


@pytest.mark.parametrize("name", [pytest.param("csd", marks=pytest.mark.slow), "sd"])
def test_decode_in_a_user_jit_equals_generate_without_a_plan(pair, prompts, name):
    """The promise the timings broke under rejection sampling: under the Gumbel coupling decode's
    prior plan and generate's measured one give the same tokens."""
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, coupling="gumbel")
    key = jax.random.PRNGKey(5)
    out = ssd_jax.generate(target, prompts, method=name, draft=_draft(name, draft), max_new_tokens=NEW,
                           temperature=1.0, coupling="gumbel", key=key, tuner=Tuner())
    width = max(map(len, prompts)) + 5
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, row in enumerate(prompts):
        tokens[i, :len(row)] = row
    lengths = np.array([len(r) for r in prompts], np.int32)
    method = ssd_jax.methods.as_method(name)

    @jax.jit
    def run(target, draft, tokens, lengths, key):
        res = ssd_jax.decode(target, tokens, lengths, method=method, max_new_tokens=NEW, key=key,
                             draft=draft, sampling=sampling)
        return res.tokens, res.num_tokens

    got, counts = run(target, _draft(name, draft), tokens, lengths, key)
    assert [list(map(int, got[i, :counts[i]])) for i in range(len(prompts))] == _tokens(out)


@pytest.mark.parametrize("name", ["sd", "gbv", "ssd", "csd"])
def test_a_draft_equal_to_the_target_is_always_accepted(pair, prompts, name):
    """The drafters perturb their laws with the target's noise at the same positions: a draft
    that is the target proposes exactly the target's tokens (one position off, and acceptance
    falls to chance)."""
    target, _ = pair
    method = {"sd": ssd_jax.SD(draft_len=4), "gbv": ssd_jax.GBV(draft_len=3, paths=2),
              "ssd": ssd_jax.SSD(draft_len=3), "csd": ssd_jax.CSD(max_draft_tokens=4, lenience=1.0)}[name]
    out = ssd_jax.generate(target, prompts, method=method, draft=_draft(name, target), max_new_tokens=NEW,
                           temperature=1.0, coupling="gumbel", key=jax.random.PRNGKey(2))
    assert out.stats["acceptance_rate"] == 1.0
    if name == "ssd":
        assert out.stats["cache_hit_rate"] == 1.0


def test_coupled_ar_first_token_has_the_target_s_law(pair):
    """N rows of one prompt are N independent coupled draws (row r's key is fold_in(key, r)):
    their first tokens against the target's processed law by the kit's G-test
    (`ssd_jax.testing.g_test`, false-failure rate 1e-6); the same counts reject the law at another
    temperature (the check's power)."""
    target, _ = pair
    ids = target.tokenizer.encode("def fibonacci(n):").ids
    n = 4000
    out = ssd_jax.generate(target, [ids] * n, max_new_tokens=1, temperature=0.8, top_k=20, coupling="gumbel",
                           key=jax.random.PRNGKey(0))
    logits = ssd_jax.forward(target, jnp.asarray([ids]))[0, -1]
    counts = np.bincount([row[0] for row in out.tokens], minlength=logits.shape[-1])

    def law(temperature):
        p = np.asarray(processed_law(logits, SamplingParams(temperature=temperature, top_k=20)), np.float64)
        return p / p.sum()

    assert g_test(counts, law(0.8)).passed
    assert not g_test(counts, law(1.2)).passed


def test_noise_depends_on_the_key_and_position_alone():
    keys = row_keys(jax.random.PRNGKey(3), 3, SamplingParams(temperature=1.0, coupling="gumbel"))
    assert keys.shape == (3, 2)
    np.testing.assert_array_equal(keys[2], jax.random.fold_in(jax.random.PRNGKey(3), 2))
    a = gumbel_noise(keys, jnp.array([[5, 6], [5, 6], [9, 10]]), 17)
    b = gumbel_noise(keys[1:2], jnp.array([[6, 5]]), 17)
    np.testing.assert_array_equal(a[1, 0], b[0, 1])
    assert not np.array_equal(a[0, 0], a[1, 0])   # another row, other noise
    assert not np.array_equal(a[0, 0], a[0, 1])   # another position, other noise


def test_perturbation_keeps_top_k_and_top_p_before_the_noise():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jnp.zeros((1, 2), jnp.uint32)
    for sampling, support in [(SamplingParams(temperature=1.0, top_k=2, coupling="gumbel"), [0, 1]),
                              (SamplingParams(temperature=1.0, top_p=0.9, coupling="gumbel"), [0, 1, 2])]:
        law = np.exp(np.asarray(jax.nn.log_softmax(log_law(logits, sampling))))
        np.testing.assert_allclose(law[0, support], np.asarray(processed_law(logits, sampling))[0, support], rtol=1e-5)
        scores = decision_logits(logits, keys, jnp.array([4]), sampling)
        assert np.all(np.isneginf(np.asarray(scores)[0, len(support):]))
    # rejection sampling and T=0 leave the logits alone
    for sampling in [SamplingParams(temperature=1.0), SamplingParams(coupling="gumbel")]:
        assert decision_logits(logits, keys, jnp.array([4]), sampling) is logits


def test_bad_coupling_is_named(pair, prompts):
    with pytest.raises(InputError, match="coupling.*'exact'"):
        SamplingParams(temperature=1.0, coupling="exact")
    with pytest.raises(InputError, match="coupling.*None"):
        SamplingParams(coupling=None)
    with pytest.raises(InputError, match="coupling.*'Gumbel'"):
        ssd_jax.generate(pair[0], prompts, max_new_tokens=4, temperature=1.0, coupling="Gumbel")


def test_cli_coupling(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    bad = subprocess.run([sys.executable, "-m", "ssd_jax.cli", "generate", "x", "--coupling", "exact"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "--coupling" in bad.stderr and "exact" in bad.stderr
