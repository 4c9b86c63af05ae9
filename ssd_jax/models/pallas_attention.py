"""Masked attention of new tokens against a KV cache as a Pallas TPU kernel (flash decoding).

The TPU backend policy's `decode_attention` ("pallas"): every cached step and every token tree
of a model whose shapes the kernel takes (`supports`). It computes what the reference attention
(`ssd_jax.models.transformer._attend`) computes, scores and softmax in float32, but streams the
cache through VMEM one block of slots at a time with an online softmax, and stops at the last
block any row can see: a decode step reads the cache up to its length, not its capacity.

Layout. One kernel instance per (batch row, KV head) owns the G query heads of its group and the
T new tokens, as R = G*T query rows (padded to the sublane tile), so each cache block is read
once per group rather than once per query head. The grid's last axis walks the cache blocks;
a scalar-prefetched count per row clamps the block index past the last visible block, so the
pipeline re-uses the block it holds instead of fetching masked ones.

Meshes: the kernel is a custom call that XLA cannot split by itself, so it is wrapped in
`custom_partitioning` with the rule "independent per batch row and per KV head": on a mesh that
splits the cache over rows or KV heads each device runs the kernel on its own shard, and no
operand is gathered.

`interpret=True` runs the same kernel through Pallas's interpreter on any backend: the tests
check it against the reference on CPU, and lower the compiled form for TPU (`tpu_custom_call`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec

# Scores of masked slots. Finite, so that a block in which a row sees nothing leaves its running
# maximum finite (exp(-inf - -inf) would be NaN); every row sees some slot, and the first real
# score rescales what the masked ones added by exp(-1e30 - m) = 0.
MASKED_SCORE = -1e30
LANES = 128  # the running max and sum are kept lane-replicated: (rows, 128) is a native VMEM tile
BLOCK_SIZES = (512, 256, 128)  # cache slots per block, tried in order; each a multiple of the lane width
MAX_WHOLE_CACHE_BLOCK = 1024  # a capacity no block size divides is taken whole up to this many slots


def block_size(capacity: int) -> int | None:
    """The cache slots per kernel block for a cache of `capacity` slots, or None when the kernel
    does not take it (a capacity that no block size divides, above MAX_WHOLE_CACHE_BLOCK)."""
    for size in BLOCK_SIZES:
        if capacity % size == 0:
            return size
    return capacity if capacity <= MAX_WHOLE_CACHE_BLOCK else None


def supports(capacity: int) -> bool:
    """Whether the kernel takes a cache of this many slots (any heads, head size, T and dtype)."""
    return block_size(capacity) is not None


def _row_tile(dtype) -> int:
    """Query rows are padded to a multiple of the sublane tile of their dtype (8 for 32-bit, 16 for 16-bit)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _kernel(blocks_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, max_ref, sum_ref, acc_ref, *, scale, softcap):
    """One (row, KV head) instance at cache block j: q [R, hd], k and v [block, hd], mask int32 [R, block]."""
    row, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _start():
        max_ref[...] = jnp.full(max_ref.shape, MASKED_SCORE, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j < blocks_ref[row])
    def _accumulate():
        scores = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(mask_ref[...] != 0, scores, MASKED_SCORE)
        old_max = max_ref[...][:, :1]
        new_max = jnp.maximum(old_max, scores.max(axis=1, keepdims=True))
        weights = jnp.exp(scores - new_max)
        rescale = jnp.exp(old_max - new_max)
        new_sum = rescale * sum_ref[...][:, :1] + weights.sum(axis=1, keepdims=True)
        sum_ref[...] = jnp.broadcast_to(new_sum, sum_ref.shape)
        max_ref[...] = jnp.broadcast_to(new_max, max_ref.shape)
        acc_ref[...] = rescale * acc_ref[...] + jax.lax.dot_general(
            weights.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        out_ref[...] = (acc_ref[...] / sum_ref[...][:, :1]).astype(out_ref.dtype)


def _local_attention(q_rows, k_cache, v_cache, mask_rows, blocks, *, scale, softcap, interpret):
    """The kernel over one device's shard: q_rows [B, KVH, R, hd], caches [B, KVH, S, hd],
    mask_rows int32 [B, R, S], blocks int32 [B] (cache blocks each row reads) -> [B, KVH, R, hd]."""
    b, kvh, rows, hd = q_rows.shape
    capacity = k_cache.shape[2]
    size = block_size(capacity)

    def kv_block(row, head, j, blocks_ref):
        return row, head, jnp.minimum(j, blocks_ref[row] - 1), 0

    def mask_block(row, head, j, blocks_ref):
        return row, 0, jnp.minimum(j, blocks_ref[row] - 1)

    def whole(row, head, j, blocks_ref):
        return row, head, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kvh, capacity // size),
        in_specs=[pl.BlockSpec((None, None, rows, hd), whole),
                  pl.BlockSpec((None, None, size, hd), kv_block),
                  pl.BlockSpec((None, None, size, hd), kv_block),
                  pl.BlockSpec((None, rows, size), mask_block)],
        out_specs=pl.BlockSpec((None, None, rows, hd), whole),
        scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, hd), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, softcap=softcap),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows, hd), q_rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(blocks, q_rows, k_cache, v_cache, mask_rows)


def _row_and_head_axes(sharding) -> tuple:
    """The mesh axes a cache sharding splits its batch and KV-head dims over (None: not split)."""
    spec = tuple(sharding.spec) + (None,) * 4
    return spec[0], spec[1]


@functools.lru_cache(maxsize=None)
def _partitioned(scale: float, softcap: float | None, interpret: bool):
    """`_local_attention` as a custom-partitioned op: split like the cache over rows and KV heads,
    whole over query rows, slots and head size."""
    def local(q_rows, k_cache, v_cache, mask_rows, blocks):
        return _local_attention(q_rows, k_cache, v_cache, mask_rows, blocks, scale=scale, softcap=softcap,
                                interpret=interpret)

    op = custom_partitioning(local)

    def shardings(mesh, cache_sharding):
        row_axis, head_axis = _row_and_head_axes(cache_sharding)
        heads = NamedSharding(mesh, PartitionSpec(row_axis, head_axis, None, None))
        return heads, NamedSharding(mesh, PartitionSpec(row_axis, None, None)), NamedSharding(mesh, PartitionSpec(row_axis))

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes[1].sharding)[0]

    def partition(mesh, arg_shapes, result_shape):
        heads, mask, blocks = shardings(mesh, arg_shapes[1].sharding)
        return mesh, local, heads, (heads, heads, heads, mask, blocks)

    op.def_partition(partition, infer_sharding_from_operands=infer,
                     sharding_rule="b h r d, b h s d, b h s d, b r s, b -> b h r d",
                     need_replication_factors=("r", "d", "s"))  # in order of first appearance
    return op


def pallas_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array, *, scale: float,
                     softcap: float | None = None, interpret: bool = False) -> jax.Array:
    """New tokens against a cache, any mask (token trees included), through the Pallas kernel.

    q: [B, T, H, hd]; k_cache, v_cache: [B, KVH, S, hd] (H a multiple of KVH, `supports(S)`);
    mask: bool [B, T, S], every row with a True; scale: the factor of q.k; softcap: Gemma 2's
    attention logit soft-cap (cap * tanh(score / cap)) or None. interpret: run through Pallas's
    interpreter (any backend) instead of compiling for TPU.
    Returns [B, T, H * hd] in q's dtype, as the reference attention does.
    """
    b, t, h, hd = q.shape
    kvh, capacity = k_cache.shape[1], k_cache.shape[2]
    if not supports(capacity):
        raise ValueError(f"the Pallas attention takes no cache of {capacity} slots (see pallas_attention.supports)")
    groups = h // kvh
    rows = groups * t
    tile = _row_tile(q.dtype)
    padded = -(-rows // tile) * tile
    # Query row g*T + t is query head (kv_head*G + g) at new token t: the mask repeats per group.
    q_rows = q.reshape(b, t, kvh, groups, hd).transpose(0, 2, 3, 1, 4).reshape(b, kvh, rows, hd)
    q_rows = jnp.pad(q_rows.astype(k_cache.dtype), ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    mask_rows = jnp.pad(jnp.tile(mask, (1, groups, 1)), ((0, 0), (0, padded - rows), (0, 0)), constant_values=True)
    size = block_size(capacity)
    last_seen = jnp.max(jnp.where(mask.any(axis=1), jnp.arange(capacity, dtype=jnp.int32), 0), axis=1)
    blocks = (last_seen // size + 1).astype(jnp.int32)
    op = _partitioned(float(scale), None if softcap is None else float(softcap), bool(interpret))
    out = op(q_rows, k_cache, v_cache, mask_rows.astype(jnp.int32), blocks)
    out = out[:, :, :rows].reshape(b, kvh, groups, t, hd).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h * hd).astype(q.dtype)
