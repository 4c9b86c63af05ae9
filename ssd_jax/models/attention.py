"""Attention through `jax.nn.dot_product_attention`: causal self-attention of a prompt, and
masked attention of new tokens against a KV cache.

The reference attention (`ssd_jax.models.transformer._attend`: einsum scores, a boolean mask,
softmax in float32) serves every cached step and every token tree. A prompt forward into an empty
cache needs only the plain causal mask (plus a sliding window), which fused kernels take without
a materialised [T, S] mask: cuDNN's flash attention on GPU, XLA's fused attention elsewhere. The
backend policy (`ssd_jax.backend`) picks the implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                     scale: float | None = None, implementation: str = "xla") -> jax.Array:
    """Grouped-query causal self-attention over one sequence of new tokens.

    q: [B, T, H, hd]; k, v: [B, T, KVH, hd] (H a multiple of KVH), all of one dtype (cuDNN needs
    bfloat16 or float16). window: a sliding window W (token i sees i-W+1..i), or None. scale: the
    factor of q.k (None: 1/sqrt(hd)).
    Returns [B, T, H * hd] in q's dtype. Rows are right-padded prompts: padded positions come
    after every real one, so the causal mask already keeps them out of real tokens' outputs.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; known: {IMPLEMENTATIONS}")
    b, t, h, hd = q.shape
    if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        implementation = "xla"  # cuDNN's fused attention takes half-precision operands only
    local = None if window is None else (int(window) - 1, 0)
    out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale, is_causal=True,
                                       local_window_size=local, implementation=implementation)
    return out.reshape(b, t, h * hd)


def masked_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """New tokens against a cache, any mask (token trees included), through XLA's fused attention.

    q: [B, T, H, hd]; k_cache, v_cache: [B, KVH, S, hd]; mask: bool [B, T, S] (every row has a
    True); scale: the factor of q.k (None: 1/sqrt(hd)). Returns [B, T, H * hd] in q's dtype, as
    `ssd_jax.models.transformer._attend` does.
    """
    b, t, h, hd = q.shape
    k = k_cache.transpose(0, 2, 1, 3).astype(q.dtype)
    v = v_cache.transpose(0, 2, 1, 3).astype(q.dtype)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="xla")
    return out.reshape(b, t, h * hd)
