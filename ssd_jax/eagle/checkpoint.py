"""A head on disk: a directory with head_config.json (`HeadConfig`), head.safetensors (the params,
flat names such as "layers.q.kernel") and, after training, training_report.json. Written into a
temporary directory that replaces the destination only once complete, so a failed or
interrupted save never leaves a half-written head in place of a good one."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.eagle.head import EagleHead, HeadConfig, cast_floats, check_draft_vocab, check_head_params
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.model import dtype_from_name

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "head.safetensors"
REPORT_NAME = "training_report.json"


def _flat(params: dict, prefix: str = "") -> dict[str, jax.Array]:
    out = {}
    for name, value in params.items():
        key = f"{prefix}{name}"
        out.update(_flat(value, key + ".") if isinstance(value, dict) else {key: value})
    return out


def _nested(tensors: dict[str, np.ndarray]) -> dict:
    params: dict = {}
    for name, array in tensors.items():
        node = params
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = array
    return params


def save_head(head: EagleHead, directory: str, *, dtype: str | None = None, report: dict | None = None,
              overwrite: bool = False) -> str:
    """Writes head to directory (params cast to dtype: "float32", "bfloat16", "float16"; None
    keeps theirs). InputError where directory is a file, or holds files and overwrite is False.
    Returns the directory's absolute path."""
    from checkpoints_convert.convert import _atomic_directory
    from safetensors.numpy import save_file

    params = head.params if dtype is None else cast_floats(head.params, dtype_from_name(dtype))
    tensors = {name: np.asarray(leaf) for name, leaf in _flat(params).items()}
    with _atomic_directory(directory, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "ssd_jax.eagle"})
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            f.write(head.config.to_json())
        if report is not None:
            with open(os.path.join(tmp, REPORT_NAME), "w") as f:
                json.dump(report, f, indent=2)
    return os.path.abspath(directory)


def load_head(directory: str, target=None, dtype: str | None = None) -> EagleHead:
    """Reads a head directory; with target (a `Model`), checks that the head fits it
    (InputError naming the mismatch) and that every leaf has its shape. dtype: as `ssd_jax.load`
    (None: float32, or the target's dtype where one is given). CheckpointError where the
    directory, its config or its weights are missing or unreadable."""
    from checkpoints_convert.safetensors_slices import SafetensorsFile

    directory = os.fspath(directory)
    config_path, weights_path = os.path.join(directory, CONFIG_NAME), os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isdir(directory):
        raise CheckpointError(f"head directory {directory!r} does not exist")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise CheckpointError(f"{directory} is not a head directory: {os.path.basename(path)} is missing")
    try:
        with open(config_path) as f:
            config = HeadConfig.from_json(f.read())
    except (json.JSONDecodeError, TypeError, InputError) as err:
        raise CheckpointError(f"malformed {config_path}: {err}") from None
    file = SafetensorsFile(weights_path)
    try:
        tensors = {name: file.read(name) for name in file.tensors}
    except OSError as err:
        raise CheckpointError(f"cannot read {weights_path}: {err}") from None
    finally:
        file.close()
    if "draft_to_target" in tensors:
        try:
            check_draft_vocab(tensors["draft_to_target"], config.target_vocab_size)
        except InputError as err:
            raise CheckpointError(f"{weights_path}: {err}") from None
    cast = dtype_from_name(dtype) if dtype is not None else (target.dtype if target is not None else jnp.float32)
    params = cast_floats(jax.tree.map(jnp.asarray, _nested(tensors)), cast)
    head = EagleHead(config=config, params=params, path=os.path.abspath(directory))
    if target is not None:
        head.check_target(target)
        check_head_params(head, target.config)
    return head
