"""Helpers shared by the benchmarks: machine description, timing, JSON results, tables.

Benchmarks compare ssd_jax with a peer side by side in one process on one machine; absolute
numbers depend on the machine (and on whatever else runs on it), so every result file records
the machine, the library versions and the load average before and after the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags(wanted: Sequence[str] = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "fma")) -> list[str]:
    """Which of the SIMD features that matter for matmuls the CPU reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """Fraction of all cores' time spent busy over the next `seconds` (from /proc/stat). Sampled
    while this process idles, it measures what other processes take from the benchmark."""

    def snapshot():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total0, idle0 = snapshot()
        time.sleep(seconds)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return round(1.0 - (idle1 - idle0) / total, 3) if total > 0 else None


def machine_busy(info: dict[str, Any], threshold: float = 0.25) -> bool:
    """Whether other processes took more than `threshold` of the CPU just before or just after
    the run: timings taken while others compete for the cores (and the memory bandwidth) are
    not reliable."""
    samples = [info.get("cpu_busy_before"), info.get("cpu_busy_after")]
    return any(s is not None and s > threshold for s in samples)


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:
        return None
    return getattr(module, "__version__", None)


def machine_info() -> dict[str, Any]:
    """Machine, OS, library versions and date (UTC) of this run."""
    import jax

    try:
        with open("/proc/meminfo") as f:
            mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        memory_gib = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        memory_gib = None
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "ssd_jax": _version("ssd_jax"),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_average(),
        "cpu_busy_before": cpu_busy_fraction(),
    }


def weight_stream_roofline(num_params: int, width: int = 768, repeats: int = 10) -> dict[str, float]:
    """Full passes per second over num_params float32 values: a read-only reduction (the memory
    bandwidth bound), one jitted matrix-vector product, and torch's (when installed). At batch 1
    a decoder reads every weight once per token, so these bound its tokens/s from above."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = max(1, num_params // width)
    host = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    w, x = jnp.asarray(host), jnp.ones((width,), jnp.float32)
    out: dict[str, float] = {"bytes_per_pass": float(host.nbytes)}
    for name, fn in (("read_only_passes_per_s", lambda w, x: jnp.sum(w, axis=0) + x),
                     ("jax_matvec_passes_per_s", lambda w, x: w @ x)):
        exe = jax.jit(fn).lower(w, x).compile()
        exe(w, x).block_until_ready()
        best = min(timed(lambda: exe(w, x).block_until_ready())[0] for _ in range(repeats))
        out[name] = 1.0 / best
    try:
        import torch
    except ImportError:
        return out
    tw, tx = torch.from_numpy(host), torch.ones(width)
    with torch.inference_mode():
        tw @ tx
        out["torch_matvec_passes_per_s"] = 1.0 / min(timed(lambda: tw @ tx)[0] for _ in range(repeats))
    return out


OUT_HELP = "path stem of the results: STEM.json and STEM.png (a trailing .json or .png is dropped)"


def output_stem(path: str) -> str:
    """The stem a benchmark writes STEM.json and STEM.png at: path without a trailing .json or
    .png, so `--out results/x.json` writes results/x.json, not results/x.json.json."""
    root, ext = os.path.splitext(path)
    return root if ext.lower() in (".json", ".png") else path


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call of fn."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """best / median / all of a list of timings, in seconds."""
    return {
        "best_s": min(seconds),
        "median_s": statistics.median(seconds),
        "all_s": [round(s, 6) for s in seconds],
    }


def write_text(path: str, text: str) -> str:
    """Writes text to path whole or not at all (creating the directory); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # never leave a half-written result behind
    return path


def write_json(path: str, data: Any) -> str:
    """Writes data as indented JSON (creating the directory); returns the path."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def override_policy(assignments: list[str]) -> dict:
    """Sets fields of this backend's policy from "field=value" strings (ints, or true/false for
    flags); returns the fields set."""
    from ssd_jax import backend

    here = backend.default_platform()
    policy = backend.POLICIES[here]
    fields = {}
    for assignment in assignments:
        name, _, text = assignment.partition("=")
        if not hasattr(policy, name) or not text:
            raise SystemExit(f"--policy {assignment!r}: expected FIELD=VALUE with FIELD one of the policy's "
                             f"({', '.join(f for f in vars(policy))})")
        current = getattr(policy, name)
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise SystemExit(f"--policy {assignment!r}: {name} takes true or false")
            fields[name] = text.lower() == "true"
        elif isinstance(current, int):
            fields[name] = int(text)
        else:
            fields[name] = text
    backend.POLICIES[here] = dataclasses.replace(policy, **fields)
    return fields
