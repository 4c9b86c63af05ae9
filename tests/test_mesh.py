"""Models sharded over device meshes (8 fake CPU devices, in a subprocess: see tests/mesh_checks.py).

The default run covers one 2-D mesh with the issue's mesh methods, the other methods with the
embedded pair on 2x2, the collectives of the compiled decode, SSD on disjoint sub-meshes, Mixtral's
experts and the bad inputs (one subprocess), and two processes under jax.distributed; `-m slow`
adds the other mesh shapes, sampling, every method on 1x2 and 2x2, and the sharding block of
docs/sharding.md."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from subprocess_env import fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _checks(*args: str) -> dict:
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mesh_checks.py"), *args], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The 2x4 check covers AR, SD, GBV, LogitSpec and CSD; the embedded pair on 2x2 covers the other
# methods, so every method runs sharded in the default run (-m slow: every method on 1x2 and 2x2).
EMBEDDED_DEFAULT = ("bv", "specinfer", "spectr", "pld")


@pytest.fixture(scope="module")
def default_checks() -> dict:
    """The default run's checks in one subprocess (jax starts and the embedded pair loads once)."""
    return _checks("meshes", "2x4", "+", "embedded", "2x2", ",".join(EMBEDDED_DEFAULT), "+", "hlo", "+", "ssd",
                   "+", "bad", "+", "moe", "+", "model_only", "+", "stream", "+", "coupling", "+", "eagle")


def _assert_meshes(results: dict) -> None:
    for shape, result in results.items():
        assert all(result["same"].values()), (shape, result["same"])
        # every split weight holds 1/model of itself per device; norms are replicated (a few
        # percent here), and so are the K/V projections when the KV heads do not divide "model"
        model, total, kv = result["model"], result["total_bytes"], result["kv_bytes"]
        replicated = kv if result["kv_heads"] % model else 0
        assert result["max_device_bytes"] <= ((total - replicated) / model + replicated) * 1.15, (shape, result)
        assert result["devices"] == int(shape.split("x")[0]) * result["model"]


def test_eagle_on_a_2x2_mesh_gives_the_unsharded_tokens(default_checks):
    assert default_checks["eagle"] == {"eagle@0": True, "eagle@1": True}


def test_2x4_mesh_loaded_sharded_gives_the_unsharded_tokens(default_checks):
    _assert_meshes(default_checks["meshes"])


def test_streamed_calls_on_a_mesh_give_the_unstreamed_tokens(default_checks):
    """Streaming's pieces on a 2x2 mesh: AR at T=0 and SD at a fixed length at T=1 stream the
    unstreamed call's tokens, every one once."""
    for name, result in default_checks["stream"].items():
        assert result["same"] and result["sink"] and result["tokens"] > 0, (name, result)


@pytest.mark.slow
def test_every_mesh_shape_greedy_and_sampled():
    _assert_meshes(_checks("meshes", "1x2,2x2,1x4,2x4,1x8", "--sampled"))


def test_embedded_pair_on_2x2_the_other_methods_identical(default_checks):
    results = default_checks["embedded"]
    assert set(results["2x2"]) == set(EMBEDDED_DEFAULT)
    assert all(results["2x2"].values()), results


@pytest.mark.slow
def test_embedded_pair_on_1x2_and_2x2_every_method_identical():
    results = _checks("embedded", "1x2,2x2")
    for shape in ("1x2", "2x2"):
        assert set(results[shape]) == {"ar", "sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd"}
        assert all(results[shape].values()), results


def test_decode_in_jit_sharded_all_reduces_and_never_gathers_a_weight(default_checks):
    found = default_checks["hlo"]
    for name, result in found.items():
        assert result["all_reduces"] >= 2, (name, result)  # after attention and after the MLP, per layer
        assert result["weight_gathers"] == [], (name, result)
        assert result["decode_equals_generate"], name  # decode inside the user's jit, sharded


def test_ssd_with_target_and_draft_on_disjoint_sub_meshes(default_checks):
    result = default_checks["ssd"]
    assert result["equal_to_ar"]
    assert result["target_devices"] == [f"cpu:{i}" for i in range(4)]
    assert result["draft_devices"] == [f"cpu:{i}" for i in range(4, 8)]
    assert result["colocated"] is False and result["target_param_devices"] == [0, 1, 2, 3]
    assert 0.0 <= result["hit_rate"] <= 1.0


def test_bad_meshes_rules_and_placements(default_checks):
    found = default_checks["bad"]
    assert found["no_model_axis"].startswith("InputError") and "no 'model' axis" in found["no_model_axis"]
    assert "'tensor'" in found["unknown_rule_axis"] and found["unknown_rule_axis"].startswith("InputError")
    assert "unknown logical axis 'head'" in found["unknown_logical"]
    assert "heads = 6 is not divisible" in found["heads_not_divisible"] and "size 4" in found["heads_not_divisible"]
    assert found["kv_replicated"] == "P(None, None, None)"  # 4 KV heads on an 8-way model axis
    assert "jax.sharding.Mesh" in found["not_a_mesh"]
    assert found["auto_mesh_works"] == "P('model', None)"
    assert "cpu:2" in found["draft_elsewhere"] and found["draft_elsewhere"].startswith("InputError")
    assert "overlap" in found["ssd_overlap"] and "[1, 2]" in found["ssd_overlap"]


def test_gumbel_coupling_sharded_gives_the_unsharded_tokens(default_checks):
    """coupling="gumbel" on 2x2: AR and SD "auto" give the unsharded coupled AR tokens
    (the noise is keyed by row and position alone, `ssd_jax.coupling`)."""
    assert default_checks["coupling"] == {"ar": True, "sd": True}


def test_mesh_with_only_a_model_axis(default_checks):
    found = default_checks["model_only"]
    assert found["q_spec"] == "P(None, None, 'model')"  # stacked [layers, embed, heads]
    assert all(found["same"].values()), found


def test_mixtral_experts_shard_by_the_rules(default_checks):
    """Default rules split each expert's MLP over "model"; {"experts": "model", "mlp": None} puts
    one expert per device (expert parallelism). Both decode the unsharded tokens."""
    found = default_checks["moe"]
    assert found["default_rules"]["expert_spec"] == "P(None, None, None, 'model')"
    assert found["default_rules"]["expert_shard_shape"] == [2, 4, 64, 24]
    assert found["expert_parallel"]["expert_spec"] == "P(None, 'model', None, None)"
    assert found["expert_parallel"]["expert_shard_shape"] == [2, 1, 64, 96]
    for name in ("default_rules", "expert_parallel"):
        assert all(found[name]["same"].values()), (name, found[name])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_under_jax_distributed_print_the_single_process_tokens():
    script = os.path.join(HERE, "multiprocess_mesh.py")
    env = fake_devices_env(2)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, script, str(i), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    reference = subprocess.run([sys.executable, script, "reference"], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                               capture_output=True, text=True, timeout=900)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = json.loads(reference.stdout.strip().splitlines()[-1])["outputs"]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert (result["process"], result["processes"], result["local_devices"], result["global_devices"]) == (i, 2, 2, 4)
        assert result["outputs"] == dict(expected, sd=expected["ar"])   # greedy SD's tokens are AR's
        assert result["other_process_mesh"].startswith("InputError") and f"process {i}" in result["other_process_mesh"]


@pytest.mark.slow   # ~45 s; the same sharding runs in the default checks above
def test_docs_sharding_block_runs_on_eight_devices(tmp_path):
    doc = open(os.path.join(os.path.dirname(HERE), "docs", "sharding.md")).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "ssd_jax.shard(" in b]
    assert len(blocks) == 1
    script = tmp_path / "docs_sharding.py"
    script.write_text(blocks[0] + "\nassert out.stats['colocated'] is False and len(out.tokens) == 3\n")
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu:4" in proc.stdout
