"""read_params_sharded: checkpoints read straight into sharded jax.Arrays equal hf_to_params exactly.

The multi-device checks run once, in tests/sharded_read_script.py under 8 fake CPU devices (a
subprocess: the rest of the suite runs with one device); each test here asserts on its findings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from subprocess_env import fake_devices_env

from checkpoints_convert.sharded_read import read_params_sharded
from hf_models import FAMILY_CONFIGS
from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import _is_shape, param_shapes

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("llama3", "gpt2", "phi3", "mixtral", "gemma")


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    env = fake_devices_env(8)
    work = str(tmp_path_factory.mktemp("sharded_read"))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharded_read_script.py"), work], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_leaf_equals_hf_to_params_with_the_requested_sharding(findings):
    assert findings["devices"] == 8
    cases = findings["cases"]
    expected = [f"{checkpoint}/{mesh}/{mode}" for checkpoint in FAMILIES + ("llama3_sharded", "gpt2_old_names")
                for mesh in ("1x8", "2x4") for mode in ("last", "lead", "lead+last", "replicated")]
    assert set(expected) <= set(cases)
    for name, case in cases.items():
        assert case["bad_values"] == [] and case["bad_sharding"] == [], (name, case)


def test_the_shardings_really_split(findings):
    """Every leaf splits somewhere on 2x4; on 1x8 the last axis of all but Mixtral's [N, D, 4] router."""
    cases = findings["cases"]
    for checkpoint in FAMILIES:
        assert cases[f"{checkpoint}/2x4/lead+last"]["split"] == cases[f"{checkpoint}/2x4/lead+last"]["leaves"]
        assert cases[f"{checkpoint}/2x4/lead"]["split"] == cases[f"{checkpoint}/2x4/lead"]["leaves"]
        last = cases[f"{checkpoint}/1x8/last"]
        assert last["split"] == last["leaves"] - (checkpoint == "mixtral"), checkpoint
        assert cases[f"{checkpoint}/1x8/replicated"]["split"] == 0


def test_dtypes_chunked_reads_and_converted_directories(findings):
    cases = findings["cases"]
    for name in ("llama3_bf16/2x4/lead+last", "llama3_bf16/2x4/replicated", "converted_bf16/2x4/replicated",
                 "llama3_stored_bf16/2x4/lead+last/float32", "llama3_stored_bf16/2x4/lead+last/bfloat16",
                 *(f"converted/{m}/{mode}" for m in ("1x8", "2x4") for mode in ("last", "lead", "replicated")),
                 *(f"{c}/2x4/lead+last/100-byte reads" for c in FAMILIES)):
        assert name in cases and cases[name]["split"] >= (0 if "replicated" in name else 1), name
    assert "down/kernel has shape" in findings["converted_wrong_config"]


def test_on_tensor_runs_once_per_hf_tensor_as_in_hf_to_params(findings):
    for checkpoint, (old, new) in findings["on_tensor_counts"].items():
        assert old == new > 0, checkpoint


def test_bad_checkpoints_fail_before_reading_with_hf_to_params_errors(findings):
    bad = findings["bad"]
    assert "model.layers.1.mlp.up_proj.weight" in bad["missing"][0]
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (16, 64), expected (32, 64)" in bad["wrong_shape"][0]
    assert "model.extra.weight" in bad["unexpected"][0]
    for key, (error, reads, old_error) in bad.items():
        assert error == old_error and reads == 0, key


def test_shardings_of_the_wrong_structure_are_an_input_error(tmp_path):
    """Checked before the directory is read (here it is empty)."""
    directory, config = str(tmp_path), ModelConfig.from_hf(dict(FAMILY_CONFIGS["llama3"]))
    replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: replicated, param_shapes(config), is_leaf=_is_shape)
    del shardings["layers"]["q"]
    with pytest.raises(InputError, match="layers/q/kernel"):
        read_params_sharded(directory, config, shardings, jnp.float32)
    shardings["layers"]["q"] = {"kernel": "model"}
    with pytest.raises(InputError, match="not a jax.sharding.Sharding"):
        read_params_sharded(directory, config, shardings, jnp.float32)
