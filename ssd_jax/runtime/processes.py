"""Agreement between the processes of one program (jax.distributed): host-side values that shape
a program or its inputs must be the same on every process."""

from __future__ import annotations

import jax
import numpy as np


def agreed(values: np.ndarray) -> np.ndarray:
    """values as process 0 has them: a program spanning several processes (jax.distributed) must
    get the same plan and loop inputs on each, and timings differ between hosts."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values)))
