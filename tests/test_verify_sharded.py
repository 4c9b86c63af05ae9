"""The public verifiers inside sharded JAX programs (4 fake CPU devices, in a subprocess: see
tests/verify_sharded_checks.py): batch-sharded inputs under an Explicit `jax.make_mesh` mesh, and
calls inside `jax.shard_map` over the batch (Explicit and Auto meshes), each giving the
unsharded call's verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from subprocess_env import fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sharded_checks() -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "verify_sharded_checks.py")],
                          env=fake_devices_env(4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["explicit", "shard_map", "shard_map_auto"])
def test_verifiers_on_batch_sharded_inputs_give_the_unsharded_verdicts(sharded_checks, check):
    results = sharded_checks[check]
    assert len(results) == 10, results
    failed = {name: r for name, r in results.items() if r != "ok"}
    assert not failed, failed
