"""The memories draft_len="auto" keeps between calls: bounded most-recent tables, decayed means
and the identity of the weights a memory belongs to. A `ssd_jax.Tuner` owns every instance."""

from __future__ import annotations

import threading
import weakref

import jax

from ssd_jax.runtime.recent import Recent

ACCEPTANCE_MEMORY = 0.5   # weight of the previous calls in the remembered acceptance


class ParamsIdentity:
    """Which weights a remembered value belongs to: equal only to an identity of the very same
    (still living) param arrays, so a new model reusing a collected one's ids starts afresh."""

    def __init__(self, *params):
        leaves = [jax.tree.leaves(p)[0] for p in params]
        self._ids = tuple(id(x) for x in leaves)
        self._refs = tuple(None if isinstance(x, jax.core.Tracer) else weakref.ref(x) for x in leaves)

    def _alive(self) -> tuple:
        return tuple(None if r is None else r() for r in self._refs)

    def __hash__(self) -> int:
        return hash(self._ids)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ParamsIdentity) or self._ids != other._ids:
            return False
        mine, theirs = self._alive(), other._alive()
        return all(a is not None and a is b for a, b in zip(mine, theirs))


class DecayedMeans:
    """Per key: a mean of the values added, each weighted `weight` against those before it; the
    most recent keys only. Thread-safe. running_start: the n-th value (n < 1 / weight) weighs
    1 / n instead, so that the first values are a plain mean: decayed from the first value, the
    first call of a program kept weight 0.75^n for n calls after it (SSD at batch 4 on short
    prompts at T=0, one CPU device: a first call at 1.31x plain decoding's cost sent the next 20
    calls plain where fixed L=4 ran 1.10x AR, each probe at 0.7-0.8x moving the mean a quarter)."""

    def __init__(self, weight: float, limit: int = 256, running_start: bool = False):
        self.weight = weight
        self.running_start = running_start
        self._values = Recent(limit)   # key -> (mean, values added)
        self._lock = threading.Lock()

    def lookup(self, key, default=None):
        with self._lock:
            entry = self._values.lookup(key)
        return default if entry is None else entry[0]

    def add(self, key, value: float, share: float = 1.0) -> float:
        """Adds a value counted as `share` (0, 1] of one (a value that says less: it moves the mean
        as a share of an add would, weight 1 - (1 - weight)^share, and in the running start
        share / (shares so far + share)); returns the key's new mean."""
        with self._lock:
            mean, count = self._values.lookup(key) or (0.0, 0.0)
            weight = self.weight if share == 1 else 1.0 - (1.0 - self.weight) ** share
            if self.running_start or count == 0:
                weight = max(weight, share / (count + share))
            mean = (1.0 - weight) * mean + weight * float(value)
            self._values.store(key, (mean, count + share))
            return mean

    def restart(self, key, value: float | None = None) -> float | None:
        """Forgets the key's values: its mean is `value`, counted as one value (None: none, the
        next value added is its mean)."""
        with self._lock:
            self._values.store(key, None if value is None else (float(value), 1.0))
            return value

    def means(self) -> dict:
        """key -> its mean, for every key kept."""
        with self._lock:
            return {key: entry[0] for key, entry in self._values.items() if entry is not None}

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


class AcceptanceMemory:
    """Per-position acceptance of past calls, per key (the pair's weights, the method, greedy or
    not); the most recent keys only. Thread-safe."""

    def __init__(self, limit: int = 256):
        self._means = DecayedMeans(1.0 - ACCEPTANCE_MEMORY, limit)

    def known(self, key) -> float | None:
        """The remembered acceptance, None before any call of key."""
        return self._means.lookup(key)

    def update(self, key, observed: float | None, share: float = 1.0) -> None:
        """Adds a call's observed acceptance, counted as `share` of a call (`DecayedMeans.add`)."""
        if observed is not None:
            self._means.add(key, observed, share)

    def clear(self) -> None:
        self._means.clear()
