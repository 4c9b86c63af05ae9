"""One process of a two-process run under `jax.distributed` (127.0.0.1, gloo CPU collectives),
each with 2 fake CPU devices, sharing a 1x4 (data, model) mesh; run by tests/test_mesh.py.

  python tests/multiprocess_mesh.py PROCESS_ID PORT
  python tests/multiprocess_mesh.py reference        # the same runs, one process, unsharded
                                                     # (but greedy SD, whose tokens are AR's)

Builds the random Llama of tests/mesh_checks.py (and its noisy copy as the draft) in every
process, shards both over the global mesh, runs AR and SD ("auto") greedily and SD (L=4) at T=1,
and prints one JSON line with this process's view of the outputs (which must be the whole batch)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402


def main(process_id: int | None, port: int | None) -> dict:
    if process_id is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                                   initialization_timeout=300)
    import ssd_jax
    from mesh_checks import random_llama
    from spec_models import noisy_copy

    target = random_llama(0)
    draft = noisy_copy(target, 0.05, 7)
    ts, ds = target, draft
    if process_id is not None:
        mesh = jax.make_mesh((1, 4), ("data", "model"))
        ts, ds = ssd_jax.shard(target, mesh), ssd_jax.shard(draft, mesh)
    prompts = [[5, 9, 17, 3, 44, 2], [7, 7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
    outputs = {}
    # SD's adaptive loop (its default) greedily; at T=1 a fixed length: sampling across processes
    # needs no second adaptive program, whose per-cap steps three processes would each compile.
    # The reference leaves greedy SD out: its tokens are AR's, which the test compares them with.
    runs = [("ar", ssd_jax.AR(), 0.0), ("sd", ssd_jax.SD(), 0.0), ("sd_t1", ssd_jax.SD(draft_len=4), 1.0)]
    if process_id is None:
        runs = [run for run in runs if run[0] != "sd"]
    for name, method, temperature in runs:
        out = ssd_jax.generate(ts, prompts, method=method, draft=None if isinstance(method, ssd_jax.AR) else ds,
                               max_new_tokens=16, temperature=temperature, key=jax.random.PRNGKey(3))
        outputs[name] = out.tokens
    others = None
    if process_id is not None:  # a mesh of the other process's devices only
        import numpy as np
        from jax.sharding import Mesh

        theirs = [d for d in jax.devices() if d.process_index != jax.process_index()]
        try:
            ssd_jax.shard(target, Mesh(np.array(theirs).reshape(1, len(theirs)), ("data", "model")))
            others = "no error"
        except ssd_jax.InputError as err:
            others = "InputError: " + str(err)
    return dict(process=jax.process_index(), processes=jax.process_count(), local_devices=len(jax.local_devices()),
                global_devices=len(jax.devices()), outputs=outputs, other_process_mesh=others)


if __name__ == "__main__":
    distributed = sys.argv[1] != "reference"
    result = main(int(sys.argv[1]), int(sys.argv[2])) if distributed else main(None, None)
    print(json.dumps(result), flush=True)
    if distributed:
        jax.distributed.shutdown()
