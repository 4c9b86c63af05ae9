"""Peak host memory of read_params_sharded on a 1.07 GB float32 checkpoint: about one shard above the
device buffers, where ssd_jax.load's path (hf_to_params then jnp.asarray) holds the model again.

Each step runs tests/load_memory_script.py in a fresh process with 8 fake CPU devices (see there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from subprocess_env import fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1e6

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _step(step: str, directory: str) -> dict:
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "load_memory_script.py"), step, directory], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _overhead(result: dict) -> int:
    return result["peak_rss"] - result["baseline_rss"] - result["device_bytes"]


def test_sharded_read_peak_is_about_one_tensor_above_the_device_buffers(tmp_path):
    directory = str(tmp_path / "checkpoint")
    try:
        written = _step("write", directory)
        new = _step("new", directory)
        old = _step("old", directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    largest, bound = written["largest_tensor_bytes"], 1.5 * written["largest_tensor_bytes"]
    report = (
        f"checkpoint {written['checkpoint_bytes'] / MB:.0f} MB in {written['files']} files, largest tensor "
        f"{largest / MB:.0f} MB; new: baseline {new['baseline_rss'] / MB:.0f} MB, peak {new['peak_rss'] / MB:.0f} MB, "
        f"device {new['device_bytes'] / MB:.0f} MB, overhead {_overhead(new) / MB:.0f} MB (bound {bound / MB:.0f} MB), "
        f"{new['read_s']:.1f} s; old: baseline {old['baseline_rss'] / MB:.0f} MB, peak {old['peak_rss'] / MB:.0f} MB, "
        f"device {old['device_bytes'] / MB:.0f} MB, overhead {_overhead(old) / MB:.0f} MB, {old['read_s']:.1f} s"
    )
    print(report)
    assert written["checkpoint_bytes"] >= 1e9 and 100 * MB <= largest <= 270 * MB
    assert new["devices"] == 8 and new["split_leaves"] == 9 and new["leaves"] == 12
    assert new["device_bytes"] >= written["checkpoint_bytes"]
    assert _overhead(new) <= bound, report
