"""The runtime pieces of the SSD host loop: the models' params placed on their device groups
(cached across calls), and the device programs compiled once per static key and laid out so that
each program's outputs fit the next call's inputs."""

from __future__ import annotations

import functools
import threading
import time

import jax
import numpy as np

from ssd_jax.engine.autoregressive import unroll_layers
from ssd_jax.engine.ssd_placement import DeviceGroup
from ssd_jax.model import Model
from ssd_jax.models.transformer import decode_params

_PLACED: dict = {}
_PLACED_MAX = 4


def placed_params(model: Model, group: DeviceGroup):
    """The model's params on the group (replicated), in the decode layout on CPU; cached per
    (params object, devices) so repeated calls skip the copy. Returns (params, seconds spent)."""
    key = (id(model.params), group.ids())
    entry = _PLACED.get(key)
    if entry is not None and entry[0] is model.params:
        return entry[1], 0.0
    start = time.perf_counter()
    params = group.put(model.params, replicate=True)
    if unroll_layers():
        params = jax.jit(functools.partial(decode_params, config=model.config))(params)
    params = jax.block_until_ready(params)
    if len(_PLACED) >= _PLACED_MAX:
        _PLACED.pop(next(iter(_PLACED)))
    _PLACED[key] = (model.params, params)  # holding model.params keeps its id unique
    return params, time.perf_counter() - start


_EXECUTABLES: dict = {}


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
                          for x in leaves)


class Programs:
    """Compiles each device program on first use and accumulates the compile seconds, which the
    decode's wall time excludes. Executables are cached per (program, static key, argument shapes,
    dtypes and shardings); every output is laid out on its group as `DeviceGroup.sharding_for`
    says, so a program's outputs fit the next call's inputs (no recompiles, no relayouts)."""

    def __init__(self, static: tuple):
        self.static = static
        self.compile_s = 0.0
        self.lock = threading.Lock()  # the draft's thread compiles too
        # Within one decode a program's arguments keep their shapes and shardings (outputs are
        # laid out like the inputs they become), so after the first call a program is found by
        # name and by which optional arguments are None, without hashing every leaf again.
        self.local: dict = {}

    def __call__(self, name: str, fn, group: DeviceGroup, *args, donate: tuple[int, ...] = ()):
        local_key = (name, tuple(a is None for a in args))
        executable = self.local.get(local_key)
        if executable is not None:
            return executable(*args)
        key = (name, self.static, _signature(args), donate)
        with self.lock:
            executable = _EXECUTABLES.get(key)
            if executable is None:
                start = time.perf_counter()
                out_shardings = jax.tree.map(group.sharding_for, jax.eval_shape(fn, *args))
                executable = jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args).compile()
                _EXECUTABLES[key] = executable
                self.compile_s += time.perf_counter() - start
            self.local[local_key] = executable
        return executable(*args)
