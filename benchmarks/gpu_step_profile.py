"""Per-step time and device-kernel counts of SD's fixed lengths against draft_len="auto" (issue 17,
on a lent GPU): where the adaptive loop's extra time per step goes.

    python benchmarks/gpu_step_profile.py OUTDIR [--batches 1,8] [--temperatures 0,1] [--trace]

With --trace each row also counts the device kernels per target call by kind (a kernel's name
without its trailing number: "gemm_fusion_dot", "loop_multiply_fusion", ...), the names of two
programs' kernels being numbered apart: where "auto" runs more kernels of a kind per step than the
fixed lengths, that kind is its overhead (on an H200, 2026-11-27, the loop's steps cost ~5% over
fixed L=4's at T=0 and ~20% at T=1).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from benchmarks.spec_harness import generate_kwargs  # noqa: E402

CONFIGS = [("ar", "ar", {}), ("sd L=1", "sd", {"num_draft_tokens": 1}), ("sd L=2", "sd", {"num_draft_tokens": 2}),
           ("sd L=4", "sd", {"num_draft_tokens": 4}), ("sd auto", "sd", {"num_draft_tokens": "auto"})]


def kernel_summary(trace_dir: str) -> dict:
    """Device kernels in the trace: count, busy microseconds, and the 12 most frequent names."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}
    data = ProfileData.from_file(files[0])
    names = collections.Counter()
    kinds = collections.Counter()
    busy = 0.0
    lines = sorted({f"{plane.name}|{line.name}" for plane in data.planes for line in plane.lines})
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for event in line.events:
                names[event.name] += 1
                kinds[re.sub(r"[._]\d+$", "", event.name)] += 1
                busy += event.duration_ns / 1e3
    return dict(kernels=sum(names.values()), busy_us=busy, top=names.most_common(12), kinds=dict(kinds), lines=lines[:40])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = ssd_jax.default_models()
    prompts = heldout_prompts(target.tokenizer, 8, prompt_tokens=128, seed=11)
    rows = []
    cases = [(int(b), float(t)) for b in args.batches.split(",") for t in args.temperatures.split(",")]
    for batch, temperature in cases:
        group = prompts[:batch]
        for label, method, options in CONFIGS:
            kwargs = generate_kwargs(method, options, draft, args.new_tokens, temperature)
            out = ssd_jax.generate(target, group, key=jax.random.PRNGKey(0), **kwargs)
            walls = []
            for _ in range(5):
                start = time.perf_counter()
                out = ssd_jax.generate(target, group, key=jax.random.PRNGKey(0), **kwargs)
                walls.append(time.perf_counter() - start)
            stats = out.stats
            calls = stats.get("target_calls", 0) or 1
            row = dict(batch=batch, temperature=temperature, config=label, wall_ms=1e3 * min(walls), target_calls=calls,
                       ms_per_call=1e3 * min(walls) / calls, mean_draft_len=stats.get("mean_draft_len"),
                       ar_fallback_share=stats.get("ar_fallback_share"))
            if args.trace:
                trace_dir = os.path.join("/tmp/ssd_jax_traces", f"b{batch}_t{temperature:g}_{label.replace(' ', '_')}")
                with jax.profiler.trace(trace_dir):
                    ssd_jax.generate(target, group, key=jax.random.PRNGKey(0), **kwargs)
                summary = kernel_summary(trace_dir)
                if summary and not rows:
                    print("trace lines:", summary["lines"])
                if summary:
                    row.update(kernels_per_call=summary["kernels"] / calls,
                               busy_us_per_call=summary["busy_us"] / calls, top_kernels=summary["top"],
                               kernels_per_call_by_kind={k: n / calls for k, n in sorted(summary["kinds"].items())})
            rows.append(row)
            print(f"B={batch} T={temperature:g} {label:8s} {row['ms_per_call']:.3f} ms/call, {calls} calls, "
                  f"{row.get('kernels_per_call', 0):.0f} kernels/call, {row.get('busy_us_per_call', 0):.0f} us busy/call",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = "_cmdbuf" if "command_buffer" in os.environ.get("XLA_FLAGS", "") else ""
    with open(os.path.join(args.out, f"step_profile{tag}.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
