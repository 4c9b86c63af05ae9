"""`benchmarks/bench_startup.py`: its configurations, medians and plot (the timed runs themselves
are the benchmark's, not the suite's)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_startup  # noqa: E402


def test_configurations_name_the_command_line_options():
    assert bench_startup.config_args("ar") == ["--method", "ar", "--json"]
    assert bench_startup.config_args("sd") == ["--method", "sd", "--json"]
    assert bench_startup.config_args("sd:4") == ["--method", "sd", "--num-draft-tokens", "4", "--json"]
    assert bench_startup.config_args("pld@1") == ["--method", "pld", "--temperature", "1", "--json"]
    assert bench_startup.config_args("sd:2@0.5") == ["--method", "sd", "--num-draft-tokens", "2", "--temperature", "0.5",
                                                     "--json"]
    assert bench_startup.config_args("sd@1+stream") == ["--method", "sd", "--temperature", "1", "--stream"]


def test_a_state_is_the_median_of_its_runs_and_the_plot_is_written(tmp_path):
    runs = [dict(process_s=s, compile_time_s=s / 2, cost_measure_time_s=0.1, wall_time_s=0.2, tokens=128)
            for s in (3.0, 9.0, 4.0)]
    median = bench_startup.summary(runs)
    assert median == dict(process_s=4.0, compile_time_s=2.0, cost_measure_time_s=0.1, wall_time_s=0.2)
    results = {c: {s: median for s in bench_startup.STATES} for c in ("ar", "sd")}
    bench_startup.plot(results, str(tmp_path / "startup.png"))
    assert (tmp_path / "startup.png").stat().st_size > 1000
    two_states = {c: {s: median for s in ("first", "later")} for c in ("ar", "sd")}   # --states first,later
    bench_startup.plot(two_states, str(tmp_path / "two.png"))
    assert (tmp_path / "two.png").stat().st_size > 1000


def test_greedy_configurations_must_print_the_same_tokens_in_every_state():
    def runs(*printed):
        return {state: [dict(token_ids=p)] for state, p in zip(bench_startup.STATES, printed)}

    assert bench_startup.agreement("sd", runs([[5, 6]], [[5, 6]], [[5, 6]])) is True
    assert bench_startup.agreement("sd:4@0", runs([[5, 6]], [[5, 7]], [[5, 6]])) is False   # a read-back differs
    assert bench_startup.agreement("pld@1", runs([[5]], [[6]], [[7]])) is None   # sampling: no check
    assert bench_startup.agreement("sd+stream", runs(None, None, None)) is None  # streamed: no tokens
    assert bench_startup.greedy("sd@0.0+stream") and not bench_startup.greedy("sd:2@0.5")
