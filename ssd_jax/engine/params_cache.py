"""A small cache of values derived from a model's params (decoded weights, weights placed on
devices), so that repeated generate calls on the same model skip the work."""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable


class ParamsCache:
    """Values per (params object, key), the last `size` of them kept. An entry holds its params
    object, so the object's id cannot be reused by another while the entry lives."""

    def __init__(self, size: int):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._size = size

    def get(self, params: Any, key: Hashable, make: Callable[[], Any]) -> tuple[Any, bool]:
        """(value, made): the cached value for (params, key), or make()'s, then kept."""
        slot = (id(params), key)
        entry = self._entries.get(slot)
        made = entry is None or entry[0] is not params
        if made:
            entry = (params, make())
            self._entries[slot] = entry
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        self._entries.move_to_end(slot)
        return entry[1], made

    def __len__(self) -> int:
        return len(self._entries)
