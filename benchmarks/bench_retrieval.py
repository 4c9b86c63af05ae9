"""Retrieval drafting (prompt lookup, LogitSpec) on the embedded target, against autoregressive
decoding and against transformers' prompt lookup on the same checkpoint, in one run.

Two prompt sets: held-out stdlib code windows (as the speculative benchmark) and a
repetition-heavy task (a held-out snippet written twice, then its first tokens again).
Temperature 0 and 1, batch 1, 128 new tokens: mean accepted tokens per step, tokens/s, speedup over
AR measured in the same run. LogitSpec runs at several tree capacities: on a CPU the target's tree
forward costs about linearly in the node count, so the paper's 64-node tree is not free here.
Writes benchmarks/results/retrieval.json and retrieval_speedup.png.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts, repetition_prompts  # noqa: E402
from benchmarks.spec_harness import label, run_configs, transformers_rates  # noqa: E402

PLD_LENGTHS = (4, 8)
LOGITSPEC_CAPACITIES = (8, 16, 32, 64)


def configurations(quick: bool) -> list[tuple[str, dict]]:
    configs: list[tuple[str, dict]] = [("ar", {})]
    configs += [("pld", dict(num_draft_tokens=n)) for n in ((4,) if quick else PLD_LENGTHS)]
    for capacity in ((16,) if quick else LOGITSPEC_CAPACITIES):
        configs.append(("logitspec", dict(num_draft_tokens=min(8, capacity - 1), tree_capacity=capacity)))
    return configs


def run_transformers(target_dir, prompts, temperature, new_tokens, lookup_tokens) -> dict:
    """transformers' generate and generate(prompt_lookup_num_tokens=...) on the same directory."""
    out = transformers_rates(target_dir, prompts, temperature, new_tokens,
                             {"ar": {}, "prompt_lookup": {"prompt_lookup_num_tokens": lookup_tokens}})
    out["prompt_lookup_speedup_over_own_ar"] = out["prompt_lookup"]["tokens_per_second"] / out["ar"]["tokens_per_second"]
    out["prompt_lookup_num_tokens"] = lookup_tokens
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, prompt_set in zip(axes, results["prompt_sets"]):
        runs = [r for r in results["runs"] if r["prompt_set"] == prompt_set and r["method"] != "ar"]
        labels = list(dict.fromkeys(r["label"] for r in runs))
        width = 0.4
        for j, temperature in enumerate((0.0, 1.0)):
            values = [next((r["speedup_over_ar"] for r in runs if r["label"] == lab and r["temperature"] == temperature),
                           0.0) for lab in labels]
            ax.bar(np.arange(len(labels)) + (j - 0.5) * width, values, width, label=f"ssd_jax, T={temperature:g}")
        hf = results["transformers"].get(prompt_set, {})
        for j, temperature in enumerate((0.0, 1.0)):
            if str(temperature) in hf:
                ax.axhline(hf[str(temperature)]["prompt_lookup_speedup_over_own_ar"], color=f"C{j}", linestyle="--",
                           linewidth=1, label=f"transformers prompt lookup, T={temperature:g}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(labels)), labels, rotation=30, ha="right")
        ax.set_title(f"{prompt_set} prompts")
    axes[0].set_ylabel("speedup over autoregressive (wall clock)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Retrieval drafting on the embedded target (CPU, batch 1, {results['new_tokens']} new tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, fewer configurations")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each call this many times and keep its fastest run (filters out interference)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens = 4, 32
    info = machine_info()
    target, _ = ssd_jax.default_models()
    prompt_sets = {"code": heldout_prompts(target.tokenizer, args.prompts),
                   "repetition": repetition_prompts(target.tokenizer, args.prompts)}
    runs, hf = [], {}
    for set_name, prompts in prompt_sets.items():
        for temperature in (0.0, 1.0):
            configs = configurations(args.quick)
            results = run_configs(target, prompts, configs, temperature, args.new_tokens, repeats=args.repeats)
            ar_speed = results[0]["tokens_per_second"]
            for (method, options), result in zip(configs, results):
                result.update(method=method, options=options, label=label(method, options), temperature=temperature,
                              prompt_set=set_name, speedup_over_ar=result["tokens_per_second"] / ar_speed)
                runs.append(result)
                print(f"{set_name:>10} T={temperature:g} {result['label']:>20}: {result['tokens_per_second']:7.1f} tok/s "
                      f"speedup {result['speedup_over_ar']:.2f}x  mean acc len "
                      f"{result.get('mean_acceptance_length', 1.0):.2f}", flush=True)
            if not args.no_transformers:
                hf.setdefault(set_name, {})[str(temperature)] = run_transformers(
                    target.path, prompts, temperature, args.new_tokens, lookup_tokens=PLD_LENGTHS[-1])
                print(f"transformers {set_name} T={temperature:g}: {hf[set_name][str(temperature)]}", flush=True)
    info["load_average_at_end"] = load_average()
    results = dict(benchmark="retrieval drafting (prompt lookup, LogitSpec) on the embedded target",
                   machine=info, prompts=args.prompts, new_tokens=args.new_tokens, batch_size=1, timing_repeats=args.repeats,
                   prompt_sets=list(prompt_sets), runs=runs, transformers=hf)
    suffix = "_quick" if args.quick else ""
    write_json(os.path.join(RESULTS_DIR, f"retrieval{suffix}.json"), results)
    plot(results, os.path.join(RESULTS_DIR, f"retrieval_speedup{suffix}.png"))
    rows = [[r["prompt_set"], r["temperature"], r["label"], r["tokens_per_second"], r["speedup_over_ar"],
             r.get("mean_acceptance_length", 1.0), r.get("acceptance_rate", 0.0)] for r in runs]
    print(format_table(["prompts", "T", "method", "tok/s", "speedup", "mean acc len", "acc rate"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
