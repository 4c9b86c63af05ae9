"""SSD in the draft/target cost regimes of `bench_regimes.py`: its measured components, the
Saguaro model's projection of SSD against SD where the draft has a device of its own, and the
model checked against every SSD run measured so far.

    python benchmarks/ssd_regimes.py [--regimes 5,20,100] [--prompts 2] [--new-tokens 128]

Why a projection: two CPU devices of this VM share its memory bandwidth (two memory-bound
programs on two devices take 1.73-1.84x one program's time), so SSD's overlap of the draft's
cache build with the target's verify cannot pay here, and a measured SSD-over-SD ratio says
nothing about a draft on an accelerator of its own. What does carry over is each component's
cost and the hit rate, measured here in each regime (widened pair, as `bench_regimes.py`:
`TARGET_WIDENING`, the draft widened to the regime's ratio) on one device, L=4, fan-out budget 10,
batch 1 (SSD's cache pays at small batches: a step hits only when every row hits):

  T_v  the target's verify of a speculation          (sync-timing runs: each program alone)
  T_b  the draft's cache build for the fan-out        (idem)
  T_s  the cache lookup on the draft's device         (idem, steps where every row hit)
  T_f  the fallback drafting of a missed outcome      (idem)
  h    the host's work per step (the loop's Python, dispatches and transfers: the sync-timing
       runs' wall time less their programs)
  p    the cache hit rate (and by outcome depth), a  the mean acceptance length

  colocated step = max(T_v + T_b + T_s + (1 - p) T_f, h)     (what this VM runs: checks the model)
  split step     = max(max(T_v, T_b) + T_s + (1 - p) T_f, h)  (the draft on its own device: the projection)
  tokens/s       = a / step
The host queues each step before it reads the one before (`ssd_jax.ssd.host_loop`), so its work
overlaps the devices' and sets the pace only where it is the larger.

SD runs in the same process (at its defaults and at L=4, the faster counts), on the same
prompts; the projection is split SSD's tokens/s over that. The check: every SSD run of
`benchmarks/results/ssd.json` (one device, two fake devices in both dispatch modes, one thread
each) and this script's own colocated runs, predicted step against measured step. The H100 runs
in `accelerator_*.json` recorded no component latencies, so they cannot be checked; the GPU
script records them when a device is lent.
Writes benchmarks/results/ssd_regimes.json and ssd_regimes.png. --smoke: toy size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402

LENGTH, BUDGET = 4, 10
TEMPERATURES = (0.0, 1.0)


def ssd_step(latency_ms: dict, hit_rate: float, host_ms: float, colocated: bool) -> float:
    """ms of an SSD step (the Saguaro model, module docstring): with both models on one device
    taking turns (colocated), or with the draft on its own device."""
    from benchmarks.bench_ssd import device_step

    device = device_step(*(latency_ms[k] for k in ("verify", "build", "select", "fallback")), hit_rate, colocated)
    return max(device, host_ms)


def worker(ratio: int, batch: int, per_set: int, new_tokens: int, rounds: int, target_widening: dict,
           draft_menu) -> dict:
    import ssd_jax
    from benchmarks.bench_regimes import calibrated_draft, prompt_sets, step_ms
    from benchmarks.bench_ssd import run_ssd
    from benchmarks.spec_harness import run_configs
    from ssd_jax.testing import widen
    from ssd_jax.tuning.tuner import Tuner

    target, draft_small = ssd_jax.default_models()
    target = widen(target, **target_widening) if target_widening else target
    tuner = Tuner()
    target_ms = step_ms(tuner, target, batch)
    draft, widening, draft_ms, measured = calibrated_draft(tuner, draft_small, target_ms, ratio, batch, draft_menu)
    prompts = [p for group in prompt_sets(target.tokenizer, per_set, batch).values() for p in group]
    out = dict(regime=f"1/{ratio}", ratio=ratio, measured_ratio=measured, batch_size=batch, target_step_ms=target_ms,
               draft_step_ms=draft_ms, draft_widening=widening, prompts=len(prompts), new_tokens=new_tokens, runs=[])
    for temperature in TEMPERATURES:
        configs = [("ar", {}), ("sd", {}), ("sd", dict(num_draft_tokens=LENGTH))]
        ar, sd_auto, sd_fixed = run_configs(target, prompts, configs, temperature, new_tokens, batch_size=batch,
                                            draft=draft, repeats=rounds, tuner=tuner)
        ssd = run_ssd(target, draft, prompts, temperature, new_tokens,
                      dict(num_draft_tokens=LENGTH, fanout_budget=BUDGET, fanout="geometric"),
                      sync_prompts=len(prompts))
        sd_best = max(sd_auto["tokens_per_second"], sd_fixed["tokens_per_second"])
        latency, p, host = ssd["latency_ms"], ssd["cache_hit_rate"], ssd["host_work_ms_per_step"]
        split = ssd_step(latency, p, host, colocated=False)
        run = dict(temperature=temperature, ar_tokens_per_second=ar["tokens_per_second"],
                   sd_tokens_per_second=dict(auto=sd_auto["tokens_per_second"], fixed_l4=sd_fixed["tokens_per_second"]),
                   sd_mean_acceptance_length=sd_fixed.get("mean_acceptance_length"),
                   sd_step_ms=sd_fixed["wall_time_s"] / sd_fixed["target_calls"] * 1e3,
                   ssd_measured_tokens_per_second=ssd["tokens_per_second"], ssd_measured_step_ms=ssd["measured_step_ms"],
                   ssd_colocated_predicted_step_ms=ssd_step(latency, p, host, colocated=True),
                   latency_ms=latency, host_ms_per_step=host, hit_rate=p,
                   hit_rate_by_accepted_length=ssd["hit_rate_by_accepted_length"],
                   outcomes_by_accepted_length=ssd["outcomes_by_accepted_length"],
                   ssd_mean_acceptance_length=ssd["mean_acceptance_length"],
                   projected_split_step_ms=split,
                   projected_split_tokens_per_second=ssd["mean_acceptance_length"] / split * 1e3,
                   # the host's work in series with the devices', as the loop read each step before
                   # queueing the next (until 2026-12-03)
                   projected_split_host_in_series_tokens_per_second=ssd["mean_acceptance_length"]
                   / (ssd_step(latency, p, 0.0, colocated=False) + host) * 1e3)
        run["projected_ssd_over_sd"] = run["projected_split_tokens_per_second"] / sd_best
        run["projected_ssd_over_sd_host_in_series"] = run["projected_split_host_in_series_tokens_per_second"] / sd_best
        run["measured_ssd_over_sd"] = ssd["tokens_per_second"] / sd_best
        out["runs"].append(run)
        print(f"1/{ratio} b{batch} T={temperature:g}: SD {sd_best:.1f} tok/s, SSD measured {ssd['tokens_per_second']:.1f} "
              f"(colocated), hit {p:.2f}, T_v {latency['verify']:.2f} T_b {latency['build']:.2f} "
              f"T_f {latency['fallback']:.2f} host {host:.2f} ms; projected split SSD/SD "
              f"{run['projected_ssd_over_sd']:.2f} (host in series {run['projected_ssd_over_sd_host_in_series']:.2f})",
              flush=True)
    return out


def validation(regime_parts: list[dict], ssd_results: dict | None) -> list[dict]:
    """Predicted against measured step for every SSD run with component latencies."""
    rows = []
    for part in regime_parts:
        for run in part["runs"]:
            rows.append(dict(source="ssd_regimes (this script)", setup=f"{part['regime']} batch {part['batch_size']}",
                             temperature=run["temperature"], model="colocated",
                             predicted_step_ms=run["ssd_colocated_predicted_step_ms"],
                             measured_step_ms=run["ssd_measured_step_ms"]))
    for run in (ssd_results or {}).get("runs", []):
        if run.get("method") != "ssd" or "predicted" not in run:
            continue
        rows.append(dict(source="ssd.json", setup=f"{run['setup']}: {run['label']}", temperature=run["temperature"],
                         model="colocated" if run["colocated"] else "split",
                         predicted_step_ms=run["predicted"]["step_ms"], measured_step_ms=run["measured_step_ms"]))
    for row in rows:
        row["measured_over_predicted"] = row["measured_step_ms"] / row["predicted_step_ms"]
    return rows


def plot(parts: list[dict], checks: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    labels = [f"{p['regime']}\nb{p['batch_size']}" for p in parts]
    x = np.arange(len(parts))
    for i, temperature in enumerate(TEMPERATURES):
        runs = [next(r for r in p["runs"] if r["temperature"] == temperature) for p in parts]
        ax.bar(x + (i - 0.5) * 0.38, [r["projected_ssd_over_sd"] for r in runs], 0.38,
               label=f"projected, own device, T={temperature:g}")
        ax.scatter(x + (i - 0.5) * 0.38, [r["measured_ssd_over_sd"] for r in runs], color="k", marker="x", zorder=3,
                   label="measured here (one device)" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_xlabel("draft/target cost regime")
    ax.set_ylabel("SSD tokens/s over SD's (best of auto, L=4)")
    ax.set_title("SSD against SD: projected with the draft on its own device")
    ax.legend(fontsize=8)
    ax = axes[1]
    for model, marker in (("colocated", "o"), ("split", "^")):
        chosen = [c for c in checks if c["model"] == model]
        ax.scatter([c["predicted_step_ms"] for c in chosen], [c["measured_step_ms"] for c in chosen], marker=marker,
                   label=f"{model} ({len(chosen)} runs)")
    top = max([c["measured_step_ms"] for c in checks] + [c["predicted_step_ms"] for c in checks] + [1.0]) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="measured = predicted")
    ax.set_xlabel("predicted ms per SSD step")
    ax.set_ylabel("measured ms per SSD step")
    ax.set_title("the model against measured SSD runs (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from benchmarks.bench_regimes import DRAFT_MENU, TARGET_WIDENING

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="5,20,100")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set (code, prose, repetition)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "ssd_regimes.json"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        result = worker(**spec["run"])
        result.update(machine=machine_info(), load_average_at_end=load_average())
        write_json(spec["path"], result)
        return 0
    widening, menu, regimes = TARGET_WIDENING, DRAFT_MENU, [int(r) for r in args.regimes.split(",")]
    if args.smoke:
        widening, menu, regimes, args.prompts, args.new_tokens = {}, DRAFT_MENU[:2], regimes[:1], 1, 16
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in regimes:
            path = os.path.join(tmp, f"{ratio}.json")
            run = dict(ratio=ratio, batch=1, per_set=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds,
                       target_widening=widening, draft_menu=menu)
            started = time.perf_counter()
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                            json.dumps(dict(run=run, path=path))], check=True)
            print(f"regime 1/{ratio}: {time.perf_counter() - started:.0f} s", flush=True)
            with open(path) as f:
                parts.append(json.load(f))
    ssd_json = os.path.join(RESULTS_DIR, "ssd.json")
    previous = json.load(open(ssd_json)) if os.path.exists(ssd_json) else None
    checks = validation(parts, previous)
    errors = {model: [c["measured_over_predicted"] for c in checks if c["model"] == model]
              for model in ("colocated", "split")}
    summary = {model: dict(runs=len(v), median=float(np.median(v)), min=float(np.min(v)), max=float(np.max(v)))
               for model, v in errors.items() if v}
    results = dict(benchmark="SSD's components per draft/target cost regime, the Saguaro model's projection "
                             "with the draft on its own device, and the model checked against measured runs",
                   machine=machine_info(), num_draft_tokens=LENGTH, fanout_budget=BUDGET,
                   target_widening=widening, regimes=parts, validation=checks,
                   validation_summary=summary,
                   unchecked=("accelerator_nvidia_h100_80gb_hbm3*.json: SSD ran (0.19x / 0.14x AR at T=0 / T=1, "
                              "one GPU, colocated) but no component latencies were recorded"))
    write_json(args.out, results)
    plot(parts, checks, os.path.splitext(args.out)[0] + ".png")
    rows = [[p["regime"], f"1/{1 / p['measured_ratio']:.0f}", p["batch_size"], r["temperature"],
             r["latency_ms"]["verify"], r["latency_ms"]["build"], r["latency_ms"]["select"], r["latency_ms"]["fallback"],
             r["host_ms_per_step"], r["hit_rate"], r["ssd_mean_acceptance_length"], r["measured_ssd_over_sd"],
             r["projected_ssd_over_sd"], r["projected_ssd_over_sd_host_in_series"]]
            for p in parts for r in p["runs"]]
    print(format_table(["regime", "measured", "batch", "T", "T_v ms", "T_b ms", "T_s ms", "T_f ms", "host ms", "hit",
                        "acc len", "SSD/SD here", "SSD/SD projected", "projected, host in series"], rows))
    print("model check (measured / predicted step):", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
