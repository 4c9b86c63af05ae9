"""draft_len="auto" chosen per call among fixed programs (`ssd_jax.tuning.per_call`, the GPU policy
at one row): exact (each call runs a fixed program or AR's), the choice from the remembered
acceptance and the programs' measured prices, probes while AR's program wins."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.draft.maxgram import MaxGram
from ssd_jax.eagle import init_head
from ssd_jax.runtime import compile_cache, decode_program
from ssd_jax.tuning import auto_call, cost_model, measure, per_call
from ssd_jax.tuning.cost_model import StepCosts
from ssd_jax.tuning.memory import AcceptanceMemory, DecayedMeans
from spec_models import pair
from tuning_helpers import deterministic, measuring

PROMPTS = [[5, 9, 3, 7, 2, 11, 4]]
COSTS = StepCosts(target_fixed=1.0, target_per_token=0.05, draft=0.1)
KEY = ("program",)
MENU = per_call.simple_menu(COSTS, 8)


@pytest.fixture(autouse=True)
def tuner(monkeypatch):
    """No remembered acceptance, prices or probe counts from other tests: a new default tuner,
    deterministic as the suite's (a test that measures installs a measuring one, `measuring`)."""
    return deterministic(monkeypatch)


@pytest.fixture
def per_call_policy(monkeypatch):
    """This backend's policy with per-call choice below 2 rows (the GPU's)."""
    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here,
                        dataclasses.replace(backend.POLICIES[here], adaptive_per_call_below_rows=2))


@pytest.fixture
def model_costs(monkeypatch):
    """Timings allowed, every cost at COSTS' (the pair's draft is the target's size, so its
    measured costs would rightly choose AR's program every call: priced with a draft a tenth of
    the target, the calls speculate), AR's program's reference run too."""
    tuner = measuring(monkeypatch)
    monkeypatch.setattr(measure, "measure_costs", lambda *args, **kwargs: dataclasses.replace(COSTS))
    # AR's reference: 24 target calls, one of them the fixed part, so AR's price is COSTS.target(1)
    monkeypatch.setattr(auto_call, "ar_reference", lambda *args: (24 * COSTS.target(1), 24, COSTS.target(1)))
    return tuner


@pytest.fixture(scope="module")
def models():
    return pair(noise=0.3)


def test_per_call_auto_is_exact_and_remembers_what_it_ran(models, per_call_policy, model_costs, monkeypatch):
    """Greedy: every call gives AR's tokens and runs one fixed program (its stats say which);
    with timings allowed its acceptance and seconds are remembered. Sampled: the tokens of the
    fixed program of the chosen length with the same key (whose law the fixed-length tests
    check). Two rows keep the adaptive loop."""
    tuner = model_costs   # the measuring default tuner
    target, draft = models
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method="ar")
    method = ssd_jax.SD(draft_len="auto", max_draft_len=4)
    lengths = []
    for _ in range(3):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=method, draft=draft)
        assert out.tokens == reference.tokens
        assert out.stats["per_call"] and out.stats["adaptive"] and out.stats["method"] == "sd"
        length = out.stats["planned_draft_len"]
        lengths.append(length)
        assert 0 <= length <= 4
        if length:
            assert out.stats["mean_draft_len"] == length and out.stats["observed_acceptance"] is not None
        else:
            assert out.stats["plain_from_start"] and out.stats["ar_fallback_share"] == 1.0
    assert lengths[0] > 0   # the prior acceptance at these prices speculates
    memory_key = cost_model.acceptance_key(target, draft, method, ssd_jax.SamplingParams())
    assert tuner.acceptance.known(memory_key) is not None
    # AR's program priced (its reference); the drafted lengths' tokens remembered (their calls
    # compiled their programs, so on CPU they set no price yet)
    assert {length for _, length in tuner.per_call.price_table()} >= {0}
    assert {length for _, length in tuner.per_call._tokens.means()} == set(lengths) - {0}

    key = jax.random.PRNGKey(7)
    sampled = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=method, draft=draft, temperature=1.0,
                               key=key)
    length = sampled.stats["planned_draft_len"]
    fixed = ssd_jax.SD(draft_len=length) if length else ssd_jax.AR()
    again = ssd_jax.generate(target, PROMPTS, max_new_tokens=24, method=fixed, draft=draft if length else None,
                             temperature=1.0, key=key)
    assert sampled.tokens == again.tokens

    deterministic(monkeypatch)   # no calibration of the loop's program
    two_rows = ssd_jax.generate(target, PROMPTS * 2, max_new_tokens=24, method=method, draft=draft)
    assert "per_call" not in two_rows.stats and two_rows.tokens == reference.tokens * 2


def test_a_calls_menus_are_built_once_and_prices_kept_under_short_keys(models, per_call_policy, model_costs,
                                                                       monkeypatch):
    """The call's shapes (method at each path count, acceptance key, Menu) are built on a group's
    first call and kept (`layout`): a later call builds no Menu. Its prices sit under the same
    short key call after call, and forget() drops the layouts."""
    tuner = model_costs   # the measuring default tuner
    target, draft = models
    built = []
    menu_for = per_call.menu_for
    monkeypatch.setattr(per_call, "menu_for", lambda *args: built.append(args[1].paths) or menu_for(*args))
    method = ssd_jax.GBV(draft_len="auto", max_draft_len=2)
    for _ in range(3):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=method, draft=draft, temperature=1.0)
        ran_ar = out.stats["planned_draft_len"] == 0
        assert out.stats["per_call"] and out.stats["chosen_paths"] in ((None,) if ran_ar else (1, 2, 4))
    assert sorted(built) == [1, 2, 4]
    keys = {key[0] for key in tuner.per_call.price_table()}
    assert keys and all(key[0] == "program" for key in keys)
    assert tuner.per_call.compact(("a", "full", "key")) == tuner.per_call.compact(("a", "full", "key"))
    assert tuner.per_call.compact(("a", "full", "key")) != tuner.per_call.compact(("another",))
    tuner.reset()
    ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=method, draft=draft, temperature=1.0)
    assert len(built) == 6


def test_the_call_that_compiled_its_program_sets_no_price(models, per_call_policy, model_costs):
    """An executable's first run is slow (allocations, first touches): its seconds would price its
    length out for good, so that call records its tokens but no price; the next call does."""
    tuner = model_costs   # the measuring default tuner
    target, draft = models
    compile_cache.clear()
    method = ssd_jax.SD(draft_len="auto", max_draft_len=2)
    warm = set()
    for _ in range(5):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=method, draft=draft)
        if not out.stats["compile_time_s"]:
            warm.add(out.stats["planned_draft_len"])
        # AR's program is priced before the first choice: the baseline
        assert {key[1] for key in tuner.per_call.price_table()} == warm | {0}
    assert warm and tuner.per_call._tokens._values



def test_a_warmed_first_run_lets_the_compiling_call_set_its_price(models, per_call_policy, model_costs,
                                                                  monkeypatch):
    """Under the policy's warm_new_programs (the GPU's), a call that compiles its program runs it
    once apart first (counted in compile_time_s): the call's own run is a steady one, so its
    seconds price its length at once; later calls warm nothing; the tokens are AR's all along."""
    tuner = model_costs   # the measuring default tuner
    target, draft = models
    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here, dataclasses.replace(backend.POLICIES[here], warm_new_programs=True))
    first_runs = []
    first_run_s = decode_program.first_run_s
    monkeypatch.setattr(decode_program, "first_run_s",   # a first run of 1000 s, to find it in compile_time_s
                        lambda executable, args: first_runs.append(1) or first_run_s(executable, args) + 1000.0)
    # no fixed part to subtract: on a loaded machine AR's one-token run can outlast a whole short
    # call here, and a call no longer than its fixed part prices nothing (`PerCallMemory.record`)
    monkeypatch.setattr(per_call.PerCallMemory, "fixed_part", lambda self, key, length: None)
    compile_cache.clear()
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method="ar")
    assert reference.stats["first_run_warmed"] and reference.stats["compile_time_s"] > 1000
    first_runs.clear()
    method = ssd_jax.SD(draft_len="auto", max_draft_len=2)
    compiled, lengths = 0, []
    for _ in range(4):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=method, draft=draft)
        assert out.tokens == reference.tokens
        length = out.stats["planned_draft_len"]
        lengths.append(length)
        if out.stats["compile_time_s"]:
            compiled += 1
            assert out.stats["first_run_warmed"] and out.stats["compile_time_s"] > 1000
        else:
            assert "first_run_warmed" not in out.stats
        (key,) = {key for key, _ in tuner.per_call.price_table()}   # one shape: one key
        assert (key, length) in tuner.per_call.price_table()   # priced by this very call
    assert compiled >= 1 and len(first_runs) == compiled == len(set(lengths) - {0})   # each new program once

@pytest.mark.parametrize("method, drafted", [
    (ssd_jax.BV(), True), (ssd_jax.SpecInfer(), True), (ssd_jax.SpecTr(), True), (ssd_jax.GBV(), True),
    (ssd_jax.PLD(), False), (ssd_jax.LogitSpec(), False), (ssd_jax.CSD(), True), (ssd_jax.EAGLE(topk=2), True)])
def test_every_synchronous_method_runs_per_call_exactly(models, per_call_policy, method, drafted):
    """Greedy: AR's tokens from the fixed program chosen (a draft length, CSD's verified cap, or
    LogitSpec's root branch), with the stats saying which; a fixed length keeps its program."""
    target, draft = models
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=20, method="ar")
    drafter = draft if drafted else None
    if method.name == "csd":   # the drafter, then Max-Gram over the target's own argmax bigrams
        bigram = np.asarray(jnp.argmax(ssd_jax.forward(target, jnp.arange(target.config.vocab_size)[:, None])[:, -1],
                                       axis=-1), np.int32)
        drafter = (draft, MaxGram.for_target(target, bigram))
    if method.name == "eagle":
        drafter = init_head(target)
    out = ssd_jax.generate(target, PROMPTS, max_new_tokens=20, method=method, draft=drafter)
    assert out.stats["per_call"] and out.stats["method"] == method.name
    assert out.tokens == reference.tokens
    assert out.stats["planned_draft_len"] >= 0


def test_a_fixed_length_keeps_its_program(models, per_call_policy):
    target, draft = models
    fixed = ssd_jax.generate(target, PROMPTS, max_new_tokens=16, method=ssd_jax.SD(draft_len=3), draft=draft)
    assert "per_call" not in fixed.stats


def test_a_sampled_multi_path_call_is_its_fixed_program(models, per_call_policy):
    """T=1: the tokens of the fixed program (the paths and the length chosen per call) with the
    same key, whose law the fixed-length tests check."""
    target, draft = models
    key = jax.random.PRNGKey(3)
    out = ssd_jax.generate(target, PROMPTS, max_new_tokens=20, method=ssd_jax.GBV(), draft=draft,
                           temperature=1.0, key=key)
    length, paths = out.stats["planned_draft_len"], out.stats["chosen_paths"]
    assert paths in (1, 2, 4) and (not length or out.stats["num_paths"] == paths)
    fixed = ssd_jax.GBV(draft_len=length, paths=paths) if length else ssd_jax.AR()
    again = ssd_jax.generate(target, PROMPTS, max_new_tokens=20, method=fixed, draft=draft if length else None,
                             temperature=1.0, key=key)
    assert out.tokens == again.tokens


def test_menus_price_each_methods_fixed_programs(models, tuner):
    """CSD's lengths run to its cascade's verified width, LogitSpec's is the one root branch its
    tree allows, multi-path prices K L + 1 verified tokens."""
    target, draft = models
    sampling = ssd_jax.SamplingParams()
    csd = per_call.menu_for(tuner, ssd_jax.CSD(), target, (draft, None), sampling, 1, 32)
    assert csd.lengths == (1, 2, 4, 8, 9)   # up to the greedy one-drafter cascade's 3 rounds of 2 + 1
    logitspec = per_call.menu_for(tuner, ssd_jax.LogitSpec(tree_size=8), target, None, sampling, 1, 32)
    assert logitspec.lengths == (6,)
    two = per_call.menu_for(tuner, ssd_jax.GBV(paths=2), target, draft, sampling, 1, 32)
    one = per_call.menu_for(tuner, ssd_jax.GBV(paths=1), target, draft, sampling, 1, 32)
    assert two.lengths == one.lengths == (1, 2, 4, 8)
    assert two.model_s[4] > one.model_s[4] and two.model_s[0] == one.model_s[0]
    tree = per_call.menu_for(tuner, ssd_jax.EAGLE(topk=2), target, init_head(target), sampling, 1, 32)
    assert tree.lengths == (1, 2, 4, 8) and tree.model_s[0] == one.model_s[0]


def test_choice_follows_the_acceptance_and_the_measured_prices(monkeypatch):
    """High acceptance: a long draft; none: AR's program. A length whose program measured slower
    than the model prices it carries its surplus to the lengths nearest it (AR's program too,
    until measured), which favours longer drafts; AR's program measured cheap wins."""
    tuner = measuring(monkeypatch)
    long = tuner.per_call.choose(KEY, MENU, 0.95)
    short = tuner.per_call.choose(KEY, MENU, 0.6)
    assert long > short >= 1
    assert tuner.per_call.choose(KEY, MENU, 0.0) == 0
    tuner.reset()
    # length `short` measured at twice the model's step: its neighbours carry the same surplus
    surplus = per_call.model_seconds(COSTS, short)
    tuner.per_call.record(KEY, short, seconds=2 * surplus * 10, target_calls=10)
    price = tuner.per_call.prices(KEY, MENU)
    assert price[short] == pytest.approx(2 * surplus)
    above = MENU.lengths[MENU.lengths.index(short) + 1]
    assert price[above] == pytest.approx(per_call.model_seconds(COSTS, above) + surplus)
    assert price[3] == float("inf")                                 # off the menu
    assert price[0] == pytest.approx(COSTS.target(1) + surplus)   # not measured: the nearest's surplus
    assert tuner.per_call.choose(KEY, MENU, 0.6) > short          # a fixed surplus favours longer drafts
    tuner.per_call.record(KEY, 0, seconds=0.5 * COSTS.target(1) * 10, target_calls=10)   # AR measured cheap
    assert tuner.per_call.predicted_speedups(KEY, MENU, 0.6)[short] < 1.0 and tuner.per_call.choose(KEY, MENU, 0.6) == 0


def test_measured_tokens_per_call_correct_the_geometric_law(monkeypatch):
    """A length's measured tokens per target call replace E(L, a); the lengths not run take E
    scaled by the nearest measured one's measured / E (a retrieval draft that finds nothing on
    half its steps reads half the geometric gain), and the choice follows."""
    tuner = measuring(monkeypatch)
    a = 0.8
    geometric = tuner.per_call.tokens_per_call(KEY, MENU, a)
    assert geometric[0] == 1.0 and geometric[4] == pytest.approx(cost_model.expected_tokens(a, 4))
    assert MENU.lengths == (1, 2, 4, 8) and geometric[3] == 0.0   # off the menu
    tuner.per_call.record(KEY, 2, seconds=None, target_calls=10, tokens=0.5 * geometric[2], acceptance=a)
    tuner.per_call.record(KEY, 8, seconds=None, target_calls=10, tokens=geometric[8], acceptance=a)
    corrected = tuner.per_call.tokens_per_call(KEY, MENU, a)
    assert corrected[2] == pytest.approx(0.5 * geometric[2]) and corrected[8] == pytest.approx(geometric[8])
    assert corrected[1] == pytest.approx(0.5 * geometric[1])       # nearest measured: 2
    assert corrected[4] == pytest.approx(0.5 * geometric[4])       # 2 is nearer than 8
    tuner.reset()
    tuner.per_call.record(KEY, 1, seconds=None, target_calls=10, tokens=0.5 * geometric[1], acceptance=a)
    tuner.per_call.record(KEY, 4, seconds=None, target_calls=10, tokens=geometric[4], acceptance=a)
    assert tuner.per_call.tokens_per_call(KEY, MENU, a)[2] == pytest.approx(0.5 * geometric[2])   # 1 is nearer
    # another program whose every length measured one token a call: AR's program
    other = ("other program",)
    assert tuner.per_call.choose(other, MENU, a) > 0
    for n in MENU.lengths:
        tuner.per_call.record(other, n, seconds=None, target_calls=10, tokens=1.0, acceptance=a)
    assert tuner.per_call.choose(other, MENU, a) == 0


def test_ar_wins_but_probes_speculate_ever_further_apart(monkeypatch):
    """While AR's program wins: a probe once the calls since hold its predicted loss within
    PROBE_OVERHEAD of them, then 2x and 4x as many calls after each probe it kept winning through,
    capped at PROBE_EVERY_MAX; a predicted gain speculates and starts the count again."""
    tuner = measuring(monkeypatch)
    speedup = tuner.per_call.predicted_speedups(KEY, MENU, 0.0)[1:].max()
    assert 0.8 < speedup < 0.95
    p = per_call.probe_interval(speedup, 0)
    assert p == int(np.ceil((1 / speedup - 1) / per_call.PROBE_OVERHEAD - 1e-9)) and p > per_call.PROBE_EVERY_MIN
    choices = [tuner.per_call.choose(KEY, MENU, 0.0) for _ in range(7 * p)]
    probes = [i for i, length in enumerate(choices) if length]
    assert probes == [p - 1, 3 * p - 1, 7 * p - 1] and choices[probes[0]] == 1
    for _ in range(20 * per_call.PROBE_EVERY_MAX // p):
        tuner.per_call.choose(KEY, MENU, 0.0)
    assert per_call.probe_interval(speedup, tuner.per_call._ar_calls.lookup(KEY)[1]) == per_call.PROBE_EVERY_MAX
    assert tuner.per_call.choose(KEY, MENU, 0.9) > 1      # a gain again: speculation, and the count restarts
    assert [tuner.per_call.choose(KEY, MENU, 0.0) for _ in range(p)][-1] == 1


@pytest.mark.parametrize("speedup, first", [(0.999, 2), (0.98, 3), (0.9, 12), (0.8, 25), (0.55, 64), (0.0, 64)])
def test_probes_are_as_far_apart_as_their_predicted_loss(speedup, first):
    """A near tie probes within PROBE_EVERY_MIN calls (one poor call does not hand the next good
    ones to AR's program); a clear loss seldom (each probe costs 1/s - 1 of an AR call); doubling
    after each probe AR's program kept winning through, up to PROBE_EVERY_MAX."""
    assert per_call.probe_interval(speedup, 0) == first
    assert per_call.probe_interval(speedup, 1) == min(2 * first, per_call.PROBE_EVERY_MAX)
    assert per_call.probe_interval(speedup, 40) == per_call.PROBE_EVERY_MAX


def test_a_near_tie_probes_soon_and_a_clear_loss_late(monkeypatch):
    """Through choose_shape: AR's program measured a hair cheaper than L=1's tokens are worth
    probes on the second call; measured at 0.8 of L=1's price per token, on the 25th."""
    tuner = measuring(monkeypatch)
    menu = per_call.Menu((1,), np.asarray([1.0, 1.0]))
    tuner.per_call.record(KEY, 1, seconds=10.0, target_calls=10, tokens=1.0, acceptance=0.5)   # 1 s, 1 token a call
    tuner.per_call.record(KEY, 0, seconds=9.99, target_calls=10)               # AR: 0.999 s a token
    assert [tuner.per_call.choose(KEY, menu, 0.5) for _ in range(2)] == [0, 1]
    other = ("clear loss",)
    tuner.per_call.record(other, 1, seconds=12.5, target_calls=10, tokens=1.0, acceptance=0.5)
    tuner.per_call.record(other, 0, seconds=10.0, target_calls=10)
    choices = [tuner.per_call.choose(other, menu, 0.5) for _ in range(50)]
    assert choices.index(1) == 24 and sum(choices) == 1


def test_probes_run_a_priced_program_not_a_new_one(monkeypatch):
    """AR's program wins; L=1, never run, predicts more than L=4, which ran: the probe runs L=4
    (a new program would compile and run slow first), as many calls in as L=4's loss allows."""
    tuner = measuring(monkeypatch)
    menu = per_call.simple_menu(COSTS, 4)
    tuner.per_call.record(KEY, 0, seconds=10 * menu.model_s[0], target_calls=10)
    tuner.per_call.record(KEY, 4, seconds=10 * (menu.model_s[4] + 0.5), target_calls=10, tokens=1.6, acceptance=0.3)
    speedups = tuner.per_call.predicted_speedups(KEY, menu, 0.3)
    assert speedups[4] < speedups[1] < 1.0
    interval = per_call.probe_interval(speedups[4], 0)
    assert interval > per_call.probe_interval(speedups[1], 0)
    choices = [tuner.per_call.choose(KEY, menu, 0.3) for _ in range(interval)]
    assert choices == [0] * (interval - 1) + [4]


def test_a_program_never_run_needs_a_clear_predicted_gain(monkeypatch):
    """L=1 never run, priced like AR's program: at 3% more tokens predicted AR's program runs (a
    compile and a slow first run would eat that), at 8% L=1; once priced, 3% is enough."""
    tuner = measuring(monkeypatch)
    menu = per_call.Menu((1,), np.asarray([1.0, 1.0]))
    tuner.per_call.record(KEY, 0, seconds=10.0, target_calls=10)
    assert per_call.EXPLORE_GAIN > 1.03
    assert tuner.per_call.choose(KEY, menu, 0.03) == 0
    assert tuner.per_call.choose(KEY, menu, 0.08) == 1
    tuner.per_call.record(KEY, 1, seconds=10.0, target_calls=10, tokens=1.03, acceptance=0.03)
    assert tuner.per_call.choose(KEY, menu, 0.03) == 1


def test_deterministic_auto_neither_measures_nor_probes(tuner):
    """Under SSD_JAX_DETERMINISTIC_AUTO=1 (the suite's default) a call does not depend on the ones
    before: no price is recorded and no probe runs."""
    tuner.per_call.record(KEY, 2, seconds=5.0, target_calls=10, tokens=1.0, acceptance=0.7)
    menu = per_call.simple_menu(COSTS, 4)
    assert tuner.per_call.prices(KEY, menu)[2] == pytest.approx(per_call.model_seconds(COSTS, 2))
    assert tuner.per_call.tokens_per_call(KEY, menu, 0.7)[2] == pytest.approx(cost_model.expected_tokens(0.7, 2))
    assert all(tuner.per_call.choose(KEY, menu, 0.0) == 0 for _ in range(2 * per_call.PROBE_EVERY_MAX))


def test_ar_reference_times_ars_own_program(models, monkeypatch):
    """The choice's baseline: AR's program run on the call's inputs (again where this compiled
    it), the fastest of AR_REFERENCE_RUNS timed runs, its target calls, and the fastest of as
    many runs of it to one token (the call's fixed part)."""
    from ssd_jax.runtime.prompts import prepare_prompts

    target, _ = models
    batch = prepare_prompts(PROMPTS, target.config, 40)
    seconds, calls, fixed = auto_call.ar_reference(target, batch, 40, ssd_jax.SamplingParams(),
                                                   jax.random.PRNGKey(0))
    # at the output's budget (64 tokens), not the call's 40
    assert calls == ssd_jax.generate(target, PROMPTS, max_new_tokens=64).stats["target_calls"] == 64
    assert fixed > 0 and seconds > 0   # their order is the clock's, asserted below, not this machine's load
    executable, args, _, _ = decode_program.ar_executable(target, batch, 40, ssd_jax.SamplingParams(),
                                                          jax.random.PRNGKey(0))
    one = executable(*decode_program.with_budget(target, args, 1))
    assert int(one.counters["spec"].target_calls) == 1 and int(np.max(np.asarray(one.num_tokens))) == 1
    # each round: a one-token run, then a whole one; one-token runs of 1, 0.5 and 2 s, whole runs of 5, 2 and 9 s
    clock = iter(np.cumsum([0, 1, 0, 5, 0, 0.5, 0, 2, 0, 2, 0, 9]).tolist())
    monkeypatch.setattr(auto_call, "AR_REFERENCE_RUNS", 3)
    monkeypatch.setattr(auto_call.time, "perf_counter", lambda: next(clock))
    seconds, _, fixed = auto_call.ar_reference(target, batch, 40, ssd_jax.SamplingParams(),
                                               jax.random.PRNGKey(0))
    assert (seconds, fixed) == (2.0, 0.5)


def test_path_count_follows_the_measured_verification(monkeypatch):
    """Forwards priced alike at 1, 2 and 4 paths (a GPU's wide forwards), more paths accept more.
    Nothing measured: one path (the cheapest program; the others scale its surplus). Measured as
    modelled, 2 paths borrow its surplus and are tried (4 paths wait for 2 paths' price, though
    predicted best); measured as modelled too, 4 paths are tried; 4 measured far dearer than the
    model says (their verification and sampling) and 2 a little dearer, 2 paths win; 2 measured
    dearer still, one path. AR's program measured cheaper than every
    program: AR's."""
    tuner = measuring(monkeypatch)
    gpu = StepCosts(target_fixed=1.0, target_per_token=0.0, draft=0.1)
    menu = per_call.simple_menu(gpu, 4)
    shapes = [per_call.Shape((f"K={k}",), menu, a, k) for k, a in ((1, 0.6), (2, 0.65), (4, 0.7))]
    group = ("group",)

    def measured(shape, surplus: float) -> None:
        for length in menu.lengths:
            tuner.per_call.record(shape.key, length, seconds=10 * (menu.model_s[length] + surplus), target_calls=10)

    assert tuner.per_call.choose_shape(group, shapes) == (0, 4)
    for shape in shapes:   # AR's program, every shape's baseline, measured as modelled
        tuner.per_call.record(shape.key, 0, seconds=10 * menu.model_s[0], target_calls=10)
    measured(shapes[0], 0.0)
    assert tuner.per_call.shape_speedups(shapes)[2].max() == 0.0
    assert tuner.per_call.choose_shape(group, shapes)[0] == 1
    measured(shapes[1], 0.0)
    assert tuner.per_call.choose_shape(group, shapes)[0] == 2
    measured(shapes[2], 2.0)
    price = tuner.per_call.prices(("K=2 unmeasured",), menu, [(shapes[2].key, menu, 0.5)])
    assert price[2] == pytest.approx(menu.model_s[2] + 1.0)
    measured(shapes[1], 0.1)
    assert tuner.per_call.choose_shape(group, shapes)[0] == 1
    measured(shapes[1], 3.0)
    assert tuner.per_call.choose_shape(group, shapes) == (0, 4)
    tuner.reset()   # AR's program measured at a tenth of the model: no program pays
    for shape in shapes:
        tuner.per_call.record(shape.key, 0, seconds=menu.model_s[0], target_calls=10)
    measured(shapes[0], 0.0)
    assert tuner.per_call.choose_shape(group, shapes)[1] == 0


def test_a_negative_surplus_is_borrowed_unscaled(monkeypatch):
    """One path measured below the cost model (forwards that run faster inside the program than
    alone): 4 paths borrowing it are priced at their model plus that surplus, not 4 times it
    (which priced them below one path's program: tried first on an H200, at 3x its time)."""
    tuner = measuring(monkeypatch)
    gpu = StepCosts(target_fixed=1.0, target_per_token=0.0, draft=0.1)
    menu = per_call.simple_menu(gpu, 4)
    for length in menu.lengths:
        tuner.per_call.record(("K=1",), length, seconds=10 * (menu.model_s[length] - 0.2), target_calls=10)
    borrowed = tuner.per_call.prices(("K=4",), menu, [(("K=1",), menu, 4.0)])
    assert borrowed[4] == pytest.approx(menu.model_s[4] - 0.2)
    assert borrowed[4] >= tuner.per_call.prices(("K=1",), menu)[4]


def test_while_speculation_wins_its_runner_up_is_timed_again(monkeypatch):
    """A price is renewed only by running its program. AR's program timed once 2x slow makes L=1
    (1.11 s a token against AR's true 1 s) win at a predicted 1.8x: AR's program runs again after
    as many calls as keep that predicted loss within PROBE_OVERHEAD of them (without this it never
    ran again: simulated, L=1 on 270 of 270 calls at 0.91x AR), then twice as many calls apart
    while L=1 keeps winning; a near tie is timed again within PROBE_EVERY_MIN calls."""
    tuner = measuring(monkeypatch)
    menu = per_call.Menu((1,), np.asarray([1.0, 1.0]))
    tuner.per_call.record(KEY, 0, seconds=20.0, target_calls=10)                          # AR: 2 s, once slow
    tuner.per_call.record(KEY, 1, seconds=11.1, target_calls=10, tokens=1.0, acceptance=0.0)   # L=1: 1.11 s a token
    interval = per_call.probe_interval(1.11 / 2.0, 0, per_call.RETIME_EVERY_MAX)
    assert interval == 81
    choices = [tuner.per_call.choose(KEY, menu, 0.0) for _ in range(3 * interval)]
    assert [i for i, length in enumerate(choices) if length == 0] == [interval - 1, 3 * interval - 1]
    near = ("near tie",)
    tuner.per_call.record(near, 0, seconds=11.2, target_calls=10)
    tuner.per_call.record(near, 1, seconds=11.1, target_calls=10, tokens=1.0, acceptance=0.0)
    assert [tuner.per_call.choose(near, menu, 0.0) for _ in range(per_call.PROBE_EVERY_MIN)] == [1, 0]


def test_a_lengths_tokens_follow_the_acceptance_after_a_hard_stretch(monkeypatch):
    """L=8 measured while the text was hard (its calls observed acceptance 0.45) reads from E(8, a)
    at the acceptance remembered now: back at 0.9 it predicts E(8, 0.9), not the few tokens it
    read then (which kept it priced out for good); a length's own calls still say how far it reads
    from the geometric law (a retrieval draft that finds nothing on half its steps)."""
    tuner = measuring(monkeypatch)
    hard = cost_model.expected_tokens(0.45, 8)
    tuner.per_call.record(KEY, 8, seconds=None, target_calls=10, tokens=hard, acceptance=0.45)
    assert tuner.per_call.tokens_per_call(KEY, MENU, 0.45)[8] == pytest.approx(hard)
    assert tuner.per_call.tokens_per_call(KEY, MENU, 0.9)[8] == pytest.approx(cost_model.expected_tokens(0.9, 8))
    tuner.per_call.record(KEY, 4, seconds=None, target_calls=10, tokens=0.5 * cost_model.expected_tokens(0.9, 4),
                          acceptance=0.9)
    assert tuner.per_call.tokens_per_call(KEY, MENU, 0.9)[4] == pytest.approx(0.5 * cost_model.expected_tokens(0.9, 4))
    with pytest.raises(ValueError, match="acceptance"):
        tuner.per_call.record(KEY, 2, seconds=None, target_calls=10, tokens=2.0)


def test_a_length_not_measured_is_never_priced_below_ars_program(monkeypatch):
    """L=8 measured below the cost model (forwards cheaper inside the program than timed alone):
    the shorter lengths carry that surplus as a share of their model price, and no length not
    measured is priced below AR's program (an absolute surplus left L=1 at 1e-12 s, predicting
    2e12x AR, and the choice compiled it)."""
    tuner = measuring(monkeypatch)
    gpu = StepCosts(target_fixed=1.0, target_per_token=0.0, draft=0.15)   # L=8: 2.2 s, L=1: 1.15
    menu = per_call.simple_menu(gpu, 8)
    tuner.per_call.record(KEY, 0, seconds=10 * menu.model_s[0], target_calls=10)
    tuner.per_call.record(KEY, 8, seconds=10 * (menu.model_s[8] - 1.5), target_calls=10)
    price = tuner.per_call.prices(KEY, menu)
    assert price[8] == pytest.approx(menu.model_s[8] - 1.5)                   # measured: as measured
    share = (menu.model_s[8] - 1.5) / menu.model_s[8]
    assert price[4] == pytest.approx(max(menu.model_s[4] * share, menu.model_s[0]))
    assert all(price[n] >= price[0] for n in (1, 2, 4))


def test_a_call_whose_rows_ended_early_barely_moves_the_choice(monkeypatch):
    """H200, SpecTr at T=1 on short prompts (ms): AR's program 23.6 for 128 target calls, L=4's
    calls 19 for 40 (3.2 tokens each), then one row that hit its EOS at once: 6.5 for 3 target
    calls and 4 tokens. ~5 ms of every call is fixed (AR's program to one token). Priced whole,
    that call made L=4 look 4x dearer per target call and AR's program won the next calls; with
    the fixed part taken off and the call counted by its steps, L=4 keeps winning (within 20% of
    its prediction before), and its price is the steps' own: (19 - 5) / 39 ms."""
    tuner = measuring(monkeypatch)
    menu = per_call.Menu((4,), np.asarray([0.15e-3, 0.0, 0.0, 0.0, 0.3e-3]))
    unfixed = ("unfixed",)

    def history(key):
        tuner.per_call.record(key, 0, seconds=23.6e-3, target_calls=128)
        for _ in range(3):
            tuner.per_call.record(key, 4, seconds=19e-3, target_calls=40, tokens=3.2, acceptance=0.6)

    tuner.per_call.record_fixed(KEY, 5e-3)
    history(KEY)
    history(unfixed)
    assert tuner.per_call.prices(KEY, menu)[4] == pytest.approx(14e-3 / 39)
    assert tuner.per_call.prices(KEY, menu)[0] == pytest.approx(18.6e-3 / 127)
    before = tuner.per_call.predicted_speedups(KEY, menu, 0.6)[4]
    assert before > 1.2 and tuner.per_call.choose(KEY, menu, 0.6) == 4
    for key in (KEY, unfixed):
        tuner.per_call.record(key, 4, seconds=6.5e-3, target_calls=3, tokens=4 / 3, acceptance=0.5)
    assert tuner.per_call.predicted_speedups(KEY, menu, 0.6)[4] > 0.8 * before
    assert tuner.per_call.choose(KEY, menu, 0.6) == 4
    assert tuner.per_call.predicted_speedups(unfixed, menu, 0.6)[4] < 0.8 * before   # priced whole, as before


def test_one_token_calls_price_ars_program_once(models, per_call_policy, monkeypatch):
    """AR's reference decodes the output's budget (16 tokens for a one-token call), so a group
    whose first call asks for one token prices AR's steps, and times AR's program on that call
    only (it timed its fixed part alone, stayed unpriced, and was timed again on every call). A
    call of one target call, all fixed part, records nothing, and a referenced key is not
    referenced again."""
    tuner = measuring(monkeypatch)
    target, draft = models
    references = []
    reference = auto_call.ar_reference
    monkeypatch.setattr(auto_call, "ar_reference", lambda *args: references.append(1) or reference(*args))
    plain = ssd_jax.generate(target, PROMPTS, max_new_tokens=1, method="ar")
    for _ in range(3):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=1, method=ssd_jax.SD(draft_len="auto"), draft=draft)
        assert out.tokens == plain.tokens and out.stats["target_calls"] == 1
    assert len(references) == 1
    tuner.per_call.record_fixed(KEY, 0.5)
    tuner.per_call.record(KEY, 0, seconds=0.6, target_calls=1)
    tuner.per_call.record(KEY, 4, seconds=0.6, target_calls=1, tokens=1.0, acceptance=0.5)   # an EOS at once
    assert not tuner.per_call.price_table() or (KEY, 0) not in tuner.per_call.price_table()
    assert tuner.per_call._tokens.lookup((KEY, 4)) is None and not tuner.per_call.ar_unpriced(KEY)


def test_a_programs_own_fixed_part_comes_off_its_price(models, per_call_policy, model_costs, monkeypatch):
    """A program whose fixed part is not known has it measured after its call (a drafted
    program's holds its draft's prefill), once, and that call's price is its seconds past it over
    its target calls past the first; AR's program's, from AR's reference, stands for the others."""
    tuner = model_costs   # the measuring default tuner
    target, draft = models
    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here, dataclasses.replace(backend.POLICIES[here], warm_new_programs=True))
    measured, shares = [], []
    monkeypatch.setattr(auto_call, "fixed_seconds",
                        lambda method, *rest: measured.append(method.draft_len) or 1e-4)
    update = tuner.acceptance.update
    monkeypatch.setattr(tuner.acceptance, "update",
                        lambda key, observed, share=1.0: shares.append(share) or update(key, observed, share))
    compile_cache.clear()
    out = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=ssd_jax.SD(draft_len="auto", max_draft_len=4),
                           draft=draft)
    length = out.stats["planned_draft_len"]
    assert length and measured == [length]
    ((key, _),) = [k for k in tuner.per_call.price_table() if k[1] == length]
    assert tuner.per_call.fixed_part(key, length) == 1e-4 and tuner.per_call.fixed_part(key, 0) == pytest.approx(
        COSTS.target(1))
    assert tuner.per_call.fixed_part(key, 3) == tuner.per_call.fixed_part(key, 0)   # not measured: AR's stands for it
    steps = out.stats["target_calls"] - 1
    assert shares == [per_call.call_share(steps)] and shares[0] < 1   # the call's acceptance, as a share of a call
    assert tuner.per_call.price_table()[(key, length)] == pytest.approx((out.stats["wall_time_s"] - 1e-4) / steps)
    assert tuner.per_call.price_table()[(key, 0)] == pytest.approx(COSTS.target(1))
    for _ in range(2):
        again = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=ssd_jax.SD(draft_len="auto",
                                 max_draft_len=4), draft=draft)
        assert measured.count(again.stats["planned_draft_len"]) <= 1


def test_a_short_call_counts_as_a_share_of_one(monkeypatch):
    """DecayedMeans: share 1 is the plain decayed mean (bit for bit); a share s moves the mean as
    1 - (1 - weight)^s; the running start weighs shares; the acceptance memory takes a share."""
    measuring(monkeypatch)
    shared = DecayedMeans(0.3, running_start=True)
    expected = 0.0
    for n, v in enumerate([0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.4]):
        weight = max(0.3, 1.0 / (n + 1))
        expected = (1.0 - weight) * expected + weight * v
        assert shared.add("k", v, 1.0) == expected   # the plain decayed mean, bit for bit
    mean = DecayedMeans(0.5)
    mean.add("k", 1.0)
    assert mean.add("k", 0.0, 0.25) == pytest.approx(1 - (1 - 0.5 ** 0.25))
    start = DecayedMeans(0.5, running_start=True)
    start.add("k", 1.0, 1 / 16)
    assert start.add("k", 0.0) == pytest.approx(1 / 17)   # the first add weighed a sixteenth of this one
    memory = AcceptanceMemory()
    memory.update("pair", 1.0)
    memory.update("pair", 0.0, per_call.call_share(2))
    assert memory.known("pair") > 0.9


def test_a_call_no_longer_than_its_fixed_part_sets_no_price(monkeypatch):
    """Seconds at or below the fixed part (timing noise) price nothing: a price is never <= 0."""
    tuner = measuring(monkeypatch)
    tuner.per_call.record_fixed(KEY, 1.0)
    tuner.per_call.record(KEY, 2, seconds=0.5, target_calls=10, tokens=2.0, acceptance=0.5)
    tuner.per_call.record(KEY, 1, seconds=1.0, target_calls=10, tokens=1.5, acceptance=0.5)
    assert tuner.per_call.price_table() == {}


def test_ars_reference_budget_is_the_outputs_within_the_positions():
    """The reference decodes the output's budget (a power of two), within the positions the target
    has after the longest prompt, and never fewer than the call asks."""
    from types import SimpleNamespace

    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=36))
    batch = SimpleNamespace(max_length=7)
    assert auto_call.reference_budget(target, batch, 12) == 16
    assert auto_call.reference_budget(target, batch, 20) == 29   # bucket 32, room 29
    assert auto_call.reference_budget(target, batch, 29) == 29
    assert auto_call.reference_budget(target, batch, 1) == 16


def test_deterministic_per_call_times_nothing(models, per_call_policy, monkeypatch):
    """Under SSD_JAX_DETERMINISTIC_AUTO=1 a per-call "auto" call runs no reference and measures no
    fixed part (a call must not depend on timings), and remembers nothing."""
    tuner = deterministic(monkeypatch)
    target, draft = models
    ran = []
    monkeypatch.setattr(auto_call, "ar_reference", lambda *args: ran.append("reference"))
    monkeypatch.setattr(auto_call, "fixed_seconds", lambda *args: ran.append("fixed"))
    for _ in range(3):
        out = ssd_jax.generate(target, PROMPTS, max_new_tokens=12, method=ssd_jax.SD(draft_len="auto"), draft=draft)
        assert out.stats["per_call"]
    assert ran == [] and tuner.per_call.price_table() == {}
