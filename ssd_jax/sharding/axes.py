"""Logical axis names of every parameter and cache array, in the layouts used at decode time.

A leaf's logical axes are a tuple with one name (or None) per dimension. Names:

    vocab     vocabulary (embedding rows, LM-head columns)
    embed     the residual stream (hidden size D)
    heads     query heads x head_dim, merged (q kernel columns, o kernel rows)
    kv_heads  key/value heads x head_dim, merged (k, v kernel columns); in the KV cache, KV heads
    head_dim  one head's features (q/k norms; the KV cache's last axis)
    mlp       the MLP hidden size F (and each expert's)
    experts   Mixtral's expert axis E
    layers    the stacked layer axis N (absent once layers are unstacked for decoding)
    batch     rows of a batch (KV cache)
    cache_len slots of the KV cache

Leaves are named by their path in the params pytree (see `ssd_jax.models.params`); both the
stacked layout and `decode_params`' unstacked one (a tuple of per-layer dicts, unfused when
sharded) are covered, since the names depend only on the leaf's own path.
"""

from __future__ import annotations

import jax

# Per-layer leaf (path inside one layer's dict, without the leading layer axis) -> logical axes.
_LAYER_AXES = {
    ("q", "kernel"): ("embed", "heads"), ("q", "bias"): ("heads",),
    ("k", "kernel"): ("embed", "kv_heads"), ("k", "bias"): ("kv_heads",),
    ("v", "kernel"): ("embed", "kv_heads"), ("v", "bias"): ("kv_heads",),
    ("o", "kernel"): ("heads", "embed"), ("o", "bias"): ("embed",),
    ("q_norm", "scale"): ("head_dim",), ("k_norm", "scale"): ("head_dim",),
    ("gate", "kernel"): ("embed", "mlp"), ("gate", "bias"): ("mlp",),
    ("up", "kernel"): ("embed", "mlp"), ("up", "bias"): ("mlp",),
    ("down", "kernel"): ("mlp", "embed"), ("down", "bias"): ("embed",),
    ("fc", "kernel"): ("embed", "mlp"), ("fc", "bias"): ("mlp",),
    ("proj", "kernel"): ("mlp", "embed"), ("proj", "bias"): ("embed",),
    ("router", "kernel"): ("embed", "experts"),
    ("experts", "gate", "kernel"): ("experts", "embed", "mlp"),
    ("experts", "up", "kernel"): ("experts", "embed", "mlp"),
    ("experts", "down", "kernel"): ("experts", "mlp", "embed"),
    # Fused by `decode_params` for unsharded CPU/GPU decoding only: one axis mixes q, k and v (or
    # gate and up), so it cannot be split by heads; replicated if ever sharded.
    ("qkv", "kernel"): ("embed", None), ("qkv", "bias"): (None,),
    ("gate_up", "kernel"): ("embed", None), ("gate_up", "bias"): (None,),
}

_TOP_AXES = {
    ("embed",): ("vocab", "embed"),
    ("pos_embed",): (None, "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
}

# KV cache [batch, kv_heads, capacity, head_dim] per layer (stacked: a leading layer axis).
CACHE_AXES = ("batch", "kv_heads", "cache_len", "head_dim")


def _keys(path) -> tuple:
    return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def leaf_axes(keys: tuple, ndim: int) -> tuple:
    """Logical axes of the params leaf at `keys` (its path, e.g. ("layers", 3, "q", "kernel"))."""
    if keys and keys[0] == "layers":
        rest = tuple(k for k in keys[1:] if not isinstance(k, int))
        stacked = not any(isinstance(k, int) for k in keys[1:])  # a tuple of layers has an index
        if rest in _LAYER_AXES:
            axes = _LAYER_AXES[rest]
        elif rest[0].endswith("norm"):  # attn/mlp/post-* norms act on the residual stream
            axes = ("embed",)
        else:
            raise ValueError(f"no logical axes for the params leaf {'/'.join(map(str, keys))}")
        axes = (("layers",) if stacked else ()) + axes
    elif keys in _TOP_AXES:
        axes = _TOP_AXES[keys]
    else:  # final_norm
        axes = ("embed",)
    if len(axes) != ndim:
        raise ValueError(f"logical axes {axes} do not fit the {ndim}-d leaf {'/'.join(map(str, keys))}")
    return axes


def param_axes(params: dict) -> dict:
    """The logical axes of every leaf of `params` (stacked or decode layout), as a pytree of
    tuples with the params' structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree_util.tree_unflatten(treedef, [leaf_axes(_keys(path), len(leaf.shape)) for path, leaf in flat])
