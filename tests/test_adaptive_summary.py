"""benchmarks/adaptive_summary.py: the table of "auto" in docs/benchmarks.md is the committed
summary, the newest measurement of a cell wins, and the goals are checked per set."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import adaptive_summary as summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(set_name: str, vs_ar: float, vs_best: float, best: str = "sd L=2", temperature: float = 0.0) -> dict:
    return dict(set=set_name, temperature=temperature, batch_size=1, prompts=4, best_fixed=best,
                configs=[dict(label="ar"), dict(label=best), dict(label="sd auto", mean_draft_len=2.0,
                                                                  ar_fallback_share=0.1)],
                auto_vs_ar=[vs_ar], auto_vs_best_fixed=[vs_best], auto_vs_ar_best_of=[vs_ar],
                auto_vs_best_fixed_best_of=[vs_best])


def _write(path, date: str, cases: list[dict], cpu: str = "AMD EPYC 7B13") -> str:
    machine = dict(cpu_model=cpu, cores=2, jax_backend="cpu", date_utc=f"{date}T10:00:00+00:00")
    path.write_text(json.dumps(dict(machine=machine, method="sd", repeats=15, results=cases)))
    return str(path)


def test_the_docs_table_is_the_committed_summary():
    results = os.path.join(REPO, "benchmarks", "results")
    committed = summary.committed_cells(os.path.join(results, "adaptive_summary.json"))
    table = summary.markdown(summary.summary_rows(summary.newest_cells(summary.result_paths(results), committed)))
    doc = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    assert table in doc, ("docs/benchmarks.md's adaptive table is stale: "
                          "run python benchmarks/adaptive_summary.py --doc docs/benchmarks.md")


def test_a_new_results_file_is_folded_into_the_committed_summary(tmp_path):
    """The summary's own cells are where a new run starts: a newer file's cell replaces the
    committed one, an older file's does not, and the other committed cells stay."""
    first = _write(tmp_path / "adaptive_a.json", "2026-11-25", [_case("code", 1.10, 0.97), _case("short", 1.2, 1.0)])
    stem = tmp_path / "adaptive_summary.json"
    stem.write_text(json.dumps(summary.summary_rows(summary.newest_cells([first]))))
    older = _write(tmp_path / "adaptive_b.json", "2026-11-24", [_case("code", 0.90, 0.80)])
    newer = _write(tmp_path / "adaptive_c.json", "2026-11-26", [_case("short", 1.4, 1.02)])
    cells = summary.newest_cells([older, newer], summary.committed_cells(str(stem)))
    assert cells[("sd", "cpu", 1, 0.0, "code")]["vs_ar"] == 1.10
    assert cells[("sd", "cpu", 1, 0.0, "short")]["vs_ar"] == 1.4
    assert summary.committed_cells(str(tmp_path / "none.json")) == {}


def test_the_newest_measurement_of_a_cell_wins(tmp_path):
    old = _write(tmp_path / "adaptive_a.json", "2026-11-24", [_case("code", 0.90, 0.80), _case("short", 1.2, 1.0)])
    new = _write(tmp_path / "adaptive_b.json", "2026-11-26", [_case("code", 1.30, 0.99)])
    for paths in ([old, new], [new, old]):
        cells = summary.newest_cells(paths)
        assert cells[("sd", "cpu", 1, 0.0, "code")]["vs_ar"] == 1.30
        assert cells[("sd", "cpu", 1, 0.0, "short")]["vs_ar"] == 1.2   # only the old file has it
    (row,) = summary.summary_rows(summary.newest_cells([old, new]))
    assert row["vs_ar"] == (1.2, 1.3) and row["misses"] == {} and row["machines"] == ["2-core AMD EPYC"]


@pytest.mark.parametrize("field, reason", [("superseded", "before the GPU loop policy"),
                                           ("not_in_table", "a second process of two cells of a fuller run")])
def test_a_superseded_file_is_left_out(tmp_path, field, reason):
    """A file measured on a loop the library no longer runs, or a repeat of cells a fuller run
    measured (a second try must not replace a worse first one), gives no cell, even where it
    alone has the cell or is the newest."""
    kept = _write(tmp_path / "adaptive_kept.json", "2026-11-24", [_case("code", 1.10, 0.97)])
    gone = tmp_path / "adaptive_gone.json"
    _write(gone, "2026-11-26", [_case("code", 0.90, 0.80), _case("short", 0.95, 0.79)])
    data = json.loads(gone.read_text())
    gone.write_text(json.dumps(dict(data, **{field: reason})))
    cells = summary.newest_cells([kept, str(gone)])
    assert set(cells) == {("sd", "cpu", 1, 0.0, "code")} and cells[("sd", "cpu", 1, 0.0, "code")]["vs_ar"] == 1.10


@pytest.mark.parametrize("set_name, vs_ar, vs_best, missed", [
    ("code", 1.00, 0.95, []),                       # both goals met exactly (at the shown precision)
    ("code", 0.99, 1.10, ["0.99x AR"]),
    ("badguess", 0.96, 1.00, []),                   # the badguess set's floor is 0.95x AR
    ("badguess", 0.94, 0.90, ["0.94x AR", "0.90 of L=2"]),
    ("short", 1.40, 0.944, ["0.94 of L=2"]),
])
def test_goal_misses(set_name, vs_ar, vs_best, missed):
    cell = dict(vs_ar=vs_ar, vs_best=vs_best, best_fixed="L=2")
    assert summary.goal_misses(set_name, cell) == missed


@pytest.mark.parametrize("share, missed", [
    (1.0, ["0.99x AR (plain on 100% of steps)"]),   # "auto" at best ties AR there
    (0.992, ["0.99x AR (plain on 99% of steps)"]),
    (0.9, ["0.99x AR"]),                            # speculated on a tenth of its steps: a plain miss
    (None, ["0.99x AR"]),                           # an older file without the share
])
def test_a_miss_against_ar_says_where_auto_decoded_plainly(share, missed):
    cell = dict(vs_ar=0.99, vs_best=1.2, best_fixed="L=2", ar_share=share)
    assert summary.goal_misses("code", cell) == missed


@pytest.mark.parametrize("n, expected", [(3, None), (4, None), (5, (1, 5)), (10, (2, 9)), (21, (7, 15))])
def test_median_interval_takes_the_order_statistics_that_cover_90_percent(n, expected):
    """k-th smallest and largest of n values, k the largest with P(Binomial(n, 1/2) < k) <= 0.05
    (n = 21: P(< 7) = 0.039, P(< 8) = 0.095); below 5 values not even the extremes cover 90%."""
    values = [float(v) for v in range(n, 0, -1)]   # unsorted on purpose
    assert summary.median_interval(values) == expected


def test_round_ratios_compare_seconds_per_token_per_round():
    ar = dict(round_wall_s=[1.0, 2.0], round_tokens=[100, 100])
    auto = dict(round_wall_s=[0.5, 2.0], round_tokens=[50, 200])   # same pace, then twice AR's
    assert summary.round_ratios(ar, auto) == [1.0, 2.0]
    assert summary.round_ratios(dict(round_wall_s=[1.0]), dict(round_wall_s=[0.5])) == [2.0]
    assert summary.round_ratios(dict(label="ar"), auto) is None   # a best-of run kept no rounds


@pytest.mark.parametrize("set_name, interval, missed", [
    ("code", (0.97, 1.004), ["0.99x AR (90% 0.97-1.00, within noise)"]),
    ("code", (0.96, 0.985), ["0.99x AR (90% 0.96-0.98)"]),          # a miss the rounds do place
    ("badguess", (0.90, 0.96), ["0.93x AR (90% 0.90-0.96, within noise)"]),  # badguess's floor 0.95x
    ("code", None, ["0.99x AR"]),                                    # too few rounds for an interval
])
def test_a_miss_against_ar_shows_its_interval(set_name, interval, missed):
    vs_ar = 0.93 if set_name == "badguess" else 0.99
    cell = dict(vs_ar=vs_ar, vs_best=1.2, best_fixed="L=2", ar_share=0.5, vs_ar_interval=interval)
    assert summary.goal_misses(set_name, cell) == missed


def test_a_file_with_rounds_gives_its_cells_an_interval(tmp_path):
    case = _case("code", 0.99, 1.1)
    case["configs"][0].update(round_wall_s=[1.0] * 7, round_tokens=[128] * 7)
    case["configs"][2].update(round_wall_s=[1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.02], round_tokens=[128] * 7)
    path = _write(tmp_path / "adaptive_r.json", "2026-11-26", [case])
    (cell,) = summary.newest_cells([path]).values()
    low, high = cell["vs_ar_interval"]
    assert (low, high) == (pytest.approx(1 / 1.1), pytest.approx(1 / 0.9))   # 7 rounds: the extremes
    assert "within noise" in summary.goal_misses("code", cell)[0]


def test_markdown_names_every_miss_and_the_measurement(tmp_path):
    path = _write(tmp_path / "adaptive_x.json", "2026-11-26",
                  [_case("code", 0.97, 0.89), _case("badguess", 0.96, 1.02)], cpu="Intel(R) Xeon(R) Processor")
    text = summary.markdown(summary.summary_rows(summary.newest_cells([path])))
    assert "| sd | 2-core Intel Xeon | 1 | 0 | 2 | 0.96-0.97x | 0.89-1.02 | code: 0.97x AR, 0.89 of L=2 |" in text
    assert "2026-11-26, paired, 15 rounds" in text


def test_a_file_of_another_format_is_named_in_the_error(tmp_path):
    bad = tmp_path / "adaptive_bad.json"
    bad.write_text(json.dumps(dict(machine=dict(jax_backend="cpu"), method="sd", repeats=3,
                                   results=[dict(set="code", auto_vs_ar=[1.0], auto_vs_best_fixed=[1.0])])))
    with pytest.raises(summary.SummaryError, match="adaptive_bad.json"):
        summary.newest_cells([str(bad)])
    profile = tmp_path / "adaptive_profile.json"       # no "results": not a table, skipped
    profile.write_text(json.dumps(dict(device="cuda:0", rows=[])))
    assert summary.newest_cells([str(profile)]) == {}
