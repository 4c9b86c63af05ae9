"""Reading (single file or sharded with an index) and writing Hugging Face safetensors."""

from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ssd_jax.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class LazyTensors(Mapping[str, np.ndarray]):
    """Name -> numpy array over one or several safetensors files; arrays are read on access."""

    def __init__(self, files_by_name: dict[str, str]):
        self._files_by_name = files_by_name
        self._handles: dict[str, object] = {}

    def _handle(self, path: str):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="np")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"corrupt or unreadable safetensors file {path}: {err}") from None
        return self._handles[path]

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._files_by_name[name]
        try:
            return self._handle(path).get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {err}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files_by_name)

    def __len__(self) -> int:
        return len(self._files_by_name)


def _names_in(path: str) -> list[str]:
    try:
        with safe_open(path, framework="np") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"corrupt or unreadable safetensors file {path}: {err}") from None


def read_hf_tensors(directory: str) -> LazyTensors:
    """Opens the weights of a Hugging Face directory; raises CheckpointError if absent or corrupt."""
    return LazyTensors(hf_weight_files(directory))


def hf_weight_files(directory: str) -> dict[str, str]:
    """HF tensor name -> path of the safetensors file holding it (single file or sharded index).

    Every file is opened once to check its header; raises CheckpointError if absent or corrupt."""
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"malformed {index_path}: {err}") from None
        files_by_name = {}
        for name, shard in weight_map.items():
            shard_path = os.path.join(directory, shard)
            if not os.path.exists(shard_path):
                raise CheckpointError(f"shard {shard} listed in {INDEX_NAME} is missing from {directory}")
            files_by_name[name] = shard_path
        for shard_path in sorted(set(files_by_name.values())):
            _names_in(shard_path)  # fail early on a corrupt shard
        return files_by_name
    candidates = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not candidates:
        raise CheckpointError(
            f"no weights in {directory}: expected {SINGLE_NAME} or {INDEX_NAME} "
            f"(PyTorch .bin checkpoints are not supported; re-save with safe_serialization=True)"
        )
    files_by_name = {}
    for file in candidates:
        path = os.path.join(directory, file)
        for name in _names_in(path):
            files_by_name[name] = path
    return files_by_name


def write_hf_tensors(directory: str, tensors: dict[str, np.ndarray], max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes tensors as model.safetensors, or shards plus an index past max_shard_bytes.

    Returns the file names written (relative to directory)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, SINGLE_NAME), metadata=metadata)
        return [SINGLE_NAME]
    files, weight_map = [], {}
    for n, shard in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file), metadata=metadata)
        files.append(file)
        weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files + [INDEX_NAME]
