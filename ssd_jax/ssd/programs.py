"""The device programs of the SSD host loop, compiled once per static key and laid out so that
each program's outputs fit the next call's inputs."""

from __future__ import annotations

import threading

import jax

from ssd_jax.runtime import program_store
from ssd_jax.runtime.compile_cache import PROGRAMS, signature
from ssd_jax.ssd.placement import DeviceGroup

class Programs:
    """Compiles each device program on first use and accumulates the compile seconds, which the
    decode's wall time excludes. Executables live in the one compile cache
    (`ssd_jax.runtime.compile_cache`), per (program, static key, argument shapes,
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
        static = ("ssd", name, self.static)
        sig = signature(args)

        def compile_program():
            out_shardings = jax.tree.map(group.sharding_for, jax.eval_shape(fn, *args))
            return jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args).compile()

        def build():   # from disk where the persistent cache is on and the key says everything
            return program_store.load_or_compile(fn, (static, sig, donate), compile_program)

        with self.lock:
            executable, spent = PROGRAMS.get_or_build(static + (sig, donate), build)
            self.compile_s += spent
            self.local[local_key] = executable
        return executable(*args)
