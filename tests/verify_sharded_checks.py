"""Every public verifier on batch-sharded inputs, run by tests/test_verify_sharded.py in a
subprocess with 4 fake CPU devices (XLA reads the device count when jax starts).

  python tests/verify_sharded_checks.py    # prints one JSON line: {check: {verifier: "ok" | error}}

Checks, each against the unsharded call on one device:
- explicit: inputs sharded over the batch (NamedSharding(mesh, P("data"))) under
  `jax.make_mesh`'s default Explicit axes, the verifier called as it is under `jax.set_mesh`:
  the same verdicts as the unsharded call with the same key;
- shard_map / shard_map_auto: the verifier called per shard inside `jax.shard_map` over the
  batch (check_vma on), on an Explicit and on an Auto mesh: each shard's verdicts equal the
  unsharded call on that shard's rows with the same key (the key is replicated, so every shard
  splits it over its own rows).
The CPU program runs the verifiers' rolled loops; `jax.lax.platform_dependent` traces the
unrolled (GPU/TPU) branch too, so its types are checked as well.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ssd_jax.verify as V  # noqa: E402
from ssd_jax.verify.point_tree import point_mass_chain, point_mass_tree  # noqa: E402

DEVICES = 4
B, K, L, VOCAB = 8, 3, 3, 7        # two rows per device
PARENTS = np.array([-1, 0, 0, 1, 2, 3])


def _probs(rng, shape):
    x = rng.random(shape).astype(np.float32) ** 3
    x[..., 0] = 0   # a token with no mass: the residuals' edge cases
    return x / x.sum(-1, keepdims=True)


def _cases():
    rng = np.random.default_rng(0)
    paths = rng.integers(0, VOCAB, (B, K, L)).astype(np.int32)
    paths[:, 1, 0] = paths[:, 0, 0]   # shared first tokens: the walk descends with two alive paths
    q, p = _probs(rng, (B, K, L, VOCAB)), _probs(rng, (B, K, L + 1, VOCAB))
    q[:, 1, 0], p[:, 1, 0] = q[:, 0, 0], p[:, 0, 0]
    single = (paths[:, 0], q[:, 0], p[:, 0])
    n_nodes = len(PARENTS)
    tree = (rng.integers(0, VOCAB, (B, n_nodes)).astype(np.int32), rng.random((B, n_nodes)) < 0.8,
            _probs(rng, (B, n_nodes, VOCAB)))
    cases = {name: (fn, single) for name, fn in V.SINGLE_PATH.items()}
    cases.update({name: (fn, (paths, q, p)) for name, fn in V.MULTI_PATH.items()})
    cases["point_mass_tree"] = (lambda k, t, v, pp: point_mass_tree(k, t, v, PARENTS, pp, greedy=False), tree)
    cases["point_mass_tree_greedy"] = (lambda k, t, v, pp: point_mass_tree(k, t, v, PARENTS, pp, greedy=True),
                                       tree)
    cases["point_mass_chain"] = (lambda k, t, v, pp: point_mass_chain(k, t, v, pp, greedy=False), tree)
    return cases


def _same(got, want) -> bool:
    return all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def _run(check, fn) -> str:
    try:
        return "ok" if check(fn) else "different verdicts"
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def main() -> None:
    assert jax.device_count() == DEVICES, jax.devices()
    key = jax.random.key(0)
    results = {"explicit": {}, "shard_map": {}, "shard_map_auto": {}}
    meshes = {"explicit": jax.make_mesh((DEVICES,), ("data",)),
              "auto": jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))}
    assert meshes["explicit"].axis_types == (AxisType.Explicit,)
    per_shard = B // DEVICES
    for name, (fn, args) in _cases().items():
        want = tuple(fn(key, *args))
        want_shards = [tuple(fn(key, *(a[i * per_shard:(i + 1) * per_shard] for a in args)))
                       for i in range(DEVICES)]

        def explicit(fn, args=args, want=want):
            mesh = meshes["explicit"]
            with jax.set_mesh(mesh):
                got = tuple(fn(key, *(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args)))
            return _same(got, want)

        def in_shard_map(mesh_name):
            def check(fn, args=args, want_shards=want_shards):
                mesh = meshes[mesh_name]
                body = jax.shard_map(lambda k, *xs: tuple(fn(k, *xs)), mesh=mesh,
                                     in_specs=(P(),) + (P("data"),) * len(args), out_specs=P("data"))
                with jax.set_mesh(mesh):
                    got = jax.jit(body)(key, *(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args))
                got = [np.asarray(g) for g in got]
                return all(_same([g[i * per_shard:(i + 1) * per_shard] for g in got], want_shards[i])
                           for i in range(DEVICES))
            return check

        results["explicit"][name] = _run(explicit, fn)
        results["shard_map"][name] = _run(in_shard_map("explicit"), fn)
        results["shard_map_auto"][name] = _run(in_shard_map("auto"), fn)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
