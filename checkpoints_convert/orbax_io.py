"""Our on-disk format: config.json (Hugging Face) + ssd_jax.json (marker) + params/ (orbax)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from ssd_jax.errors import CheckpointError

MARKER_NAME = "ssd_jax.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_converted_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, MARKER_NAME))


def save_params(directory: str, params: dict, dtype_name: str) -> None:
    """Writes params with orbax under directory/params and the marker file."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, PARAMS_DIR)), jax.tree.map(np.asarray, params))
    with open(os.path.join(directory, MARKER_NAME), "w") as f:
        json.dump({"format": "ssd_jax", "version": FORMAT_VERSION, "dtype": dtype_name}, f, indent=2)


def checked_params_path(directory: str) -> str:
    """Absolute path of directory/params after checking the marker's format version; CheckpointError if not."""
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    if not os.path.isdir(path):
        raise CheckpointError(f"missing weights: {path} does not exist")
    try:
        with open(os.path.join(directory, MARKER_NAME)) as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"unreadable {MARKER_NAME} in {directory}: {err}") from None
    if marker.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"unsupported ssd_jax checkpoint version {marker.get('version')!r} in {directory}")
    return path


def restore_params(directory: str) -> dict:
    """Reads params saved by `save_params` as numpy arrays; CheckpointError if absent or unreadable."""
    import orbax.checkpoint as ocp

    path = checked_params_path(directory)
    try:
        restored = ocp.PyTreeCheckpointer().restore(path)
    except Exception as err:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"cannot restore orbax checkpoint {path}: {err}") from None
    return jax.tree.map(np.asarray, restored)
