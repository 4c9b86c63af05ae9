"""Checks of `read_params_sharded`, run by tests/test_sharded_read.py in a subprocess whose XLA_FLAGS
fake 8 CPU devices (the rest of the suite runs with one). Prints one JSON line with the findings.

    python tests/sharded_read_script.py WORKDIR

For each checkpoint (tiny random HF models of several families, a sharded HF checkpoint, GPT-2 with
old-style names, a converted directory), mesh (data, model) in {1x8, 2x4} and sharding mode, every
leaf is compared with `hf_to_params` on every addressable shard and its sharding with the request.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's ssd_jax / checkpoints_convert first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from checkpoints_convert import hf_to_ssd  # noqa: E402
from checkpoints_convert.hf_mapping import hf_to_params  # noqa: E402
from checkpoints_convert.safetensors_io import read_hf_tensors  # noqa: E402
from checkpoints_convert import safetensors_slices  # noqa: E402
from checkpoints_convert.safetensors_slices import SafetensorsFile  # noqa: E402
from checkpoints_convert.sharded_read import read_params_sharded  # noqa: E402
from hf_models import make_hf_model  # noqa: E402
from ssd_jax.errors import CheckpointError  # noqa: E402
from ssd_jax.loading import read_config  # noqa: E402
from ssd_jax.models.params import _flat, _is_shape, param_shapes  # noqa: E402

FAMILIES = ("llama3", "gpt2", "phi3", "mixtral", "gemma")
MESHES = ((1, 8), (2, 4))
MODES = ("last", "lead", "lead+last", "replicated")


def _spec(name: str, shape: tuple[int, ...], mode: str, mesh: Mesh) -> PartitionSpec:
    """Layer axis on "data", expert axis / unstacked leaves' first axis on "model" ("lead"), last axis
    on "model" ("last"); an axis stays whole where the mesh axis does not divide it."""
    axes: list = [None] * len(shape)

    def put(axis: int, mesh_axis: str) -> None:
        if mesh_axis not in axes and shape[axis] % mesh.shape[mesh_axis] == 0:
            axes[axis] = mesh_axis

    parts = name.split("/")
    if mode in ("lead", "lead+last"):
        if parts[0] == "layers":
            put(0, "data")
            if parts[1] == "experts":
                put(1, "model")
        else:
            put(0, "model")
    if mode in ("last", "lead+last"):
        put(len(shape) - 1, "model")
    return PartitionSpec(*axes)


def _shardings(config, mode: str, mesh: Mesh):
    shapes = param_shapes(config)
    names = iter(name for name, _ in _flat(shapes, is_leaf=_is_shape))
    return jax.tree.map(lambda shape: NamedSharding(mesh, _spec(next(names), shape, mode, mesh)), shapes,
                        is_leaf=_is_shape)


def _compare(params, reference, shardings, dtype) -> dict:
    """Leaf names whose values (gathered and on each device) or sharding or dtype differ."""
    bad_values, bad_sharding, split = [], [], 0
    flat_ref = dict(_flat(reference))
    flat_sharding = dict(_flat(shardings))
    flat = dict(_flat(params))
    assert set(flat) == set(flat_ref), (sorted(flat), sorted(flat_ref))
    for name, leaf in flat.items():
        ref = flat_ref[name]
        ok = leaf.dtype == dtype and np.array_equal(np.asarray(leaf), ref)
        ok = ok and all(np.array_equal(np.asarray(s.data), ref[s.index]) for s in leaf.addressable_shards)
        ok = ok and len(leaf.addressable_shards) == len(jax.devices())
        if not ok:
            bad_values.append(name)
        if leaf.sharding != flat_sharding[name]:
            bad_sharding.append(name)
        split += not leaf.sharding.is_fully_replicated
    return dict(bad_values=bad_values, bad_sharding=bad_sharding, split=split, leaves=len(flat))


def _error(fn) -> str | None:
    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return None


def _variant(source: str, target: str, edit) -> str:
    """A copy of HF directory `source` whose tensors are edit(dict of arrays)."""
    os.makedirs(target)
    shutil.copy(os.path.join(source, "config.json"), target)
    tensors = {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(source, file)))
    save_file(edit(tensors), os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return target


def _old_gpt2_names(tensors: dict) -> dict:
    """GPT-2 as older checkpoints store it: no 'transformer.' prefix, attention-mask buffers, lm_head."""
    out = {name.removeprefix("transformer."): array for name, array in tensors.items()}
    out["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
    out["lm_head.weight"] = out["wte.weight"].copy()
    return out


def _bad_inputs(work: str, llama: str) -> dict:
    """Each bad checkpoint -> (error of read_params_sharded, error of hf_to_params)."""
    missing = _variant(llama, os.path.join(work, "missing"),
                       lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    wrong = _variant(llama, os.path.join(work, "wrong"), lambda t: {
        **t, "model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)})
    extra = _variant(llama, os.path.join(work, "extra"), lambda t: {**t, "model.extra.weight": np.zeros(3, np.float32)})
    config = read_config(llama)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shardings = _shardings(config, "lead+last", mesh)
    out = {}
    reads = [0]
    read_into = SafetensorsFile.read_into

    def counting(self, *args, **kwargs):
        reads[0] += 1
        return read_into(self, *args, **kwargs)

    SafetensorsFile.read_into = counting
    try:
        for key, directory in (("missing", missing), ("wrong_shape", wrong), ("unexpected", extra)):
            reads[0] = 0
            out[key] = [_error(lambda: read_params_sharded(directory, config, shardings, jnp.float32)), reads[0],
                        _error(lambda: hf_to_params(config, read_hf_tensors(directory), np.float32))]
    finally:
        SafetensorsFile.read_into = read_into
    return out


def _stored_bfloat16(work: str, model) -> dict:
    """A checkpoint stored in bfloat16 (older safetensors' numpy reader rejected it; the unsharded
    path is tested in tests/test_convert.py), read as float32 and as bfloat16; reference:
    hf_to_params over the torch tensors widened to float32."""
    import torch

    directory = os.path.join(work, "llama3_stored_bf16")
    model.to(torch.bfloat16).save_pretrained(directory)
    tensors = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    config = read_config(directory)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shardings = _shardings(config, "lead+last", mesh)
    out = {}
    for dtype in (np.float32, jnp.bfloat16):
        params = read_params_sharded(directory, config, shardings, dtype)
        out[np.dtype(dtype).name] = _compare(params, hf_to_params(config, tensors, dtype), shardings, dtype)
    return out


def main(work: str) -> dict:
    started = time.perf_counter()
    directories = {family: os.path.join(work, family) for family in FAMILIES}
    for family in FAMILIES:
        model = make_hf_model(family, directories[family])
        if family == "llama3":  # the same model as several safetensors files + an index
            llama_model = model
            directories["llama3_sharded"] = os.path.join(work, "llama3_sharded")
            model.save_pretrained(directories["llama3_sharded"], max_shard_size="40KB")
    directories["gpt2_old_names"] = _variant(directories["gpt2"], os.path.join(work, "gpt2_old"), _old_gpt2_names)
    made = time.perf_counter()

    cases, counts = {}, {}
    for key, directory in directories.items():
        config = read_config(directory)
        calls = [0, 0]
        reference = hf_to_params(config, read_hf_tensors(directory), np.float32,
                                 on_tensor=lambda: calls.__setitem__(0, calls[0] + 1))
        for rows, cols in MESHES:
            mesh = Mesh(np.array(jax.devices()).reshape(rows, cols), ("data", "model"))
            for mode in MODES:
                shardings = _shardings(config, mode, mesh)
                counter = (lambda: calls.__setitem__(1, calls[1] + 1)) if (rows, mode) == (1, "last") else None
                params = read_params_sharded(directory, config, shardings, jnp.float32, on_tensor=counter)
                cases[f"{key}/{rows}x{cols}/{mode}"] = _compare(params, reference, shardings, np.float32)
        counts[key] = calls
        # Reads of a few rows at a time (the chunked path that large tensors take).
        shardings = _shardings(config, "lead+last", Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model")))
        safetensors_slices.CHUNK_BYTES, chunk_bytes = 100, safetensors_slices.CHUNK_BYTES
        try:
            params = read_params_sharded(directory, config, shardings, jnp.float32)
        finally:
            safetensors_slices.CHUNK_BYTES = chunk_bytes
        cases[f"{key}/2x4/lead+last/100-byte reads"] = _compare(params, reference, shardings, np.float32)

    # bfloat16: the same rounding as hf_to_params' cast; a converted directory restored by orbax.
    llama = directories["llama3"]
    config = read_config(llama)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    bf16_reference = hf_to_params(config, read_hf_tensors(llama), jnp.bfloat16)
    for mode in ("lead+last", "replicated"):
        shardings = _shardings(config, mode, mesh)
        params = read_params_sharded(llama, config, shardings, jnp.bfloat16)
        cases[f"llama3_bf16/2x4/{mode}"] = _compare(params, bf16_reference, shardings, jnp.bfloat16)
    converted = hf_to_ssd(llama, os.path.join(work, "llama3_converted"), progress=False)
    reference = hf_to_params(config, read_hf_tensors(llama), np.float32)
    for rows, cols in MESHES:
        mesh = Mesh(np.array(jax.devices()).reshape(rows, cols), ("data", "model"))
        for mode in MODES:
            shardings = _shardings(config, mode, mesh)
            params = read_params_sharded(converted, config, shardings, jnp.float32)
            cases[f"converted/{rows}x{cols}/{mode}"] = _compare(params, reference, shardings, np.float32)
    params = read_params_sharded(converted, config, shardings, jnp.bfloat16)
    cases["converted_bf16/2x4/replicated"] = _compare(params, bf16_reference, shardings, jnp.bfloat16)
    wrong_config = read_config(directories["phi3"])
    converted_error = _error(lambda: read_params_sharded(
        converted, wrong_config, _shardings(wrong_config, "replicated", mesh), jnp.float32))

    cases.update({f"llama3_stored_bf16/2x4/lead+last/{k}": v for k, v in _stored_bfloat16(work, llama_model).items()})
    return dict(devices=len(jax.devices()), cases=cases, on_tensor_counts=counts, bad=_bad_inputs(work, llama),
                converted_wrong_config=converted_error, make_s=made - started, check_s=time.perf_counter() - made)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
