"""The EAGLE method: a feature-level head's dynamic tree, verified exactly. Greedy identity with AR
for several tree shapes on ragged batches, the sampled law at T = 1 (and the check's power),
the Gumbel coupling, `decode` inside a user's jit, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax import verify
from ssd_jax.eagle import init_head
from ssd_jax.errors import InputError
from ssd_jax.loop import eagle as eagle_loop
from ssd_jax.methods import EAGLE
from ssd_jax.runtime import compile_cache
from ssd_jax.sampling import SamplingParams
from spec_models import exact_law, llama, noisy_copy
from test_speculative import _consistent

NEW = 16


@pytest.fixture(scope="module")
def target():
    return llama(64, 32, 4, seed=3)


def _random_head(target, seed: int = 0, scale: float = 0.3, **kwargs):
    head = init_head(target, **kwargs)
    leaves, treedef = jax.tree.flatten(head.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return head.with_params(jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape)
                                                         for x, k in zip(leaves, keys)]))


ROWS = [[3, 4, 5, 6, 7, 8, 9], [9, 8, 7], [5, 6, 5, 6, 5]]


@pytest.mark.parametrize("method", [EAGLE(draft_len=1, topk=1), EAGLE(draft_len=3, topk=2),
                                    EAGLE(draft_len=4, topk=3, tree_size=6), EAGLE(draft_len=2, topk=4, tree_size=9)],
                         ids=["chain1", "d3k2", "d4k3n6", "d2k4n9"])
def test_greedy_equals_autoregressive_batched_and_alone(target, method):
    head = _random_head(target)
    ar = ssd_jax.generate(target, ROWS, max_new_tokens=NEW).tokens
    assert ssd_jax.generate(target, ROWS, max_new_tokens=NEW, method=method, draft=head).tokens == ar
    assert ssd_jax.generate(target, ROWS[1:2], max_new_tokens=NEW, method=method, draft=head).tokens == ar[1:2]


def test_a_head_works_unchanged_on_a_target_widened_by_appended_layers(target):
    """`ssd_jax.testing.widen` appends zero layers and zero MLP units: the head's feature layers
    read the same residual streams, so it drafts the same trees and gets the same acceptance."""
    from ssd_jax.testing import widen

    head = _random_head(target)
    wide = widen(target, mlp_multiple=2, extra_layers=2)
    method = EAGLE(draft_len=3, topk=2)
    plain = ssd_jax.generate(target, ROWS, max_new_tokens=NEW, method=method, draft=head)
    widened = ssd_jax.generate(wide, ROWS, max_new_tokens=NEW, method=method, draft=head)
    assert widened.tokens == plain.tokens
    assert widened.stats["accepted_per_position"] == plain.stats["accepted_per_position"]


# ---------------------------------------------------------------------------------- sampling law

VOCAB, LAW_NEW, SAMPLES = 4, 3, 6000
PROMPT = [0, 2, 1, 3]


@pytest.fixture(scope="module")
def law_target():
    return llama(VOCAB, 32, 2, seed=3, scale=0.4, eos=())


def _empirical(target, head, method, sampling):
    keys = jax.random.split(jax.random.PRNGKey(13), SAMPLES)
    out = ssd_jax.generate(target, [PROMPT] * SAMPLES, max_new_tokens=LAW_NEW, method=method, draft=head, key=keys,
                           temperature=sampling.temperature)
    counts = np.zeros((VOCAB,) * LAW_NEW)
    for row in out.tokens:
        counts[tuple(row)] += 1
    return counts / SAMPLES, out.stats


def test_sampled_law_equals_target_law(law_target):
    """At T = 1 the tokens follow the target's law exactly: two paths drawn from the head's law,
    verified by recursive rejection with the head's q, drafts really accepted."""
    sampling = SamplingParams(temperature=1.0)
    head = _random_head(law_target, seed=2, scale=0.5)
    freq, stats = _empirical(law_target, head, EAGLE(draft_len=2, topk=2), sampling)
    assert stats["num_accepted_tokens"] > 0.2 * SAMPLES
    assert _consistent(freq, exact_law(law_target, PROMPT, sampling, LAW_NEW))


def test_sampling_law_check_has_power(law_target, monkeypatch):
    """Accepting the sampled paths by the target's argmax at T = 1 fails the same check."""
    sampling = SamplingParams(temperature=1.0)
    head = _random_head(law_target, seed=2, scale=0.5)
    monkeypatch.setattr(eagle_loop, "SAMPLED_VERIFIER", verify.greedy_multipath)
    compile_cache.clear()
    try:
        freq, _ = _empirical(law_target, head, EAGLE(draft_len=2, topk=2), sampling)
    finally:
        compile_cache.clear()
    assert not _consistent(freq, exact_law(law_target, PROMPT, sampling, LAW_NEW))


def test_gumbel_coupling_gives_autoregressive_sampling_tokens(target):
    head = _random_head(target)
    key = jax.random.PRNGKey(5)
    kw = dict(max_new_tokens=NEW, temperature=1.0, coupling="gumbel", key=key)
    assert ssd_jax.generate(target, ROWS, method=EAGLE(draft_len=3, topk=2), draft=head, **kw).tokens == \
        ssd_jax.generate(target, ROWS, **kw).tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", [EAGLE(draft_len=3, topk=2), EAGLE(max_draft_len=3, topk=2)], ids=["fixed", "auto"])
def test_decode_in_user_jit_equals_generate(target, temperature, method):
    """decode inside a user's jit gives generate's tokens: at a fixed depth, and under "auto" (no
    plan: the fixed prior's, what a deterministic tuner plans)."""
    head = _random_head(target)
    width = max(map(len, ROWS))
    tokens = jnp.asarray([r + [0] * (width - len(r)) for r in ROWS], jnp.int32)
    lengths = jnp.asarray([len(r) for r in ROWS], jnp.int32)
    key = jax.random.PRNGKey(4)
    sampling = SamplingParams(temperature=temperature)

    @jax.jit
    def user(target, head, tokens, lengths, key):
        out = ssd_jax.decode(target, tokens, lengths, method=method, max_new_tokens=NEW, key=key, draft=head,
                             sampling=sampling, eos_ids=tuple(target.config.eos_token_ids))
        return out.tokens, out.num_tokens

    out, num = user(target, head, tokens, lengths, key)
    ours = [np.asarray(out)[b, :int(num[b])].tolist() for b in range(len(ROWS))]
    assert ours == ssd_jax.generate(target, ROWS, max_new_tokens=NEW, method=method, draft=head, key=key,
                                    temperature=temperature, tuner=ssd_jax.Tuner(deterministic=True)).tokens


# ------------------------------------------------------------------ "auto": plain stretches

def test_auto_falls_back_to_plain_decoding_and_back_greedy(target):
    """Under "auto" with costs where speculation barely pays, a ragged batch speculates, decodes
    plainly (the head falling behind, each plain step keeping its token's features), catches up
    in one forward and probes again: AR's tokens."""
    from test_adaptive import MARGINAL, _decode, assert_no_idle_steps

    head = _random_head(target)
    rows = [[3, 4, 5, 6], [9, 2], [5, 6, 5, 6, 5]]
    ar = ssd_jax.generate(target, rows, max_new_tokens=48).tokens
    out = _decode(target, head, rows, EAGLE(), MARGINAL, SamplingParams(), jax.random.split(jax.random.PRNGKey(0), 3),
                  48, draft_len=3)
    assert [row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.num_tokens))] == ar
    counters = jax.device_get(out.counters["spec"])
    assert counters.ar_steps.min() > 20 and counters.num_drafts.min() >= 2   # several phases ran
    assert_no_idle_steps(counters)


def test_the_catch_up_reads_what_a_prefill_of_the_whole_text_reads(target):
    """After n plain steps and the catch-up, the head holds what it holds after a prefill of the
    prompt and those n tokens: the same root output (whose logits are the next draft's law), as
    both read the target's real features at every position. A catch-up that read the wrong
    features, tokens or positions would not."""
    from ssd_jax.loop.eagle import eagle_parts
    from ssd_jax.loop.skeleton import advance, start
    from ssd_jax.tuning.cost_model import AutoPlan

    head = _random_head(target)
    rows = [[3, 4, 5, 6], [9, 2, 7, 7]]
    tokens, lengths = jnp.asarray(rows, jnp.int32), jnp.asarray([4, 2], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    eos = jnp.asarray([-1], jnp.int32)
    parts = eagle_parts(EAGLE(), head, target.params, target.config, SamplingParams(), 4, 16,
                        plan=AutoPlan(draft_len=3, threshold=None))
    options = dict(sampling=SamplingParams(), out_size=16)
    state = start(parts, target.params, target.config, tokens, lengths, keys, 16, eos, **options)
    pending, pending_len = parts.pending(state.inner)
    active = jnp.ones((2,), bool)
    for _ in range(5):
        verdict = parts.ar_step(state, keys, active)
        state = advance(parts, state, verdict, active, 16, eos, drafted=False)
        pending = pending.at[:, pending_len[0]].set(verdict.next_token)
        pending_len = pending_len + 1
    caught_up = parts.resync(state.inner, pending, pending_len)
    out = np.asarray(state.outputs.out)[:, :6]          # the first token and the 5 plain ones
    texts = [row[:n] + out[b, :5].tolist() for b, (row, n) in enumerate(zip(rows, [4, 2]))]
    width = max(map(len, texts))
    whole = start(parts, target.params, target.config,
                  jnp.asarray([t + [0] * (width - len(t)) for t in texts], jnp.int32),
                  jnp.asarray([len(t) for t in texts], jnp.int32), keys, 16, eos, **options)
    assert np.asarray(whole.cur).tolist() == out[:, 5].tolist()
    np.testing.assert_allclose(caught_up["root_hidden"], whole.inner["root_hidden"], atol=2e-5)
    assert np.asarray(caught_up["hcache"].lengths).tolist() == np.asarray(whole.tcache.lengths).tolist()


def test_auto_sampled_law_with_plain_stretches(law_target):
    """T = 1 under "auto": probes, plain stretches and catch-ups keep the target's law."""
    from test_adaptive import FALL_BACK, _decode

    head = _random_head(law_target, seed=2, scale=0.5)
    keys = jax.random.split(jax.random.PRNGKey(13), SAMPLES)
    out = _decode(law_target, head, [PROMPT] * SAMPLES, EAGLE(), FALL_BACK, SamplingParams(temperature=1.0), keys,
                  LAW_NEW, draft_len=2, out_size=LAW_NEW + 8)
    counts = np.zeros((VOCAB,) * LAW_NEW)
    for row in np.asarray(out.tokens)[:, :LAW_NEW]:
        counts[tuple(row)] += 1
    counters = jax.device_get(out.counters["spec"])
    assert counters.num_drafts.min() > 0 and counters.ar_steps.max() > 0
    assert _consistent(counts / SAMPLES, exact_law(law_target, PROMPT, SamplingParams(temperature=1.0), LAW_NEW))


def test_auto_plans_from_the_head_s_measured_forward(target):
    """A measuring tuner times the head as a one-layer model of the target's and plans a depth
    within max_draft_len; the call's stats name the tree it verified."""
    head = _random_head(target)
    out = ssd_jax.generate(target, ROWS, max_new_tokens=NEW, method=EAGLE(max_draft_len=4, topk=2), draft=head,
                           tuner=ssd_jax.Tuner(store=None))
    assert out.tokens == ssd_jax.generate(target, ROWS, max_new_tokens=NEW).tokens
    depth = out.stats["planned_draft_len"]
    assert out.stats["adaptive"] and 1 <= depth <= 4
    assert out.stats["tree_depth"] == depth and out.stats["tree_nodes"] == 1 + 2 * depth
    costs = out.stats["loop_costs"]
    assert 0 < costs[2] < costs[0]   # the head's forward, measured, below a target step


# ---------------------------------------------------------------------------------- bad input

def test_heads_and_draft_models_are_not_interchangeable(target):
    head = init_head(target)
    draft = noisy_copy(target, 0.1, 1)
    with pytest.raises(InputError, match="only method EAGLE takes"):
        ssd_jax.generate(target, ROWS, max_new_tokens=4, method=ssd_jax.SD(draft_len=2), draft=head)
    with pytest.raises(InputError, match="EAGLE takes a feature-level head as draft=.*got Model"):
        ssd_jax.generate(target, ROWS, max_new_tokens=4, method=EAGLE(), draft=draft)
    with pytest.raises(InputError, match="EAGLE takes a feature-level head as draft=.*got NoneType"):
        ssd_jax.generate(target, ROWS, max_new_tokens=4, method=EAGLE())
    with pytest.raises(InputError, match="vocab_size=64.*vocab_size=80"):
        ssd_jax.generate(llama(80, 32, 4, seed=1), ROWS, max_new_tokens=4, method=EAGLE(), draft=head)


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft_len=0), "draft_len must be an integer >= 1.*got 0"),
    (dict(max_draft_len=2, topk=2, tree_size=6), r"tree_size must be in \[2, 1 \+ max_draft_len \* topk = 5\]"),
    (dict(topk=-1), "topk must be an integer >= 1, got -1"),
    (dict(draft_len=2, topk=2, tree_size=6), r"tree_size must be in \[2, 1 \+ draft_len \* topk = 5\]"),
    (dict(tree_size=1), "tree_size must be in"),
])
def test_bad_eagle_options_are_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        EAGLE(**kwargs)
