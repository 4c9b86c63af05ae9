"""The exact-law test kit `ssd_jax.testing`: every verifier's exact law is the target's, the
sampled check passes on every real verifier, and every planted bug is rejected by both checks.

Exact laws are float64 enumerations (V <= 6, depth <= 5) compared at 1e-9 in total variation.
Each sampled check runs N = 200,000 steps (50 vmapped keys x 4,000 rows) of the real jitted code
and fails a correct verifier with probability at most 1e-6 (`ssd_jax.testing.g_test`); the keys
are fixed, so a run is reproducible.
"""

from __future__ import annotations

import ast
import itertools
import math
import os

import numpy as np
import pytest

import ssd_jax
from ssd_jax import testing as kit
from ssd_jax.errors import InputError
from ssd_jax.sampling import SamplingParams
from ssd_jax.testing.controls import CONTROLS, PLANTED

N_KEYS, ROWS = 50, 4000
N = N_KEYS * ROWS

TWO_DRAFTERS = ((0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1))


def zero_target_chain(t: kit.Tables) -> kit.PointTree:
    """A chain of length n whose last token has zero target probability after the ones before."""
    for path in itertools.product(range(t.V), repeat=t.n):
        if t.P[t.n - 1][path[:-1]][path[-1]] == 0:
            return kit.chain(path)
    raise AssertionError("no zero-probability target token in these tables")


def zero_target_nodes(t: kit.Tables, tree: kit.PointTree) -> list:
    node_p = tree.node_rows(t)
    return [i for i in range(1, tree.tokens.shape[0]) if node_p[tree.parents[i], tree.tokens[i]] == 0]


# ----------------------------------------------------------------------------- exact laws


EXACT_CASES = [
    ("tokenwise", 0, 3, 2, None, {}), ("tokenwise", 1, 4, 3, None, {}), ("tokenwise", 2, 6, 2, None, {}),
    ("block", 0, 3, 2, None, {}), ("block", 1, 4, 3, None, {}), ("block", 2, 6, 2, None, {}),
    ("specinfer", 10, 3, 2, 2, {}), ("specinfer", 11, 2, 3, 3, {}),
    ("spectr", 10, 3, 2, 3, {}), ("spectr", 12, 4, 2, 2, {"unrolled": True}),
    ("gbv", 13, 3, 2, 3, {}), ("gbv", 14, 2, 3, 2, {}),
    ("point_tree", 0, 3, 3, None, {}), ("point_tree", 1, 4, 2, None, {}),
    ("point_chain", 0, 3, 3, None, {}), ("point_chain", 3, 5, 3, None, {}),
    ("csd", 0, 3, 4, None, {}),
    ("csd", 1, 3, 3, None, {"setup": kit.CascadeSetup(k_matrix=((0, 2, 1), (0, 0, 0)))}),
    ("csd", 2, 2, 4, None, {"setup": kit.CascadeSetup(k_matrix=((0, 1, 1), (0, 0, 2)), max_draft_tokens=3)}),
    ("ssd", 0, 3, 3, None, {}),
    ("ssd", 1, 3, 3, None, {"setup": kit.SSDSetup(fanout=(1, 2), saguaro_c=0.0, fallback="ngram")}),
    ("ssd", 2, 2, 5, None, {"setup": kit.SSDSetup(draft_len=2, saguaro_c=0.3)}),
    ("ssd_hit", 3, 4, 2, None, {"setup": kit.SSDSetup(draft_len=2, fanout=(2, 1, 2))}),
    ("ssd_miss", 3, 4, 2, None, {"setup": kit.SSDSetup(draft_len=2, fallback="ngram")}),
]


@pytest.mark.parametrize("name,seed,V,n,K,options", EXACT_CASES,
                         ids=[f"{c[0]}-{c[1]}-V{c[2]}-n{c[3]}" for c in EXACT_CASES])
def test_exact_law_of_every_verifier_is_the_target_law(name, seed, V, n, K, options):
    t = kit.random_tables(seed, V, n)
    law = kit.exact_law(name, t, K, **options)
    assert law.shape == (V,) * (n + 1) and abs(law.sum() - 1) < 1e-12 and law.min() >= 0
    kit.assert_exact(law, t)


def test_every_verifier_name_has_an_exact_case():
    assert {case[0] for case in EXACT_CASES} == set(kit.NAMES)


def test_two_drafter_cascade_with_a_cap():
    """Drafter 2 reviews Max-Gram, drafter 1 reviews drafter 2, the target checks 2 of 3 tokens."""
    t = kit.random_tables(4, 3, 3)
    other = kit.random_tables(5, 3, 3).Q
    for cap in (None, 2):
        setup = kit.CascadeSetup(k_matrix=TWO_DRAFTERS, drafters=(other,), max_draft_tokens=cap)
        kit.assert_exact(kit.exact_law("csd", t, setup=setup), t)


def test_point_mass_walks_with_zero_probability_and_invalid_draft_tokens():
    """Trees and chains holding tokens the target never emits, and invalid nodes."""
    t = kit.random_tables(0, 3, 3)
    tree = kit.draft_tree(t, width=2, invalid=(2, 7))
    assert zero_target_nodes(t, tree)
    kit.assert_exact(kit.exact_law("point_tree", t, tree=tree), t)
    chain = zero_target_chain(t)
    assert zero_target_nodes(t, chain)
    for name in ("point_tree", "point_chain"):
        kit.assert_exact(kit.exact_law(name, t, tree=chain), t)
    kit.assert_exact(kit.exact_law("point_chain", t, tree=kit.chain([0, 1, 2], valid=[True, False, True])), t)


def test_processed_tables_give_exact_laws():
    """Tables processed by the library's sampling (temperature, top-k, top-p: zeros in q and p)."""
    t = kit.processed_tables(3, 4, 2, SamplingParams(temperature=0.7, top_k=3, top_p=0.9))
    assert (t.Q[1] == 0).any() and (t.P[2] == 0).any()
    for name, K in (("tokenwise", None), ("block", None), ("specinfer", 2), ("gbv", 2)):
        kit.assert_exact(kit.exact_law(name, t, K), t)


def test_block_toy_expected_acceptance():
    """Sun et al.'s toy (p = [1/3, 2/3], q = [2/3, 1/3], L = 2): 10/9 token-wise, 11/9 block."""
    t = kit.iid_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2)
    drafts, prob, q, p = kit.single_path_inputs(t)
    for rule, expected in ((kit.tokenwise_rule, 10 / 9), (kit.block_rule, 11 / 9)):
        stop, _ = rule(drafts, q, p)
        assert abs(kit.expected_accepted(stop, prob) - expected) < 1e-14


# ----------------------------------------------------------------------------- sampled laws

SINGLE_TABLES = kit.random_tables(100, V=3, L=3)
MULTI_TABLES = kit.random_tables(105, V=3, L=2)

SAMPLED_CASES = [
    pytest.param("tokenwise", SINGLE_TABLES, None, {}, id="tokenwise"),
    pytest.param("block", SINGLE_TABLES, None, {}, id="block"),
    pytest.param("specinfer", MULTI_TABLES, 4, {}, id="specinfer"),
    pytest.param("spectr", MULTI_TABLES, 4, {}, id="spectr"),
    pytest.param("gbv", MULTI_TABLES, 4, {}, id="gbv"),
    pytest.param("point_tree", kit.random_tables(0, 3, 3), None, {}, id="point_tree"),
    pytest.param("point_chain", kit.random_tables(0, 3, 3), None, {}, id="point_chain"),
    pytest.param("csd", kit.random_tables(0, 3, 4), None, {}, id="csd"),
    pytest.param("csd", kit.random_tables(4, 3, 3), None,
                 {"setup": kit.CascadeSetup(k_matrix=TWO_DRAFTERS, drafters=(kit.random_tables(5, 3, 3).Q,))},
                 id="csd-two-drafters", marks=pytest.mark.slow),
    pytest.param("ssd", kit.random_tables(0, 3, 3), None, {}, id="ssd"),
    pytest.param("ssd", kit.random_tables(3, 3, 5), None,
                 {"setup": kit.SSDSetup(draft_len=2, fanout=(1, 1, 2), saguaro_c=0.7, fallback="ngram")},
                 id="ssd-ngram", marks=pytest.mark.slow),
    pytest.param("ssd_hit", kit.random_tables(1, 3, 2), None, {"setup": kit.SSDSetup(draft_len=2)}, id="ssd_hit"),
    pytest.param("ssd_miss", kit.random_tables(1, 3, 2), None, {"setup": kit.SSDSetup(draft_len=2, fallback="ngram")},
                 id="ssd_miss"),
]


def test_every_verifier_name_has_a_default_sampled_case():
    default = {case.values[0] for case in SAMPLED_CASES if not case.marks}
    assert default == set(kit.NAMES)


@pytest.mark.parametrize("name,t,K,options", SAMPLED_CASES)
def test_sampled_check_passes_on_every_real_verifier(name, t, K, options):
    sample = kit.sampled_counts(name, t, K, n_keys=N_KEYS, rows=ROWS, seed=1, **options)
    assert sample.counts.sum() == N
    kit.assert_sampled(sample.counts, t)


# ----------------------------------------------------------------------------- negative controls

# (control, tables, K): tables where the bug is far from exact; every one has power ~ 1 at N.
CONTROL_CASES = {
    "greedy_on_ssd_miss": (kit.random_tables(0, 3, 3), None),
    "raw_logits_q": (kit.processed_tables(0, 4, 2, SamplingParams(temperature=0.8, top_k=2)), None),
    "topk_tree_without_residual": (kit.random_tables(0, 3, 2, zero_prob=0.0, special_prob=0.0), 2),
    "unnormalised_residual": (kit.random_tables(0, 3, 3, zero_prob=0.0, special_prob=0.0), None),
    "argmax_acceptance": (SINGLE_TABLES, None),
    "gbv_unskewed": (MULTI_TABLES, 4),
}


def test_the_controls_are_the_issue_s_four_and_the_two_older_ones():
    assert set(PLANTED) <= set(CONTROLS) == set(CONTROL_CASES)


@pytest.mark.parametrize("name", sorted(CONTROL_CASES))
def test_exact_check_rejects_each_control(name):
    t, K = CONTROL_CASES[name]
    law = CONTROLS[name].exact_law(t, K)
    assert abs(law.sum() - 1) < 1e-12 and law.min() >= 0
    with pytest.raises(AssertionError, match="total variation"):
        kit.assert_exact(law, t)
    assert kit.law_distance(law, kit.target_law(t)) > 0.05
    assert kit.power(law, kit.target_law(t), N) > 1 - 1e-9


@pytest.mark.parametrize("name", sorted(CONTROL_CASES))
def test_sampled_check_rejects_each_control(name):
    """The same check as on the real verifiers rejects the bug, far beyond its threshold, and the
    bug's own sampled counts fit its own exact law (the kit's two halves agree on an inexact
    verifier too)."""
    t, K = CONTROL_CASES[name]
    control = CONTROLS[name]
    sample = control.sampled_counts(t, K, n_keys=N_KEYS, rows=ROWS, seed=2)
    result = kit.g_test(sample.counts, kit.target_law(t))
    assert not result.passed and result.statistic > 3 * result.threshold, result
    with pytest.raises(AssertionError, match="differs from the reference"):
        kit.assert_sampled(sample.counts, t)
    kit.assert_sampled(sample.counts, control.exact_law(t, K))


def test_exact_check_rejects_a_small_planted_bias():
    """Power at small distances: a law 1e-6 away in total variation fails at tol = 1e-9."""
    t = kit.random_tables(0, 3, 2)
    law = kit.target_law(t).copy()
    law.flat[0] += 1e-6
    law.flat[1] -= 1e-6
    with pytest.raises(AssertionError):
        kit.assert_exact(law, t)


# ----------------------------------------------------------------------------- the G-test


def test_threshold_is_where_the_finite_sample_bound_equals_alpha():
    for cells in (2, 13, 81, 729):
        for alpha in (1e-2, 1e-6):
            t = kit.g_threshold(cells, alpha)
            m = cells - 1
            assert t > m and abs((-t + m * (1 + math.log(t / m))) - math.log(alpha)) < 1e-9
    assert kit.g_threshold(1) == math.inf


def test_false_failure_rate_is_below_alpha():
    """Multinomial draws from the law itself: at alpha = 0.05 the check fails at most about 5% of
    the time (the bound is conservative: it fails far less)."""
    rng = np.random.default_rng(0)
    law = kit.target_law(kit.random_tables(7, 3, 3)).ravel()
    draws = rng.multinomial(20_000, law, size=4000)
    failed = sum(not kit.g_test(c, law, alpha=0.05).passed for c in draws)
    assert failed <= 0.05 * 4000


def test_an_impossible_outcome_fails_the_check():
    law = np.array([0.5, 0.5, 0.0])
    result = kit.g_test([500, 499, 1], law)
    assert not result.passed and result.impossible == 1
    assert kit.g_test([500, 500, 0], law).passed


def test_power_matches_simulated_rejections():
    """The normal approximation of the power against multinomial draws from an alternative."""
    rng = np.random.default_rng(1)
    law = np.full(27, 1 / 27)
    alt = law * (1 + 0.35 * np.sin(np.arange(27)))
    alt /= alt.sum()
    n = 1200
    predicted = kit.power(alt, law, n, alpha=1e-3)
    simulated = np.mean([not kit.g_test(c, law, alpha=1e-3).passed for c in rng.multinomial(n, alt, size=2000)])
    assert 0.3 < predicted < 0.7 and abs(predicted - simulated) < 0.05


# ----------------------------------------------------------------------------- the kit's place


def test_the_library_never_imports_the_kit():
    package = os.path.dirname(ssd_jax.__file__)
    offenders = []
    for folder, _, files in os.walk(package):
        if os.path.relpath(folder, package).split(os.sep)[0] == "testing":
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n == "ssd_jax.testing" or n.startswith("ssd_jax.testing.") for n in names):
                    offenders.append(os.path.relpath(path, package))
    assert not offenders, offenders


# ----------------------------------------------------------------------------- bad input


def _tables_args(seed=0, V=3, L=2):
    t = kit.random_tables(seed, V, L)
    return [a.copy() for a in t.P], [a.copy() for a in t.Q]


@pytest.mark.parametrize("edit,match", [
    (lambda P, Q: P.pop(), "one level more than Q"),
    (lambda P, Q: P.__setitem__(1, P[1][:, :2]), r"P\[1\] must have shape \(3, 3\)"),
    (lambda P, Q: Q.__setitem__(0, np.append(Q[0], 0.0)), r"Q\[0\] must have shape \(3,\)"),
    (lambda P, Q: P[2].__setitem__((1, 2), P[2][1, 2] * 0.5), r"P\[2\] row after prefix \(1, 2\) sums to"),
    (lambda P, Q: Q[1].__setitem__((0, 0), -0.25), r"Q\[1\] must hold finite non-negative"),
    (lambda P, Q: Q[1].__setitem__((0, 0), np.nan), r"Q\[1\] must hold finite non-negative"),
    (lambda P, Q: Q.clear() or P[1:].clear(), "Q must have at least one level"),
])
def test_inconsistent_tables_raise_naming_the_value(edit, match):
    P, Q = _tables_args()
    edit(P, Q)
    with pytest.raises(InputError, match=match):
        kit.Tables(P, Q)


def test_bad_raw_logits_raise():
    P, Q = _tables_args()
    with pytest.raises(InputError, match="one level per level of Q"):
        kit.Tables(P, Q, draft_logits=[np.zeros(3)])
    with pytest.raises(InputError, match=r"draft_logits\[0\] must hold finite logits"):
        kit.Tables(P, Q, draft_logits=[np.array([np.nan, 0, 0]), np.zeros((3, 3))])


@pytest.mark.parametrize("call,match", [
    (lambda: kit.exact_law("tokenwise", kit.random_tables(0, 7, 1)), "V <= 6, got V=7"),
    (lambda: kit.exact_law("specinfer", kit.random_tables(0, 3, 2)), "K .* must be an integer >= 1, got None"),
    (lambda: kit.exact_law("tokenwise", kit.random_tables(0, 3, 2), 2), "K must be None, got 2"),
    (lambda: kit.exact_law("nucleus", kit.random_tables(0, 3, 2)), "unknown verifier 'nucleus'"),
    (lambda: kit.exact_law("block", kit.random_tables(0, 3, 2), fast=True), r"takes the options none, got \['fast'\]"),
    (lambda: kit.exact_law("specinfer", kit.random_tables(0, 6, 3), 3), "would visit .* at most"),
    (lambda: kit.exact_law("tokenwise", "tables"), "must be ssd_jax.testing.Tables, got str"),
    (lambda: kit.exact_law("ssd", kit.random_tables(0, 3, 2)), "need tables of depth n >= 3, got n=2"),
    (lambda: kit.exact_law("ssd", kit.random_tables(0, 3, 3), setup=kit.SSDSetup(fanout=(3, 1))),
     r"fanout must be L\+1 = 2 counts"),
    (lambda: kit.exact_law("ssd", kit.random_tables(0, 3, 3), setup=kit.SSDSetup(fallback="random")),
     "fallback must be one of"),
    (lambda: kit.exact_law("csd", kit.random_tables(0, 3, 3)), "need depth n >= 4, got n=3"),
    (lambda: kit.exact_law("csd", kit.random_tables(0, 3, 3), setup=kit.CascadeSetup(k_matrix=TWO_DRAFTERS)),
     "names 2 drafter"),
    (lambda: kit.exact_law("point_tree", kit.random_tables(0, 3, 2), tree=kit.chain([0, 1, 2])),
     "depth 3 needs tables of depth n >= 3"),
    (lambda: kit.exact_law("point_chain", kit.random_tables(0, 3, 2),
                           tree=kit.draft_tree(kit.random_tables(0, 3, 2))), "needs a chain"),
    (lambda: kit.PointTree(np.array([0, 1]), np.array([-1, 1]), None), r"parents\[1\] = 1"),
    (lambda: kit.iid_tables([0.5, 0.5], [1.0], 2), "rows of the same length"),
    (lambda: kit.random_tables(0, 0, 2), "V must be an integer >= 1, got 0"),
    (lambda: CONTROLS["raw_logits_q"].exact_law(kit.random_tables(0, 3, 2)), "needs tables with draft_logits"),
    (lambda: CONTROLS["topk_tree_without_residual"].exact_law(kit.random_tables(0, 3, 2), 2),
     "cannot be drawn without replacement"),
    (lambda: kit.g_test([1, 2], [0.5, 0.25, 0.25]), "counts have 2 outcomes and the law 3"),
    (lambda: kit.sampled_counts("tokenwise", kit.random_tables(0, 3, 2), n_keys=0), "n_keys must be an integer >= 1"),
    (lambda: kit.sampled_counts("tokenwise", kit.random_tables(0, 3, 2), unrolled=True),
     "takes the options none"),
])
def test_bad_kit_input_raises_naming_the_value(call, match):
    with pytest.raises(InputError, match=match):
        call()
