"""`Model`: a configuration, its parameters, the tokenizer and where they came from.

A `Model` is a pytree: its params are the leaves; config, tokenizer, path and placement are
static (aux data), so `jax.tree_util.tree_map(f, model)` returns a Model and a Model passes through
`jax.jit` like any pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_from_name(name: str | Any):
    """'float32' | 'bfloat16' | 'float16' (or a jnp dtype) -> jnp dtype; InputError otherwise."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise InputError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
        return DTYPES[name]
    for value in DTYPES.values():
        if jnp.dtype(name) == jnp.dtype(value):
            return value
    raise InputError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model (a pytree: params are its leaves; config, tokenizer and path static).

    config: static architecture (hashable); params: pytree of jax arrays (see models/params.py);
    tokenizer: a `tokenizers.Tokenizer` or None; path: the directory it was loaded from (or None);
    placement: None (params on one device) or the `ssd_jax.sharding.Placement` (mesh and rules)
    its params were sharded by (`ssd_jax.shard`, `load(..., mesh=...)`).
    """

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    path: str | None = None
    placement: Any = None

    @property
    def dtype(self):
        return self.params["embed"].dtype

    def with_params(self, params: dict) -> "Model":
        return dataclasses.replace(self, params=params)


jax.tree_util.register_dataclass(Model, data_fields=["params"], meta_fields=["config", "tokenizer", "path", "placement"])
