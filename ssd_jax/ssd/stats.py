"""Host-side bookkeeping of an SSD decode: cache hits per outcome depth, fallbacks, and where the
wall time went (waiting on the steps' reports, on fallback drafts)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass
class SSDTally:
    """Counters over the steps of one decode (all rows summed).

    outcomes[k] / hits[k]: row-steps whose verification accepted k draft tokens / whose outcome
    (k, t) was in the speculation cache. fallback_calls: fallback drafts run (one per step with a
    miss, covering every row, and one at each start from a fresh root); fallback_rows: rows whose
    outcome missed. wait_steps / fallback: host seconds blocked on the steps' reports and on the
    fallback drafts of fresh starts. In sync-timing mode, verify_s / build_s / fallback_s hold each
    program's own latency (each dispatch is waited for alone), select_s the cache lookup's on
    steps where every row hit and select_miss_s its latency where a miss was drafted.
    """

    length: int
    outcomes: np.ndarray = None
    hits: np.ndarray = None
    steps: int = 0
    fallback_calls: int = 0
    fallback_rows: int = 0
    wait_steps: float = 0.0
    fallback: float = 0.0
    sync: dict = None

    def __post_init__(self):
        self.outcomes = np.zeros(self.length + 1, np.int64)
        self.hits = np.zeros(self.length + 1, np.int64)
        self.sync = dict(verify_s=[], build_s=[], fallback_s=[], select_s=[], select_miss_s=[])

    def record(self, accepted: np.ndarray, hit: np.ndarray) -> None:
        """One step's lookups: accepted int [R], hit bool [R] for the rows still running."""
        np.add.at(self.outcomes, accepted, 1)
        np.add.at(self.hits, accepted[hit], 1)

    def stats(self, wall: float) -> dict:
        lookups = int(self.outcomes.sum())
        by_length = [float(h / n) if n else None for h, n in zip(self.hits, self.outcomes)]
        out = dict(
            cache_hit_rate=float(self.hits.sum() / lookups) if lookups else 0.0,
            cache_lookups=lookups,
            hit_rate_by_accepted_length=by_length,
            outcomes_by_accepted_length=self.outcomes.tolist(),
            ssd_steps=self.steps,
            fallback_calls=self.fallback_calls,
            fallback_rows=self.fallback_rows,
            time_waiting_steps_s=self.wait_steps,
            time_fallback_drafting_s=self.fallback,
            time_host_s=max(0.0, wall - self.wait_steps - self.fallback),
        )
        if any(self.sync.values()):
            out["latency_s"] = {name: float(np.mean(v)) if v else None for name, v in self.sync.items()}
        return out


class Stopwatch:
    """Adds the seconds spent inside `with` blocks to a named SSDTally field, less any compile
    seconds `programs` (an object with a running `compile_s`) accumulated meanwhile."""

    def __init__(self, tally: SSDTally, field: str, programs=None):
        self.tally, self.field, self.programs = tally, field, programs

    def _compile_s(self) -> float:
        return self.programs.compile_s if self.programs is not None else 0.0

    def __enter__(self):
        self.start = time.perf_counter()
        self.compile_start = self._compile_s()

    def __exit__(self, *exc):
        spent = time.perf_counter() - self.start - (self._compile_s() - self.compile_start)
        setattr(self.tally, self.field, getattr(self.tally, self.field) + spent)
