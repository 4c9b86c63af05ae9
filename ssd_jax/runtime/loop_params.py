"""The decode-layout weights a decode program takes, prepared outside it once per params object
(`loop_params`) and kept weakly for the next call."""

from __future__ import annotations

import time

import jax

from ssd_jax.loop.autoregressive import fusable, unroll_layers
from ssd_jax.model import Model
from ssd_jax.models.transformer import decode_params
from ssd_jax.runtime.params_cache import ParamsCache

_LOOP_PARAMS_KEPT = 4
_LOOP_PARAMS = ParamsCache(_LOOP_PARAMS_KEPT)


def loop_params(model: Model) -> dict:
    """The params a decode loop takes, prepared outside it: with `unroll_layers`, `decode_params`
    of model.params, made once per params object and kept (weakly: the entry goes when the params
    do) for the next call; otherwise model.params. A call then does not re-slice and re-fuse
    every weight, a cost comparable to a short decode's on a small model."""
    if not unroll_layers(model):
        return model.params
    fuse = fusable(model)
    make = lambda: jax.jit(decode_params, static_argnums=(1, 2))(model.params, model.config, fuse)  # noqa: E731
    return _LOOP_PARAMS.get(model.params, fuse, make)[0]


_PLACED = ParamsCache(4)


def placed_params(model: Model):
    """A placed model's params in the decode layout (`loop_params`), kept per params object so
    repeated calls skip the work (SSD's device groups). Returns (params, seconds spent)."""
    start = time.perf_counter()
    params, made = _PLACED.get(model.params, None, lambda: jax.block_until_ready(loop_params(model)))
    return params, (time.perf_counter() - start) if made else 0.0
