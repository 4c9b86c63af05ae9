"""The one compile cache: executables of jitted decode programs, ahead-of-time compiled so that
compile time is reported apart from decode time, kept in a bounded LRU (`MAX_ENTRIES`).

Keys hold static configuration and argument shapes, dtypes and shardings, never arrays, so the
cache keeps no parameters alive. `generate` passes models stripped of their tokenizer and path,
so reloading the same checkpoint finds the same program."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

# Each distinct (method, configs, sampling, prompt and output buckets, batch) is one entry; 32
# covers a benchmark sweep over every method at two temperatures without evictions.
MAX_ENTRIES = 32


def signature(args) -> tuple:
    """(treedef, per-leaf shape, dtype and sharding) of an argument pytree. The dtype objects
    themselves (hashable, compared by value), not their names: formatting ~100 leaves' dtypes
    took ~1 ms of every call (1% of a 128-token SD call on the embedded pair, CPU)."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None))
                          for x in leaves)


class CompileCache:
    """LRU of compiled executables, at most `size` of them."""

    def __init__(self, size: int):
        self._size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> tuple[Any, float]:
        """(executable, seconds spent building now: 0.0 on a hit)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key], 0.0
            start = time.perf_counter()
            executable = build()
            spent = time.perf_counter() - start
            self._entries[key] = executable
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
            return executable, spent

    def compiled(self, fn: Callable, static_key: Any, *args, donate_argnums: tuple[int, ...] = ()
                 ) -> tuple[Callable, float]:
        """Executable for fn(*args). static_key must capture everything fn closes over that changes
        the program (method, configs, sampling, static sizes); `fn` itself is not part of the key."""
        key = (static_key, signature(args), donate_argnums)
        return self.get_or_build(key, lambda: jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PROGRAMS = CompileCache(MAX_ENTRIES)


def clear() -> None:
    """Empties the cache (tests that swap a verifier in use it)."""
    PROGRAMS.clear()
