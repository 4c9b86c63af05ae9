"""`Placement`: a device mesh plus the rule table mapping logical axes (`ssd_jax.sharding.axes`)
to mesh axes, and the partition specs it gives each parameter and cache array.

Default rules (Megatron-style tensor parallelism on the mesh axis "model", batch on "data"):

    heads -> model      q kernel columns and o kernel rows: one all-reduce after attention
    kv_heads -> model   k, v kernel columns and the KV cache's heads
    mlp -> model        gate/up columns and down rows: one all-reduce after the MLP
    vocab -> model      embedding rows and LM-head columns
    batch -> data       the rows of a batch (KV cache, tokens)
    everything else (embed, head_dim, layers, experts, cache_len) replicated

A rule table is a mapping (or pairs) logical name -> mesh axis name, a tuple of them, or None.
When a dimension does not divide by its mesh axes: KV heads are replicated (every device holds
every KV head: what vLLM and MaxText do when KV heads are fewer than the tensor-parallel size),
as are the vocabulary (e.g. GPT-2's 50257) and a batch; query heads or the MLP hidden size that
do not divide are an `InputError`. Meshes of either axis type work: arrays are placed on an
Auto-typed copy of the mesh, so the compiler (GSPMD) partitions the decode programs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig
from ssd_jax.sharding.axes import CACHE_AXES

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "layers", "batch", "cache_len")
DEFAULT_RULES = (("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"),
                 ("batch", "data"))
# Dimensions replicated (instead of refused) when they do not divide by their mesh axes.
_REPLICABLE = ("kv_heads", "vocab", "batch")


def _auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axes with Auto axis types (a no-op on an Auto mesh)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _check_addressable(devices) -> None:
    """In a single-process run every device of the mesh must belong to this process; under
    jax.distributed each process must own some of the mesh's devices (it holds their shards and
    runs its part of every program)."""
    here = jax.process_index()
    foreign = [d for d in devices if getattr(d, "process_index", here) != here]
    if jax.process_count() > 1:
        if len(foreign) == len(devices):
            raise InputError(f"none of the mesh devices {[str(d) for d in devices]} belongs to process {here}; "
                             f"under jax.distributed every process must own part of the mesh (build it from "
                             f"jax.devices())")
        return
    if foreign:
        raise InputError(f"mesh devices {[str(d) for d in foreign]} belong to another process, but this is a "
                         f"single-process run; call jax.distributed.initialize() first, or build the mesh from "
                         f"jax.local_devices()")


def _normalize_rules(rules, mesh: Mesh) -> tuple:
    """Rules as sorted (logical, tuple of mesh axes or None) pairs, checked against the mesh."""
    if rules is None:
        pairs = [(name, axis) for name, axis in DEFAULT_RULES if axis in mesh.axis_names]
    else:
        if isinstance(rules, Mapping):
            pairs = list(rules.items())
        else:
            try:
                pairs = [tuple(p) for p in rules]
            except TypeError:
                raise InputError(f"rules must be a mapping or pairs (logical axis, mesh axis), got {rules!r}") from None
        if any(len(p) != 2 for p in pairs):
            raise InputError(f"rules must be pairs (logical axis, mesh axis), got {rules!r}")
    normalized = {}
    for name, axes in pairs:
        if name not in LOGICAL_AXES:
            raise InputError(f"unknown logical axis {name!r} in rules; known: {', '.join(LOGICAL_AXES)}")
        axes = None if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        for axis in axes or ():
            if axis not in mesh.axis_names:
                raise InputError(f"rule {name!r} -> {axis!r} names a mesh axis the mesh lacks "
                                 f"(mesh axes: {', '.join(mesh.axis_names)})")
        normalized[name] = axes
    return tuple(sorted(normalized.items()))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model lives: an Auto-typed mesh and its rule table (hashable; a Model's static
    field, so programs are compiled per placement)."""

    mesh: Mesh
    rules: tuple

    @classmethod
    def create(cls, mesh, rules=None) -> "Placement":
        """Checks the mesh (a `jax.sharding.Mesh` with a "model" axis, devices of this process
        in a single-process run) and the rules (known logical names, existing mesh axes)."""
        if not isinstance(mesh, Mesh):
            raise InputError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((1, 4), ('data', 'model'))), "
                             f"got {type(mesh).__name__}")
        if "model" not in mesh.axis_names:
            raise InputError(f"the mesh has no 'model' axis (its axes: {', '.join(map(str, mesh.axis_names))}); "
                             f"ssd_jax splits models over 'model' and batches over 'data'")
        _check_addressable(list(mesh.devices.flat))
        return cls(mesh=_auto_mesh(mesh), rules=_normalize_rules(rules, mesh))

    @property
    def devices(self) -> tuple:
        return tuple(self.mesh.devices.flat)

    def axis_size(self, name: str) -> int:
        return int(self.mesh.shape[name]) if name in self.mesh.axis_names else 1

    def spec(self, axes: tuple, shape: tuple, counts: Mapping[str, int], what: str) -> PartitionSpec:
        """The PartitionSpec of an array with these logical axes and shape. counts: the number of
        units of a merged dimension (e.g. "heads" -> num_heads for a [D, heads * head_dim]
        kernel), which must divide by the mesh axes; what: the array, for error messages."""
        rules = dict(self.rules)
        used: set = set()
        parts = []
        for name, size in zip(axes, shape):
            mesh_axes = rules.get(name)
            if not mesh_axes or used & set(mesh_axes):
                parts.append(None)
                continue
            ways = math.prod(self.axis_size(a) for a in mesh_axes)
            units = counts.get(name, size)
            if ways == 1 or units % ways or size % ways:
                if ways == 1 or name in _REPLICABLE:
                    parts.append(None)
                    continue
                raise InputError(f"{what}: {name} = {units} is not divisible by the mesh axis "
                                 f"{'x'.join(mesh_axes)} of size {ways}; use a mesh whose {'x'.join(mesh_axes)} "
                                 f"size divides {units}, or rules that replicate {name!r}")
            used.update(mesh_axes)
            parts.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return PartitionSpec(*parts)

    def sharding(self, axes: tuple, shape: tuple, counts: Mapping[str, int], what: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, counts, what))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def tensor_parallel(self) -> bool:
        """Whether heads, KV heads or the MLP hidden size are split over more than one device."""
        rules = dict(self.rules)
        return any(math.prod(self.axis_size(a) for a in rules.get(name) or ()) > 1
                   for name in ("heads", "kv_heads", "mlp"))

    def batch_ways(self) -> int:
        """How many ways the batch rule splits a batch (1 when "batch" is replicated)."""
        return math.prod(self.axis_size(a) for a in dict(self.rules).get("batch") or ())

    def rows(self, batch: int) -> NamedSharding:
        """Sharding of a [batch, ...] array: rows over the batch rule's axes when they divide."""
        return self.sharding(("batch",), (batch,), {}, "batch")

    def cache_sharding(self, config: ModelConfig, shape: tuple) -> NamedSharding:
        """Sharding of one KV-cache buffer [(layers,) batch, kv_heads, capacity, head_dim]."""
        axes = (("layers",) if len(shape) == 5 else ()) + CACHE_AXES
        return self.sharding(axes, shape, {"kv_heads": config.num_kv_heads}, "KV cache")


def unit_counts(config: ModelConfig) -> dict:
    """Units of each logical axis that must not be split inside (whole heads, experts...)."""
    return dict(heads=config.num_heads, kv_heads=config.num_kv_heads, mlp=config.intermediate_size,
                vocab=config.vocab_size, experts=max(config.num_experts, 1))


def place_array(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host or device array -> a global jax.Array with `sharding`, built shard by shard (works
    when the mesh spans several processes: each process supplies its own shards)."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
