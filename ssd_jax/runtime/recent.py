"""A bounded most-recently-used table, for the caches and memories that must not grow with a
long-lived process's history."""

from __future__ import annotations

import collections


class Recent(collections.OrderedDict):
    """A dict that keeps its `limit` most recently used entries (one small entry per program or
    model pair: the caches below must not grow with a long-lived process's history)."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def lookup(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def store(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
