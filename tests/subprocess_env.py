"""The environment of a test's subprocess that fakes N CPU devices (XLA reads the device count
when jax starts, so multi-device checks run in their own process)."""

from __future__ import annotations

import os


def fake_devices_env(count: int) -> dict:
    """os.environ plus `--xla_force_host_platform_device_count=count` (after the suite's own
    XLA_FLAGS, see conftest.py) and JAX_PLATFORMS=cpu."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={count}".strip(),
                JAX_PLATFORMS="cpu")
