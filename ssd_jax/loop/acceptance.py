"""The adaptive loop's model of acceptance and of the steps a batch still needs
(`ssd_jax.loop.adaptive_loop`): pure functions of the decayed per-row, per-position sums R_k (the
step's draft reached position k) and A_k (its k-th token was accepted).

alpha_k = A_k / R_k, each shrunk towards the acceptance pooled over positions, and a draft capped
at l tokens emits E(l) = 1 + sum_{k<=l} prod_{j<=k} alpha_j tokens per step, sd(l) its spread. A
batch runs until its slowest row is done, so a cap is judged by the steps the batch still needs,
the most any running row needs for its r remaining tokens (`batch_steps`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Steps' worth of pull of each position's acceptance towards the acceptance pooled over positions
# (`reach_probabilities`): a position whose estimate fell low by chance, and that shorter caps then
# stop measuring, drifts back and is tried again; a weaker pull left the caps short of the best.
POOLING = 8.0
# Parts that dispatch their caps once per run of steps (`dispatch_caps`) change cap only for one
# that is faster by this share (`cap_index`): leaving one compiled step's loop for another's passes
# the KV caches through a conditional, and between two caps of nearly equal speed the loop would
# flip every few steps.
SWITCH_MARGIN = 0.05
# Where caps are dispatched per run of steps at batch > 1 (no exploration bonus there), a run at
# the next cap up whenever the batch's long-memory evidence at the first position the current cap
# never reaches has decayed below this many steps' worth (`probe_up`): DECIDE_EVERY steps every ~50
# at cap c + 1, so a batch does not stay for good at a cap shorter than pays.
PROBE_BELOW = 1.0
# ... and only where the model prices the next cap within this share of the current one: a probe
# settles near ties, and a dearer cap's probe only costs.
PROBE_WITHIN = 0.1


def pooled_acceptance(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """The acceptance pooled over all positions, float32 [..., 1], from per-position sums float32
    [..., L] (no evidence at all: the prior acceptance)."""
    tiny = 1e-6
    return ((jnp.sum(accepted, axis=-1, keepdims=True) + tiny * prior)
            / (jnp.sum(reached, axis=-1, keepdims=True) + tiny))


def reach_probabilities(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                        optimism: float | jax.Array = 0.0, shape: jax.Array | None = None) -> jax.Array:
    """P(a step emits more than k tokens) = prod_{j<=k} alpha_j for k = 1..L, float32 [..., L],
    from the per-position sums float32 [..., L] (a row's, or one per row), each shrunk towards
    the acceptance pooled over all positions by POOLING steps' worth (no evidence at all: the
    prior acceptance), times shape_k where given (float32 [L], `position_shape`). Without the
    pull, a position whose estimate fell low by chance is no longer drafted, so never corrected:
    the caps would drift short. optimism: each alpha_k raised by that many standard errors,
    sqrt(alpha (1 - alpha) / n_k) with n_k = R_k + POOLING."""
    pooled = pooled_acceptance(reached, accepted, prior)
    if shape is not None:
        pooled = jnp.clip(pooled * shape, 0.0, 1.0)
    alpha = jnp.clip((accepted + POOLING * pooled) / (reached + POOLING), 0.0, 1.0)
    alpha = jnp.minimum(alpha + optimism * jnp.sqrt(alpha * (1 - alpha) / (reached + POOLING)), 1.0)
    return jnp.cumprod(alpha, axis=-1)


def expected_tokens_by_cap(reached: jax.Array, accepted: jax.Array, prior: jax.Array) -> jax.Array:
    """E(l) for l = 1..L, float32 [..., L]."""
    return 1 + jnp.cumsum(reach_probabilities(reached, accepted, prior), axis=-1)


def tokens_moments(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                   optimism: float | jax.Array = 0.0, shape: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(E(l), sd(l)) for l = 1..L, float32 [..., L] each: the mean and spread of the tokens a step
    capped at l emits, under the per-position model (`reach_probabilities`): E = 1 + sum_k P_k,
    E[T^2] = 1 + sum_k (2k + 1) P_k over k <= l."""
    p = reach_probabilities(reached, accepted, prior, optimism, shape)
    k = jnp.arange(1, reached.shape[-1] + 1, dtype=jnp.float32)
    mean = 1 + jnp.cumsum(p, axis=-1)
    second = 1 + jnp.cumsum((2 * k + 1) * p, axis=-1)
    return mean, jnp.sqrt(jnp.maximum(second - mean * mean, 0.0))


def tokens_mean_and_spread(reached: jax.Array, accepted: jax.Array, prior: jax.Array,
                           cap: jax.Array, shape: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(E, sd) of the tokens a step capped at `cap` emits, float32 [...] each."""
    mean, sd = tokens_moments(reached, accepted, prior, shape=shape)
    return mean[..., cap - 1], sd[..., cap - 1]


def within_remaining(mean: jax.Array, sd: jax.Array, remaining: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E(l), sd(l)) by cap l = 1..L, float32 [B, L] each, of the tokens a step emits that its row
    keeps: a row with r tokens left (remaining int32 [B]) keeps at most r, and min(T_l, r) =
    T_min(l, r - 1), so cap l counts as cap min(l, r - 1) there (cap 0: one token, no spread).
    Without it the call's last steps would price a long cap's tokens the row can never keep, and
    draft long for a row with one token left, where a plain step costs less."""
    length = mean.shape[-1]
    caps = jnp.minimum(jnp.arange(1, length + 1)[None, :], jnp.clip(remaining, 1, length + 1)[:, None] - 1)
    index = jnp.maximum(caps - 1, 0)
    kept = jnp.where(caps > 0, jnp.take_along_axis(mean, index, axis=-1), 1.0)
    return kept, jnp.where(caps > 0, jnp.take_along_axis(sd, index, axis=-1), 0.0)


def expected_largest_normal(count: jax.Array) -> jax.Array:
    """The expected largest of `count` standard normal draws (Blom's approximation,
    Phi^-1((n - 0.375) / (n + 0.25))): 0 for one, 0.59 for two, 1.43 for eight (exactly: 1.42)."""
    n = jnp.maximum(count, 1).astype(jnp.float32)
    return jax.scipy.special.ndtri((n - 0.375) / (n + 0.25))


def batch_steps(mean: jax.Array, sd: jax.Array, remaining: jax.Array, running: jax.Array) -> jax.Array:
    """The steps the batch still needs, float32 [...]: the most any running row needs for its
    remaining tokens at mean +- sd tokens per step (mean, sd float32 [B, ...]; remaining int32 [B];
    running bool [B]): r / mean + z_B sqrt(r) sd / mean^1.5, with z_B the expected largest of the
    running rows' standardised spreads (`expected_largest_normal`), at most r (a step emits at
    least one token, while at a large batch the spread term alone can count more)."""
    extra = (mean.ndim - 1) * (None,)
    r = jnp.maximum(remaining, 0).astype(jnp.float32)[(slice(None),) + extra]
    mean = jnp.maximum(mean, 1.0)
    z = expected_largest_normal(jnp.sum(running))
    steps = jnp.minimum(r / mean + z * jnp.sqrt(r) * sd / mean ** 1.5, r)
    return jnp.max(jnp.where(running[(slice(None),) + extra], steps, 0.0), axis=0)


def toward_batch(reached: jax.Array, accepted: jax.Array, running: jax.Array,
                 pooling: float) -> tuple[jax.Array, jax.Array]:
    """Per-row sums float32 [B, L] with `pooling` steps of the running rows' (bool [B]) mean
    row added to each row's (the largest of a batch's few-step estimates is mostly chance)."""
    weight = running.astype(jnp.float32)[:, None] / jnp.maximum(jnp.sum(running), 1)
    mean_reached = jnp.sum(reached * weight, axis=0)
    mean_accepted = jnp.sum(accepted * weight, axis=0)
    per_step = pooling / jnp.maximum(mean_reached[0], 1e-6)
    return reached + per_step * mean_reached, accepted + per_step * mean_accepted


def position_shape(reached: jax.Array, accepted: jax.Array, running: jax.Array, prior: jax.Array) -> jax.Array:
    """The batch's acceptance at each position over its acceptance pooled over positions, float32
    [L], from the running rows' (bool [B]) sums float32 [B, L] (each position shrunk towards the
    pooled one by POOLING of the batch's steps): what a row's estimates are pulled towards, times
    the row's own pooled acceptance. Acceptance clusters (a token after an accepted one is the
    likelier accepted), so a row's pooled acceptance, mostly position 1's, prices the positions
    past a cap low; a step at cap c never reaches c + 1, and after a few steps' probe there the
    rows' own few reaches would leave that low guess outweighing what the whole batch measured,
    holding the batch at a cap shorter than pays."""
    rows = running.astype(jnp.float32)[:, None]
    batch_reached = jnp.sum(reached * rows, axis=0)
    batch_accepted = jnp.sum(accepted * rows, axis=0)
    pooled = pooled_acceptance(batch_reached, batch_accepted, prior)
    alpha = (batch_accepted + POOLING * pooled) / (batch_reached + POOLING)
    return alpha / jnp.maximum(pooled, 1e-6)


def position_counts(verdict, active: jax.Array, draft_len: int) -> tuple[jax.Array, jax.Array]:
    """Whether each row in `active` (bool [B]) had its draft reach each position 1..L this step
    and its token there accepted, float32 [B, L] each (a row reaches k when it proposed k tokens
    and the first k - 1 were accepted). A row that proposed nothing (retrieval that found no
    match, a draft unsure of its first token) counts as reaching 1 and missing there: its step
    emitted one token at a speculative step's cost, and a model that took it for no evidence
    would keep speculating where most steps propose nothing. A gated step that ran as a plain
    one (`Verdict.verified` False) counts nothing: it cost a plain step."""
    k = jnp.arange(1, draft_len + 1, dtype=jnp.int32)[None, :]
    drafted = verdict.drafted if verdict.drafted is not None else jnp.full_like(verdict.accepted, draft_len)
    accepted = verdict.accepted[:, None]
    rows = active[:, None] if verdict.verified is None else (active & verdict.verified)[:, None]
    reached = rows & ((drafted[:, None] >= k) | (k == 1)) & (accepted >= k - 1)
    hit = rows & (accepted >= k)
    return reached.astype(jnp.float32), hit.astype(jnp.float32)


def probe_up(index: jax.Array, candidate: jax.Array, long_reached: jax.Array, running: jax.Array,
             seconds: jax.Array) -> jax.Array:
    """The cap index to run (int32 []): the next candidate above `index` (int32 []; candidate
    bool [L]) where the running rows' (bool [B]) mean long-memory evidence at that cap's first
    new position (long_reached float32 [B, L]) has decayed below PROBE_BELOW steps' worth and
    its seconds to finish the batch (seconds float32 [L]) are within PROBE_WITHIN of index's,
    else index. A step at cap c never reaches position c + 1, so what the loop knows of it is pooled
    from the positions it measures; acceptance clusters (a token after an accepted one is the
    likelier accepted), so the pooled guess runs low and a near tie between c and the next cap
    would stay at c for good."""
    later = candidate & (jnp.arange(candidate.shape[0]) > index)
    has_next = jnp.any(later)
    nxt = jnp.where(has_next, jnp.argmax(later), index).astype(jnp.int32)
    weight = running.astype(jnp.float32) / jnp.maximum(jnp.sum(running), 1)
    evidence = jnp.sum(long_reached[:, jnp.minimum(index + 1, candidate.shape[0] - 1)] * weight)
    near = seconds[nxt] <= (1 + PROBE_WITHIN) * seconds[index]
    return jnp.where(has_next & (evidence < PROBE_BELOW) & near, nxt, index).astype(jnp.int32)


def cap_index(seconds: jax.Array, current: jax.Array, sticky: bool) -> jax.Array:
    """The index (int32 []) of the cap a step runs at, from the seconds to finish the batch by
    cap (float32 [L], inf where l is no candidate): the fastest (the longest of exact ties), or
    where `sticky` (caps dispatched once per run of steps) the current index (int32 []) unless the
    fastest is SWITCH_MARGIN faster than it."""
    index = seconds.shape[-1] - 1 - jnp.argmin(seconds[::-1])
    if sticky:
        index = jnp.where(seconds[current] * (1 - SWITCH_MARGIN) <= seconds[index], current, index)
    return jnp.asarray(index, jnp.int32)
