"""`benchmarks/recheck_regimes.py`: how issue 78's misses are grouped for their rerun, and how a
rerun's rounds give the rechecked "auto"/best, its two halves and the verdict (made-up parts; the
rerun itself is `bench_regimes.run_part`, which its smoke test runs)."""

import json

import pytest

from benchmarks import recheck_regimes as rr


def miss(method, regime, temperature, batch, set_name, value=0.9):
    return dict(regime=regime, temperature=temperature, batch_size=batch, set=set_name, method=method,
                auto_over_best_fixed=value, best_fixed_length=4)


def test_groups_by_regime_temperature_and_batch_with_their_methods_and_sets():
    misses = [miss("sd", "1/5", 0.0, 1, "code"), miss("csd", "1/5", 0.0, 1, "prose"),
              miss("sd", "1/5", 0.0, 1, "prose"), miss("sd", "1/5", 1.0, 1, "code"),
              miss("bv", "1/100", 0.0, 8, "code"),                                   # another batch size
              miss("logitspec", "1/5", 0.0, 1, "code"), miss("logitspec", "1/20", 0.0, 1, "code")]
    groups = rr.recheck_groups(misses, batches=(1,))
    keys = [(g["kind"], g["ratio"], g["temperature"], g["batch"]) for g in groups]
    assert keys == [("draft", 5, 0.0, 1), ("draft", 5, 1.0, 1), ("retrieval", None, 0.0, 1)]
    assert groups[0]["methods"] == ["sd", "csd"] and groups[0]["sets"] == ["code", "prose"]
    assert len(groups[0]["misses"]) == 3
    assert len(groups[2]["misses"]) == 1      # a retrieval miss is listed under every regime: one cell
    assert [g["batch"] for g in rr.recheck_groups(misses, batches=(8,))] == [8]
    only_csd = rr.recheck_groups(misses, batches=(1,), methods=("csd",))
    assert [(g["methods"], g["sets"]) for g in only_csd] == [(["csd"], ["prose"])]


def test_original_part_is_the_groups_part_or_a_clear_exit():
    parts = [dict(kind="draft", ratio=20, temperature=0.0, batch_size=1, draft_widening=dict(mlp_multiple=128)),
             dict(kind="retrieval", temperature=0.0, batch_size=1)]
    group = dict(kind="draft", ratio=20, temperature=0.0, batch=1)
    assert rr.original_part(parts, group)["draft_widening"] == dict(mlp_multiple=128)
    assert rr.original_part(parts, dict(group, kind="retrieval", ratio=None))["kind"] == "retrieval"
    with pytest.raises(SystemExit, match="1/100"):
        rr.original_part(parts, dict(group, ratio=100))


def config(method, length, walls, tokens, per_second=None):
    options = {} if length is None else {"num_draft_tokens": length}
    rate = per_second if per_second is not None else sum(tokens) / sum(walls)
    return dict(method=method, options=options, fixed_length=length, round_wall_s=walls, round_tokens=tokens,
                tokens_per_second=rate)


def test_round_rate_is_the_fastest_round_at_t0_and_pooled_rounds_above():
    result = config("sd", 2, walls=[2.0, 1.0, 4.0], tokens=[100.0, 100.0, 300.0])
    assert rr.round_rate(result, [0, 2], 0.0) == pytest.approx(75.0)     # max(50, 75)
    assert rr.round_rate(result, [0, 2], 1.0) == pytest.approx(400 / 6)
    assert rr.round_rate(result, range(3), 1.0) == pytest.approx(500 / 7)


def test_recheck_rows_value_halves_and_verdicts():
    # Four rounds at T=1: "auto" steady at 100 tok/s; L4 fast in the even rounds, slow in the odd.
    results = {"ar": config("ar", None, [1.0] * 4, [50.0] * 4),
               "sd": config("sd", None, [1.0] * 4, [100.0] * 4),
               "sd-L2": config("sd", 2, [1.0] * 4, [90.0] * 4),
               "sd-L4": config("sd", 4, [1.0, 1.0, 1.0, 1.0], [120.0, 90.0, 120.0, 90.0])}
    results["ar"]["method"] = "ar"
    group = dict(kind="draft", ratio=20, temperature=1.0, batch=1, methods=["sd"], sets=["code"],
                 misses=[miss("sd", "1/20", 1.0, 1, "code", 0.85)])
    part = dict(rounds=4, prompts_per_set={"code": 4}, measured_ratio=0.05, sets={"code": results})
    (row,) = rr.recheck_rows([group], {0: part})
    assert row["original"] == 0.85
    assert row["recheck"] == pytest.approx(100 / 105, abs=1e-3) and row["recheck_best_fixed_length"] == 4
    assert row["halves"] == [pytest.approx(100 / 120, abs=1e-3), pytest.approx(100 / 90, abs=1e-3)]
    assert row["verdict"] == "met" and row["rounds"] == 4 and row["prompts_per_set"] == 4


@pytest.mark.parametrize("value, expected", [(0.95, "met"), (1.02, "met"), (0.94, "within noise"),
                                             (0.9026, "within noise"), (0.902, "miss"), (0.77, "miss")])
def test_verdict_thresholds(value, expected):
    assert rr.verdict(value) == expected


def test_a_part_file_is_a_source_with_its_own_misses(tmp_path):
    """A rerun's part (bench_regimes --methods ...) is a source too: its misses come from its own
    sets, and its setting (without the sets) is the part the groups rerun with."""
    sets = {"prose": {"ar": config("ar", None, [1.0] * 2, [50.0] * 2),
                      "ssd": config("ssd", None, [1.0] * 2, [90.0] * 2),
                      "ssd-L4": config("ssd", 4, [1.0] * 2, [100.0] * 2)},
            "code": {"ar": config("ar", None, [1.0] * 2, [50.0] * 2),
                     "ssd": config("ssd", None, [1.0] * 2, [99.0] * 2),
                     "ssd-L4": config("ssd", 4, [1.0] * 2, [100.0] * 2)}}
    for results in sets.values():
        for name, result in results.items():
            result.update(speedup_vs_ar=result["tokens_per_second"] / results["ar"]["tokens_per_second"],
                          tokens_per_target_call=2.0)
    part = dict(kind="draft", ratio=20, regime="1/20", measured_ratio=1 / 22.2, temperature=1.0, batch_size=1,
                draft_widening=dict(mlp_multiple=128), sets=sets)
    path = tmp_path / "r20_t1_b1_ssd.json"
    path.write_text(json.dumps(part))
    source = rr.load_source(str(path))
    assert [(m["method"], m["set"], m["auto_over_best_fixed"]) for m in source["auto_misses"]] == [("ssd", "prose", 0.9)]
    assert source["parts"] == [{k: v for k, v in part.items() if k != "sets"}]
    group = rr.recheck_groups(source["auto_misses"], batches=(1,))[0]
    assert rr.original_part(source["parts"], group)["draft_widening"] == dict(mlp_multiple=128)
    merged = tmp_path / "regimes.json"
    merged.write_text(json.dumps(dict(goal_report=dict(auto_misses=source["auto_misses"]), parts=source["parts"])))
    assert rr.load_source(str(merged)) == source
    neither = tmp_path / "other.json"
    neither.write_text(json.dumps(dict(rows=[])))
    with pytest.raises(SystemExit, match="neither"):
        rr.load_source(str(neither))
