"""Helpers shared by the verifiers: input checks, dtype policy, safe ratios, residuals,
sampling from unnormalised weights, per-row keys, first-index reductions.

Every helper here works on one row (no batch axis) unless its docstring says otherwise and is
dtype-generic: float32 in normal use, float64 when the caller enables x64 (the exact-enumeration
tests do)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.errors import InputError
from ssd_jax.sampling import argmax_first  # noqa: F401  (the verifiers' argmax)


# --------------------------------------------------------------------------- input checks


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", jnp.shape(x)))


def _check_int(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise InputError(f"{name} must be an integer array of token ids, got dtype {x.dtype}")


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise InputError(f"{name} must be a floating-point probability array, got dtype {x.dtype}")


def as_probs(*arrays):
    """Cast probability arrays to one common float dtype: float32, or float64 when the caller
    passed float64 (possible only with x64 enabled); float16/bfloat16 are promoted to float32."""
    dtype = jnp.float32
    for x in arrays:
        dtype = jnp.promote_types(dtype, x.dtype)
    return tuple(jnp.asarray(x, dtype) for x in arrays)


def check_single(draft_tokens, q, p) -> tuple[int, int, int]:
    """Validate single-path inputs at trace time; return (B, L, V).

    draft_tokens int [B, L]; q float [B, L, V]; p float [B, L+1, V]."""
    draft_tokens, q, p = jnp.asarray(draft_tokens), jnp.asarray(q), jnp.asarray(p)
    if draft_tokens.ndim != 2:
        raise InputError(f"draft_tokens must have shape [B, L], got shape {_shape(draft_tokens)}")
    _check_int("draft_tokens", draft_tokens)
    b, l = draft_tokens.shape
    if l < 1:
        raise InputError(f"draft length L must be >= 1, got draft_tokens shape {_shape(draft_tokens)}")
    if q.ndim != 3 or q.shape[:2] != (b, l):
        raise InputError(
            f"q must have shape [B, L, V] = [{b}, {l}, V] to match draft_tokens {_shape(draft_tokens)}, "
            f"got shape {_shape(q)}")
    v = q.shape[2]
    if p.ndim != 3 or p.shape[:2] != (b, l + 1):
        raise InputError(
            f"p must have shape [B, L+1, V] = [{b}, {l + 1}, V] (one row per draft prefix plus the bonus row), "
            f"got shape {_shape(p)}")
    if p.shape[2] != v:
        raise InputError(f"vocabulary mismatch: q has V={v}, p has V={p.shape[2]}")
    if v < 1:
        raise InputError(f"vocabulary size V must be >= 1, got {v}")
    _check_float("q", q)
    _check_float("p", p)
    return b, l, v


def draft_lengths(lengths, draft_tokens) -> jax.Array:
    """Per-row proposed lengths int32 [B] for a single-path verifier: None -> all L; else checked
    (shape [B], integer; values in [0, L] are trusted, they come from the decode loop), placed over
    the batch as draft_tokens is (`rows_like`)."""
    b, l = draft_tokens.shape
    if lengths is None:
        return rows_like(jnp.full((b,), l, jnp.int32), draft_tokens)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise InputError(f"lengths must be integers [B] = [{b}] (draft tokens proposed per row), "
                         f"got shape {_shape(lengths)} {lengths.dtype}")
    return rows_like(jnp.clip(lengths.astype(jnp.int32), 0, l), draft_tokens)


def check_multi(paths, q, p) -> tuple[int, int, int, int]:
    """Validate multi-path inputs at trace time; return (B, K, L, V).

    paths int [B, K, L]; q float [B, K, L, V]; p float [B, K, L+1, V]."""
    paths, q, p = jnp.asarray(paths), jnp.asarray(q), jnp.asarray(p)
    if paths.ndim != 3:
        raise InputError(f"paths must have shape [B, K, L], got shape {_shape(paths)}")
    _check_int("paths", paths)
    b, k, l = paths.shape
    if k < 1:
        raise InputError(f"number of paths K must be >= 1, got paths shape {_shape(paths)}")
    if l < 1:
        raise InputError(f"draft length L must be >= 1, got paths shape {_shape(paths)}")
    if q.ndim != 4 or q.shape[:3] != (b, k, l):
        raise InputError(
            f"q must have shape [B, K, L, V] = [{b}, {k}, {l}, V] to match paths {_shape(paths)}, "
            f"got shape {_shape(q)}")
    v = q.shape[3]
    if p.ndim != 4 or p.shape[:3] != (b, k, l + 1):
        raise InputError(
            f"p must have shape [B, K, L+1, V] = [{b}, {k}, {l + 1}, V], got shape {_shape(p)}")
    if p.shape[3] != v:
        raise InputError(f"vocabulary mismatch: q has V={v}, p has V={p.shape[3]}")
    if v < 1:
        raise InputError(f"vocabulary size V must be >= 1, got {v}")
    _check_float("q", q)
    _check_float("p", p)
    return b, k, l, v


# --------------------------------------------------------------------------- arithmetic


def accept_prob(px, qx, scale=1.0):
    """min(1, px / (scale * qx)) with the 0/0 and x/0 cases defined: a token the draft could not
    have produced (qx = 0) is accepted iff the target gives it mass. Shapes broadcast."""
    den = scale * qx
    ratio = px / jnp.where(den > 0, den, 1)
    return jnp.where(den > 0, jnp.minimum(ratio, 1), jnp.where(px > 0, 1, 0).astype(ratio.dtype))


# A finite stand-in for log(p/0) = +inf: large enough to saturate any block weight, small enough
# that L of them summed stay finite (an inf here would make S_i - max_j S_j = inf - inf = NaN).
LOG_RATIO_CAP = 1.0e4


def log_ratio(px, qx):
    """log px - log qx, -inf where px = 0, LOG_RATIO_CAP where qx = 0 < px. Shapes broadcast."""
    safe_p = jnp.where(px > 0, px, 1)
    safe_q = jnp.where(qx > 0, qx, 1)
    lr = jnp.log(safe_p) - jnp.log(safe_q)
    lr = jnp.where(qx > 0, lr, LOG_RATIO_CAP)
    return jnp.where(px > 0, lr, -jnp.inf)


def gather_tokens(rows, tokens):
    """rows[i, tokens[i]] for rows [L, V] and tokens int [L] -> [L]."""
    return jnp.take_along_axis(rows, tokens[:, None], axis=-1)[:, 0]


def positive_part(x):
    return jnp.maximum(x, 0)


def normalize_or(weights, fallback, axis=-1):
    """weights / sum(weights); `fallback` where the sum is not positive (a 0/0 residual)."""
    total = jnp.sum(weights, axis=axis, keepdims=True)
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1), fallback)


# Vocabularies above 2 * _CHUNK are sampled in two stages (a chunk, then a token in it).
_CHUNK = 512


def _categorical_from_weights(key, weights):
    logits = jnp.where(weights > 0, jnp.log(jnp.where(weights > 0, weights, 1)), -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def sample_from_weights(key, weights, fallback):
    """One token id (int32 scalar) drawn proportionally to non-negative `weights` [V];
    `fallback` [V] is used instead when the weights sum to zero (a residual that exact arithmetic
    never selects).

    Gumbel-max over log weights, -inf for zeros: no normalisation and no long cumulative sum, so
    nothing overflows or loses tail mass at V = 152k. Large vocabularies draw a chunk of _CHUNK
    tokens with probability proportional to its mass, then a token within it: the same law
    (S_c / S * w_x / S_c = w_x / S) from V / _CHUNK + _CHUNK Gumbel variates instead of V, which
    is where a single draw spends its time on CPU."""
    use = jnp.where(jnp.sum(weights) > 0, weights, fallback)
    v = use.shape[0]
    if v <= 2 * _CHUNK:
        return _categorical_from_weights(key, use)
    k_chunk, k_token = jax.random.split(key)
    n_chunks = -(-v // _CHUNK)
    padded = jnp.pad(use, (0, n_chunks * _CHUNK - v)).reshape(n_chunks, _CHUNK)
    chunk = _categorical_from_weights(k_chunk, jnp.sum(padded, axis=1))
    within = _categorical_from_weights(k_token, padded[chunk])
    return chunk * _CHUNK + within


def row_keys(key, batch: int, like=None):
    """One independent key per batch row; like: an input whose axis 0 is the batch, the keys
    then placed as its rows are (`rows_like`)."""
    return rows_like(jax.random.split(key, batch), like)


def rows_like(x, like):
    """x (axis 0: the batch), the same values, sharded over the batch as `like` is.

    Under a mesh with Explicit axes (`jax.make_mesh`'s default) an input sharded over the batch
    carries that sharding in its type, and `jax.vmap` requires every mapped input to be sharded
    alike over the mapped axis: arrays the verifiers build themselves (per-row keys split from
    one key, default lengths, broadcast parents) are replicated, so they are resharded to the
    batch's axes. Elsewhere (Auto meshes, `jax.shard_map`, one device, like None) x is returned
    as it is."""
    typeof = getattr(jax, "typeof", None)
    if like is None or typeof is None:
        return x
    sharding = getattr(typeof(like), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return x
    target = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[0]))
    return jax.sharding.reshard(x, target)


def typed_like(x, *refs):
    """x (a pytree), the same values, typed as a value computed from refs is: mapped where refs
    are mapped (`jax.vmap`), device-varying over every manual mesh axis that any of refs varies
    over (`jax.shard_map`), sharded over the batch where refs are (Explicit mesh axes).

    Values built from constants (`jnp.ones(...)`, `jnp.arange(...)`) have none of these types,
    and three checks reject them where they meet values computed from the inputs:
    - inside `jax.shard_map` (check_vma) a loop's carry must enter a `scan` or `fori_loop` with
      the type its body returns, device-varying when the body reads a varying input;
    - under `jax.vmap` over a batch sharded over Explicit mesh axes, a loop's batching rule gives
      an unmapped initial carry the batch's sharding against a constant's empty mesh ("Resource
      axis ... not found in mesh: ()", jax 0.10.2);
    - there, too, indexing an unmapped array with mapped indices cannot choose the gather's
      output sharding ("Use `.at[...].get(out_sharding=)`").
    The anchor, a bool read from each ref, carries those types; a select between equal operands
    carries them to x, whatever the anchor holds. XLA folds the select (its operands are equal)
    and drops the anchor; x's values are unchanged everywhere."""
    anchor = jnp.zeros((), bool)
    for ref in refs:
        ref = jnp.asarray(ref)
        if jnp.issubdtype(ref.dtype, jax.dtypes.prng_key):
            ref = jax.random.key_data(ref)
        first = jnp.ravel(ref)[0]
        anchor = anchor | (first != first)
    return jax.tree.map(lambda leaf: jnp.where(anchor, leaf, leaf), x)


def first_true(mask):
    """Index of the first True along the last axis (0 when there is none), int32."""
    return jnp.argmax(mask, axis=-1).astype(jnp.int32)


def leading_true_count(mask):
    """Number of leading True values along the last axis, int32."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
