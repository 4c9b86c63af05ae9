"""Slices of safetensors tensors read with positioned reads (os.preadv) into bounded buffers.

Why not `safe_open(...).get_slice(name)[...]`: safetensors copies a slice out of a memory map of the
whole file, and every page the copy touches stays resident in this process until the file is closed.
A column slice of a row-major tensor touches nearly all of its pages, so reading a model shard by
shard with one open handle per file would leave the whole checkpoint in the process's RSS. Here the
bytes go from the page cache into a buffer of at most CHUNK_BYTES (or straight into the output).

File format (huggingface/safetensors): an 8-byte little-endian header length n, n bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data;
offsets count from the end of the header; arrays are C-ordered and little-endian.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Sequence

import ml_dtypes
import numpy as np

from ssd_jax.errors import CheckpointError

CHUNK_BYTES = 16 << 20

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


class TensorInfo(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


class SafetensorsFile:
    """One open safetensors file: `tensors` (name -> TensorInfo, from the header) and `read_into`."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise CheckpointError(f"cannot open safetensors file {path}: {err}") from None
        try:
            self.tensors = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(f"corrupt or unreadable safetensors file {self.path}: {what}")

    def _parse_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._corrupt("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise self._corrupt(f"header length {n} exceeds the file size {size}")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise self._corrupt(f"header is not JSON ({err})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"malformed header entry for {name!r}") from None
            if dtype not in _DTYPES:
                raise CheckpointError(f"tensor {name!r} in {self.path} has unsupported dtype {dtype}")
            np_dtype = np.dtype(_DTYPES[dtype])
            if end - begin != math.prod(shape) * np_dtype.itemsize or begin < 0 or 8 + n + end > size:
                raise self._corrupt(f"tensor {name!r} ({dtype} {list(shape)}) has data offsets [{begin}, {end}]")
            tensors[name] = TensorInfo(np_dtype, shape, 8 + n + begin)
        return tensors

    def _pread_into(self, buffer: np.ndarray, offset: int) -> None:
        """Fills the C-contiguous `buffer` with the file's bytes from `offset`."""
        view = memoryview(buffer.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count == 0:
                raise self._corrupt(f"truncated at byte {offset + done}")
            done += count

    def read(self, name: str) -> np.ndarray:
        """The whole tensor, in its stored dtype (bfloat16 and float8 as ml_dtypes' types)."""
        info = self.tensors[name]
        out = np.empty(info.shape, info.dtype)
        self._pread_into(out, info.offset)
        return out

    def read_into(self, name: str, index: Sequence[tuple[int, int]], out: np.ndarray, transpose: bool = False) -> None:
        """Copies tensor[index] into `out` (its transpose, all axes reversed, when `transpose`), casting
        to out.dtype.

        index: one (start, stop) per axis of the tensor. out: the slice's shape, reversed if transpose.
        Reads whole rows (axis 0) of the slice's row range, at most CHUNK_BYTES per read, unless the
        slice is a run of whole rows already in out's dtype and layout: then straight into `out`.
        """
        info = self.tensors[name]
        assert len(index) == len(info.shape) >= 1, (name, index, info.shape)
        (row0, row1), rest = index[0], tuple(index[1:])
        row_shape = info.shape[1:]
        whole_rows = all(a == 0 and b == n for (a, b), n in zip(rest, row_shape))
        row_bytes = math.prod(row_shape) * info.dtype.itemsize
        if whole_rows and not transpose and out.dtype == info.dtype and out.flags.c_contiguous:
            self._pread_into(out, info.offset + row0 * row_bytes)
            return
        columns = (slice(None),) + tuple(slice(a, b) for a, b in rest)
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for start in range(row0, row1, step):
            stop = min(row1, start + step)
            chunk = np.empty((stop - start,) + row_shape, info.dtype)
            self._pread_into(chunk, info.offset + start * row_bytes)
            part = chunk if whole_rows else chunk[columns]
            if transpose:
                out[..., start - row0:stop - row0] = part.T
            else:
                out[start - row0:stop - row0] = part
