"""`benchmarks/bench_eagle.py`: its smoke run end to end (the shipped head against SD at toy
size), and its acceptance-by-position summary."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_eagle  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow   # 76 s on the 2-core VM
def test_smoke_run_writes_results_and_plot(tmp_path):
    out = tmp_path / "eagle.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_eagle.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert (tmp_path / "eagle.png").stat().st_size > 0
    per_call = results["tokens_per_call"]
    assert per_call["sd"] >= 1 and per_call["eagle_chain"] >= 1 and per_call["eagle_tree"] >= 1
    assert len(per_call["acceptance_by_position"]["eagle_tree"]) == bench_eagle.LENGTH
    assert [r["temperature"] for r in results["widened"]["runs"]] == [0.0, 1.0]
    assert all(r["eagle_over_ar"] > 0 for r in results["widened"]["runs"])
    assert set(results["training"]) == {"eagle_head", "draft_small"}


def test_acceptance_by_position_pads_and_cuts():
    assert bench_eagle.by_position(dict(acceptance_per_position=[0.9, 0.5]), 4) == [0.9, 0.5, 0.0, 0.0]
    assert bench_eagle.by_position(dict(acceptance_per_position=[0.9, 0.5, 0.2]), 2) == [0.9, 0.5]
    assert bench_eagle.by_position({}, 2) == [0.0, 0.0]
