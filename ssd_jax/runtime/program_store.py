"""Compiled decode programs kept on disk whole, so that a later process runs one without tracing it.

JAX's persistent compilation cache (`compile_cache.use_persistent_cache`) finds a program by its
lowered text, so a later process still traces and lowers the program to look it up, which for
the default SD "auto" loop of the embedded pair (the target's step at four verification widths,
plain steps and the draft chain) is a large share of a later `ssd-jax generate`. Here an
entry is the compiled executable itself (`jax.experimental.serialize_executable`), named by a
digest of everything that decides the program without tracing it:

    the program's function and its key in the in-process cache (`compile_cache.PROGRAMS`: method,
        sampling, buckets, adaptive plan), its arguments' structure, shapes, dtypes and shardings
    the library's own source (every module of the ssd_jax package, `source_digest`)
    jax, jaxlib, Python, numpy and flax versions, JAX's configuration, and the environment's XLA_*,
        JAX_*, SSD_JAX_*, TPU_* and LIBTPU_* variables (but those naming where caches are kept)
    the machine (`calibration_store.machine`: backend, device kinds, CPU model, cores usable; the
        CPU's instruction-set flags, `backend.cpu_features`) and the program's device (id, kind)
    FORMAT (bumped whenever what an entry holds changes)

A program is kept only where that text says everything about it (`_text`): every part of its key
a value of ssd_jax's own classes (whose code the source digest covers), one of its module-level
functions (by name), a number, string or dtype, and every pytree node of its arguments a builtin
container or an ssd_jax class. A user's own
method or drafter class, a value printed in part (a large array's "..."), an object printed by
its address, a program spanning several devices or processes: kept in memory only, compiled in
each process as before. Only programs compiled afresh are kept: one that JAX's persistent cache
read back serializes without its code (on CPU its copy fails with "Function ... not found" when
run), so a compile during which that cache reported a hit keeps nothing, and so does one that
JAX answered with an executable it had made earlier in the process (no backend compile in the
compiling thread: a function compiled again after the in-process cache dropped it, whose first
executable may have been read back). An entry holds its key's
full text, compared when it is read, so a digest collision never runs another program, and a
sha256 of the executable's bytes, checked before it is loaded (a flipped byte that still unpickles
would otherwise run, and crash the process on every later run). Files are written to a temporary
name, synced and renamed; an unreadable or damaged entry is removed and compiled again. At most
MAX_FILES entries and MAX_BYTES in all, the least recently used removed first; temporary files a
killed writer left are removed after an hour.

Where: a folder `ssd_jax-programs` inside the compile cache directory, only while ssd_jax's
persistent compile cache is on (the command line's default, `ssd_jax.use_persistent_cache`);
deleting the folder only costs the next runs their trace. Loading an entry unpickles it: keep the
directory as private as JAX's own cache, whose entries are executables too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import platform
import re
import threading
import time
import types
from typing import Any, Callable

import jax
import numpy as np

from ssd_jax.runtime.calibration_store import machine, write_atomically
from ssd_jax.runtime.progress import notice

FORMAT = 3
FOLDER = "ssd_jax-programs"
SUFFIX = ".program"
# A program of the embedded pair is a few megabytes; 64 of them cover every method at two
# temperatures and a few prompt buckets.
MAX_FILES = 64
MAX_BYTES = 1 << 30
STALE_TEMPORARY_S = 3600   # a temporary file this old is no write in progress
ENV_PREFIXES = ("XLA_", "JAX_", "SSD_JAX_", "TPU_", "LIBTPU_")
# Text that stands for something it does not print: an object's address, an elided array.
_UNSPOKEN = re.compile(r" at 0x|\.\.\.")

_directory: str | None = None
_persistent_cache_hits = 0
# Backend compiles (or persistent-cache reads) run by this thread: a jit whose function JAX has
# lowered and compiled before in this process hands back that executable without either, and if
# that one was read from JAX's persistent cache it has no code to keep (see the module's docstring).
_compiles = threading.local()
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _count_hits(event: str, **kwargs) -> None:
    global _persistent_cache_hits
    if "cache_hit" in event:
        _persistent_cache_hits += 1


def _count_compiles(event: str, duration_secs: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _compiles.count = getattr(_compiles, "count", 0) + 1


# JAX's persistent cache reports each program it reads back, and JAX each program it compiles or
# reads (in the thread that asked for it).
jax.monitoring.register_event_listener(_count_hits)
jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def use_directory(compile_cache_dir: str | None) -> str | None:
    """Keeps programs inside `compile_cache_dir` (None: in memory only). Returns the folder."""
    global _directory
    _directory = None if not compile_cache_dir else os.path.join(compile_cache_dir, FOLDER)
    return _directory


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the ssd_jax package's Python modules (relative paths and contents): a program's
    code is the library's, so any change of it traces anew."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def _ours(module: str) -> bool:
    """Whether a module is ssd_jax's (its code is in `source_digest`)."""
    return module == "ssd_jax" or module.startswith("ssd_jax.")


def _text(value: Any) -> str | None:
    """value's text where it says all that makes value what it is, None otherwise: builtin
    scalars, strings and dtypes by their repr, ssd_jax's own module-level functions by name,
    containers of such, and dataclasses of ssd_jax's own classes by the fields they compare."""
    if isinstance(value, np.generic):   # by its type too: numpy 1.x prints float32(1) as 1.0
        return f"{type(value).__name__}({value!r})"
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.dtype)):
        return repr(value)
    if isinstance(value, types.FunctionType):
        named = _ours(value.__module__) and "<" not in value.__qualname__
        return f"{value.__module__}.{value.__qualname__}" if named else None
    if isinstance(value, (tuple, list, frozenset)):
        parts = [_text(v) for v in value]
        if None in parts:
            return None
        parts = sorted(parts) if isinstance(value, frozenset) else parts
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, dict):
        items = [(_text(k), _text(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(items)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _ours(type(value).__module__):
        fields = [(f.name, _text(getattr(value, f.name))) for f in dataclasses.fields(value) if f.compare]
        if any(text is None for _, text in fields):
            return None
        cls = type(value)
        return f"{cls.__module__}.{cls.__qualname__}({', '.join(f'{n}={t}' for n, t in fields)})"
    return None


def _tree_spoken(treedef) -> bool:
    """Whether every node of a pytree structure is a builtin container or an ssd_jax class whose
    aux data has a text (`_text`)."""
    data = treedef.node_data()
    if data is not None:
        kind, aux = data
        if kind not in (tuple, list, dict, type(None)) and not (_ours(kind.__module__) and _text(aux) is not None):
            return False
    return all(_tree_spoken(child) for child in treedef.children())


def _function_name(fn: Callable) -> str | None:
    """The text of an ssd_jax module-level function, or of one under functools.partial with the
    partial's keywords and their values (`_text`); None otherwise. The values are in the
    program's static key too, by `compiled`'s contract: here they guard a caller that forgot one."""
    if not isinstance(fn, functools.partial):
        return _text(fn) if isinstance(fn, types.FunctionType) else None
    if fn.args or not isinstance(fn.func, types.FunctionType):
        return None
    name, keywords = _text(fn.func), _text(fn.keywords)
    return None if name is None or keywords is None else f"{name}{keywords}"


def _one_device(signature) -> Any | None:
    """The device of a program whose arguments all sit on one device, whatever their sharding's
    kind (numpy leaves go to the default one); None where they span several (their executable
    must be loaded onto the same devices in the same order, which a later process cannot be sure
    to have)."""
    devices = set()
    for _, _, sharding in signature[1]:
        if sharding is not None:
            devices |= set(sharding.device_set)
    if len(devices) > 1:
        return None
    return devices.pop() if devices else jax.devices()[0]


def _names_a_place(variable: str) -> bool:
    """Whether an environment variable says where things are kept (JAX_COMPILATION_CACHE_DIR,
    SSD_JAX_COMPILE_CACHE, SSD_JAX_CALIBRATION_DIR), not what a program computes."""
    return "CACHE" in variable or variable.endswith("_DIR")


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    """Python's, numpy's and flax's versions: an entry pickles pytree definitions of their classes
    (jax's and jaxlib's are in `machine`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        flax = version("flax")
    except PackageNotFoundError:
        flax = None
    return (platform.python_version(), np.__version__, flax)


def _environment() -> str:
    """What besides the key decides a program in this process: versions, configuration, machine."""
    from ssd_jax.backend import cpu_features

    # The compilation cache's own settings say where programs are kept, not what they compute.
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and not _names_a_place(k))
    # machine() holds the jax and jaxlib versions too; the CPU's flags by digest (XLA:CPU compiles for them).
    features = hashlib.sha256(cpu_features().encode()).hexdigest()[:16]
    return repr((FORMAT, source_digest(), jax.devices()[0].client.platform_version, sorted(machine().items()),
                 _versions(), features, settings, env))


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one program is kept: its file and its key's full text."""

    path: str
    key_text: str
    device: Any

    def load(self):
        """The stored executable (a `jax.stages.Compiled`), None where there is none or it cannot
        be read."""
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(self.path, "rb") as f:
                stored = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:   # noqa: BLE001 - half-written or damaged: compile instead, and drop it
            self._drop()
            return None
        if not isinstance(stored, dict) or stored.get("key") != self.key_text:
            return None   # another program under the same digest: left to it
        if stored.get("digest") != _digest(stored.get("executable")):
            self._drop()   # damaged where unpickling cannot tell (a flipped byte ran and crashed)
            return None
        try:
            executable = deserialize_and_load(stored["executable"], stored["in_tree"], stored["out_tree"],
                                              backend=self.device.client, execution_devices=[self.device])
        except Exception:   # noqa: BLE001 - a runtime that no longer reads it: compile instead
            self._drop()
            return None
        try:
            os.utime(self.path)   # the least recently used are evicted first
        except OSError:
            pass
        return executable

    def _drop(self) -> None:
        try:
            os.remove(self.path)
        except OSError:
            pass

    def save(self, executable) -> None:
        """Keeps the executable (nothing where it cannot be serialized or written)."""
        from jax.experimental.serialize_executable import serialize

        try:
            serialized, in_tree, out_tree = serialize(executable)
            payload = pickle.dumps(dict(key=self.key_text, executable=serialized, digest=_digest(serialized),
                                        in_tree=in_tree, out_tree=out_tree), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:   # noqa: BLE001 - constants or callbacks the serializer refuses: memory only
            return
        try:
            write_atomically(self.path, payload)
        except OSError:
            return
        _evict(os.path.dirname(self.path))


def _digest(data) -> str | None:
    """sha256 of an entry's executable bytes, checked when it is read."""
    return hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else None


def load_or_compile(fn: Callable, key: tuple, compile: Callable[[], Any]):
    """The executable of fn under `key` (`compile_cache.CompileCache.compiled`'s: static key,
    argument signature, donated arguments): read from the store where it holds it, else
    `compile()`d, and kept where the key says everything and the compile was fresh: JAX compiled
    it in this thread (an executable it made before in this process, which it hands back without
    compiling, may be one read from its persistent cache) and read nothing back from its
    persistent cache meanwhile, in any thread."""
    kept = entry(fn, key)
    executable = None if kept is None else kept.load()
    if executable is not None:
        return executable
    hits, compiles = _persistent_cache_hits, getattr(_compiles, "count", 0)
    later = "; later runs load it" if kept is not None else ""
    with notice(f"compiling a decode program{later}"):
        executable = compile()
    fresh = getattr(_compiles, "count", 0) > compiles and _persistent_cache_hits == hits
    if kept is not None and fresh:
        kept.save(executable)
    return executable


def describe(name: str | None, static_key: Any, signature: tuple) -> str | None:
    """The full text of what decides a program: its function's name, static key and argument
    signature (`compile_cache.signature`), with the library's source, versions, configuration and
    machine (`_environment`); None where that text would not say everything (see the module's
    docstring). Also names measurements of a program without lowering it
    (`ssd_jax.tuning.measure`'s per-forward timings)."""
    static_text = _text(static_key)
    if name is None or static_text is None or not _tree_spoken(signature[0]):
        return None
    text = f"({name}, {static_text}, {signature!r}, {_environment()})"
    return None if _UNSPOKEN.search(text) else text


def entry(fn: Callable, key: tuple) -> Entry | None:
    """Where the program of fn under `key` (`compile_cache.CompileCache.compiled`'s: static key,
    argument signature, donated arguments) is kept; None while programs are kept in memory, or
    where the key does not say everything about the program (`describe`)."""
    folder = _directory
    if folder is None or jax.process_count() > 1:
        return None
    static_key, signature, donated = key
    device = _one_device(signature)
    # The device by id (the environment names the backend): a sharding over a one-device mesh
    # prints the mesh's shape only.
    placed = None if device is None else f"device {device.id} {device.device_kind}"
    key_text = None if device is None else describe(_function_name(fn), (static_key, donated, placed), signature)
    if key_text is None:
        return None
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:40]
    return Entry(os.path.join(folder, digest + SUFFIX), key_text, device)


def _evict(folder: str) -> None:
    """Removes the least recently used entries beyond MAX_FILES or MAX_BYTES, and temporary files
    older than STALE_TEMPORARY_S (a writer killed mid-write)."""
    try:
        entries = []
        for name in os.listdir(folder):
            stat = os.stat(os.path.join(folder, name))
            if name.endswith(SUFFIX):
                entries.append((stat.st_mtime, stat.st_size, name))
            elif name.endswith(".tmp") and time.time() - stat.st_mtime > STALE_TEMPORARY_S:
                os.remove(os.path.join(folder, name))
    except OSError:
        return
    entries.sort(reverse=True)
    total = 0
    for count, (_, size, name) in enumerate(entries, 1):
        total += size
        if count > MAX_FILES or total > MAX_BYTES:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
