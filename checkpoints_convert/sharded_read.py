"""A checkpoint read straight into sharded jax.Arrays, one shard's slice at a time.

    params = read_params_sharded(directory, config, shardings, jnp.bfloat16)

Nothing model-sized is ever built on the host: each device's shard of each leaf is assembled from
the layers / experts / rows of the safetensors tensors it covers (a column range is cut out of whole
rows read a bounded chunk at a time), put on its device, and dropped before the next one is read.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable

import jax
import numpy as np

from checkpoints_convert.hf_mapping import (
    _expected_hf_shape, _get, _set, check_all_used, check_tensor_shape, lead_shape, mapping_rows, require_tensor,
    row_tensor_names, stored_names,
)
from checkpoints_convert.orbax_io import checked_params_path, is_converted_dir
from checkpoints_convert.safetensors_io import hf_weight_files
from checkpoints_convert.safetensors_slices import SafetensorsFile
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import _flat, _is_shape, param_shapes, validate_params

Bounds = tuple[tuple[int, int], ...]  # one (start, stop) per axis


def read_params_sharded(directory: str, config: ModelConfig, shardings, dtype, on_tensor=None) -> dict:
    """Reads the params of a Hugging Face or `checkpoints_convert` directory as sharded jax.Arrays.

    config: the directory's ModelConfig (e.g. `ssd_jax.loading.read_config(directory)`).
    shardings: a pytree with exactly the structure of `param_shapes(config)` whose leaves are
        `jax.sharding.Sharding`s (typically NamedSharding over a mesh); leaf k of the result has
        shape param_shapes(config)[k] (the stacked layout: [N, ...] per layer, [N, E, ...] per expert)
        and sharding shardings[k].
    dtype: the dtype of every leaf (jnp.float32, jnp.bfloat16, ...); values are cast from the stored
        dtype exactly as `hf_to_params(..., dtype)` casts them, so the two agree bit for bit.
    on_tensor: optional callback run once per HF tensor consumed, after its leaves are on device (a
        progress bar); not called for a converted directory.

    Hugging Face directory: every tensor's name and shape is checked against the config from the
    safetensors headers before any data is read (CheckpointError naming a missing tensor, a wrong
    shape or unexpected tensors, as `hf_to_params`). Then, leaf by leaf and for each distinct shard
    index of the addressable devices, the shard is read into one host array: for each layer (and
    expert) in the shard's leading range, the shard's column range of the HF tensor (offset into the
    concatenation for fused rows such as qkv_proj and c_attn; rows of the [out, in] tensor for torch
    Linear weights, transposed on the way in) and its row range. That host array is copied to each
    device holding that index and freed once the copies are done. Each safetensors file is opened
    once per call and closed at the end.

    Converted directory: restored by orbax directly into `shardings` and `dtype`, after its shapes are
    checked (from the checkpoint's metadata) with `validate_params`.

    Peak host memory above what the arrays themselves occupy on the devices: one shard of one leaf
    (its stacked layers included) in `dtype`, plus one read buffer of at most
    safetensors_slices.CHUNK_BYTES; a replicated leaf is read once and copied to each device. On CPU
    devices the device buffers are themselves host memory.

    Raises CheckpointError for a bad checkpoint and InputError for shardings of the wrong structure.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"model directory {directory!r} does not exist")
    _check_shardings(config, shardings)
    if is_converted_dir(directory):
        return _restore_converted(directory, config, shardings, dtype)
    return _read_hf(directory, config, shardings, np.dtype(dtype), on_tensor)


def _check_shardings(config: ModelConfig, shardings) -> None:
    expected = {name for name, _ in _flat(param_shapes(config), is_leaf=_is_shape)}
    actual = dict(_flat(shardings))
    missing, unexpected = sorted(expected - set(actual)), sorted(set(actual) - expected)
    if missing or unexpected:
        raise InputError(f"shardings do not match param_shapes(config): missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    for name, sharding in actual.items():
        if not isinstance(sharding, jax.sharding.Sharding):
            raise InputError(f"shardings[{name!r}] is {type(sharding).__name__}, not a jax.sharding.Sharding")


class _OpenFiles:
    """Path -> SafetensorsFile, each opened on first use and all closed on exit."""

    def __init__(self):
        self._files: dict[str, SafetensorsFile] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for file in self._files.values():
            file.close()

    def get(self, path: str) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]


def _read_hf(directory: str, config: ModelConfig, shardings, dtype: np.dtype, on_tensor) -> dict:
    files = hf_weight_files(directory)
    names = stored_names(config, files)
    shapes = param_shapes(config)
    with _OpenFiles() as open_files:
        plans, used = [], set()
        for row in mapping_rows(config):
            expected = _expected_hf_shape(row, shapes)
            sources = {}
            for position, name in row_tensor_names(config, row).items():
                stored = require_tensor(name, names)
                file = open_files.get(files[stored])
                if stored not in file.tensors:
                    raise CheckpointError(f"tensor {stored!r} is listed for {file.path} but not in it")
                check_tensor_shape(name, file.tensors[stored].shape, expected)
                used.add(name)
                sources[position] = (file, stored)
            plans.append((row, sources))
        check_all_used(config, names, used)

        params: dict = {}
        for row, sources in plans:
            offset = 0
            for path in row.paths:
                shape = _get(shapes, path)
                read = _shard_reader(sources, len(lead_shape(config, row)), offset, row.kind == "linear", dtype)
                _set(params, path, _place(shape, _get(shardings, path), read))
                offset += shape[-1]
            if on_tensor is not None:
                for _ in sources:
                    on_tensor()
    return params


def _shard_reader(sources: dict, n_lead: int, offset: int, transpose: bool, dtype: np.dtype
                  ) -> Callable[[Bounds], np.ndarray]:
    """bounds (of our leaf) -> that shard as a host array in `dtype`.

    sources: our leading position ((), (i,) or (i, j)) -> (file, stored HF name). offset: where our
    leaf's last axis starts in the HF tensor's (concatenated) last axis, in our orientation."""

    def read(bounds: Bounds) -> np.ndarray:
        out = np.empty([stop - start for start, stop in bounds], dtype)
        lead, rest = bounds[:n_lead], bounds[n_lead:]
        (start, stop) = rest[-1]
        ours = rest[:-1] + ((start + offset, stop + offset),)
        index = ours[::-1] if transpose else ours
        for position in itertools.product(*(range(a, b) for a, b in lead)):
            file, name = sources[position]
            file.read_into(name, index, out[tuple(p - a for p, (a, _) in zip(position, lead))], transpose)
        return out

    return read


def _bounds(index: tuple, shape: tuple[int, ...]) -> Bounds:
    bounds = []
    for axis, size in enumerate(shape):
        start, stop, step = (index[axis] if axis < len(index) else slice(None)).indices(size)
        if step != 1:
            raise InputError(f"sharding index {index} for shape {shape} is strided; shards must be contiguous")
        bounds.append((start, stop))
    return tuple(bounds)


def _place(shape: tuple[int, ...], sharding: jax.sharding.Sharding, read: Callable[[Bounds], np.ndarray]
           ) -> jax.Array:
    """The global array of `shape` with `sharding`, each distinct shard read once by `read`.

    Not jax.make_array_from_callback: it runs the callback for every addressable device and keeps all
    the results on the host before the first transfer, i.e. a whole leaf (all N layers of a stacked one)."""
    devices_by_bounds: dict[Bounds, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        devices_by_bounds.setdefault(_bounds(index, shape), []).append(device)
    shards = []
    for bounds, devices in devices_by_bounds.items():
        host = read(bounds)
        placed = [jax.device_put(host, jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
                  for d in devices]
        jax.block_until_ready(placed)  # only then may `host` go: keeps one host shard alive at a time
        shards += placed
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _restore_converted(directory: str, config: ModelConfig, shardings, dtype) -> dict:
    import orbax.checkpoint as ocp

    path = checked_params_path(directory)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        metadata = checkpointer.metadata(path)
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
        stored = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
                              is_leaf=lambda m: hasattr(m, "shape"))
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"cannot read orbax checkpoint metadata {path}: {err}") from None
    validate_params(config, stored)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s, dtype=np.dtype(dtype)), shardings)
    try:
        params = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as err:
        raise CheckpointError(f"cannot restore orbax checkpoint {path}: {err}") from None
    validate_params(config, params)
    return params
