"""`Tuner`: everything draft_len="auto" learns or measures, in one object.

A tuner owns the acceptance the loops reported (per model pair, method and temperature), the
measured forward and step costs, the calibrations of compiled programs, the verdicts that a
program's calls should start plainly, the per-call programs' prices, SSD's verdicts and paces,
and the locks that keep two threads from measuring one thing at once. Nothing else in the
package remembers anything between calls (but for the compile and params caches of
`ssd_jax.runtime`, which hold no decision).

`generate(..., tuner=None)` uses `default_tuner()`, made on first use; the environment variable
SSD_JAX_DETERMINISTIC_AUTO=1 makes that one deterministic, and is read there only. A
deterministic tuner measures and remembers nothing: it plans from the fixed relative costs and
the prior acceptance (`cost_model.prior_plan`), so a call gives the same tokens on every run and
machine. Two tuners never share a memory; `reset` forgets everything.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator

from ssd_jax.errors import InputError
from ssd_jax.runtime.progress import notice
from ssd_jax.tuning.cost_model import PRIOR_ACCEPTANCE
from ssd_jax.tuning.memory import AcceptanceMemory, Recent
from ssd_jax.tuning.per_call import PerCallMemory
from ssd_jax.tuning.plain_verdicts import PlainVerdicts
from ssd_jax.tuning.ssd_memory import SSDMemory

DETERMINISTIC_ENV = "SSD_JAX_DETERMINISTIC_AUTO"


class _FromEnvironment:
    """The store of a tuner made without one: the directory `calibration_store.store_dir` names
    when a measurement is kept (the environment's SSD_JAX_CALIBRATION_DIR, else the user's cache)."""

    def __repr__(self) -> str:
        return "FROM_ENVIRONMENT"


FROM_ENVIRONMENT = _FromEnvironment()


class Tuner:
    """The host policy's memory for draft_len="auto" (module docstring).

    deterministic: measure nothing and remember nothing; plan from fixed relative costs and the
    prior acceptance (the same tokens on every run and machine). store: the directory where
    measurements are kept across processes (per program and machine), None to keep them in memory
    only; by default the one `ssd_jax.runtime.calibration_store.store_dir` names."""

    def __init__(self, deterministic: bool = False, store: str | os.PathLike | None | _FromEnvironment = FROM_ENVIRONMENT):
        if not isinstance(deterministic, bool):
            raise InputError(f"Tuner(deterministic=...) must be True or False, got {deterministic!r}")
        if not (store is None or store is FROM_ENVIRONMENT or isinstance(store, (str, os.PathLike))):
            raise InputError(f"Tuner(store=...) must be a directory path or None, got {type(store).__name__}")
        self._deterministic = deterministic
        self._store = store if store is None or store is FROM_ENVIRONMENT else os.path.expanduser(os.fspath(store))
        # Held while measuring: two threads' first calls of one program measured it twice at once,
        # each timing the other's runs too.
        self.measuring = threading.RLock()
        self._lock = threading.Lock()
        # Per thread: the seconds its calibrations took (`calibrating`), and how deep it is in them.
        self._calibration_clock = threading.local()
        self.reset()

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    @property
    def measures(self) -> bool:
        """Whether this tuner times programs and remembers calls (not deterministic)."""
        return not self._deterministic

    def store_dir(self) -> str | None:
        """The directory measurements are kept in now, None where they stay in memory."""
        if self._store is FROM_ENVIRONMENT:
            from ssd_jax.runtime.calibration_store import store_dir

            return store_dir()
        return self._store

    def reset(self) -> None:
        """Forgets everything this tuner learned or measured (files in its store stay)."""
        with self._lock:
            self.acceptance = AcceptanceMemory()
            self.step_costs = Recent()        # (pair, batch, context bucket, width) -> StepCosts
            self.forward_seconds = Recent()   # (model, batch, context bucket, width) -> seconds
            self.calibrations = Recent()      # program key -> its calibration
            self.ar_ratios = Recent()         # loop program key -> AR's step over its plain step
            self.loop_verdicts = PlainVerdicts()
            self.per_call = PerCallMemory(self.measures)
            self.ssd = SSDMemory(self.measures)

    def acceptance_for(self, key) -> float:
        """The acceptance remembered for key, PRIOR_ACCEPTANCE before any (and always when deterministic)."""
        known = self.known_acceptance(key)
        return PRIOR_ACCEPTANCE if known is None else known

    def known_acceptance(self, key) -> float | None:
        """The acceptance remembered for key, None before any (and always when deterministic)."""
        return self.acceptance.known(key) if self.measures else None

    def remember_acceptance(self, key, observed: float | None, share: float = 1.0) -> None:
        """Adds a call's observed acceptance (None: no evidence), as `share` of a call; nothing when
        deterministic."""
        if self.measures:
            self.acceptance.update(key, observed, share)

    def remembered(self, table: Recent, key):
        """table's value for key (None: none), under the tuner's lock."""
        with self._lock:
            return table.lookup(key)

    def keep(self, table: Recent, key, value) -> None:
        with self._lock:
            table.store(key, value)

    def measured_once(self, table: Recent, key, measure: Callable[[], Any]):
        """table's value for key, else measure()'s, kept: measured one at a time (`measuring`), and
        read again once that lock is held (another thread may have measured it meanwhile)."""
        with self.measuring:
            value = self.remembered(table, key)
            if value is None:
                value = measure()
                self.keep(table, key, value)
        return value

    @contextlib.contextmanager
    def calibrating(self, text: str) -> Iterator[None]:
        """Around a measurement that is kept per machine (a calibration: `calibration_store`):
        shows `text` as a notice and adds its seconds to this thread's `calibration_seconds`,
        once where calibrations nest."""
        clock = self._calibration_clock
        depth = getattr(clock, "depth", 0)
        clock.depth = depth + 1
        start, left_out = time.perf_counter(), getattr(clock, "left_out", 0.0)
        try:
            with notice(text):
                yield
        finally:
            clock.depth = depth
            if depth == 0:
                elapsed = time.perf_counter() - start - (getattr(clock, "left_out", 0.0) - left_out)
                clock.seconds = self.calibration_seconds() + max(elapsed, 0.0)

    def leave_out_of_calibration(self, seconds: float) -> None:
        """Leaves `seconds` spent inside this thread's current calibration (`calibrating`) out of
        its seconds: time the call reports elsewhere (a program compiled by a timing run, in
        compile_time_s), which a timed call would otherwise leave out twice."""
        clock = self._calibration_clock
        clock.left_out = getattr(clock, "left_out", 0.0) + float(seconds)

    def calibration_seconds(self) -> float:
        """The seconds this thread has spent in this tuner's calibrations (`calibrating`), in
        all: a call's share is the difference across it (`generate`'s calibration_time_s)."""
        return getattr(self._calibration_clock, "seconds", 0.0)

    def __repr__(self) -> str:
        return f"Tuner(deterministic={self._deterministic}, store={self._store!r})"


_default: Tuner | None = None
_default_lock = threading.Lock()


def default_tuner() -> Tuner:
    """The process's tuner for calls that pass none: made on first use, deterministic where the
    environment sets SSD_JAX_DETERMINISTIC_AUTO=1 (the one place that variable is read)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Tuner(deterministic=os.environ.get(DETERMINISTIC_ENV, "") == "1")
        return _default


def as_tuner(tuner) -> Tuner:
    """tuner, or the default one for None; InputError for anything else."""
    if tuner is None:
        return default_tuner()
    if not isinstance(tuner, Tuner):
        raise InputError(f"tuner must be an ssd_jax.Tuner or None, got {type(tuner).__name__}")
    return tuner
