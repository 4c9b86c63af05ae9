"""Models over device meshes: logical axes (`axes`), rule tables and placements (`placement`),
and `shard`, which places a model's params on a mesh. See docs/sharding.md."""

from __future__ import annotations

import dataclasses

import jax

from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.sharding.axes import CACHE_AXES, leaf_axes, param_axes
from ssd_jax.sharding.placement import DEFAULT_RULES, LOGICAL_AXES, Placement, place_array, unit_counts

__all__ = ["CACHE_AXES", "DEFAULT_RULES", "LOGICAL_AXES", "Placement", "colocate", "constrain_cache", "param_axes",
           "param_shardings", "shard", "shape_shardings"]


def param_shardings(placement: Placement, params: dict, config: ModelConfig) -> dict:
    """The NamedSharding of every leaf of `params` (any layout), as a pytree like params."""
    counts = unit_counts(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    shardings = []
    for path, leaf in flat:
        keys = tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
        shardings.append(placement.sharding(leaf_axes(keys, len(leaf.shape)), tuple(leaf.shape), counts,
                                            "/".join(map(str, keys))))
    return jax.tree_util.tree_unflatten(treedef, shardings)


def shape_shardings(placement: Placement, shapes: dict, config: ModelConfig) -> dict:
    """`param_shardings` for a pytree of shape tuples (`ssd_jax.models.params.param_shapes`)."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, "float32"), shapes, is_leaf=is_shape)
    return param_shardings(placement, structs, config)


def shard(model: Model, mesh, rules=None) -> Model:
    """The model with its params placed on `mesh` by `rules` (None: `DEFAULT_RULES`; `()`:
    replicate everything). mesh: a `jax.sharding.Mesh` with a "model" axis and optionally
    "data", from `jax.make_mesh` (Explicit) or `Mesh(...)` (Auto). Every device then holds about
    1/model of each split weight. InputError names a missing axis, an unknown rule axis, heads
    that do not divide, or devices of another process."""
    if not isinstance(model, Model):
        raise InputError(f"shard() takes an ssd_jax Model, got {type(model).__name__}")
    placement = Placement.create(mesh, rules)
    shardings = param_shardings(placement, model.params, model.config)
    params = jax.tree.map(place_array, model.params, shardings)
    return dataclasses.replace(model, params=params, placement=placement)


def colocate(target: Model, draft: Model, method_name: str) -> Model:
    """The draft ready to run in one program with a sharded target: a draft on the same devices
    as it is; an unplaced draft replicated on the target's mesh; a draft elsewhere refused."""
    if target.placement is None or draft.placement == target.placement:
        return draft
    if draft.placement is None:
        return shard(draft, target.placement.mesh, rules=())
    if set(draft.placement.devices) != set(target.placement.devices):
        raise InputError(f"method {method_name} runs the draft and the target in one program, but the draft lives on "
                         f"devices {[str(d) for d in draft.placement.devices]} and the target on "
                         f"{[str(d) for d in target.placement.devices]}; shard the draft on the target's mesh "
                         f"(or leave it unsharded). Only SSD takes models on disjoint devices")
    return draft


def constrain_cache(cache, config: ModelConfig, placement: Placement | None):
    """Inside a traced decode: pin a KV cache's buffers to the placement's cache sharding."""
    if placement is None:
        return cache

    def pin(buffer):
        return jax.lax.with_sharding_constraint(buffer, placement.cache_sharding(config, buffer.shape))

    k = tuple(map(pin, cache.k)) if cache.per_layer else pin(cache.k)
    v = tuple(map(pin, cache.v)) if cache.per_layer else pin(cache.v)
    return cache.replace(k=k, v=v)
