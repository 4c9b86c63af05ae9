"""The adaptive loop's cost inputs (`LoopCosts`): what a step of each kind costs, the acceptance
the loop's estimates start from, and a forced cap for calibration. Traced, so one compiled program
serves every price; the host (`ssd_jax.tuning`) measures them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class LoopCosts:
    """Named cost inputs of the adaptive loop (`ssd_jax.loop.adaptive_loop`), float32 each.

    ar_step []: seconds of a plain (autoregressive) step;
    spec_step []: seconds of a speculative step without its draft forwards (the draft's catch-up,
        the target's verification, the commit);
    draft_forward []: seconds of one draft forward; for parts that take a cap without a draft
        model (capped retrieval, CSD), what one more verified token costs;
    acceptance []: the per-token acceptance the loop's running estimates start from (the prior);
    forced_cap []: 0: the loop chooses each step's cap and whether to speculate; > 0: every step
        speculates with its draft capped at that many tokens (how the host calibrates);
    cap_seconds [L] or None: seconds of a speculative step at each cap 1..L, 0 where not measured
        (priced linearly from spec_step and draft_forward); None: none measured.
    """

    ar_step: jax.Array
    spec_step: jax.Array
    draft_forward: jax.Array
    acceptance: jax.Array
    forced_cap: jax.Array
    cap_seconds: jax.Array | None = None

    @classmethod
    def from_vector(cls, vector: jax.Array, draft_len: int | None = None) -> "LoopCosts":
        """The costs of a float32 vector [NUM_COST_INPUTS] or [NUM_COST_INPUTS + L], the form the
        compiled programs take: positions 0-4 hold ar_step, spec_step, draft_forward, acceptance and
        forced_cap, and positions 5.. the cap seconds of caps 1, 2, ... Where draft_len is given,
        cap_seconds is the L = draft_len entries after the scalars, or None when the vector has
        fewer (a forced vector, `ssd_jax.tuning.cost_model.FORCE_SPECULATION`); else all of them
        (None when there are none)."""
        vector = vector.astype(jnp.float32)
        ar_step, spec_step, draft_forward, acceptance, forced_cap = (vector[i] for i in range(NUM_COST_INPUTS))
        size = vector.shape[0]
        if draft_len is None:
            cap_seconds = vector[NUM_COST_INPUTS:] if size > NUM_COST_INPUTS else None
        else:
            cap_seconds = (vector[NUM_COST_INPUTS:NUM_COST_INPUTS + draft_len]
                           if size >= NUM_COST_INPUTS + draft_len else None)
        return cls(ar_step=ar_step, spec_step=spec_step, draft_forward=draft_forward, acceptance=acceptance,
                   forced_cap=forced_cap, cap_seconds=cap_seconds)

    def to_vector(self) -> jax.Array:
        """float32 [NUM_COST_INPUTS (+ L)]: the inverse of `from_vector`."""
        scalars = jnp.stack([jnp.asarray(x, jnp.float32) for x in (
            self.ar_step, self.spec_step, self.draft_forward, self.acceptance, self.forced_cap)])
        if self.cap_seconds is None:
            return scalars
        return jnp.concatenate([scalars, jnp.asarray(self.cap_seconds, jnp.float32)])


# The scalar inputs before the per-cap seconds in `LoopCosts.from_vector`'s vector.
NUM_COST_INPUTS = 5


def cost_vector(*, ar_step: float, spec_step: float, draft_forward: float, acceptance: float,
                forced_cap: float = 0.0, cap_seconds=()) -> np.ndarray:
    """Named cost inputs as the compiled programs take them, built on the host: float32
    [NUM_COST_INPUTS + len(cap_seconds)] in `LoopCosts.from_vector`'s layout (fields as
    `LoopCosts`'; cap_seconds: seconds of a step at caps 1..L, 0 where not measured)."""
    return np.asarray([ar_step, spec_step, draft_forward, acceptance, forced_cap, *cap_seconds], np.float32)


def host_costs(vector) -> LoopCosts:
    """The `LoopCosts` of a cost vector read on the host (numpy float64, nothing traced): how the
    host prices a call's steps at the loop's prices (`ssd_jax.tuning.against_ar`)."""
    values = np.asarray(vector, np.float64)
    return LoopCosts(*(float(values[i]) for i in range(NUM_COST_INPUTS)),
                     cap_seconds=values[NUM_COST_INPUTS:] if values.shape[0] > NUM_COST_INPUTS else None)
