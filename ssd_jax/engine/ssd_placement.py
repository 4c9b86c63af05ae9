"""Device groups for SSD: the target's params and cache on one group, the draft's params, cache
and speculation cache on the other.

A group is a tuple of `jax.Device`s. Arrays go to a group with a `NamedSharding` over a 1-D mesh
of its devices: arrays whose leading axis is the batch are split along it when the batch divides
by the group size (rows are independent, so the programs run data-parallel), everything else
(params, odd batches) is replicated. Default groups: the visible devices split in two, the target
taking the first ceil(n/2); with one visible device both groups are that device ("colocated": the
two programs then take turns instead of overlapping, which the stats report).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ssd_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """One group of devices and its shardings for a batch of `batch` rows."""

    devices: tuple
    batch: int

    @property
    def mesh(self) -> Mesh:
        return Mesh(np.array(self.devices, dtype=object), ("rows",))

    @property
    def replicated(self):
        """Every device of the group holds the whole array (a one-device group: that device)."""
        if len(self.devices) == 1:
            return SingleDeviceSharding(self.devices[0])
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def split_rows(self) -> bool:
        return len(self.devices) > 1 and self.batch % len(self.devices) == 0

    def sharding_for(self, x):
        """Rows split over the group for batch-leading arrays (when the batch divides), else replicated."""
        shape = tuple(getattr(x, "shape", None) or np.shape(x))
        if self.split_rows and len(shape) >= 1 and shape[0] == self.batch:
            return NamedSharding(self.mesh, PartitionSpec("rows"))
        return self.replicated

    def put(self, tree: Any, *, replicate: bool = False) -> Any:
        """device_put of every leaf onto this group (params: replicate=True)."""
        return jax.tree.map(lambda x: jax.device_put(x, self.replicated if replicate else self.sharding_for(x)), tree)

    def ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)


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


def resolve_groups(target_devices, draft_devices) -> tuple[tuple, tuple]:
    """(target devices, draft devices) from the options (None = default split, see module doc).
    Groups either coincide (colocated) or are disjoint; anything else is an InputError."""
    visible = jax.devices()
    if target_devices is None and draft_devices is None:
        if len(visible) == 1:
            return tuple(visible), tuple(visible)
        half = (len(visible) + 1) // 2
        return tuple(visible[:half]), tuple(visible[half:])
    if target_devices is None or draft_devices is None:
        raise InputError("give both target_devices and draft_devices, or neither (default: split the visible devices)")
    target = _as_devices("target_devices", target_devices, visible)
    draft = _as_devices("draft_devices", draft_devices, visible)
    if target != draft and set(target) & set(draft):
        raise InputError(f"target_devices {[d.id for d in target]} and draft_devices {[d.id for d in draft]} "
                         "overlap; make them disjoint, or identical to colocate both models")
    return target, draft
