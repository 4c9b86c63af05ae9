"""The benchmarks' shared harness (`benchmarks/spec_harness.py`), which every speed table in
docs/benchmarks.md comes from: paired speedups, interleaved rounds, per-configuration totals."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import spec_harness  # noqa: E402
from benchmarks.common import output_stem, write_json  # noqa: E402
from spec_models import pair  # noqa: E402


def test_paired_speedup_is_the_median_of_same_round_ratios():
    """Round ratios 2, 1 and 4: the median 2, not the ratio of totals (7/3) or of best-of times (1)."""
    base, other = dict(round_wall_s=[2.0, 1.0, 4.0]), dict(round_wall_s=[1.0, 1.0, 1.0])
    assert spec_harness.paired_speedup(base, other) == 2.0
    assert spec_harness.paired_speedup(other, base) == 0.5
    # With each round's token counts, seconds per token: a configuration that stopped at an EOS
    # after half the tokens in the same time is half as fast, not as fast.
    full = dict(round_wall_s=[1.0, 1.0, 1.0], round_tokens=[100, 100, 100])
    early = dict(round_wall_s=[1.0, 1.0, 1.0], round_tokens=[50, 100, 50])
    assert spec_harness.paired_speedup(full, early) == 0.5


def test_out_is_a_stem_even_when_given_with_its_extension():
    # `--out results/x.json` once wrote results/x.json.json and results/x.json.png.
    assert output_stem("results/x.json") == "results/x"
    assert output_stem("results/x.PNG") == "results/x"
    assert output_stem("results/x") == "results/x"
    assert output_stem("results/x.v2") == "results/x.v2"


def test_adaptive_benchmark_batch_sizes_divide_the_prompts():
    """4 prompts at --batch 8 once timed calls of 4 rows labelled batch 8: refused, named."""
    from benchmarks.bench_adaptive import batch_sizes

    assert batch_sizes("1,8", 8) == [1, 8] and batch_sizes("2", 4) == [2]
    with pytest.raises(ValueError, match="--batch 8 must be >= 1 and divide --prompts 4, so that every call holds 8 rows"):
        batch_sizes("1,8", 4)
    with pytest.raises(ValueError, match="--batch 3 .* divide --prompts 8"):
        batch_sizes("3", 8)
    with pytest.raises(ValueError, match="--batch 0 must be >= 1"):
        batch_sizes("0", 8)
    with pytest.raises(ValueError, match="comma-separated integers, got '1,x'"):
        batch_sizes("1,x", 8)


def test_labels_batches_and_generate_arguments():
    assert spec_harness.label("gbv", {"num_draft_tokens": 8, "num_paths": 4}) == "gbv-L8-K4"
    assert spec_harness.label("csd", {"k_matrix": [[0, 2], [0, 1]]}) == "csd-km0x2x0x1"
    assert spec_harness.batches([[1], [2], [3]], 2) == [[[1], [2]], [[3]]]
    pld = spec_harness.generate_kwargs("pld", {"num_draft_tokens": 4}, "a draft", 8, 0.0)
    assert "draft" not in pld and pld["method"].draft_len == 4 and pld["max_new_tokens"] == 8
    sd = spec_harness.generate_kwargs("sd", {"num_draft_tokens": 3}, "a draft", 8, 1.0)
    assert sd["draft"] == "a draft" and sd["method"].draft_len == 3 and sd["temperature"] == 1.0
    csd = spec_harness.generate_kwargs("csd", {"drafts": ["big", "small"]}, "a draft", 8, 0.0)
    assert csd["draft"] == ("big", "small")


@pytest.fixture(scope="module")
def rows():
    target, draft = pair(vocab=64, seed=0, noise=0.3)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    return spec_harness.run_configs(target, prompts, [("ar", {}), ("sd", {"num_draft_tokens": 2})], 0.0, 8,
                                    batch_size=2, draft=draft, repeats=3)


def test_run_configs_keeps_every_round_and_each_calls_fastest_run(rows):
    for row in rows:
        assert len(row["round_wall_s"]) == 3 and min(row["round_wall_s"]) > 0
        assert row["round_tokens"] == [row["tokens"]] * 3   # greedy: the same tokens every round
        # the sum over calls of each call's fastest run is at most any one round's sum
        assert 0 < row["wall_time_s"] <= min(row["round_wall_s"]) * (1 + 1e-9)
        assert row["tokens_per_second"] == pytest.approx(row["tokens"] / row["wall_time_s"])
        assert row["batch_size"] == 2 and row["timing_repeats"] == 3


def test_run_configs_counts_tokens_per_round_and_the_drafts_acceptance(rows):
    ar, sd = rows
    assert 0 < ar["tokens"] == sd["tokens"] <= 3 * 8   # greedy SD emits AR's tokens
    assert "acceptance_rate" not in ar
    assert 0.0 <= sd["acceptance_rate"] <= 1.0 and sd["mean_acceptance_length"] >= 1.0
    assert len(sd["acceptance_per_position"]) == 2
    assert sd["target_calls"] <= ar["target_calls"]


def test_timed_generate_times_the_whole_call_but_its_compile(monkeypatch):
    """call_wall_s: the call's seconds end to end (host work included) minus the compile it
    reports: here 1 s of host work around a 0.25 s program and a 2 s compile, on a fake clock."""
    clock = iter([10.0, 13.25])

    class Out:
        stats = dict(wall_time_s=0.25, compile_time_s=2.0)

    monkeypatch.setattr(spec_harness.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(spec_harness.ssd_jax, "generate", lambda target, prompts, **kwargs: Out())
    out = spec_harness.timed_generate("target", [[1]], method="ar")
    assert out.stats["call_wall_s"] == pytest.approx(1.25) and out.stats["wall_time_s"] == 0.25


def test_per_call_auto_keeps_a_trace_of_every_call(monkeypatch):
    """A per-call "auto" configuration (the GPU's policy at one row, forced here) keeps what each
    call ran, first call first: length (0: AR's program), seconds, compile seconds, target calls
    and tokens; its timed calls' seconds are the rounds'."""
    import dataclasses

    from ssd_jax import backend
    from tuning_helpers import deterministic

    here = backend.default_platform()
    monkeypatch.setitem(backend.POLICIES, here,
                        dataclasses.replace(backend.POLICIES[here], adaptive_per_call_below_rows=2))
    deterministic(monkeypatch)   # the suite's default tuner, with nothing remembered (dropped after the test)
    target, draft = pair(vocab=64, seed=0, noise=0.3)
    prompts = [[3, 4, 5], [6, 7]]
    ar, auto = spec_harness.run_configs(target, prompts, [("ar", {}), ("sd", {"num_draft_tokens": "auto"})], 0.0,
                                        8, batch_size=1, draft=draft, repeats=2)
    assert "per_call_trace" not in ar
    trace = auto["per_call_trace"]
    assert len(trace) == 1 + 2 * 2
    assert all(set(c) == {"length", "wall_s", "compile_s", "calibration_s", "target_calls", "tokens"} for c in trace)
    assert all(c["tokens"] == 8 and c["target_calls"] >= 1 and c["wall_s"] > 0 for c in trace)
    assert sum(c["wall_s"] for c in trace[1:]) == pytest.approx(sum(auto["round_wall_s"]))
    assert spec_harness.call_trace(dict(planned_draft_len=4, chosen_paths=2, wall_time_s=0.5, target_calls=3,
                                        num_generated_tokens=8)) == dict(
        length=4, paths=2, wall_s=0.5, compile_s=0.0, calibration_s=0.0, target_calls=3, tokens=8)
    # A multi-path call that ran AR's program has no path count (chosen_paths None).
    assert spec_harness.call_trace(dict(planned_draft_len=0, chosen_paths=None, wall_time_s=0.5, target_calls=8,
                                        num_generated_tokens=8)) == dict(
        length=0, wall_s=0.5, compile_s=0.0, calibration_s=0.0, target_calls=8, tokens=8)
    # SSD's call: where it switched (None: it did not), the plain step it was judged against.
    ssd = dict(method="ssd", adaptive=True, planned_draft_len=4, switched_to_plain_at_step=None, ssd_resumed=0,
               plain_step_s=0.005, judged_step_s=0.015, judged_pace_tokens=3.5, call_pace_tokens=3.0, wall_time_s=0.5,
               target_calls=40, num_generated_tokens=128, calibration_time_s=0.25)
    assert spec_harness.call_trace(ssd) == dict(length=4, wall_s=0.5, compile_s=0.0, calibration_s=0.25, target_calls=40,
                                                tokens=128, ssd_resumed=0.0, plain_step_s=0.005, judged_step_s=0.015,
                                                judged_pace_tokens=3.5, call_pace_tokens=3.0)
    assert spec_harness.call_trace(dict(ssd, switched_to_plain_at_step=14))["switched_to_plain_at_step"] == 14
    # A call started plain: the draft's read of its text; SD's calls keep no SSD stats.
    read = spec_harness.call_trace(dict(ssd, observed_acceptance=None, plain_read_acceptance=0.9, plain_read_s=0.1))
    assert read["plain_read_acceptance"] == 0.9 and read["plain_read_s"] == 0.1 and "observed_acceptance" not in read
    sd = spec_harness.call_trace(dict(ssd, method="sd", observed_acceptance=0.8))
    assert set(sd) == {"length", "wall_s", "compile_s", "calibration_s", "target_calls", "tokens"}


def test_results_are_written_whole(tmp_path):
    path = write_json(str(tmp_path / "sub" / "result.json"), {"speedup": 1.5})
    assert json.loads(open(path).read()) == {"speedup": 1.5}
    assert os.listdir(tmp_path / "sub") == ["result.json"]   # no temporary file left behind


def test_recorded_calibrations_are_replayed_in_order(tmp_path, monkeypatch):
    """Loop variants are compared under one set of step prices (`benchmarks/calibration_replay.py`):
    what one run measured is returned, in order, to the next instead of measuring; a file that
    runs out or was recorded for another program is refused, naming it."""
    from benchmarks import calibration_replay
    from ssd_jax.tuning import cost_model, measure

    measured = iter([(1.0, 2.0, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0)])
    monkeypatch.setattr(measure, "_calibrate", lambda *args, **kwargs: next(measured))
    size = 4 + len(cost_model.FORCE_SPECULATION) - 3   # loop inputs of a program whose calibration has 4 entries
    args = (None, np.zeros(size))
    path = str(tmp_path / "cal.json")
    with calibration_replay.calibrations(record=path):
        first = [measure._calibrate(None, args, None, True) for _ in range(2)]
    assert first == [(1.0, 2.0, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0)]
    monkeypatch.setattr(measure, "_calibrate", lambda *args, **kwargs: pytest.fail("measured while replaying"))
    with calibration_replay.calibrations(replay=path):
        again = [measure._calibrate(None, args, None, True) for _ in range(2)]
        with pytest.raises(calibration_replay.ReplayError, match="holds 2 calibrations"):
            measure._calibrate(None, args, None, True)
    assert again == first
    with calibration_replay.calibrations(replay=path):
        with pytest.raises(calibration_replay.ReplayError, match="has 4 entries, the program takes 5"):
            measure._calibrate(None, (None, np.zeros(size + 1)), None, True)
    with pytest.raises(ValueError, match="not both"):
        with calibration_replay.calibrations(record=path, replay=path):
            pass


def test_a_call_is_priced_by_its_steps_at_each_cap():
    """A call priced at its steps (`ssd_jax.tuning.against_ar`'s prices): a step at a cap the calibration
    timed costs that time, at an untimed cap the speculative step plus a draft forward per extra
    token, a plain step the AR step; a call's seconds sum its steps (which at T=0 compares two
    loops' choices exactly)."""
    from ssd_jax.tuning.against_ar import call_seconds as priced_seconds, step_price

    # The loop's cost inputs: AR, spec, forward, prior, forced cap; then caps 1, 2, (3), 4 timed.
    loop_costs = [1.0, 1.2, 0.1, 0.7, 0.0, 1.25, 1.5, 0.0, 2.0]
    assert step_price(loop_costs, 0) == 1.0
    assert step_price(loop_costs, 2) == 1.5 and step_price(loop_costs, 4) == 2.0
    assert step_price(loop_costs, 3) == pytest.approx(1.2 + 2 * 0.1)
    assert step_price(loop_costs, 6) == pytest.approx(1.2 + 5 * 0.1)   # past the timed table
    assert priced_seconds(loop_costs, [0, 10, 0, 5], plain_steps=3) == pytest.approx(10 * 1.5 + 5 * 2.0 + 3 * 1.0)
