"""`GenerateOutput` and the conversion of a decoder's device buffers into per-row results."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ssd_jax.loop.emission import FINISH_EOS, FINISH_LENGTH, FINISH_RUNNING

FINISH_NAMES = {FINISH_RUNNING: "running", FINISH_EOS: "eos", FINISH_LENGTH: "length"}


@dataclasses.dataclass
class GenerateOutput:
    """tokens: per row, the generated ids (prompt excluded; the EOS token, if any, is the last);
    finish_reasons: per row "eos" or "length"; stats: a dict of metrics (see
    docs/internals.md#outputs-and-stats); plan: the `ssd_jax.Plan` the call ran."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict[str, Any]
    plan: Any = None   # the `ssd_jax.Plan` the call ran (`decode(..., plan=)` replays it)

    def texts(self, tokenizer) -> list[str]:
        """Decodes each row with a `tokenizers.Tokenizer`."""
        return [tokenizer.decode(row) for row in self.tokens]


def rows_from_buffers(out: np.ndarray, num_out: np.ndarray, finish: np.ndarray) -> tuple[list[list[int]], list[str]]:
    """out int32 [B, N], num_out int32 [B], finish int32 [B] -> python lists."""
    tokens = [out[b, : int(num_out[b])].tolist() for b in range(out.shape[0])]
    return tokens, [FINISH_NAMES[int(f)] for f in finish]


def generate_output(method: str, out, num_out, finish, counters, wall: float, compile_s: float,
                    extra_stats: dict, drafts: bool = True) -> GenerateOutput:
    """GenerateOutput of a decode: out int32 [B, N], num_out int32 [B], finish int32 [B],
    counters `SpecCounters`; stats = method, batch_size, num_generated_tokens, extra_stats, the
    DESIGN.md section 6 counters (with drafts; else target_calls only), wall_time_s,
    compile_time_s, tokens_per_second."""
    from ssd_jax.metrics import speculative_stats

    num_out = np.asarray(num_out)
    tokens, reasons = rows_from_buffers(np.asarray(out), num_out, np.asarray(finish))
    generated = int(num_out.sum())
    stats = dict(method=method, batch_size=len(tokens), num_generated_tokens=generated, **extra_stats)
    counters = jax.device_get(counters)
    stats.update(speculative_stats(counters, num_out) if drafts else dict(target_calls=int(counters.target_calls)))
    stats.update(wall_time_s=wall, compile_time_s=compile_s,
                 tokens_per_second=generated / wall if wall > 0 else float("inf"))
    return GenerateOutput(tokens=tokens, finish_reasons=reasons, stats=stats)
