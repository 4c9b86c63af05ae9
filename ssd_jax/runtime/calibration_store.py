"""Calibrations of adaptive speculation kept on disk: a compiled program's step costs are measured
once per machine, not once per process (`ssd_jax.tuning.measure.calibrated_inputs`).

Measuring them runs the program ~20 times on a few tokens: on the embedded pair on a 2-core CPU
at batch 8, 3-8 s, several times a 128-token call itself, which every new process (the command
line, a notebook restart) paid again. An entry is one small JSON file named by a digest of

    what decides the program (`program_store.describe`: its static key and argument signature,
        the library's source, versions and settings), or where that cannot say everything, the
        program's optimized HLO text without its debug information (`program_text`)
    the machine (backend, device kind, CPU model, cores usable, jax and jaxlib versions, XLA_FLAGS)
    FORMAT (bumped whenever what a calibration measures changes)

so another program, machine or library version never reads it. The per-forward timings the cost
model starts from (`ssd_jax.tuning.measure.forward_seconds`: 1 s a timed width on that machine,
~3 s of a fresh process's first "auto" call) are kept the same way, as files named "forward-"
and a digest of what decides the timed loop (`program_store.describe`: the models' config and
shapes, the library's source, versions, machine; its lowered program where that says too
little), and so is AR's step over the loop's plain step
(`ssd_jax.tuning.against_ar`: ~2 s of every later process of a near-tie call, which compiled and
timed AR's program again), as "ar-ratio-" files named like the loop's calibration, and so are SSD's
plain-step timings (`ssd_jax.ssd.auto.plain_step_seconds`: 3-8 chunks of 16 plain steps at each
of a program's first three SSD calls), as "ssd-plain-" files. Files are written to a temporary
name and renamed, so a reader never sees half of one; an unreadable or malformed file counts as
absent (and is measured again and replaced).

Where: $SSD_JAX_CALIBRATION_DIR, else ~/.cache/ssd_jax/calibration ($XDG_CACHE_HOME honoured).
SSD_JAX_CALIBRATION_DIR="" (empty) keeps calibrations in memory only, as does a program that
spans several processes (every process must take part in measuring it, so none may skip it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings

import jax

FORMAT = 2
DIR_ENV = "SSD_JAX_CALIBRATION_DIR"


def store_dir() -> str | None:
    """The directory calibrations are kept in, None when they are kept in memory only ("~" is
    expanded, as the compile cache's directory is)."""
    if DIR_ENV in os.environ:
        return os.path.expanduser(os.environ[DIR_ENV]) or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ssd_jax", "calibration")


def machine() -> dict:
    """What a calibration's timings depend on besides the program."""
    import jaxlib

    from ssd_jax.backend import cpu_model, default_platform

    return dict(backend=default_platform(), device_kinds=sorted({d.device_kind for d in jax.devices()}),
                devices=jax.device_count(),
                cpu=cpu_model(), cores=usable_cores(), jax=jax.__version__, jaxlib=jaxlib.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""))


def usable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity: taskset, a container's cpuset, a batch
    job's allocation), not the machine's: XLA:CPU sizes its thread pool by them (a process pinned
    to 1 of 2 cores starts 4 fewer threads), so a calibration's timings depend on them, and hosts
    of one CPU model sharing a home directory may allot different numbers."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


# Debug information in an HLO module's text: the tables of source files, functions, locations and
# stack frames (a header line, then lines `N "..."` or `N {...}`), and each instruction's
# `metadata={...}` (op names, source lines, stack frame ids).
_DEBUG_TABLE = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)$|^\d+ [\"{].*$")
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def program_text(text: str) -> str:
    """An optimized HLO module's text without its debug information: what the program computes.
    The same program read back from JAX's persistent compilation cache prints fewer stack frames
    than when it was compiled, and a comment moved in the caller's file changes source lines;
    neither changes what a calibration measures."""
    lines = (_METADATA.sub("", line) for line in text.splitlines() if not _DEBUG_TABLE.match(line))
    return "\n".join(line for line in lines if line.strip())


def _digest(kind: str, text: str) -> str:
    """A file name for a measurement of the program `text` on this machine (kind: what is measured,
    "" for a loop's calibration)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(format=FORMAT, machine=machine()), sort_keys=True).encode())
    if kind:
        digest.update(kind.encode())
    digest.update(program_text(text).encode())
    return (f"{kind}-" if kind else "") + digest.hexdigest()[:32] + ".json"


def entry_name(executable, kind: str = "") -> str | None:
    """The file name of the program's calibration (kind "") or of another measurement of it (a
    digest), None where the program's text cannot be had."""
    try:
        text = executable.as_text()
    except Exception:   # noqa: BLE001 - an executable without text is simply not kept on disk
        return None
    if not text:
        return None
    return _digest(kind, text)


def _kept_in(store: str | None) -> str | None:
    """The directory measurements are kept in (store, a tuner's), None where they stay in memory
    (no directory, or a program spanning several processes)."""
    return None if store is None or jax.process_count() > 1 else store


def path_for(executable, kind: str = "", key: tuple | None = None, store: str | None = None) -> str | None:
    """Where the program's calibration (kind "") is kept, or another measurement of the program
    (kind: the file name's prefix, e.g. "ar-ratio" for `ssd_jax.tuning.against_ar`); None where
    kept in memory only (no directory, several processes, no program text). key: the program's
    (static key, argument signature), named by `program_store.describe`'s text where that says
    everything about the program (hashing the optimized HLO text instead took 0.15 s of a later
    run of the default on a 2-core CPU: ~6 MB of it), else by the program's text. store: the
    directory (`Tuner.store_dir`; None: memory only)."""
    from ssd_jax.runtime import program_store

    directory = _kept_in(store)
    if directory is None:
        return None
    described = None if key is None else program_store.describe(f"{__name__}:{kind}", key[0], key[1])
    name = _digest(kind, described) if described else entry_name(executable, kind)
    return None if name is None else os.path.join(directory, name)


def path_for_text(kind: str, text: str, store: str | None) -> str | None:
    """Where a measurement of the program whose lowered text is `text` is kept (kind: what is
    measured, the file name's prefix, e.g. "forward" for `ssd_jax.tuning.measure.forward_seconds`);
    None where kept in memory only. Keyed by the text, so a change of the models' code measures
    again."""
    directory = _kept_in(store)
    return None if directory is None else os.path.join(directory, _digest(kind, text))


# Above any step's seconds or any ratio of two: a larger value kept is damage, not a measurement
# (as float32, the loop's cost inputs, 1e39 is inf, and inf / inf a NaN in the cost model).
MAX_VALUE = 1e6


def _measured(value) -> bool:
    """Whether a value read from a file can be a measurement: a JSON number (not a bool), finite,
    in [0, MAX_VALUE]."""
    return type(value) in (int, float) and 0 <= value <= MAX_VALUE


def load(path: str | None) -> tuple[float, ...] | None:
    """The calibration kept at path (`path_for`), None if there is none (or it is unreadable, or
    not a non-empty list of measurements, `_measured`)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            values = json.load(f)["costs"]
    # RecursionError: JSON nested too deep to parse.
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(values, list) or not values or not all(_measured(v) for v in values):
        return None
    return tuple(float(v) for v in values)


def write_atomically(path: str, data: bytes) -> None:
    """Writes data to path through a temporary file in its folder (made if missing) and a rename,
    so a reader never sees half of it; OSError where it cannot be written (nothing left behind)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())   # on disk before the name points at it (a crash keeps the old file)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def save(path: str | None, values: tuple[float, ...]) -> None:
    """Keeps a calibration at path (`path_for`; atomically); a directory that cannot be written
    leaves it in memory only."""
    if path is None:
        return
    directory = os.path.dirname(path)
    try:
        write_atomically(path, json.dumps(dict(format=FORMAT, costs=[float(v) for v in values],
                                               machine=machine())).encode())
    except OSError as error:
        warnings.warn(f"ssd_jax: adaptive speculation's calibration kept in memory only, as {directory!r} "
                      f"cannot be written ({error}); set {DIR_ENV} to a writable directory, or to '' to "
                      "silence this", stacklevel=3)
