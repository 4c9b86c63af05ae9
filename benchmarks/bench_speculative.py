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
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402


def configurations(quick: bool) -> list[tuple[str, dict]]:
    lengths = (4,) if quick else (4, 8)
    paths = (2,) if quick else (2, 4)
    configs: list[tuple[str, dict]] = [("ar", {})]
    for length in lengths:
        configs += [("sd", dict(num_draft_tokens=length)), ("bv", dict(num_draft_tokens=length))]
        for k in paths:
            configs += [(m, dict(num_draft_tokens=length, num_paths=k)) for m in ("specinfer", "spectr", "gbv")]
    return configs


def label(method: str, options: dict) -> str:
    parts = [method]
    if "num_draft_tokens" in options:
        parts.append(f"L{options['num_draft_tokens']}")
    if "num_paths" in options:
        parts.append(f"K{options['num_paths']}")
    return "-".join(parts)


def run_ours(target, draft, prompts, method, options, temperature, new_tokens) -> dict:
    """Each prompt alone (batch 1); the first call compiles and is not timed."""
    kwargs = dict(max_new_tokens=new_tokens, method=method, temperature=temperature, **options)
    if method != "ar":
        kwargs["draft"] = draft
    warm = ssd_jax.generate(target, [prompts[0]], key=jax.random.PRNGKey(999), **kwargs)
    totals = dict(tokens=0, wall=0.0, drafts=0, accepted=0, drafted=0, calls=0)
    per_position = None
    for i, prompt in enumerate(prompts):
        out = ssd_jax.generate(target, [prompt], key=jax.random.PRNGKey(i), **kwargs)
        s = out.stats
        totals["tokens"] += s["num_generated_tokens"]
        totals["wall"] += s["wall_time_s"]
        totals["calls"] += s["target_calls"]
        if method != "ar":
            totals["drafts"] += s["num_drafts"]
            totals["accepted"] += s["num_accepted_tokens"]
            totals["drafted"] += s["num_draft_tokens"]
            pos = np.array(s["accepted_per_position"], float)
            per_position = pos if per_position is None else per_position + pos
    result = dict(tokens=totals["tokens"], wall_time_s=totals["wall"], tokens_per_second=totals["tokens"] / totals["wall"],
                  target_calls=totals["calls"], block_efficiency=totals["tokens"] / totals["calls"],
                  compile_time_s=warm.stats["compile_time_s"])
    if method != "ar":
        result.update(acceptance_rate=totals["accepted"] / totals["drafted"],
                      mean_acceptance_length=1 + totals["accepted"] / totals["drafts"],
                      acceptance_per_position=(per_position / totals["drafts"]).tolist())
    return result


def run_transformers(target_dir, draft_dir, prompts, temperature, new_tokens) -> dict:
    """transformers' generate and assisted generate on the same HF directories, same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    out = {}
    for name, extra in (("ar", {}), ("assisted", {"assistant_model": draft})):
        kwargs = dict(max_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=1, **extra)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        with torch.no_grad():
            target.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
            tokens, start = 0, time.perf_counter()
            for i, prompt in enumerate(prompts):
                torch.manual_seed(i)
                generated = target.generate(torch.tensor([prompt]), **kwargs)
                tokens += generated.shape[1] - len(prompt)
            wall = time.perf_counter() - start
        out[name] = dict(tokens=tokens, wall_time_s=wall, tokens_per_second=tokens / wall)
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
    for j, temperature in enumerate((0.0, 1.0)):
        hf = results["transformers"][str(temperature)]["assisted_speedup_over_own_ar"]
        ax.axhline(hf, color=f"C{j}", linestyle="--", linewidth=1, label=f"transformers assisted, T={temperature:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right")
    ax.set_ylabel("speedup over autoregressive (wall clock)")
    ax.set_title("ssd_jax speculative decoding on the embedded pair (CPU, batch 1, 128 new tokens)")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, fewer configurations")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens = 4, 32
    info = machine_info()
    target, draft = ssd_jax.default_models()
    prompts = heldout_prompts(target.tokenizer, args.prompts)
    runs = []
    for temperature in (0.0, 1.0):
        ar_speed = None
        for method, options in configurations(args.quick):
            result = run_ours(target, draft, prompts, method, options, temperature, args.new_tokens)
            if method == "ar":
                ar_speed = result["tokens_per_second"]
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
                   machine=info, prompts=len(prompts), new_tokens=args.new_tokens, batch_size=1, runs=runs,
                   transformers=hf)
    for temperature in (0.0, 1.0):
        sd = max((r for r in runs if r["temperature"] == temperature and r["method"] == "sd"),
                 key=lambda r: r["tokens_per_second"])
        if hf:
            results[f"sd_vs_transformers_assisted_t{temperature:g}"] = (
                sd["tokens_per_second"] / hf[str(temperature)]["assisted"]["tokens_per_second"])
    suffix = "_quick" if args.quick else ""
    write_json(os.path.join(RESULTS_DIR, f"speculative{suffix}.json"), results)
    if hf:
        plot(results, os.path.join(RESULTS_DIR, f"speculative_speedup{suffix}.png"),
             os.path.join(RESULTS_DIR, f"speculative_acceptance{suffix}.png"))
    rows = [[r["temperature"], r["label"], r["tokens_per_second"], r["speedup_over_ar"], r["block_efficiency"],
             r.get("mean_acceptance_length", 1.0), r.get("acceptance_rate", 0.0)] for r in runs]
    print(format_table(["T", "method", "tok/s", "speedup", "block eff", "mean acc len", "acc rate"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
