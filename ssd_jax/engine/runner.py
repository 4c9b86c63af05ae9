"""Running a compiled decode loop and packaging its buffers: the tail every synchronous
speculative engine shares (compile once per static key, time the call, build `GenerateOutput`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from ssd_jax.engine.compiled import compiled
from ssd_jax.engine.output import GenerateOutput, rows_from_buffers
from ssd_jax.engine.prompts import PromptBatch
from ssd_jax.engine.streaming import StreamSink, streaming_to
from ssd_jax.metrics import speculative_stats


def run_compiled(fn: Callable, static_key: Any, args: tuple, stream: StreamSink | None) -> tuple[Any, float, float]:
    """Compiles fn for args (cached under static_key) and runs it to completion.
    Returns (fn's outputs, decode wall seconds, compile seconds: 0.0 when cached)."""
    executable, compile_s = compiled(fn, static_key, *args)
    start = time.perf_counter()
    with streaming_to(stream):
        result = jax.block_until_ready(executable(*args))
    return result, time.perf_counter() - start, compile_s


def speculative_output(method: str, batch: PromptBatch, out, num_out, finish, counters, wall: float,
                       compile_s: float, extra_stats: dict) -> GenerateOutput:
    """GenerateOutput of a speculative decode: out int32 [B, N], num_out int32 [B], finish int32
    [B], counters SpecCounters; stats = method, batch_size, num_generated_tokens, extra_stats,
    the DESIGN.md section 6 counters, wall_time_s, compile_time_s, tokens_per_second."""
    num_out = np.asarray(num_out)
    tokens, reasons = rows_from_buffers(np.asarray(out), num_out, np.asarray(finish))
    generated = int(num_out.sum())
    stats = dict(method=method, batch_size=batch.batch_size, num_generated_tokens=generated, **extra_stats)
    stats.update(speculative_stats(jax.device_get(counters), num_out))
    stats.update(wall_time_s=wall, compile_time_s=compile_s,
                 tokens_per_second=generated / wall if wall > 0 else float("inf"))
    return GenerateOutput(tokens=tokens, finish_reasons=reasons, stats=stats)
