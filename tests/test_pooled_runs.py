"""benchmarks/pooled_runs.py: several processes of one bench_adaptive.py measurement pooled into
one results file, whose ratios are medians over every process's rounds."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks import adaptive_summary as summary
from benchmarks import pooled_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(label: str, ratios: list[float]) -> dict:
    """A configuration whose round r ran `ratios[r]` times faster than AR (AR: 1 s, 100 tokens)."""
    return dict(label=label, tokens_per_second=100.0 * ratios[0], mean_draft_len=4.0, ar_fallback_share=0.5,
                round_wall_s=[1.0 / r for r in ratios], round_tokens=[100.0] * len(ratios),
                per_call_trace=[dict(length=4)], paired_speedup_vs_ar=0.0)


def _run(auto: list[float], fixed: list[float], date: str, set_name: str = "code") -> dict:
    case = dict(set=set_name, temperature=0.0, batch_size=4, prompts=8, best_fixed="ssd L=4",
                configs=[_config("ar", [1.0] * len(auto)), _config("ssd L=4", fixed), _config("ssd auto", auto)],
                auto_vs_ar=[sorted(auto)[len(auto) // 2]], auto_vs_best_fixed=[1.0], auto_vs_ar_best_of=[max(auto)],
                auto_vs_best_fixed_best_of=[1.0])
    machine = dict(cpu_model="AMD EPYC", cores=2, jax_backend="cpu", device_kind="cpu", date_utc=date)
    return dict(machine=machine, method="ssd", draft_model="draft", new_tokens=128, repeats=len(auto),
                policy_overrides={}, call_timed=True, results=[case])


def test_ratios_are_medians_over_every_process_rounds():
    """Process medians 1.2 and 0.9 (mean 1.05); over the six rounds the median is 1.1."""
    runs = [_run([1.0, 1.2, 1.2], [0.8, 0.8, 0.8], "2026-11-28T10:00:00+00:00"),
            _run([0.9, 0.9, 1.3], [0.7, 0.7, 0.7], "2026-11-28T11:00:00+00:00")]
    pooled = pooled_runs.pool(runs, ["a.json", "b.json"])
    (case,) = pooled["results"]
    assert case["auto_vs_ar"][0] == pytest.approx(1.1)
    assert case["auto_vs_ar_per_process"] == [[1.2], [0.9]]   # each run's own reading, kept
    same_round = np.median([1.0 / 0.8, 1.2 / 0.8, 1.2 / 0.8, 0.9 / 0.7, 0.9 / 0.7, 1.3 / 0.7])
    assert case["best_fixed"] == "ssd L=4" and case["auto_vs_best_fixed"][0] == pytest.approx(same_round)
    auto = case["configs"][2]
    assert auto["round_wall_s"] == pytest.approx([1 / 1.0, 1 / 1.2, 1 / 1.2, 1 / 0.9, 1 / 0.9, 1 / 1.3])
    assert auto["timing_repeats"] == 6 and "per_call_trace" not in auto
    assert pooled["processes"] == 2 and pooled["repeats"] == 3 and pooled["process_files"] == ["a.json", "b.json"]
    assert pooled["machine"]["date_utc"] == "2026-11-28T11:00:00+00:00"


def test_a_number_one_process_lacks_is_the_mean_of_the_others():
    """A process whose "auto" calls all ran AR's program reports no acceptance."""
    runs = [_run([1.0] * 3, [0.8] * 3, "2026-11-28T10:00"), _run([1.0] * 3, [0.8] * 3, "2026-11-28T11:00")]
    runs[0]["results"][0]["configs"][2]["acceptance_rate"] = 0.6
    (case,) = pooled_runs.pool(runs)["results"]
    assert case["configs"][2]["acceptance_rate"] == 0.6 and case["configs"][2]["mean_draft_len"] == 4.0
    del runs[1]["results"][0]["configs"][2]["round_tokens"]
    with pytest.raises(pooled_runs.PoolError, match="round_tokens"):
        pooled_runs.pool(runs)


def test_the_best_fixed_setting_is_chosen_on_the_pooled_rounds():
    """L=2 wins the first process, L=4 the pooled rounds: the pooled cell's best is L=4."""
    runs = []
    for date, two, four in (("2026-11-28T10:00", [1.3] * 3, [1.2] * 3), ("2026-11-28T11:00", [0.9] * 3, [1.2] * 3)):
        run = _run([1.0] * 3, four, date)
        run["results"][0]["configs"].insert(1, _config("ssd L=2", two))
        runs.append(run)
    (case,) = pooled_runs.pool(runs)["results"]
    assert case["best_fixed"] == "ssd L=4" and case["auto_vs_best_fixed"][0] == pytest.approx(1 / 1.2)


def test_a_run_without_fixed_settings_pools_and_prints():
    """Runs of AR and "auto" alone (--lengths "" --tree-sizes ""): no best fixed setting, and the
    printed line says so instead of failing."""
    runs = []
    for date, auto in (("2026-11-28T10:00", [1.0, 1.1, 1.2]), ("2026-11-28T11:00", [0.9] * 3)):
        run = _run(auto, [0.8] * 3, date)
        run["results"][0]["configs"].pop(1)
        runs.append(run)
    (case,) = pooled_runs.pool(runs)["results"]
    assert case["auto_vs_best_fixed"] is None and case["auto_vs_ar"][0] == pytest.approx(0.95)
    assert pooled_runs.cell_line(case, "new") == "new: code T=0 B=4: auto 0.950x AR (processes 1.10, 0.90)"
    case = pooled_runs.pool([_run([1.0] * 3, [0.8] * 3, "2026-11-28T10:00"),
                             _run([1.0] * 3, [0.8] * 3, "2026-11-28T11:00")])["results"][0]
    assert pooled_runs.cell_line(case) == "code T=0 B=4: auto 1.000x AR (processes 1.00, 1.00), 1.250 of ssd L=4"


@pytest.mark.parametrize("change, field", [
    (lambda run: run.update(method="sd"), "method"),
    (lambda run: run.update(repeats=5), "repeats"),
    (lambda run: run["machine"].update(cpu_model="Intel Xeon"), "machine"),
    (lambda run: run["results"][0].update(set="short"), "cells"),
    (lambda run: run["results"][0]["configs"].pop(1), "configurations"),
])
def test_runs_that_are_not_one_measurement_are_refused(change, field):
    runs = [_run([1.0] * 3, [0.8] * 3, "2026-11-28T10:00"), _run([1.0] * 3, [0.8] * 3, "2026-11-28T11:00")]
    change(runs[1])
    with pytest.raises(pooled_runs.PoolError, match=field):
        pooled_runs.pool(runs)
    with pytest.raises(pooled_runs.PoolError, match="at least 2"):
        pooled_runs.pool(runs[:1])


def test_the_table_reads_the_pooled_file_and_not_its_processes(tmp_path):
    paths = []
    for index, (auto, date) in enumerate((([0.9] * 3, "2026-11-28T10:00"), ([1.1] * 3, "2026-11-28T11:00")), 1):
        path = tmp_path / f"adaptive_x_process{index}.json"
        path.write_text(json.dumps(_run(auto, [0.8] * 3, date)))
        pooled_runs.mark_process(str(path), index, 2, "adaptive_x.json")
        paths.append(str(path))
    assert summary.newest_cells(paths) == {}   # the processes alone: left out
    pooled_runs.pool_files(paths, str(tmp_path / "adaptive_x"), code_state="abc1234")
    assert (tmp_path / "adaptive_x.png").exists()
    assert json.loads((tmp_path / "adaptive_x.json").read_text())["code_state"] == "abc1234"
    cells = summary.newest_cells(summary.result_paths(str(tmp_path)))
    cell = cells[("ssd", "cpu", 4, 0.0, "code")]
    assert cell["vs_ar"] == pytest.approx(1.0) and cell["processes"] == 2
    (row,) = summary.summary_rows(cells)
    assert row["timing"] == ["paired per token, calls, 2 processes x 3 rounds"]


def test_checkouts_run_interleaved_and_pool_one_file_each(tmp_path):
    """--checkouts: process 1 of every checkout, then process 2 of each, each from its own
    folder; one pooled file per checkout from its own processes only."""
    folders = {}
    for name in ("old", "new"):
        (tmp_path / name / "benchmarks").mkdir(parents=True)
        (tmp_path / name / "benchmarks" / "bench_adaptive.py").write_text("")
        folders[name] = str(tmp_path / name)
    checkouts = pooled_runs.parse_checkouts([f"old={folders['old']}", f"new={folders['new']}"])
    ran = []

    def run(command, check, cwd):
        ran.append((cwd, command[1], command[-1]))
        speed = 0.9 if cwd == folders["old"] else 1.1
        with open(command[-1] + ".json", "w") as f:
            json.dump(_run([speed] * 3, [0.8] * 3, "2026-11-29T02:00"), f)

    stems = {name: str(tmp_path / f"ab_{name}") for name in checkouts}
    paths = pooled_runs.run_processes(["--batch", "4"], stems, checkouts, 2, run=run)
    assert [(cwd, stem[-len("ab_old_process1"):]) for cwd, _, stem in ran] == [
        (folders["old"], "ab_old_process1"), (folders["new"], "ab_new_process1"),
        (folders["old"], "ab_old_process2"), (folders["new"], "ab_new_process2")]
    assert all(bench == f"{cwd}/benchmarks/bench_adaptive.py" for cwd, bench, _ in ran)
    for name, speed in (("old", 0.9), ("new", 1.1)):
        pooled = pooled_runs.pool_files(paths[name], stems[name])
        assert pooled["results"][0]["auto_vs_ar"][0] == pytest.approx(speed)
        assert all(json.load(open(p))["not_in_table"].endswith(f"ab_{name}.json") for p in paths[name])


@pytest.mark.parametrize("specs, problem", [(["old"], "NAME=DIR"), (["=x"], "NAME=DIR"),
                                            (["a=/nonexistent"], "no benchmarks"), ([f"a={ROOT}", f"a={ROOT}"], "twice")])
def test_bad_checkouts_are_refused(specs, problem):
    with pytest.raises(pooled_runs.PoolError, match=problem):
        pooled_runs.parse_checkouts(specs)
