"""Streaming of tokens out of a decode run in pieces.

A streamed call runs two compiled programs: one that prefills and draws the first token
(`ssd_jax.loop.decoder.begin_arrays`), and one that goes on with the decode loop from a state
until every row is done or holds a given number of tokens (`resume_arrays`), called again and
again with a growing bound. The sink gets each piece's new tokens between the calls. Neither
program holds a host callback, so JAX's persistent compilation cache keeps them like any other
(a program that calls back to the host, as a per-step stream did, is compiled again in every
process: 10-12 s for the default speculative decoding's loop on a 2-core CPU, tens of seconds on
a GPU). A piece costs one read of the outputs back to the host, not one per step.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from ssd_jax.runtime.processes import agreed

# sink(new_tokens int32 [B, N], counts int32 [B]): row b produced new_tokens[b, :counts[b]].
StreamSink = Callable[[np.ndarray, np.ndarray], None]

# Tokens per piece past the slowest running row: a few at first, so the text starts to show at
# once, then doubling while a piece takes less than PIECE_SECONDS (text that appears ten times a
# second reads as continuous). Each piece costs a program launch and a read back to the host, and
# ends the adaptive loop's phase: on the embedded pair on a 2-core CPU ~0.3 ms a piece for AR and
# ~2 ms for SD, whose streamed calls decoded at 0.94-0.96x the unstreamed speed over 128 tokens
# and 0.94-0.97x over 448 (AR's 0.97x and 1.01x).
# Untimed (a deterministic tuner's calls) the pieces double up to FIXED_LAST_PIECE whatever their
# times: where "auto" samples, the pieces' ends steer its choices, hence the tokens drawn.
FIRST_PIECE = 4
PIECE_SECONDS = 0.1
FIXED_LAST_PIECE = 32


class TokenForwarder:
    """Hands a sink the tokens of each piece that it has not seen yet."""

    def __init__(self, sink: StreamSink, rows: int):
        self.sink = sink
        self.sent = np.zeros(rows, np.int64)

    def forward(self, tokens: np.ndarray, num_tokens: np.ndarray) -> None:
        """tokens int32 [B, N] of the decode so far (row b's first num_tokens[b] are generated)."""
        new = np.asarray(num_tokens, np.int64) - self.sent
        if not new.any():
            return
        width = int(new.max())
        piece = np.zeros((len(new), width), np.int32)
        for row, (start, count) in enumerate(zip(self.sent, new)):
            piece[row, :count] = tokens[row, start:start + count]
        self.sink(piece, new.astype(np.int32))
        self.sent += new


def stream_pieces(begin: Callable, resume: Callable, sink: StreamSink, timed: bool) -> tuple[object, float]:
    """Runs a decode in pieces: begin() -> (state, output) and resume(state, piece int32 []) ->
    (state, output), each output a `DecodeOutput` so far and each piece ending once every row is
    done or holds `piece` tokens more than the running row with the fewest had, until every row
    is finished; the sink gets every piece's new tokens. Each piece is queued before the one
    before it is read back (JAX dispatches asynchronously), so the device never waits on the host's
    read and the sink; the piece queued after the last is empty. Returns (the last output, wall
    seconds of the pieces and the sink). timed: pieces grow by their times (else up to
    FIXED_LAST_PIECE whatever their times, so that the pieces never depend on a timing)."""
    start = time.perf_counter()
    state, output = begin()
    forwarder = None
    piece = FIRST_PIECE
    read_at = start
    while True:
        state, queued = resume(state, np.int32(piece))
        num_tokens, finish, tokens = jax.device_get((output.num_tokens, output.finish_reason, output.tokens))
        if forwarder is None:
            forwarder = TokenForwarder(sink, len(num_tokens))
        forwarder.forward(tokens, num_tokens)
        if np.all(finish != 0):
            return output, time.perf_counter() - start
        now = time.perf_counter()
        if timed:   # process 0's timing on every process: they must pause alike
            quick = agreed(np.asarray([now - read_at < PIECE_SECONDS], np.float64))[0] > 0
        else:
            quick = piece < FIXED_LAST_PIECE
        read_at = now
        output = queued
        if quick:
            piece *= 2
