"""`GenerateOutput` and the conversion of a decoder's device buffers into per-row results."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FINISH_RUNNING, FINISH_EOS, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_RUNNING: "running", FINISH_EOS: "eos", FINISH_LENGTH: "length"}


@dataclasses.dataclass
class GenerateOutput:
    """tokens: per row, the generated ids (prompt excluded; the EOS token, if any, is the last);
    finish_reasons: per row "eos" or "length"; stats: a dict of metrics (see README)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict[str, Any]

    def texts(self, tokenizer) -> list[str]:
        """Decodes each row with a `tokenizers.Tokenizer`."""
        return [tokenizer.decode(row) for row in self.tokens]


def rows_from_buffers(out: np.ndarray, num_out: np.ndarray, finish: np.ndarray) -> tuple[list[list[int]], list[str]]:
    """out int32 [B, N], num_out int32 [B], finish int32 [B] -> python lists."""
    tokens = [out[b, : int(num_out[b])].tolist() for b in range(out.shape[0])]
    return tokens, [FINISH_NAMES[int(f)] for f in finish]
