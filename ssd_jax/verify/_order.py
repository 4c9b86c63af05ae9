"""GBV's total order on tokens at a node: (log p - log q, token id), ascending, as integer keys,
and the draft mass before each token in that order.

Selection and cumulative sums both read these integer keys, so they use bit-identical keys and
the same tie-break (token id); a mismatch between the two orders is what makes some GBV
implementations inexact."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.backend import per_platform
from ssd_jax.verify._common import typed_like


def order_key(p, q):
    """Unsigned integers whose order is the order of the float key log p - log q (ascending),
    unclipped: -inf where p = 0, +inf where q = 0 < p. Tokens with p = q = 0 get +inf: they have no
    draft mass, so their place in the order changes no cumulative sum. -0.0 is folded into +0.0
    so that integer order equals float order; ties are left for the caller to break by token id.

    Integer keys make the sort a plain integer sort (several times faster than a float sort on
    CPU) and make selection and cumulative sums use bit-identical keys."""
    key = log_ratio_unclipped(p, q) + 0.0
    if key.dtype == jnp.float64:
        utype, bits = jnp.uint64, 64
    else:
        key = key.astype(jnp.float32)
        utype, bits = jnp.uint32, 32
    u = jax.lax.bitcast_convert_type(key, utype)
    sign = utype(1 << (bits - 1))
    negative = (u & sign) != 0
    return jnp.where(negative, ~u, u | sign)


def log_ratio_unclipped(p, q):
    """log p - log q with -inf where p = 0 and +inf where q = 0 < p or p = q = 0; never NaN."""
    lp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1)), -jnp.inf)
    lq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1)), -jnp.inf)
    diff = jnp.where((p > 0) & (q > 0), lp - lq, 0)
    return jnp.where(q > 0, jnp.where(p > 0, diff, -jnp.inf), jnp.inf)


def _pair_sort_order(keys):
    """Token ids sorted by (key, id): one stable key/value sort."""
    ids = jnp.arange(keys.shape[0], dtype=jnp.int32)
    return jax.lax.sort((keys, ids), num_keys=1, is_stable=True)[1]


def _radix_order(keys):
    """Token ids sorted by (key, id), by LSD radix over passes of single-operand uint32 sorts.

    Each pass sorts (digit << pos_bits) | position: the values are distinct, so the sort is a
    stable sort by the digit, and the ids come back in the low bits. Starting from id order,
    passes over the key's digits from least to most significant leave the (key, id) order.
    On CPU a single-operand integer sort is several times faster than a key/value sort, so the
    2 passes (V <= 2^15) or 3 passes (V <= 2^18) beat one key/value sort."""
    v = keys.shape[0]
    key_bits = keys.dtype.itemsize * 8
    pos_bits = max(1, (v - 1).bit_length())
    digit_bits = 32 - pos_bits
    positions = jnp.arange(v, dtype=jnp.uint32)
    order = typed_like(jnp.arange(v, dtype=jnp.int32), keys)   # indexed by values read from keys
    for shift in range(0, key_bits, digit_bits):
        width = min(digit_bits, key_bits - shift)
        digit = ((keys[order] >> shift) & ((1 << width) - 1)).astype(jnp.uint32)
        packed = jnp.sort((digit << pos_bits) | positions)
        order = order[(packed & ((1 << pos_bits) - 1)).astype(jnp.int32)]
    return order


def sort_order(keys):
    """Token ids [V] (int32) sorted by (keys ascending, id ascending); keys unsigned [V].
    Radix passes when compiled for CPU, one key/value sort elsewhere (GPU and TPU sort pairs
    natively); both give the same order."""
    if keys.shape[0] >= 1 << 31:
        return _pair_sort_order(keys)
    return per_platform(keys, cpu=_radix_order, default=_pair_sort_order)


def cdf_before(keys, q):
    """F^-(x) [V]: draft mass of the tokens strictly before x in the (key, token id) order."""
    perm = sort_order(keys)
    q_sorted = q[perm]
    before_sorted = jnp.concatenate([jnp.zeros_like(q[:1]), jnp.cumsum(q_sorted)[:-1]])
    return jnp.zeros_like(q).at[perm].set(before_sorted, unique_indices=True)
