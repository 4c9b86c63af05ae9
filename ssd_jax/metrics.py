"""Speculative-decoding counters with vLLM's definitions, accumulated on the device and turned
into the `stats` dict on the host.

num_drafts: verification steps (per row, summed); num_draft_tokens: tokens proposed (L per step
for a draft model; the valid tree nodes for retrieval drafters, whose matches can run short);
num_accepted_tokens: draft tokens accepted; accepted_per_position[i]: drafts whose token i+1 was
accepted; acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted / num_drafts
(counts the bonus token); block_efficiency = generated tokens / target calls (per row, summed).
Adaptive speculation adds num_rejected (drafts that ended in a rejection: the acceptance model's
evidence), ar_steps (loop steps that fell back to plain decoding), draft_forwards (the draft
forwards the loop ran after each step's catch-up, the batch's: a step drafts until its last row
stops), steps_by_cap (the batch's speculative steps at each cap 1..L the loop chose; with the
calibrated step prices this says what a call cost, where mean_draft_len mixes caps and rows),
mean_draft_len and ar_fallback_share (ar_steps / decode steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SpecCounters:
    """num_drafts int32 [B]; num_drafted int32 [B]; num_accepted int32 [B]; per_position int32 [B, L];
    target_calls int32 []; num_rejected int32 [B]; ar_steps int32 [B]; draft_forwards int32 [];
    cap_steps int32 [L]: speculative steps by cap 1..L (adaptive loops only; else zeros)."""

    num_drafts: jax.Array
    num_drafted: jax.Array
    num_accepted: jax.Array
    per_position: jax.Array
    target_calls: jax.Array
    num_rejected: jax.Array
    ar_steps: jax.Array
    draft_forwards: jax.Array
    cap_steps: jax.Array

    @classmethod
    def zeros(cls, batch: int, num_draft_tokens: int) -> "SpecCounters":
        return cls(num_drafts=jnp.zeros((batch,), jnp.int32), num_drafted=jnp.zeros((batch,), jnp.int32),
                   num_accepted=jnp.zeros((batch,), jnp.int32),
                   per_position=jnp.zeros((batch, num_draft_tokens), jnp.int32),
                   target_calls=jnp.ones((), jnp.int32), num_rejected=jnp.zeros((batch,), jnp.int32),
                   ar_steps=jnp.zeros((batch,), jnp.int32), draft_forwards=jnp.zeros((), jnp.int32),
                   cap_steps=jnp.zeros((num_draft_tokens,), jnp.int32))

    def record(self, active: jax.Array, num_accepted: jax.Array, num_drafted: jax.Array | None = None,
               draft_forwards: jax.Array | None = None) -> "SpecCounters":
        """One verification step: active bool [B] rows took part; num_accepted int32 [B];
        num_drafted int32 [B] tokens proposed (default: L, the width of per_position);
        draft_forwards int32 []: the step's draft forwards after its catch-up (None: not counted)."""
        length = self.per_position.shape[1]
        act = active.astype(jnp.int32)
        drafted = jnp.full_like(act, length) if num_drafted is None else num_drafted.astype(jnp.int32)
        positions = (jnp.arange(length)[None, :] < num_accepted[:, None]).astype(jnp.int32) * act[:, None]
        rejected = (num_accepted < drafted).astype(jnp.int32) * act
        forwards = 0 if draft_forwards is None else draft_forwards.astype(jnp.int32)
        return self.replace(num_drafts=self.num_drafts + act, num_drafted=self.num_drafted + drafted * act,
                            num_accepted=self.num_accepted + num_accepted * act,
                            per_position=self.per_position + positions, target_calls=self.target_calls + 1,
                            num_rejected=self.num_rejected + rejected,
                            draft_forwards=self.draft_forwards + forwards)

    def record_cap(self, cap: jax.Array) -> "SpecCounters":
        """One speculative step of an adaptive loop at cap int32 [] (1..L; one past L is dropped)."""
        return self.replace(cap_steps=self.cap_steps.at[cap - 1].add(1, mode="drop"))

    def record_ar_step(self, active: jax.Array) -> "SpecCounters":
        """One loop step that fell back to plain decoding (a target call, no draft) for the
        active rows (bool [B])."""
        return self.replace(target_calls=self.target_calls + 1, ar_steps=self.ar_steps + active.astype(jnp.int32))


def speculative_stats(counters: SpecCounters, num_out: np.ndarray) -> dict:
    """Host-side stats dict from the final counters and per-row generated counts."""
    drafts = int(np.sum(counters.num_drafts))
    accepted = int(np.sum(counters.num_accepted))
    drafted = int(np.sum(counters.num_drafted))
    generated = int(np.sum(num_out))
    ar_steps = int(np.sum(counters.ar_steps))
    row_calls = drafts + ar_steps + int(np.size(counters.num_drafts))  # + the prefill call
    return dict(
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        accepted_per_position=np.sum(np.asarray(counters.per_position), axis=0).tolist(),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_acceptance_length=1 + accepted / drafts if drafts else 0.0,
        block_efficiency=generated / row_calls if row_calls else 0.0,
        target_calls=int(counters.target_calls),
        mean_draft_len=drafted / drafts if drafts else 0.0,
        ar_fallback_share=ar_steps / (drafts + ar_steps) if drafts + ar_steps else 0.0,
        num_rejected=int(np.sum(counters.num_rejected)),
        steps_by_cap=np.asarray(counters.cap_steps).tolist(),
    )
