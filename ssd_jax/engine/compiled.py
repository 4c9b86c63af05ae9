"""Ahead-of-time compilation with a process-wide cache, so compile time is reported apart from
decode time and a shape bucket compiles once per process."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

_CACHE: dict[Any, Any] = {}


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x)))) for x in leaves)


def compiled(fn: Callable, static_key: Any, *args, donate_argnums: tuple[int, ...] = ()) -> tuple[Callable, float]:
    """Returns (executable for fn(*args), seconds spent compiling now: 0.0 on a cache hit).

    static_key must name the program and capture everything fn closes over that changes it
    (method, configs, sampling parameters, static sizes); `fn` itself is not part of the key, so
    a fresh functools.partial per call still hits. Arrays are keyed by shape and dtype.
    """
    key = (static_key, _signature(args), donate_argnums)
    if key in _CACHE:
        return _CACHE[key], 0.0
    start = time.perf_counter()
    executable = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
    _CACHE[key] = executable
    return executable, time.perf_counter() - start


def clear() -> None:
    _CACHE.clear()
