"""Speculative decoding on the embedded pair, against autoregressive decoding and against
transformers' assisted generation on the same pair, in one run.

For held-out stdlib prompts (never seen in training), 128 new tokens, temperature 0 and 1,
batch 1: AR, SD, BV (L in {4, 8}) and SpecInfer, SpecTr, GBV (L in {4, 8}, K in {2, 4}) —
block efficiency, mean acceptance length, acceptance per position, tokens/s and speedup over
AR. Side by side: transformers `generate(assistant_model=draft)` vs its own `generate`.
Writes benchmarks/results/speculative.json, speculative_speedup.png, speculative_acceptance.png.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from benchmarks.spec_harness import label, run_configs, transformers_rates  # noqa: E402


def configurations(quick: bool, sweep: bool = False) -> list[tuple[str, dict]]:
    """The issue's grid (L in {4, 8}, K in {2, 4}); `sweep` instead scans L and K around the
    command line's defaults (the numbers that justify them)."""
    if sweep:
        configs: list[tuple[str, dict]] = [("ar", {})]
        configs += [(m, dict(num_draft_tokens=n)) for m in ("sd", "bv") for n in (2, 3, 4, 5, 6, 8)]
        configs += [(m, dict(num_draft_tokens=5, num_paths=k)) for m in ("specinfer", "spectr", "gbv") for k in (2, 3)]
        return configs
    lengths = (4,) if quick else (4, 8)
    paths = (2,) if quick else (2, 4)
    configs = [("ar", {})]
    for length in lengths:
        configs += [("sd", dict(num_draft_tokens=length)), ("bv", dict(num_draft_tokens=length))]
        for k in paths:
            configs += [(m, dict(num_draft_tokens=length, num_paths=k)) for m in ("specinfer", "spectr", "gbv")]
    return configs


def run_transformers(target_dir, draft_dir, prompts, temperature, new_tokens) -> dict:
    """transformers' generate and assisted generate on the same HF directories, same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    out = transformers_rates(target_dir, prompts, temperature, new_tokens,
                             {"ar": {}, "assisted": {"assistant_model": draft}})
    out["assisted_speedup_over_own_ar"] = out["assisted"]["tokens_per_second"] / out["ar"]["tokens_per_second"]
    return out


def plot(results: dict, path_speedup: str, path_acceptance: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [r["label"] for r in results["runs"] if r["temperature"] == 0.0 and r["method"] != "ar"]
    width = 0.4
    for j, temperature in enumerate((0.0, 1.0)):
        speedups = [next(r["speedup_over_ar"] for r in results["runs"] if r["label"] == lab and r["temperature"] == temperature)
                    for lab in labels]
        ax.bar(np.arange(len(labels)) + (j - 0.5) * width, speedups, width, label=f"T={temperature:g}")
    for j, temperature in enumerate((0.0, 1.0) if results["transformers"] else ()):
        hf = results["transformers"][str(temperature)]["assisted_speedup_over_own_ar"]
        ax.axhline(hf, color=f"C{j}", linestyle="--", linewidth=1, label=f"transformers assisted, T={temperature:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right")
    ax.set_ylabel("speedup over autoregressive (wall clock)")
    ax.set_title(f"ssd_jax speculative decoding on the embedded pair (CPU, batch {results['batch_size']}, "
                 f"{results['new_tokens']} new tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_speedup, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, temperature in zip(axes, (0.0, 1.0)):
        for r in results["runs"]:
            if r["temperature"] == temperature and r["method"] != "ar" and r.get("acceptance_per_position"):
                acc = r["acceptance_per_position"]
                ax.plot(np.arange(1, len(acc) + 1), acc, marker="o", markersize=3, label=r["label"])
        ax.set_title(f"T={temperature:g}")
        ax.set_xlabel("draft position")
    axes[0].set_ylabel("fraction of drafts accepting this position")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path_acceptance, dpi=120)
    plt.close(fig)


def plot_sweep(results: dict, path: str) -> None:
    """Speedup over AR against draft length L for sd and bv, at each temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for j, temperature in enumerate((0.0, 1.0)):
        for method, style in (("sd", "-o"), ("bv", "--s")):
            runs = [r for r in results["runs"] if r["temperature"] == temperature and r["method"] == method]
            ax.plot([r["options"]["num_draft_tokens"] for r in runs], [r["speedup_over_ar"] for r in runs], style,
                    color=f"C{j}", label=f"{method}, T={temperature:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("draft length L")
    ax.set_ylabel("speedup over autoregressive (wall clock)")
    ax.set_title(f"Draft length sweep on the embedded pair (CPU, batch {results['batch_size']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, fewer configurations")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--draft-model", choices=["draft", "draft_small"], default="draft",
                        help="which embedded draft drafts (draft_small: the 64x1 model shipped for cascades)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each call this many times and keep its fastest run (filters out interference)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (rows of a batch)")
    parser.add_argument("--methods", default=None, help="comma-separated subset of methods to run (ar always runs)")
    parser.add_argument("--sweep", action="store_true",
                        help="scan L in 2..8 and K in {2, 3} (the evidence for the CLI defaults); no transformers")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens = 4, 32
    if args.sweep or args.batch_size > 1:
        args.no_transformers = True  # transformers' assisted generation supports batch size 1 only
    info = machine_info()
    target, draft = ssd_jax.default_models(draft=args.draft_model)
    prompts = heldout_prompts(target.tokenizer, args.prompts)
    runs = []
    configs = [(m, o) for m, o in configurations(args.quick, args.sweep)
               if m == "ar" or not args.methods or m in args.methods.split(",")]
    for temperature in (0.0, 1.0):
        results = run_configs(target, prompts, configs, temperature, args.new_tokens, batch_size=args.batch_size,
                              draft=draft, repeats=args.repeats)
        ar_speed = results[0]["tokens_per_second"]
        for (method, options), result in zip(configs, results):
            result.update(method=method, options=options, label=label(method, options), temperature=temperature,
                          speedup_over_ar=result["tokens_per_second"] / ar_speed)
            runs.append(result)
            print(f"T={temperature:g} {result['label']:>16}: {result['tokens_per_second']:7.1f} tok/s  "
                  f"speedup {result['speedup_over_ar']:.2f}x  block eff {result['block_efficiency']:.2f}", flush=True)
    hf = {}
    if not args.no_transformers:
        for temperature in (0.0, 1.0):
            hf[str(temperature)] = run_transformers(target.path, draft.path, prompts, temperature, args.new_tokens)
            print(f"transformers T={temperature:g}: {hf[str(temperature)]}", flush=True)
    info["load_average_at_end"] = load_average()
    results = dict(benchmark="speculative decoding on the embedded pair vs AR and transformers assisted generation",
                   machine=info, prompts=len(prompts), new_tokens=args.new_tokens, batch_size=args.batch_size,
                   draft_model=args.draft_model, timing_repeats=args.repeats, runs=runs,
                   transformers=hf)
    for temperature in (0.0, 1.0):
        sd = max((r for r in runs if r["temperature"] == temperature and r["method"] == "sd"),
                 key=lambda r: r["tokens_per_second"])
        if hf:
            results[f"sd_vs_transformers_assisted_t{temperature:g}"] = (
                sd["tokens_per_second"] / hf[str(temperature)]["assisted"]["tokens_per_second"])
    suffix = ("_quick" if args.quick else "") + ("_sweep" if args.sweep else "") + (
        f"_b{args.batch_size}" if args.batch_size != 1 else "") + ("_small" if args.draft_model == "draft_small" else "") + (
        f"_{args.methods.replace(',', '_')}" if args.methods else "")
    write_json(os.path.join(RESULTS_DIR, f"speculative{suffix}.json"), results)
    if args.sweep:
        plot_sweep(results, os.path.join(RESULTS_DIR, f"speculative{suffix}.png"))
    else:
        plot(results, os.path.join(RESULTS_DIR, f"speculative_speedup{suffix}.png"),
             os.path.join(RESULTS_DIR, f"speculative_acceptance{suffix}.png"))
    rows = [[r["temperature"], r["label"], r["tokens_per_second"], r["speedup_over_ar"], r["block_efficiency"],
             r.get("mean_acceptance_length", 1.0), r.get("acceptance_rate", 0.0)] for r in runs]
    print(format_table(["T", "method", "tok/s", "speedup", "block eff", "mean acc len", "acc rate"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
