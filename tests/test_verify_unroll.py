"""The multi-path and tree verifiers' loops: XLA loops in CPU programs, straight-line code in GPU
and TPU programs (`ssd_jax.verify._unroll`), with the same verdicts either way."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.verify._common import row_keys
from ssd_jax.verify._tree_walk import walk

specinfer_mod = importlib.import_module("ssd_jax.verify.specinfer")
spectr_mod = importlib.import_module("ssd_jax.verify.spectr")
gbv_mod = importlib.import_module("ssd_jax.verify.gbv")
point_tree_mod = importlib.import_module("ssd_jax.verify.point_tree")

B, K, L, V = 3, 3, 4, 40
PARENTS = np.array([-1, 0, 0, 1, 2, 3, 4])   # two branches of depth 3 under the root


def _multi_inputs(seed: int):
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(V, 0.3), size=(B, K, L)).astype(np.float32)
    p = rng.dirichlet(np.full(V, 0.3), size=(B, K, L + 1)).astype(np.float32)
    # paths sampled from q, sharing prefixes often (small vocabulary mass concentrated): the walk
    # then meets nodes with several alive candidates
    paths = np.array([[[rng.choice(V, p=q[b, k, i]) for i in range(L)] for k in range(K)] for b in range(B)])
    paths[:, 1, :2] = paths[:, 0, :2]
    return jnp.asarray(paths, jnp.int32), jnp.asarray(q), jnp.asarray(p)


def _gbv_rows(key, paths, q, p, *, unrolled):
    rows = jax.vmap(functools.partial(gbv_mod._gbv_row, unrolled=unrolled))
    return rows(row_keys(key, paths.shape[0]), paths, q, p)


VERIFIERS = {
    "specinfer": (specinfer_mod._specinfer_core, functools.partial(walk, specinfer_mod.specinfer_node)),
    "spectr": (spectr_mod._spectr_core, functools.partial(walk, spectr_mod.spectr_node)),
    "gbv": (gbv_mod._gbv_core, _gbv_rows),
}


def _loops(fn, platform: str, *args) -> int:
    """The `while` loops of fn's program exported for platform."""
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module().count("stablehlo.while")


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_loops_only_in_cpu_programs(name):
    """The GPU and TPU programs hold no `while` (XLA:GPU reads each turn's predicate back to the
    host); the CPU program keeps its loops. Exported per platform, so no accelerator is needed.
    A CPU program holds loops of its own besides (XLA:CPU's threefry is one), so the CPU program
    is compared with the same verifier's loops and with it written out."""
    core, rows = VERIFIERS[name]
    paths, q, p = _multi_inputs(0)
    args = (jax.random.key(0), paths, q, p)
    assert _loops(core, "cpu", *args) == _loops(functools.partial(rows, unrolled=False), "cpu", *args)
    assert _loops(core, "cpu", *args) > _loops(functools.partial(rows, unrolled=True), "cpu", *args)
    assert _loops(core, "cuda", *args) == 0
    assert _loops(core, "tpu", *args) == 0


def test_point_tree_loops_only_in_cpu_programs():
    tokens = jnp.zeros((2, PARENTS.size), jnp.int32)
    valid = jnp.ones((2, PARENTS.size), bool)
    p = jnp.full((2, PARENTS.size, V), 1.0 / V)
    args = (jax.random.key(0), tokens, valid, p)
    verify_tree = lambda key, t, v, pp: point_tree_mod.point_mass_tree(key, t, v, PARENTS, pp, greedy=False)

    def walk_rows(key, t, v, pp, *, unrolled):
        row = functools.partial(point_tree_mod._walk_row, max_depth=3, greedy=False, unrolled=unrolled)
        return jax.vmap(row, in_axes=(0, 0, 0, 0, None))(row_keys(key, t.shape[0]), t, v, pp, jnp.asarray(PARENTS))

    assert _loops(verify_tree, "cpu", *args) > _loops(functools.partial(walk_rows, unrolled=True), "cpu", *args)
    assert _loops(verify_tree, "cpu", *args) == _loops(functools.partial(walk_rows, unrolled=False), "cpu", *args)
    assert _loops(verify_tree, "cuda", *args) == 0
    assert _loops(verify_tree, "tpu", *args) == 0


@pytest.mark.parametrize("n_paths, n_draft", [(1, 3), (3, 1), (1, 1)])
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_one_step_loops_are_unrolled_too(name, n_paths, n_draft):
    """One path (SpecInfer's candidates) or one depth (the walk, GBV's selection): `lax.scan` with
    `unroll=True` over one step lowers to a `while` of one turn, which the GPU and TPU programs
    must not hold either."""
    core, _ = VERIFIERS[name]
    paths = jnp.zeros((2, n_paths, n_draft), jnp.int32)
    q = jnp.full((2, n_paths, n_draft, V), 1.0 / V)
    p = jnp.full((2, n_paths, n_draft + 1, V), 1.0 / V)
    for platform in ("cuda", "tpu"):
        text = jax.export.export(core, platforms=[platform])(jax.random.key(0), paths, q, p).mlir_module()
        assert "stablehlo.while" not in text, platform


def test_point_tree_of_a_root_alone_has_no_loop_off_cpu():
    """A tree of the root alone: the walk's one step written out too (no one-turn `while`)."""
    verify_tree = jax.jit(lambda key, t, v, pp: point_tree_mod.point_mass_tree(key, t, v, np.array([-1]), pp, greedy=False))
    args = (jax.random.key(0), jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool), jnp.full((2, 1, V), 1.0 / V))
    for platform in ("cuda", "tpu"):
        assert "stablehlo.while" not in jax.export.export(verify_tree, platforms=[platform])(*args).mlir_module(), platform


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_unrolled_verdicts_equal_the_loops(name, seed):
    """Same key, same inputs: the unrolled form returns the loop's verdict row for row. (SpecTr's
    rho* may differ in its last float bits between the two searches; a verdict could flip only
    for a uniform within those bits of its threshold, which these seeds do not draw.)"""
    _, rows = VERIFIERS[name]
    paths, q, p = _multi_inputs(seed)
    key = jax.random.key(seed)
    rolled = jax.jit(functools.partial(rows, unrolled=False))(key, paths, q, p)
    unrolled = jax.jit(functools.partial(rows, unrolled=True))(key, paths, q, p)
    for a, b in zip(rolled, unrolled):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the inputs reach nodes with several alive candidates, so the node rules' own loops ran
    assert int(np.max(np.asarray(rolled[0]))) >= 1


@pytest.mark.parametrize("greedy", [False, True])
def test_point_tree_unrolled_verdicts_equal_the_loop(greedy):
    rng = np.random.default_rng(5)
    b, n = 4, PARENTS.size
    tokens = jnp.asarray(rng.integers(0, 3, size=(b, n)), jnp.int32)   # 3 tokens: children often match
    valid = jnp.asarray(rng.random((b, n)) < 0.9)
    p = jnp.asarray(rng.dirichlet(np.full(3, 1.0), size=(b, n)), jnp.float32)
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (b, n))
    keys = row_keys(jax.random.key(7), b)
    out = {}
    for unrolled in (False, True):
        row = functools.partial(point_tree_mod._walk_row, max_depth=3, greedy=greedy, unrolled=unrolled)
        out[unrolled] = jax.jit(jax.vmap(row))(keys, tokens, valid, p, parents)
    for a, c in zip(out[False], out[True]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert int(np.max(np.asarray(out[False][0]))) >= 1
