"""On-device n-gram retrieval over per-row token buffers: find where an n-gram last occurred in
the text and copy what followed it. Prompt lookup (PLD), LogitSpec and Cascade Speculative
Drafting's Max-Gram all draft with it.

A context is a fixed-capacity buffer int32 [B, C] whose row b holds text in [0, length[b]);
entries past length are garbage and never count as text. Every function here is pure, jit-able
(the keyword-only arguments are static) and works on static shapes: a search is a handful of
[B, Q, C] comparisons, one per n-gram order, with no loop over the data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.errors import InputError


def find_continuation(
    context: jax.Array,
    length: jax.Array,
    query: jax.Array,
    query_len: jax.Array,
    *,
    n_min: int,
    n_max: int,
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Looks up Q n-gram queries per row and returns what followed their best earlier occurrence.

    context int32 [B, C], length int32 [B]. query int32 [B, Q, n_max]: query[b, q, n_max-1] is
    the most recent token; query_len int32 [B, Q] says how many trailing elements are valid.
    For n from n_max down to n_min (only n <= query_len), a match of order n is an end position e
    with context[e-n+1 .. e] == query[b, q, -n:] and at least one token after it (e + 1 < length).
    The largest n with any match wins; among its matches the most recent one with all num_tokens
    continuation tokens available (e + num_tokens < length), else the most recent one.

    Returns (tokens int32 [B, Q, num_tokens] = context[e+1 .. e+num_tokens], zero past the
    available continuation; count int32 [B, Q] valid continuation tokens; matched_n int32 [B, Q]
    the winning n). count and matched_n are 0 and tokens all 0 where nothing matched.
    """
    _check_orders(n_min, n_max, num_tokens)
    context, length, query, query_len = map(jnp.asarray, (context, length, query, query_len))
    batch, capacity = _check_context(context, length)
    if query.ndim != 3 or query.shape[0] != batch or query.shape[2] != n_max:
        raise InputError(f"query must have shape [B={batch}, Q, n_max={n_max}], got {tuple(query.shape)}")
    num_queries = query.shape[1]
    if tuple(query_len.shape) != (batch, num_queries):
        raise InputError(f"query_len must have shape [{batch}, {num_queries}], got {tuple(query_len.shape)}")

    context = context.astype(jnp.int32)
    query = query.astype(jnp.int32)
    length = jnp.clip(length.astype(jnp.int32), 0, capacity)
    positions = jnp.arange(capacity, dtype=jnp.int32)
    has_next = positions[None, :] + 1 < length[:, None]  # [B, C]
    has_all = positions[None, :] + num_tokens < length[:, None]  # [B, C]
    # Ranks are distinct per position and put every full continuation above every partial one,
    # so one max over C picks the preferred match and `rank % C` recovers its position.
    rank = positions[None, :] + jnp.where(has_all, capacity, 0)  # [B, C]

    best_end = jnp.zeros((batch, num_queries), jnp.int32)
    best_n = jnp.zeros((batch, num_queries), jnp.int32)
    # matches[b, q, e]: context[e-k .. e] equals the last k+1 query tokens (built up one k at a time).
    matches = jnp.ones((batch, num_queries, capacity), bool)
    for k in range(n_max):
        n = k + 1
        shifted = _shift_right(context, k)  # shifted[:, e] = context[:, e - k]
        matches = matches & (shifted[:, None, :] == query[:, :, n_max - 1 - k, None]) & (positions >= k)
        if n < n_min:
            continue
        usable = matches & has_next[:, None, :] & (n <= query_len)[:, :, None]
        best = jnp.max(jnp.where(usable, rank[:, None, :], -1), axis=-1)  # [B, Q]
        # n grows along the loop, so a later (longer) match overrides an earlier one.
        found = best >= 0
        best_end = jnp.where(found, best % capacity, best_end)
        best_n = jnp.where(found, n, best_n)

    matched = best_n > 0
    count = jnp.where(matched, jnp.minimum(num_tokens, length[:, None] - 1 - best_end), 0)
    offsets = jnp.arange(num_tokens, dtype=jnp.int32)
    index = jnp.minimum(best_end[..., None] + 1 + offsets, capacity - 1)  # [B, Q, T]
    gathered = jnp.take_along_axis(context, index.reshape(batch, -1), axis=1).reshape(index.shape)
    tokens = jnp.where(offsets < count[..., None], gathered, 0)
    return tokens, count.astype(jnp.int32), best_n


def suffix_queries(context: jax.Array, length: jax.Array, n_max: int) -> tuple[jax.Array, jax.Array]:
    """The last n_max tokens of each row as one query: what prompt lookup matches.

    context int32 [B, C], length int32 [B]. Returns (query int32 [B, 1, n_max], left-padded with 0;
    query_len int32 [B, 1] = min(n_max, length)). The suffix ends at length - 1, where nothing
    follows, so `find_continuation` never matches it with itself.
    """
    if n_max < 1:
        raise InputError(f"n_max must be at least 1, got {n_max}")
    context, length = jnp.asarray(context), jnp.asarray(length)
    _, capacity = _check_context(context, length)
    length = jnp.clip(length.astype(jnp.int32), 0, capacity)
    index = length[:, None] + jnp.arange(-n_max, 0, dtype=jnp.int32)  # [B, n_max]
    gathered = jnp.take_along_axis(context.astype(jnp.int32), jnp.clip(index, 0, capacity - 1), axis=1)
    query = jnp.where(index >= 0, gathered, 0)
    return query[:, None, :], jnp.minimum(n_max, length)[:, None]


def append_tokens(
    context: jax.Array, length: jax.Array, tokens: jax.Array, count: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Writes tokens[b, :count[b]] at context[b, length[b]:].

    context int32 [B, C], length int32 [B], tokens int32 [B, T], count int32 [B] (clipped to
    [0, T]). Writes that would land at or past C are dropped, never wrapped. Returns (context
    int32 [B, C], length int32 [B] = min(length + count, C)).
    """
    context, length, tokens, count = map(jnp.asarray, (context, length, tokens, count))
    batch, capacity = _check_context(context, length)
    if tokens.ndim != 2 or tokens.shape[0] != batch:
        raise InputError(f"tokens must have shape [B={batch}, T], got {tuple(tokens.shape)}")
    if tuple(count.shape) != (batch,):
        raise InputError(f"count must have shape [{batch}], got {tuple(count.shape)}")
    width = tokens.shape[1]
    length = jnp.clip(length.astype(jnp.int32), 0, capacity)
    count = jnp.clip(count.astype(jnp.int32), 0, width)
    offsets = jnp.arange(width, dtype=jnp.int32)
    # Unwanted writes are sent to column C, which mode="drop" discards.
    columns = jnp.where(offsets[None, :] < count[:, None], length[:, None] + offsets[None, :], capacity)
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], columns.shape)
    context = context.astype(jnp.int32).at[rows, columns].set(tokens.astype(jnp.int32), mode="drop")
    return context, jnp.minimum(length + count, capacity)


def _shift_right(context: jax.Array, k: int) -> jax.Array:
    """context shifted k columns to the right, -1 in the vacated columns: int32 [B, C]."""
    if k == 0:
        return context
    capacity = context.shape[1]
    return jnp.pad(context, ((0, 0), (k, 0)), constant_values=-1)[:, :capacity]


def _check_context(context: jax.Array, length: jax.Array) -> tuple[int, int]:
    if context.ndim != 2 or context.shape[1] < 1:
        raise InputError(f"context must have shape [B, C] with C >= 1, got {tuple(context.shape)}")
    if not jnp.issubdtype(context.dtype, jnp.integer):
        raise InputError(f"context must hold integer token ids, got dtype {context.dtype}")
    if tuple(length.shape) != (context.shape[0],):
        raise InputError(f"length must have shape [{context.shape[0]}], got {tuple(length.shape)}")
    return context.shape[0], context.shape[1]


def _check_orders(n_min: int, n_max: int, num_tokens: int) -> None:
    if n_min < 1:
        raise InputError(f"n_min must be at least 1, got {n_min}")
    if n_max < n_min:
        raise InputError(f"n_max must be at least n_min={n_min}, got {n_max}")
    if num_tokens < 1:
        raise InputError(f"num_tokens must be at least 1, got {num_tokens}")
