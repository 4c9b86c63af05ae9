"""The parameter pytree: its expected shapes, random initialisation and validation.

Layout (per-layer leaves stacked on a leading axis of size num_layers; kernels are [in, out]):

    embed [V, D]                       pos_embed [P, D]          (learned positions only)
    layers/attn_norm/{scale[, bias]} [N, D]
    layers/{q,k,v}/kernel [N, D, heads*hd]   layers/{q,k,v}/bias   (qkv_bias)
    layers/o/kernel [N, H*hd, D]             layers/o/bias         (o_bias)
    layers/{q_norm,k_norm}/scale [N, hd]     (qk_norm)
    layers/mlp_norm/{scale[, bias]} [N, D]
    layers/{post_attn_norm,post_mlp_norm}/scale [N, D]                  (sandwich_norms)
    layers/{gate,up}/kernel [N, D, F], layers/down/kernel [N, F, D]      (gated MLP)
    layers/fc/kernel [N, D, F], layers/proj/kernel [N, F, D] (+ biases)   (plain MLP)
    layers/router/kernel [N, D, E]                                       (MoE, see models/moe.py;
    layers/experts/{gate,up}/kernel [N, E, D, F], .../down/kernel [N, E, F, D]   E: expert axis)
    final_norm/{scale[, bias]} [D]          lm_head/kernel [D, V]     (untied only)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import CheckpointError
from ssd_jax.models.config import ModelConfig


def _norm_shapes(config: ModelConfig, lead: tuple[int, ...], dim: int) -> dict:
    shapes = {"scale": lead + (dim,)}
    if config.norm == "layer":
        shapes["bias"] = lead + (dim,)
    return shapes


def _dense_shapes(lead: tuple[int, ...], fan_in: int, fan_out: int, bias: bool) -> dict:
    shapes = {"kernel": lead + (fan_in, fan_out)}
    if bias:
        shapes["bias"] = lead + (fan_out,)
    return shapes


def param_shapes(config: ModelConfig) -> dict:
    """The expected shape of every leaf, as a pytree of tuples."""
    n, d, f, hd = (config.num_layers,), config.hidden_size, config.intermediate_size, config.head_dim
    layers = {
        "attn_norm": _norm_shapes(config, n, d),
        "q": _dense_shapes(n, d, config.num_heads * hd, config.qkv_bias),
        "k": _dense_shapes(n, d, config.num_kv_heads * hd, config.qkv_bias),
        "v": _dense_shapes(n, d, config.num_kv_heads * hd, config.qkv_bias),
        "o": _dense_shapes(n, config.num_heads * hd, d, config.o_bias),
        "mlp_norm": _norm_shapes(config, n, d),
    }
    if config.qk_norm:
        layers["q_norm"] = {"scale": n + (hd,)}
        layers["k_norm"] = {"scale": n + (hd,)}
    if config.sandwich_norms:
        layers["post_attn_norm"] = _norm_shapes(config, n, d)
        layers["post_mlp_norm"] = _norm_shapes(config, n, d)
    if config.mlp == "moe":
        e = (config.num_experts,)
        layers["router"] = _dense_shapes(n, d, config.num_experts, False)
        layers["experts"] = {
            "gate": _dense_shapes(n + e, d, f, False),
            "up": _dense_shapes(n + e, d, f, False),
            "down": _dense_shapes(n + e, f, d, False),
        }
    elif config.mlp == "gated":
        layers["gate"] = _dense_shapes(n, d, f, config.mlp_bias)
        layers["up"] = _dense_shapes(n, d, f, config.mlp_bias)
        layers["down"] = _dense_shapes(n, f, d, config.mlp_bias)
    else:
        layers["fc"] = _dense_shapes(n, d, f, config.mlp_bias)
        layers["proj"] = _dense_shapes(n, f, d, config.mlp_bias)
    shapes = {"embed": (config.vocab_size, d), "layers": layers, "final_norm": _norm_shapes(config, (), d)}
    if config.positions == "learned":
        shapes["pos_embed"] = (config.max_position_embeddings, d)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = {"kernel": (d, config.vocab_size)}
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random parameters: normal(0, scale) matrices (output projections scaled by 1/sqrt(2N)),
    unit norm scales (zero for "rms_1p", which applies 1 + scale) and zero biases."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if name.endswith("scale"):
            leaves.append((jnp.zeros if config.norm == "rms_1p" else jnp.ones)(shape, dtype))
        elif name.endswith("bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            parts = name.split("/")
            is_output = len(parts) > 1 and parts[-2] in ("o", "down", "proj")
            std = scale / np.sqrt(2 * config.num_layers) if is_output else scale
            leaves.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def validate_params(config: ModelConfig, params: dict) -> None:
    """Raises CheckpointError naming the first missing, unexpected or mis-shaped leaf."""
    expected = dict(_flat(param_shapes(config), is_leaf=_is_shape))
    actual = {name: tuple(np.shape(leaf)) for name, leaf in _flat(params)}
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise CheckpointError(f"missing weights: {', '.join(missing[:8])}")
    unexpected = sorted(set(actual) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected weights: {', '.join(unexpected[:8])}")
    for name, shape in expected.items():
        if actual[name] != shape:
            raise CheckpointError(f"weight {name} has shape {actual[name]}, expected {shape}")


def _flat(tree, is_leaf=None):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [("/".join(str(getattr(p, "key", p)) for p in path), leaf) for path, leaf in flat]
