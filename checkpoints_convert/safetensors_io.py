"""Reading (single file or sharded with an index) and writing Hugging Face safetensors."""

from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import numpy as np
from safetensors.numpy import save_file

from checkpoints_convert.safetensors_slices import SafetensorsFile
from ssd_jax.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class LazyTensors(Mapping[str, np.ndarray]):
    """Name -> numpy array over one or several safetensors files; arrays are read on access, in
    their stored dtype (bfloat16 and float8 as ml_dtypes' types), by our own reader
    (`SafetensorsFile`, as the sharded reader): safetensors' numpy reader (0.4.5 at least) finds
    bfloat16 by numpy's dtype name, which exists only once something imported ml_dtypes (without
    it: "TypeError: data type 'bfloat16' not understood")."""

    def __init__(self, files_by_name: dict[str, str]):
        self._files_by_name = files_by_name
        self._files: dict[str, SafetensorsFile] = {}

    def _file(self, path: str) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._files_by_name[name]
        try:
            return self._file(path).read(name)
        except OSError as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {err}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (no data read)."""
        return self._file(self._files_by_name[name]).tensors[name].shape

    def __iter__(self) -> Iterator[str]:
        return iter(self._files_by_name)

    def __len__(self) -> int:
        return len(self._files_by_name)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __del__(self):
        self.close()


def _names_in(path: str) -> list[str]:
    """The tensor names in one file's header (CheckpointError if it is corrupt or unreadable)."""
    file = SafetensorsFile(path)
    try:
        return list(file.tensors)
    finally:
        file.close()


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
