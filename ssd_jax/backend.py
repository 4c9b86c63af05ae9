"""The backend policy: every choice that depends on the hardware, made in one place.

No other module under `ssd_jax/` asks JAX which backend it runs on or a device's platform; they
ask this module for the `Policy` of the platform their model lives on (`policy_for(model)`).

The choices, per platform (each measured; the numbers are in benchmarks/results/):

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
  matmul on XLA:CPU and on XLA:GPU alike (H100, Llama-1B shape, bf16, batch 1: 3.06 ms per AR
  step scanned, 1.63 ms unrolled; `accelerator_*_baseline.json`, part e). TPU follows the GPU
  choice until measured there.
- Prompt attention: `jax.nn.dot_product_attention` with cuDNN (flash attention) serves the causal
  prompt forward on GPU, where the mask is plain causal (plus a sliding window): at 2048 tokens
  0.11 ms against the reference's 1.04 ms (H100, 8B-class heads); below 256 tokens the
  reference is faster (128 tokens: 0.048 vs 0.088 ms), hence `fused_prefill_min_tokens`.
- Cached steps and token trees need arbitrary masks, which cuDNN took 2-3x slower than the
  alternatives at 1-64 new tokens. XLA's `dot_product_attention` with the mask beat the
  reference einsum end to end on an H100 (embedded pair, bf16, T=0: AR +9.5%, SD +12%,
  LogitSpec +7%, CSD +7%; `accelerator_*_policy.json`); on CPU the reference stays (measured
  equal or faster). On TPU a Pallas kernel (`ssd_jax.models.pallas_attention`, flash decoding:
  the cache streamed block by block with an online softmax, stopping at the last visible block)
  serves every cache whose capacity it takes; other capacities keep the reference. It is checked
  against the reference on CPU through Pallas's interpreter and lowered for TPU in the tests, but
  not yet timed on a TPU.
- Rows: on an H100 one AR step of the 1B shape took 1.47-1.51 ms at batch 1 and 1.21-1.26 ms at
  batch 2 (bf16; `accelerator_*_policy.json`): XLA's one-row matrix-vector products read the
  weights more slowly than its two-row products. AR therefore decodes a lone row beside a copy
  of itself on GPU and drops the copy.
- Adaptive speculation's control flow: XLA:GPU runs a `while_loop` turn or a `lax.switch` by
  reading its predicate or index back to the host, which waits for the GPU to drain before it
  launches the next kernel; the embedded pair's steps are ~100-200 tiny kernels (H100: an AR step
  88 kernels, 0.19 ms), so each read costs a visible share. On an H100 (embedded pair, bf16,
  128 tokens) PLD "auto" ran 2.8x AR where fixed L=8 ran 3.5x at the same 4.51 tokens per step
  (badguess set, T=0, batch 1), and its plain fallback 0.74x AR at T=1. Checking the loop's
  conditions and choices every 4 steps (a static trip count, no read back) took the fallback to
  0.80x and SD "auto" at batch 8 from 0.91x to 0.99x AR; the per-step verification switch and
  the batch-1 early-stopping draft loop are left out on GPU from that measurement (wider
  verification is nearly free there) but not yet timed without them. XLA:TPU runs control flow
  on the device, so TPU keeps the CPU's choices but one: on CPU SD "auto" at batch 1 now also
  compiles one step per cap (dispatched per run of steps) instead of drafting in the
  early-stopping `while_loop` and switching the verification width per step, whose conditional
  copied the target's KV cache in and out every step (with the loop choosing less often and
  measured per-cap step times: 0.95-1.02 of the best fixed length against 0.86-0.99, batch 1,
  embedded pair, 2026-11-25); TPU keeps the `while_loop` until timed there.
- Per-call choice: even checked every 4 steps, the loop's steps on an H100 cost 10-11% over a
  fixed length's program at the same cap and its plain steps 27% over AR's program (SD, batch 1,
  2026-11-27), and "auto" ran 0.84-0.91 of fixed L=2 (PLD's loop 0.92-0.95 of fixed L=8 at the
  same tokens per step, H200). On GPU an "auto" call of one row of a synchronous method (SD, BV,
  SpecInfer, SpecTr, GBV, PLD, LogitSpec, CSD) therefore runs the fixed program (or AR's) that
  the cost model picks before the call from the pair's remembered acceptance and the programs'
  measured step times and tokens per step (`ssd_jax.tuning.per_call`); on an H200 at batch 1
  (2026-11-28) SD ran 0.91-1.02 of its best fixed length, PLD 1.00-1.02 at T=0, CSD 0.98-1.03,
  where the loop had run 0.82-0.96; GBV and PLD at T=1 missed AR's speed by pricing AR's program
  off the drafted programs' surplus, fixed since (AR's program timed, paths chosen per call),
  not yet re-timed there. Batch 8 keeps the loop (1.01-1.04 of the best fixed length on the
  H100, where a step is long enough to hide the reads).
- Verifiers' loops: the multi-path and tree verifiers loop over a few static steps (depths,
  candidates, SpecTr's 24 bisection steps for rho* at every depth). On an H200 (embedded pair,
  bf16, T=1, batch 1, 2 paths, 2026-11-30) SpecTr's fixed L=1/2/4 ran 0.76/0.67/0.54x AR where
  SpecInfer's, the same walk without the bisection, ran 1.09/1.16/1.12x: each `while_loop` turn
  is a read back to the host. Off CPU these loops are unrolled and SpecTr's search takes 15
  points a round (6 rounds, the same final bracket); on CPU, where turns are free and the extra
  points cost compute (a SpecTr verification at batch 8, L=8, 2 paths, V=4096: 9.4 ms unrolled
  with the 15-point search against 3.3 ms in loops, bisecting), the loops stay. Not yet timed on
  a GPU or TPU.
- Drafting: a draft model's fixed-length drafting (SD, BV, SpecInfer, SpecTr, GBV) runs its L - 1
  forwards in a `lax.scan` everywhere; `unroll_draft_steps` writes them out instead, which on
  XLA:GPU would spare L - 1 host reads a step (as the verifiers' loops, above). On CPU it changes
  nothing measurable (SD, T=0, batch 1, 4 prompts x 128 tokens, fastest of 3: scan over unrolled
  1.003 / 0.983 / 1.008 at L = 2 / 4 / 8, 2026-11-30). Off until timed on a GPU
  (`bench_adaptive.py --policy unroll_draft_steps=true` against the default).
- First runs: an executable's first run costs more than its later ones. On an H200 (per-call
  "auto" at batch 1, SpecInfer and SpecTr at T=0, 2026-11-30, `adaptive_gpu_h200_*_percall5.json`'s
  call traces) a newly compiled program's first call took 30-40 ms where its later calls on the
  same prompt took 12-24 ms: "auto" pays that on each program it tries (two or three in its first
  calls), which held it to 0.82-0.88 of the best fixed length (whose first run the benchmark's
  untimed first call takes) where its fastest of 3 rounds ran 0.95-1.10 of that length's fastest.
  The same on a 2-core Xeon VM with per-call "auto" forced (SpecTr, T=0, batch 1): compiling
  calls took 207-223 ms against 80-100 ms for later calls; warmed, they took 80-109 ms and "auto"
  ran 2.25x and 1.94x AR on code and badguess against 2.04x and 1.57x
  (`adaptive_spectr_b1_t0_percall_warm_{off,on}_xeon.json`).
  Off CPU such a program runs once on its call's inputs before the call's own run
  (`generate._first_run_s`; one more decode on top of a 1-11 s compile), so a call's wall time is
  a steady run's and per-call "auto" prices the program it tried on that call. On CPU, where
  "auto" is the adaptive loop (whose calibration runs its program first) and a fixed program's
  extra run would add a whole decode to a short command line's first call (0.2-1 s on 2 cores),
  the first run stays in the call. Not yet timed on a GPU.
- LogitSpec's tree: on CPU the target forward is compute-bound, so every node costs (8 nodes:
  1.49x AR, 64: 0.48x on held-out code); on an H100 16 nodes beat 64 (1.96x vs 1.63x AR, T=0),
  and on an H200 too (1.63x vs 1.55x, 2026-11-28): building and verifying the tree grow with its
  nodes where the forward does not. Under "auto" this size caps the one the measured forwards
  choose (`auto_shape.tree_size_for`).

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
