"""Options of method "ssd" (speculative speculative decoding / Saguaro): defaults and checks."""

from __future__ import annotations

import numpy as np

from ssd_jax.draft.fanout import check_fanout_options
from ssd_jax.engine.prompts import PromptBatch
from ssd_jax.engine.ssd import FALLBACKS
from ssd_jax.errors import InputError
from ssd_jax.model import Model

# Defaults: L = 4 and a budget of 2(L+1) = 10 speculations per step (benchmarks/bench_ssd.py).
SSD_DEFAULTS = dict(num_draft_tokens=4, fanout_budget=10, fanout="geometric", saguaro_c=1.0, fallback="jit",
                    target_devices=None, draft_devices=None, fanout_acceptance=None, fanout_exponent=None)


def ssd_options(target: Model, batch: PromptBatch, max_new_tokens: int, options: dict) -> dict:
    """Checks method "ssd"'s options against SSD_DEFAULTS; returns generate_ssd's keyword arguments
    (every option filled in). Raises InputError naming the bad option and value."""
    unknown = sorted(set(options) - set(SSD_DEFAULTS))
    if unknown:
        raise InputError(f"method 'ssd' does not take option(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(SSD_DEFAULTS)}")
    values = dict(SSD_DEFAULTS, **options)
    length = values["num_draft_tokens"]
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise InputError(f"num_draft_tokens must be an integer >= 1, got {length!r}")
    check_fanout_options(values["fanout"], values["fanout_budget"], values["fanout_acceptance"],
                         values["fanout_exponent"])
    c = values["saguaro_c"]
    if isinstance(c, bool) or not isinstance(c, (int, float, np.floating)) or not 0.0 <= c <= 1.0:
        raise InputError(f"saguaro_c must be a number in [0, 1] (1 disables Saguaro sampling), got {c!r}")
    if values["fallback"] not in FALLBACKS:
        raise InputError(f"fallback must be one of {', '.join(map(repr, FALLBACKS))}, got {values['fallback']!r}")
    needed = batch.max_length + int(max_new_tokens) + int(length) + 1
    if needed > target.config.max_position_embeddings:
        raise InputError(f"method 'ssd' needs up to {needed} positions, beyond the target's "
                         f"max_position_embeddings={target.config.max_position_embeddings}")
    values.update(num_draft_tokens=int(length), fanout_budget=int(values["fanout_budget"]), saguaro_c=float(c))
    return values
