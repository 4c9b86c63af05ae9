"""`widen`: a model with the same logits as a given one and the compute of a bigger one. A tool for
benchmarks, not a model to use (docs/testing.md, "Cost-faithful targets: `widen`").

Why: a speculative decoder's speed-up depends on two things, how often the target accepts the
drafts and what one target step costs. The embedded pair is trained, so its acceptance is real,
but its target is small, so a step costs little. `widen(target, mlp_multiple=4, extra_layers=6)`
keeps the trained acceptance and makes each step cost what a bigger model of the same family
costs. Its tokens are exactly the original's (greedy), so every method's output and acceptance can
be compared with the original's while the timing is a bigger model's.

How: every added part adds exactly zero to the residual stream.

- Extra MLP units (`mlp_multiple`): the intermediate size F becomes F x mlp_multiple. The new
  gate/up columns (a plain MLP's fc columns, with their biases) are random and the new units' rows
  in the down projection (proj) are zero, so each new unit adds act(.) x 0 = 0 to the MLP output.
  The down projection's bias acts per output feature and is unchanged. Mixtral: the same in every
  expert, with the router unchanged, so each token goes to the same experts.
- Extra query heads (`extra_heads`, a multiple of num_kv_heads so that num_heads stays one and
  each KV head gets the same number of new query heads): the new q columns (and q biases) are
  random and their rows in the output projection are zero. The KV heads and the KV cache stay the
  same.
- Extra layers (`extra_layers`, appended after the last layer): the q/k/v kernels, the gate/up
  (fc, router, experts' gate/up) kernels are random; norms and input-side biases are copied from
  original layer j mod num_layers; the attention output projection, the MLP down projection and
  their biases are zero. The layer then adds 0 + 0 to the residual. Gemma 2/3's sandwich norms
  normalise each block's output before the residual add: an RMS norm of zero is
  0 x rsqrt(0 + eps) = 0 when eps > 0, and a LayerNorm's bias on those outputs is set to zero.
  Per-layer patterns continue in a cycle: new layer j takes the `layer_types` entry (sliding or
  global window, local or global RoPE) of layer j mod num_layers. The new layers get KV caches of
  their own, so those cost what they would in a bigger model too.

Random weights are normal, with the mean and standard deviation of the weights they extend, drawn
from `key` (default PRNGKey(0)). Then no unit is all zeros, so nothing can skip the work.
The results agree to rounding, not bit for bit: a sum gets more terms, each an exact zero, and
that can change the order in which the compiler adds the nonzero ones. On the test configs the
float32 logits differed by at most 2e-6 (tests/test_widen.py checks 1e-5).

Sharded models (`model.placement` set): `reshard=True` gathers the params, widens them and shards
the result with the same mesh and rules (`ssd_jax.shard`), so the new units are split like the
old ones; the new sizes must divide by the mesh axes, as for any model. Without `reshard=True` it
is an InputError that says how to do this.

Refused, each with an InputError that names the value: a non-integer or non-positive
mlp_multiple; a negative or non-integer extra_layers or extra_heads; extra_heads that is not a
multiple of num_kv_heads; extra heads for GPT-2 (its config fixes head_dim = n_embd / n_head and a
KV head per query head, so a GPT-2 with more heads cannot be written); extra layers under sandwich
norms with norm_eps <= 0 (a norm of zero is not zero then); a sharded model without reshard; params
not in the stacked layout of `ssd_jax.models.params` (e.g. a decode-layout copy); a parameter
this module does not know (a new family's parts are refused until they are handled here).
"""

from __future__ import annotations

import dataclasses
import json
import numbers

import jax
import jax.numpy as jnp

from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import validate_params

__all__ = ["widen"]

# The standard deviation of a new kernel whose source kernel is all one value (e.g. all zeros).
_FALLBACK_STD = 0.02

# What each leaf of one layer (its path inside the layer's dict) becomes in an added layer.
# Leaves that write to the residual stream: all zeros.
_ZEROED = frozenset({
    ("o", "kernel"), ("o", "bias"), ("down", "kernel"), ("down", "bias"), ("proj", "kernel"), ("proj", "bias"),
    ("experts", "down", "kernel"), ("post_attn_norm", "bias"), ("post_mlp_norm", "bias"),
})
# Kernels that only feed the layer's own computation: random.
_RANDOM = frozenset({
    ("q", "kernel"), ("k", "kernel"), ("v", "kernel"), ("gate", "kernel"), ("up", "kernel"), ("fc", "kernel"),
    ("router", "kernel"), ("experts", "gate", "kernel"), ("experts", "up", "kernel"),
})
# Norms and input-side biases: copied from an original layer.
_COPIED = frozenset({
    ("attn_norm", "scale"), ("attn_norm", "bias"), ("mlp_norm", "scale"), ("mlp_norm", "bias"),
    ("post_attn_norm", "scale"), ("post_mlp_norm", "scale"), ("q_norm", "scale"), ("k_norm", "scale"),
    ("q", "bias"), ("k", "bias"), ("v", "bias"), ("gate", "bias"), ("up", "bias"), ("fc", "bias"),
})


def widen(model: Model, *, mlp_multiple: int = 1, extra_layers: int = 0, extra_heads: int = 0,
          key=None, reshard: bool = False) -> Model:
    """Returns `model` widened with parts that add exactly zero: the same logits, a larger cost.

    mlp_multiple: the MLP's intermediate size (each expert's, for Mixtral) becomes
    intermediate_size x mlp_multiple (an integer >= 1). extra_layers: layers appended after the last
    one, each passing the residual through unchanged (>= 0). extra_heads: query heads added to every
    layer, a multiple of num_kv_heads (>= 0; not for GPT-2). key: a jax PRNG key or an int seed for
    the new random weights (None: PRNGKey(0)). reshard: for a sharded model, shard the result
    with the same mesh and rules (otherwise a sharded model is refused).

    The result has the same tokenizer, no path (it is not the checkpoint at model.path), and the
    same placement when resharded. It is a benchmarking tool, not a model: see the module
    docstring for why the logits stay the same and what is refused. Raises InputError.
    """
    if not isinstance(model, Model):
        raise InputError(f"widen() takes an ssd_jax Model, got {type(model).__name__}")
    config = model.config
    mlp_multiple = _integer("mlp_multiple", mlp_multiple, 1)
    extra_layers = _integer("extra_layers", extra_layers, 0)
    extra_heads = _integer("extra_heads", extra_heads, 0)
    if not isinstance(reshard, bool):
        raise InputError(f"reshard must be True or False, got {reshard!r}")
    _check_family(config, extra_layers, extra_heads)
    params = _host_params(model, reshard)
    try:
        validate_params(config, params)
    except CheckpointError as error:
        raise InputError(f"widen() needs params in the stacked layout of ssd_jax.models.params (as ssd_jax.load "
                         f"returns them), not a decode-layout or edited copy: {error}") from None
    key = _as_key(key)

    layers = params["layers"]
    layers = _widen_mlp(layers, config, mlp_multiple, jax.random.fold_in(key, 0))
    layers = _widen_heads(layers, config, extra_heads, jax.random.fold_in(key, 1))
    layers = _add_layers(layers, config, extra_layers, jax.random.fold_in(key, 2))
    widened_config = _widened_config(config, mlp_multiple, extra_layers, extra_heads)
    widened = dataclasses.replace(model, config=widened_config, params=dict(params, layers=layers), path=None,
                                  placement=None)
    validate_params(widened_config, widened.params)  # a bug here, not the caller's
    if model.placement is None:
        return widened
    from ssd_jax.sharding import shard

    return shard(widened, model.placement.mesh, rules=model.placement.rules)


# ------------------------------------------------------------------ checks


def _integer(name: str, value, least: int) -> int:
    """`value` as an int >= least, or InputError naming it (bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        what = "a positive integer" if least == 1 else "an integer >= 0"
        raise InputError(f"{name} must be {what}, got {value!r}")
    return int(value)


def _check_family(config: ModelConfig, extra_layers: int, extra_heads: int) -> None:
    """InputError for a widening this family cannot take exactly."""
    if extra_heads:
        if config.model_type == "gpt2":
            raise InputError(
                f"extra_heads={extra_heads}: a gpt2 model cannot take extra query heads exactly (GPT-2 fixes "
                f"head_dim = n_embd / n_head and has one key/value head per query head, so a GPT-2 with "
                f"{config.num_heads + extra_heads} heads would be a different model); widen it with mlp_multiple "
                f"or extra_layers")
        if extra_heads % config.num_kv_heads:
            raise InputError(
                f"extra_heads={extra_heads} must be a multiple of num_kv_heads={config.num_kv_heads} (each key/value "
                f"head gets the same number of new query heads, so num_heads stays a multiple of num_kv_heads)")
    if extra_layers and config.sandwich_norms and config.norm_eps <= 0:
        raise InputError(
            f"extra_layers={extra_layers}: model_type {config.model_type!r} with sandwich norms and norm_eps="
            f"{config.norm_eps!r} cannot be kept exact (a norm of a zero block output is 0 x rsqrt(eps), which is "
            f"not zero unless eps > 0); widen it with mlp_multiple or extra_heads")


def _host_params(model: Model, reshard: bool) -> dict:
    """The params to widen: as they are, or (a sharded model with reshard=True) gathered to the host."""
    if model.placement is None:
        return model.params
    if not reshard:
        raise InputError(
            f"the model is sharded ({_describe(model.placement)}) and widen() would have to decide how the new "
            f"heads, MLP units and layers are sharded: pass reshard=True to shard the widened model by the same "
            f"mesh and rules (ssd_jax.shard), or widen the unsharded model and shard the result yourself")
    if not all(getattr(leaf, "is_fully_addressable", True) for leaf in jax.tree.leaves(model.params)):
        raise InputError("widen(reshard=True) gathers the params on this process, but this model spans several "
                         "processes; widen the model before sharding it")
    return jax.tree.map(jnp.asarray, jax.device_get(model.params))


def _describe(placement) -> str:
    """A placement in a few words: its mesh's axis sizes and its rules."""
    mesh = getattr(placement, "mesh", None)
    shape = dict(getattr(mesh, "shape", {}) or {})
    return f"placement on a mesh {shape or mesh!r} with rules {getattr(placement, 'rules', None)!r}"


def _as_key(key) -> jax.Array:
    if key is None:
        return jax.random.PRNGKey(0)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return jax.random.PRNGKey(int(key))
    try:
        jax.random.fold_in(key, 0)
    except Exception:  # noqa: BLE001 - any failure means it is not a key
        raise InputError(f"key must be a jax PRNG key, an int seed or None, got {key!r}") from None
    return key


# ------------------------------------------------------------------ the widening


def _random_like(key: jax.Array, source: jax.Array, shape: tuple, kernel: bool) -> jax.Array:
    """Normal values of `shape` in source's dtype with source's mean and standard deviation (a
    kernel that is all one value gets std `_FALLBACK_STD`, so no new unit is all zeros)."""
    values = source.astype(jnp.float32)
    mean, std = float(jnp.mean(values)), float(jnp.std(values))
    if kernel and std == 0.0:
        std = _FALLBACK_STD
    return (mean + std * jax.random.normal(key, shape, jnp.float32)).astype(source.dtype)


def _widen_mlp(layers: dict, config: ModelConfig, multiple: int, key: jax.Array) -> dict:
    """Intermediate size F -> F x multiple: random input-side columns, zero rows of the output side."""
    if multiple == 1:
        return layers
    extra = config.intermediate_size * (multiple - 1)
    moe = config.mlp == "moe"
    block = dict(layers["experts"] if moe else layers)
    inputs, output = (("fc",), "proj") if config.mlp == "plain" else (("gate", "up"), "down")
    for i, name in enumerate(inputs):
        dense = dict(block[name])
        for j, leaf_name in enumerate(sorted(dense)):  # kernel [..., D, F], bias [..., F]
            leaf = dense[leaf_name]
            new = _random_like(jax.random.fold_in(key, 2 * i + j), leaf, leaf.shape[:-1] + (extra,),
                               leaf_name == "kernel")
            dense[leaf_name] = jnp.concatenate([leaf, new], axis=-1)
        block[name] = dense
    down = dict(block[output])  # kernel [..., F, D]; its bias [..., D] is per output feature
    kernel = down["kernel"]
    zeros = jnp.zeros(kernel.shape[:-2] + (extra, kernel.shape[-1]), kernel.dtype)
    down["kernel"] = jnp.concatenate([kernel, zeros], axis=-2)
    block[output] = down
    return dict(layers, experts=block) if moe else block


def _widen_heads(layers: dict, config: ModelConfig, extra_heads: int, key: jax.Array) -> dict:
    """Adds extra_heads / num_kv_heads query heads to each KV head's group (query head h attends
    with KV head h // num_groups, see transformer._attend): random q columns, zero o rows."""
    if not extra_heads:
        return layers
    kv, groups, hd = config.num_kv_heads, config.num_groups, config.head_dim
    new_groups = extra_heads // kv
    width = kv * (groups + new_groups) * hd
    q = dict(layers["q"])
    for j, name in enumerate(sorted(q)):  # kernel [L, D, H * hd], bias [L, H * hd]
        leaf = q[name]
        grouped = leaf.reshape(leaf.shape[:-1] + (kv, groups, hd))
        new = _random_like(jax.random.fold_in(key, j), leaf, leaf.shape[:-1] + (kv, new_groups, hd), name == "kernel")
        q[name] = jnp.concatenate([grouped, new], axis=-2).reshape(leaf.shape[:-1] + (width,))
    o = dict(layers["o"])  # kernel [L, H * hd, D]; its bias [L, D] is per output feature
    kernel = o["kernel"]
    n, d = kernel.shape[0], kernel.shape[-1]
    grouped = kernel.reshape(n, kv, groups, hd, d)
    zeros = jnp.zeros((n, kv, new_groups, hd, d), kernel.dtype)
    o["kernel"] = jnp.concatenate([grouped, zeros], axis=2).reshape(n, width, d)
    return dict(layers, q=q, o=o)


def _add_layers(layers: dict, config: ModelConfig, count: int, key: jax.Array) -> dict:
    """Appends `count` layers that pass the residual through unchanged (see the module docstring)."""
    if not count:
        return layers
    sources = jnp.asarray([j % config.num_layers for j in range(count)], jnp.int32)
    flat, treedef = jax.tree_util.tree_flatten_with_path(layers)
    leaves = []
    for index, (path, leaf) in enumerate(flat):
        name = tuple(getattr(p, "key", p) for p in path)
        shape = (count,) + tuple(leaf.shape[1:])
        if name in _ZEROED:
            new = jnp.zeros(shape, leaf.dtype)
        elif name in _RANDOM:
            new = _random_like(jax.random.fold_in(key, index), leaf, shape, kernel=True)
        elif name in _COPIED:
            new = jnp.take(leaf, sources, axis=0)
        else:
            raise InputError(f"widen() does not know the parameter layers/{'/'.join(map(str, name))} of model_type "
                             f"{config.model_type!r}, so it cannot add layers that keep the logits exact")
        leaves.append(jnp.concatenate([leaf, new], axis=0))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _widened_config(config: ModelConfig, mlp_multiple: int, extra_layers: int, extra_heads: int) -> ModelConfig:
    """The config of the widened model; its config.json text (`hf_json`) is rewritten to match."""
    types = config.layer_types
    if types and extra_layers:
        types = types + tuple(types[j % config.num_layers] for j in range(extra_layers))
    widened = dataclasses.replace(
        config, intermediate_size=config.intermediate_size * mlp_multiple, num_layers=config.num_layers + extra_layers,
        num_heads=config.num_heads + extra_heads, layer_types=types)
    return dataclasses.replace(widened, hf_json=json.dumps(widened.to_hf(), sort_keys=True))
