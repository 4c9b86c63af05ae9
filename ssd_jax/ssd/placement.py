"""Device groups for SSD: the target's params and cache on one group, the draft's params, cache
and speculation cache on the other. A group is simply where its model lives.

A sharded model (`ssd_jax.shard`, `load(..., mesh=...)`) brings its own group: its mesh, its rules
(heads and KV cache over "model", rows over "data"). An unsharded model is placed on a group of
devices (the SSD options, or by default the visible devices split in two, the target taking the
first ceil(n/2); with one visible device both groups are that device, "colocated": the two
programs then take turns instead of overlapping, which the stats report) as a (data = n, model =
1) mesh: params replicated, batch rows split over the group when the batch divides (rows are
independent, so the programs run data-parallel). The two groups either coincide or are disjoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ssd_jax.runtime.params_cache import REPLICAS
from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.sharding import shard
from ssd_jax.sharding.placement import Placement


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """One group: the placement of its model and the layout of its arrays for a batch of `batch`
    rows (config: its model's, to recognise KV-cache buffers among a program's outputs)."""

    placement: Placement
    batch: int
    config: ModelConfig

    @property
    def devices(self) -> tuple:
        return self.placement.devices

    @property
    def replicated(self):
        return self.placement.replicated()

    def sharding_for(self, x):
        """KV-cache buffers [(layers,) batch, kv_heads, capacity, head_dim]: the placement's cache
        sharding; other batch-leading arrays: rows over "data" when the batch divides; the rest
        replicated."""
        shape = tuple(getattr(x, "shape", None) or np.shape(x))
        if len(shape) in (4, 5) and shape[-4] == self.batch and shape[-3] == self.config.num_kv_heads:
            return self.placement.cache_sharding(self.config, shape)
        if len(shape) >= 1 and shape[0] == self.batch:
            return self.placement.rows(self.batch)
        return self.replicated

    def put(self, tree: Any) -> Any:
        """Every leaf placed on this group as `sharding_for` says."""
        return jax.tree.map(lambda x: jax.device_put(x, self.sharding_for(x)), tree)

    def ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)


def group_placement(devices: tuple) -> Placement:
    """A (data = len(devices), model = 1) placement over a group of devices."""
    return Placement.create(Mesh(np.array(devices, dtype=object).reshape(len(devices), 1), ("data", "model")))


def placed_model(model: Model, devices: tuple) -> Model:
    """An unsharded model replicated on a group's devices (a sharded model is returned as it is);
    the copy is kept per (params object, devices), weakly, for the next call."""
    if model.placement is not None:
        return model
    ids = tuple(d.id for d in devices)
    replica = REPLICAS.get(model.params, ids, lambda: shard(model, group_placement(devices).mesh))[0]
    # Only the arrays are reused: config (EOS ids, ...) and tokenizer come from this call's model.
    return dataclasses.replace(model, params=replica.params, placement=replica.placement)


def _as_devices(name: str, value, visible: Sequence) -> tuple:
    by_id = {d.id: d for d in visible}
    if isinstance(value, jax.Device) or isinstance(value, int):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise InputError(f"{name} must be a list of jax devices or device ids, got {value!r}") from None
    if not items:
        raise InputError(f"{name} is empty; give at least one device")
    devices = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer, jax.Device)):
            raise InputError(f"{name} must hold jax devices or device ids, got {item!r}")
        device = by_id.get(int(item)) if not isinstance(item, jax.Device) else item
        if device is None or device not in visible:
            raise InputError(f"{name} names device {item!r}, which is not among the visible devices "
                             f"{[d.id for d in visible]}")
        devices.append(device)
    if len(set(devices)) != len(devices):
        raise InputError(f"{name} lists a device twice: {[d.id for d in devices]}")
    return tuple(devices)


def _check_disjoint(target: tuple, draft: tuple, what: str) -> None:
    if target != draft and set(target) & set(draft):
        raise InputError(f"{what}: the target's devices {[d.id for d in target]} and the draft's "
                         f"{[d.id for d in draft]} overlap; make them disjoint, or identical to colocate both models")


def resolve_groups(target_devices, draft_devices, target: Model | None = None, draft: Model | None = None
                   ) -> tuple[tuple, tuple]:
    """(target devices, draft devices): a sharded model's mesh devices, else from the options (None
    = default split, see module doc). Groups either coincide (colocated) or are disjoint; anything
    else is an InputError."""
    placed = [m.placement for m in (target, draft) if m is not None and m.placement is not None]
    if placed:
        if target_devices is not None or draft_devices is not None:
            raise InputError("SSD's target_devices/draft_devices are for unsharded models; a sharded model "
                             "already lives on its mesh (give neither)")
        visible = jax.devices()
        t_devs = target.placement.devices if target.placement is not None else None
        d_devs = draft.placement.devices if draft.placement is not None else None
        if t_devs is None:  # the target takes the devices the draft leaves (or shares the draft's)
            t_devs = tuple(d for d in visible if d not in d_devs) or d_devs
        if d_devs is None:
            d_devs = tuple(d for d in visible if d not in t_devs) or t_devs
        if set(t_devs) == set(d_devs) and t_devs != d_devs:
            raise InputError(f"the target and the draft share devices {[d.id for d in t_devs]} in different "
                             f"orders; colocated models must use the same mesh devices")
        _check_disjoint(t_devs, d_devs, "models placed for SSD")
        return t_devs, d_devs
    visible = jax.devices()
    if target_devices is None and draft_devices is None:
        if len(visible) == 1:
            return tuple(visible), tuple(visible)
        half = (len(visible) + 1) // 2
        return tuple(visible[:half]), tuple(visible[half:])
    if target_devices is None or draft_devices is None:
        raise InputError("give both target_devices and draft_devices, or neither (default: split the visible devices)")
    target_group = _as_devices("target_devices", target_devices, visible)
    draft_group = _as_devices("draft_devices", draft_devices, visible)
    _check_disjoint(target_group, draft_group, "target_devices and draft_devices")
    return target_group, draft_group
