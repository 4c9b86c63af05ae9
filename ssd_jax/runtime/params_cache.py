"""A small cache of values derived from a model's params (decode-layout weights, weights placed
on devices), so that repeated `generate` calls on the same params skip the work, and that holds
no params alive: an entry is keyed by the identities of the params' leaves, holds only weak
references to them, and is dropped as soon as one of them is garbage-collected."""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Hashable

import jax


class ParamsCache:
    """Values per (params pytree, key), the last `size` of them kept, weakly keyed.

    A value that holds one of its own key's leaves (e.g. a pass-through weight) is still made but
    not kept, since keeping it would keep its params alive."""

    def __init__(self, size: int):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        # Entries whose params were collected, dropped at the next call: a finalizer may run in
        # the middle of a call that holds the lock (a garbage collection there), so it never
        # takes the lock itself (that deadlocked).
        self._dead: collections.deque = collections.deque()

    def get(self, params: Any, key: Hashable, make: Callable[[], Any]) -> tuple[Any, bool]:
        """(value, made): the cached value for (params, key), or make()'s (then kept when it can be)."""
        leaves = jax.tree.leaves(params)
        slot = (tuple(id(x) for x in leaves), key)
        with self._lock:
            self._drop_dead()
            entry = self._entries.get(slot)
            if entry is not None and all(ref() is x for ref, x in zip(entry[0], leaves)):
                self._entries.move_to_end(slot)
                return entry[1], False
        value = make()
        kept_ids = {id(x) for x in jax.tree.leaves(value)}
        if not leaves or any(id(x) in kept_ids for x in leaves):
            return value, True
        try:
            refs = tuple(weakref.ref(x) for x in leaves)
        except TypeError:  # leaves that cannot be weakly referenced (e.g. numpy arrays): not kept
            return value, True
        with self._lock:
            self._drop_dead()
            self._entries[slot] = (refs, value)
            self._entries.move_to_end(slot)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        weakref.finalize(leaves[0], self._drop, slot, refs)
        return value, True

    def _drop(self, slot, refs) -> None:
        self._dead.append((slot, refs))   # deque.append is atomic; no lock here (see __init__)

    def _drop_dead(self) -> None:
        """Drops the entries of collected params (the caller holds the lock)."""
        while self._dead:
            slot, refs = self._dead.popleft()
            entry = self._entries.get(slot)
            if entry is not None and entry[0] is refs:
                del self._entries[slot]

    def __len__(self) -> int:
        with self._lock:
            self._drop_dead()
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# Copies of unsharded models' params placed on a group of devices (SSD's device groups), per
# params object and device ids.
REPLICAS = ParamsCache(4)
