"""The verdict every verifier returns."""

from __future__ import annotations

from typing import NamedTuple

import jax


class VerifyResult(NamedTuple):
    """Outcome of one verification step, per batch row (a pytree of int32 arrays).

    num_accepted: int32 [B], in [0, L]: draft tokens kept from the chosen path.
    next_token:   int32 [B]: the correction token (a rejection happened) or the bonus token
                  (all L accepted), sampled so that the emitted sequence has the target's law.
    path_index:   int32 [B], in [0, K): the path whose first `num_accepted` tokens are kept
                  (the lowest index among paths sharing that prefix); 0 for single-path verifiers.

    Emitted sequence of row b: paths[b, path_index[b], :num_accepted[b]] + [next_token[b]].
    """

    num_accepted: jax.Array
    next_token: jax.Array
    path_index: jax.Array
