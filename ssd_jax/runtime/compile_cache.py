"""The one compile cache: executables of jitted decode programs, ahead-of-time compiled so that
compile time is reported apart from decode time, kept in a bounded LRU (`MAX_ENTRIES`).

Keys hold static configuration and argument shapes, dtypes and shardings, never arrays, so the
cache keeps no parameters alive. `generate` passes models stripped of their tokenizer and path,
so reloading the same checkpoint finds the same program."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

# Each distinct (method, configs, sampling, prompt and output buckets, batch) is one entry. A GPU's
# per-call "auto" runs up to 13 programs per prompt bucket (lengths 1, 2, 4, 8 at 1, 2 and 4 paths,
# and AR's): at 32, three buckets used in turn could evict programs between their calls, and a
# program compiled again sets no price (`per_call`). 64: two or three such methods' buckets, or a
# benchmark sweep over every method at two temperatures.
MAX_ENTRIES = 64


def signature(args) -> tuple:
    """(treedef, per-leaf shape, dtype and sharding) of an argument pytree. The dtype objects
    themselves (hashable, compared by value), not their names: formatting every leaf's dtype on
    every call would cost a visible share of a short call."""
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
        the program (method, configs, sampling, static sizes); `fn` itself is not part of the key.
        While ssd_jax's persistent cache is on, a program is also kept on disk whole and read back
        by later processes without tracing it (`ssd_jax.runtime.program_store`)."""
        from ssd_jax.runtime import program_store

        key = (static_key, signature(args), donate_argnums)

        def build():
            return program_store.load_or_compile(
                fn, key, lambda: jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile())

        return self.get_or_build(key, build)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PROGRAMS = CompileCache(MAX_ENTRIES)


def clear() -> None:
    """Empties the cache (tests that swap a verifier in use it)."""
    PROGRAMS.clear()


PERSISTENT_ENV = "SSD_JAX_COMPILE_CACHE"


def use_persistent_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Keeps every compiled XLA executable of this process on disk under `directory` (default:
    the SSD_JAX_COMPILE_CACHE environment variable; neither: nothing changes, returns None), so a
    later process loads a program instead of compiling it again. Compiling is most of a short
    run's time, above all on a GPU, and draft_len="auto" chosen per call compiles each program it
    tries (docs/accelerators.md). JAX's own persistent cache (`jax_compilation_cache_dir`), every
    entry kept however quick its compile; it is a process-wide setting, so it is only set when
    asked. The decode programs are also kept whole in its folder `ssd_jax-programs`, so a later
    process skips tracing them too (`ssd_jax.runtime.program_store`). Returns the directory;
    InputError where it cannot be made."""
    import jax

    from ssd_jax.runtime import program_store
    from ssd_jax.errors import InputError

    directory = os.environ.get(PERSISTENT_ENV) if directory is None else os.fspath(directory)
    if not directory:
        return None
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise InputError(f"compile cache directory {directory!r} cannot be made: {err.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise InputError(f"compile cache directory {directory!r} is not writable")
    jax.config.update("jax_compilation_cache_dir", directory)
    program_store.use_directory(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


# The command line's own compile cache is bounded (JAX evicts the least recently used programs
# past it); the embedded pair's programs are about a megabyte each, so this holds thousands.
COMMAND_LINE_CACHE_BYTES = 2 << 30


def command_line_directory() -> str | None:
    """The compile cache a command-line run keeps when neither --compile-cache nor
    $SSD_JAX_COMPILE_CACHE names one: none where JAX's own persistent cache is already set up
    (JAX_COMPILATION_CACHE_DIR: that choice stands), else ~/.cache/ssd_jax/xla ($XDG_CACHE_HOME
    honoured). A command line is a process of its own, so the process-wide
    setting is its to make, and without it every run would compile its programs again, which is
    most of a short run's time (docs/benchmarks.md, "One-shot runs and the compile cache")."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ssd_jax", "xla")


def use_command_line_cache(directory: str | None) -> str | None:
    """The command line's compile cache: `directory` as --compile-cache gave it ("": none), else
    $SSD_JAX_COMPILE_CACHE's ("": none), else `command_line_directory()`, bounded to
    COMMAND_LINE_CACHE_BYTES (where the `filelock` package JAX's eviction needs is installed;
    unbounded otherwise). A directory named by the flag or by
    $SSD_JAX_COMPILE_CACHE that cannot be made is an InputError; the default one only warns (the
    run compiles as without one). Returns the directory in use."""
    import warnings

    import jax

    from ssd_jax.errors import InputError

    if directory is not None:
        return use_persistent_cache(directory)
    if PERSISTENT_ENV in os.environ:   # asked for by name: a directory that cannot be made is an error
        return use_persistent_cache(os.environ[PERSISTENT_ENV])
    default = command_line_directory()
    if default is None:
        return None
    try:
        chosen = use_persistent_cache(default)
    except InputError as error:
        warnings.warn(f"ssd_jax: compiled programs are not kept for the next run: {error}; set "
                      f"{PERSISTENT_ENV} to a writable directory, or to '' to silence this", stacklevel=2)
        return None
    if _importable("filelock"):   # JAX's eviction locks the folder with it (tokenizers brings it)
        jax.config.update("jax_compilation_cache_max_size", COMMAND_LINE_CACHE_BYTES)
    return chosen


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
