"""Streaming of tokens out of a jitted decode loop.

A compiled loop built with streaming on calls `emit` once per step (an ordered io_callback: a
small device-to-host copy per step, which is why streaming is opt-in). The callback forwards to
whatever sink `streaming_to` installed for the current call, so compiled programs never capture a
user's function and stay cached across calls. The runtime invokes callbacks on its own threads, so
the sink is process-wide: one streaming call at a time (a lock enforces it).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import jax
import numpy as np
from jax.experimental import io_callback

# sink(new_tokens int32 [B, N], counts int32 [B]): row b produced new_tokens[b, :counts[b]].
StreamSink = Callable[[np.ndarray, np.ndarray], None]

_SINK: list = [None]
_ONE_STREAM_AT_A_TIME = threading.Lock()


def _dispatch(tokens, counts) -> None:
    sink = _SINK[0]
    if sink is not None:
        sink(np.asarray(tokens), np.asarray(counts))


def emit(tokens: jax.Array, counts: jax.Array) -> None:
    """Inside a jitted loop: hands tokens int32 [B, N] and counts int32 [B] to the active sink."""
    io_callback(_dispatch, None, tokens, counts, ordered=True)


@contextlib.contextmanager
def streaming_to(sink: StreamSink | None):
    if sink is None:
        yield
        return
    with _ONE_STREAM_AT_A_TIME:
        _SINK[0] = sink
        try:
            yield
        finally:
            _SINK[0] = None
