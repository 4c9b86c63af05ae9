"""`load`: a Hugging Face directory or a `checkpoints_convert` directory -> `Model`."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from ssd_jax.backend import devices_platform, policy_for
from ssd_jax.errors import CheckpointError, ConfigError
from ssd_jax.model import Model, dtype_from_name
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import param_shapes, validate_params
from ssd_jax.sharding.placement import Placement


def read_config_json(directory: str, error: type[Exception] = ConfigError) -> dict:
    """directory's config.json as a dict; `error` naming the file where it is missing, unreadable
    or not a JSON object."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise error(f"missing config.json in {directory}")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"unreadable config.json in {directory}: {err}") from None
    if not isinstance(hf, dict):
        raise error(f"config.json in {directory} is not a JSON object")
    return hf


def read_config(directory: str) -> ModelConfig:
    return ModelConfig.from_hf(read_config_json(directory))


def read_tokenizer(directory: str):
    """A `tokenizers.Tokenizer` from tokenizer.json, or None when the file is absent."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception
        raise CheckpointError(f"unreadable tokenizer.json in {directory}: {err}") from None


def load(path: str, dtype: str | None = None, *, mesh=None, rules=None) -> Model:
    """Loads a model directory.

    path: a Hugging Face model directory (config.json, model.safetensors or a sharded index,
    tokenizer.json if present) or a directory written by `python -m checkpoints_convert`.
    dtype: "float32" | "bfloat16" | "float16" for the params; None: the backend policy's dtype for
    the default device (float32 on CPU, bfloat16 on GPU and TPU; see `ssd_jax.backend`), or with
    a mesh the policy of the mesh's platform.
    mesh, rules: place the params on a `jax.sharding.Mesh` by the rule table (see `ssd_jax.shard`);
    each tensor is then read slice by slice straight into its shards, so host memory while loading
    stays near one tensor rather than the whole model.
    Raises ConfigError / CheckpointError naming what is wrong (InputError for a bad mesh or rules).
    """
    from checkpoints_convert.hf_mapping import hf_to_params
    from checkpoints_convert.orbax_io import is_converted_dir, restore_params
    from checkpoints_convert.safetensors_io import read_hf_tensors

    placement = Placement.create(mesh, rules) if mesh is not None else None
    where = policy_for(devices_platform(placement.devices)) if placement is not None else policy_for(None)
    target_dtype = dtype_from_name(where.dtype if dtype is None else dtype)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"model directory {path!r} does not exist")
    config = read_config(path)
    if placement is not None:
        return _load_sharded(path, config, placement, target_dtype)
    if is_converted_dir(path):
        params = restore_params(path)
        validate_params(config, params)
    else:
        params = hf_to_params(config, read_hf_tensors(path), dtype=target_dtype)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=target_dtype), params)
    return Model(config=config, params=params, tokenizer=read_tokenizer(path), path=os.path.abspath(path))


def _load_sharded(path: str, config: ModelConfig, placement: Placement, dtype) -> Model:
    """`load` onto a mesh: every leaf read shard by shard into its NamedSharding."""
    from checkpoints_convert.sharded_read import read_params_sharded
    from ssd_jax.sharding import shape_shardings

    shardings = shape_shardings(placement, param_shapes(config), config)
    params = read_params_sharded(path, config, shardings, dtype)
    return Model(config=config, params=params, tokenizer=read_tokenizer(path), path=os.path.abspath(path),
                 placement=placement)
