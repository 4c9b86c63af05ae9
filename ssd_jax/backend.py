"""The backend policy: every choice that depends on the hardware, made in one place.

No other module under `ssd_jax/` asks JAX which backend it runs on or a device's platform; they
ask this module for the `Policy` of the platform their model lives on (`policy_for(model)`).

The choices, per platform (the measurements behind them: docs/accelerators.md, docs/benchmarks.md):

| choice | cpu | gpu | tpu |
| --- | --- | --- | --- |
| `dtype` (params and KV cache) | float32 | bfloat16 | bfloat16 |
| `unroll_layers` (decode loops on `decode_params`, per-layer KV cache) | yes | yes | yes |
| `prefill_attention` (causal prompt forward) | reference | cudnn | xla |
| `fused_prefill_min_tokens` (shortest prompt bucket given to it) | 0 | 256 | 256 |
| `decode_attention` (cached steps and token trees) | reference | xla | pallas |
| `logitspec_tree_size` (LogitSpec's default node budget) | 8 | 16 | 64 |
| `min_decode_rows` (AR decodes at least this many rows) | 1 | 2 | 1 |
| `adaptive_steps_per_check` (adaptive loop: steps between its checks and choices) | 1 | 4 | 1 |
| `adaptive_switch_per_step` (PLD, CSD: verification at the narrowest width, per step or, CSD at batch > 1, per run of steps) | yes | no | yes |
| `adaptive_scan_from_batch` (SD "auto": one compiled step per cap from this batch) | 1 | 1 | 2 |
| `adaptive_per_call_below_rows` (synchronous methods' "auto" below this many rows: a fixed program chosen per call) | - | 2 | - |
| `unroll_draft_steps` (a draft model's fixed-length drafting: its L - 1 forwards as straight-line code, not a `lax.scan`) | no | no | no |
| `warm_new_programs` (a program compiled or loaded for a call runs once apart before the call's own run, reported with its compile time) | no | yes | no |
| verifiers' small loops (multi-path walk, SpecInfer's candidates, GBV's selection, SpecTr's rho* search, tree walk; chosen when lowered, `ssd_jax.verify._unroll`) | loops | unrolled | unrolled |

- float32 on CPU: XLA:CPU has no fast bf16 matmul on most hosts, and the CPU tests are exact in f32.
  bf16 on accelerators halves the bytes that every memory-bound decode step reads; softmax,
  norms and logits stay float32 whatever the dtype (`ssd_jax.models`).
- Unrolled layers: a `lax.scan` over stacked weights copies each layer's weight slice before its
  matmul on XLA:CPU and on XLA:GPU alike. TPU follows the GPU choice until timed there.
- Prompt attention: `jax.nn.dot_product_attention` with cuDNN (flash attention) serves the causal
  prompt forward on GPU, where the mask is plain causal (plus a sliding window); on short prompts
  the reference is faster, hence `fused_prefill_min_tokens`.
- Cached steps and token trees need arbitrary masks, which cuDNN handles slowly at a few new
  tokens; XLA's `dot_product_attention` with the mask beats the reference einsum end to end on
  GPU, while on CPU the reference is as fast or faster. On TPU a Pallas kernel
  (`ssd_jax.models.pallas_attention`, flash decoding: the cache streamed block by block with an
  online softmax, stopping at the last visible block) serves every cache whose capacity it takes;
  other capacities keep the reference. It is checked against the reference on CPU through
  Pallas's interpreter and lowered for TPU in the tests, but not yet timed on a TPU.
- Rows: XLA:GPU's one-row matrix-vector products read the weights more slowly than its two-row
  products, so AR decodes a lone row beside a copy of itself on GPU and drops the copy.
- Adaptive speculation's control flow: XLA:GPU runs a `while_loop` turn or a `lax.switch` by
  reading its predicate or index back to the host, which waits for the GPU to drain before it
  launches the next kernel; a small model's step is a hundred or so tiny kernels, so each read
  costs a visible share. On GPU the adaptive loop therefore checks its conditions and choices
  every 4 steps (a static trip count, no read back), and leaves out the per-step verification
  switch and the batch-1 early-stopping draft loop (wider verification is nearly free there).
  XLA:TPU runs control flow on the device, so TPU keeps the CPU's choices but one: on CPU SD
  "auto" at batch 1 compiles one step per cap (dispatched per run of steps) instead of drafting
  in the early-stopping `while_loop` and switching the verification width per step, whose
  conditional copies the target's KV cache in and out every step; TPU keeps the `while_loop`
  until timed there.
- Per-call choice: even checked every 4 steps, the loop's steps on GPU cost more than a fixed
  length's program at the same cap, and its plain steps more than AR's program. On GPU an "auto"
  call of one row of a synchronous method (SD, BV, SpecInfer, SpecTr, GBV, PLD, LogitSpec, CSD)
  therefore runs the fixed program (or AR's) that the cost model picks before the call from the
  pair's remembered acceptance and the programs' measured step times and tokens per step
  (`ssd_jax.tuning.per_call`). Larger batches keep the loop, whose steps are long enough to hide
  the reads.
- Verifiers' loops: the multi-path and tree verifiers loop over a few static steps (depths,
  candidates, SpecTr's 24 bisection steps for rho* at every depth), and on GPU each `while_loop`
  turn is a read back to the host. Off CPU these loops are unrolled and SpecTr's search takes 15
  points a round (6 rounds, the same final bracket); on CPU, where turns are free and the extra
  points cost compute, the loops stay (`ssd_jax.verify._unroll`). The unrolled form is not yet
  timed on a GPU or TPU.
- Drafting: a draft model's fixed-length drafting (SD, BV, SpecInfer, SpecTr, GBV) runs its L - 1
  forwards in a `lax.scan` everywhere; `unroll_draft_steps` writes them out instead, which on
  XLA:GPU would spare L - 1 host reads a step (as the verifiers' loops, above). On CPU it changes
  nothing measurable; it stays off until timed on a GPU
  (`bench_adaptive.py --policy unroll_draft_steps=true` against the default).
- First runs: an executable's first run costs more than its later ones, and "auto" pays that on
  each program it tries, which both slows its first calls and skews the prices it learns from
  them. Off CPU such a program runs once on its call's inputs before the call's own run
  (`generate._first_run_s`; one more decode on top of a much longer compile), so a call's wall
  time is a steady run's and per-call "auto" prices the program it tried on that call. On CPU,
  where "auto" is the adaptive loop (whose calibration runs its program first) and a fixed
  program's extra run would add a whole decode to a short command line's first call, the first
  run stays in the call.
- LogitSpec's tree: on CPU the target forward is compute-bound, so every node costs and small
  trees win; on accelerators the forward's cost barely grows with width, but building and
  verifying the tree grow with its nodes, so a middling tree beats the largest. Under "auto" this
  size caps the one the measured forwards choose (`auto_shape.tree_size_for`).

Inside a jitted function a model's arrays are tracers with no devices; `platform_of` then gives
the platform of JAX's default device, which is where an unannotated jit compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from typing import Any, Callable

import jax

from ssd_jax.errors import InputError

PLATFORMS = ("cpu", "gpu", "tpu")
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}
PREFILL_ATTENTION = ("reference", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The backend-dependent choices for one platform (see the module docstring's table)."""

    platform: str
    dtype: str
    unroll_layers: bool
    prefill_attention: str
    decode_attention: str
    logitspec_tree_size: int
    fused_prefill_min_tokens: int = 0
    min_decode_rows: int = 1
    adaptive_steps_per_check: int = 1
    adaptive_switch_per_step: bool = True
    adaptive_scan_from_batch: int = 2
    adaptive_per_call_below_rows: int = 0
    unroll_draft_steps: bool = False
    warm_new_programs: bool = False


POLICIES = {
    "cpu": Policy("cpu", dtype="float32", unroll_layers=True, prefill_attention="reference",
                  decode_attention="reference", logitspec_tree_size=8, adaptive_scan_from_batch=1),
    "gpu": Policy("gpu", dtype="bfloat16", unroll_layers=True, prefill_attention="cudnn",
                  decode_attention="xla", logitspec_tree_size=16, fused_prefill_min_tokens=256,
                  min_decode_rows=2, adaptive_steps_per_check=4, adaptive_switch_per_step=False,
                  adaptive_scan_from_batch=1, adaptive_per_call_below_rows=2, warm_new_programs=True),
    "tpu": Policy("tpu", dtype="bfloat16", unroll_layers=True, prefill_attention="xla",
                  decode_attention="pallas", logitspec_tree_size=64, fused_prefill_min_tokens=256),
}


def normalize_platform(name: str) -> str:
    """'cpu' | 'gpu' | 'tpu' for a JAX platform name ('cuda' and 'rocm' are 'gpu'); InputError otherwise."""
    platform = _PLATFORM_ALIASES.get(str(name).lower())
    if platform is None:
        raise InputError(f"unknown platform {name!r}; known: {', '.join(sorted(_PLATFORM_ALIASES))}")
    return platform


def default_platform() -> str:
    """The platform of JAX's default device (where an unannotated jit compiles)."""
    return normalize_platform(jax.devices()[0].platform)


def platform_of(tree: Any) -> str:
    """The platform of the devices holding the first placed array in `tree` (a Model, params or
    any pytree); the default platform when it holds none (numpy arrays, tracers inside jit)."""
    leaves = jax.tree.leaves(getattr(tree, "params", tree))
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            try:
                devices = leaf.devices()
            except Exception:  # noqa: BLE001 - deleted or abstract arrays have no devices
                continue
            if devices:
                return normalize_platform(next(iter(devices)).platform)
    return default_platform()


def policy_for(where: Any = None) -> Policy:
    """The policy of a platform name, of the platform a model or pytree lives on, or (None) of
    the default device."""
    if where is None:
        return POLICIES[default_platform()]
    if isinstance(where, str):
        return POLICIES[normalize_platform(where)]
    return POLICIES[platform_of(where)]


def devices_platform(devices) -> str:
    """The platform of a group of devices (all of one platform, else InputError)."""
    platforms = {normalize_platform(d.platform) for d in devices}
    if len(platforms) != 1:
        raise InputError(f"devices {[str(d) for d in devices]} span several platforms: {sorted(platforms)}")
    return platforms.pop()


def per_platform(*args: Any, cpu: Callable, default: Callable):
    """`cpu(*args)` in programs compiled for CPU, `default(*args)` elsewhere: the choice is made
    when the program is lowered (XLA drops the other branch), so one traced function serves
    every platform."""
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def _cpuinfo(*fields: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of fields; None without one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo; platform.processor() where there is none)."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def cpu_features() -> str:
    """The host CPU's instruction-set flags (/proc/cpuinfo's "flags", or "Features" on ARM; ""
    where there is none): XLA:CPU compiles for them, and virtual machines of one CPU model can
    hide some (an executable built where AVX-512 is on dies with SIGILL where it is off)."""
    return " ".join(sorted((_cpuinfo("flags", "Features") or "").split()))


def describe() -> dict:
    """The default backend and JAX version, for reports."""
    return {"jax_backend": default_platform(), "jax": jax.__version__}


def scan_unroll(unrolled: bool, length: int) -> int:
    """`lax.scan`'s `unroll` for a scan of `length` steps: 1 (an XLA loop) or, unrolled, more than
    `length`, so every step is written out. (`unroll=True` means `unroll=length`, which for one
    step is `unroll=1`: a `while` of one turn, the loop the unrolled programs must not hold.)"""
    return length + 1 if unrolled else 1
