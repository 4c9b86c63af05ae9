"""The Gumbel coupling against rejection sampling, every method at its defaults, in one run.

    python benchmarks/bench_coupling.py [--prompts 6] [--new-tokens 128] [--rounds 2]

For each temperature (1.0 and 0.7) and method (AR; SD, BV, SpecInfer, SpecTr, GBV, PLD,
LogitSpec, CSD, SSD at their defaults, draft_len "auto"; and SD and SSD at a fixed L=4, where
acceptance and SSD's hit rate compare without "auto"'s choices, which may end SSD's speculation), `coupling="rejection"` and `coupling="gumbel"` run as two
configurations of one interleaved `run_configs` call (held-out prompts, batch 1, a measuring
`Tuner` shared by all, every configuration's first call compiling untimed; each round samples
with keys of its own, the same for every configuration; each call keeps its fastest round). Each
temperature runs in a process of its own: one process compiling all 44 configurations ran out of
LLVM's code memory. Reported: tokens/s of each, coupled over rejection (the ratio of tokens/s;
also `paired_speedup`'s median of per-round ratios, which counts the rounds where "auto" still
measured), mean acceptance length, tokens per target call, and SSD's cache hit rate. Goal (issue 77): coupled SD at >= 0.9x
rejection SD's speed. Under the coupling every method's tokens are coupled AR's for the key
(tests/test_coupling.py); this script also checks it on its prompts at the end.
Writes benchmarks/results/coupling.json and coupling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from benchmarks.spec_harness import generate_kwargs, label, paired_speedup, run_configs  # noqa: E402
from ssd_jax.tuning.tuner import Tuner  # noqa: E402

METHODS: list[tuple[str, dict]] = [("ar", {}), ("sd", {}), ("sd", dict(num_draft_tokens=4)), ("bv", {}),
                                   ("specinfer", {}), ("spectr", {}), ("gbv", {}), ("pld", {}), ("logitspec", {}),
                                   ("csd", {}), ("ssd", {}), ("ssd", dict(num_draft_tokens=4))]
COUPLINGS = ("rejection", "gumbel")
TEMPERATURES = (1.0, 0.7)
GOAL = 0.9   # coupled SD over rejection SD


def configurations(methods: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [(m, dict(options, coupling=c)) for m, options in methods for c in COUPLINGS]


def same_tokens_as_coupled_ar(target, draft, prompts, methods, temperature: float, new_tokens: int) -> dict:
    """Per method: whether its coupled tokens on the prompts (one batch, one key) are coupled AR's."""
    key = jax.random.PRNGKey(123)
    outputs = {}
    for method, options in methods:
        kw = generate_kwargs(method, dict(options, coupling="gumbel"), draft, new_tokens, temperature)
        if method == "csd":
            kw["draft"] = (draft,)
        outputs[label(method, options)] = [list(map(int, r)) for r in ssd_jax.generate(target, prompts, key=key, **kw).tokens]
    reference = outputs["ar"]
    return {name: tokens == reference for name, tokens in outputs.items()}


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = sorted({r["label"] for r in runs}, key=[r["label"] for r in runs].index)
    x = np.arange(len(names))
    for i, temperature in enumerate(TEMPERATURES):
        rows = {r["label"]: r for r in runs if r["temperature"] == temperature}
        axes[0].bar(x + (i - 0.5) * 0.38, [rows[n]["coupled_over_rejection"] for n in names], 0.38,
                    label=f"T={temperature:g}")
        for j, coupling in enumerate(COUPLINGS):
            axes[1].bar(x + (2 * i + j - 1.5) * 0.2,
                        [rows[n][coupling]["tokens_per_target_call"] for n in names], 0.2,
                        label=f"{coupling}, T={temperature:g}")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(GOAL, color="r", lw=0.8, ls="--", label=f"goal for SD ({GOAL:g})")
    axes[0].set_ylabel("coupled / rejection speed")
    axes[1].set_ylabel("tokens per target call")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=40, ha="right")
        ax.legend(fontsize=8)
    axes[0].set_title("Gumbel coupling vs rejection sampling: speed")
    axes[1].set_title("tokens per target call (1 = plain decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_temperature(temperature: float, methods, prompts_count: int, new_tokens: int, rounds: int) -> dict:
    """One temperature's runs (every method, both couplings) and its invariance check."""
    target, draft = ssd_jax.default_models()
    prompts = heldout_prompts(target.tokenizer, prompts_count)
    configs = configurations(methods)
    results = run_configs(target, prompts, configs, temperature, new_tokens, draft=draft, repeats=rounds,
                          tuner=Tuner(), extra=("cache_hit_rate",))
    by_config = {label(m, o): r for (m, o), r in zip(configs, results)}
    runs = []
    for method, options in methods:
        name = label(method, options)
        pair = {c: by_config[label(method, dict(options, coupling=c))] for c in COUPLINGS}
        for c in COUPLINGS:
            if method == "ssd":   # `extra` sums over every call of a round: the mean over prompts
                pair[c]["cache_hit_rate"] = pair[c]["cache_hit_rate"] / len(prompts)
            pair[c]["tokens_per_target_call"] = pair[c]["tokens"] / max(pair[c]["target_calls"], 1)
        run = dict(label=name, method=method, options=options, temperature=temperature,
                   coupled_over_rejection=pair["gumbel"]["tokens_per_second"] / pair["rejection"]["tokens_per_second"],
                   paired_coupled_over_rejection=paired_speedup(pair["rejection"], pair["gumbel"]), **pair)
        runs.append(run)
        print(f"T={temperature:g} {name:>10}: rejection {pair['rejection']['tokens_per_second']:7.1f} tok/s, "
              f"gumbel {pair['gumbel']['tokens_per_second']:7.1f} tok/s, ratio {run['coupled_over_rejection']:.3f}; "
              f"acc len {pair['rejection'].get('mean_acceptance_length', 1.0):.2f} / "
              f"{pair['gumbel'].get('mean_acceptance_length', 1.0):.2f}", flush=True)
    same = same_tokens_as_coupled_ar(target, draft, prompts, methods, temperature, new_tokens)
    print(f"T={temperature:g} coupled tokens equal coupled AR's: {same}", flush=True)
    return dict(runs=runs, same_tokens_as_coupled_ar=same)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (keys differ per round)")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "coupling.json"))
    parser.add_argument("--temperature", type=float, default=None, help=argparse.SUPPRESS)   # a worker's
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    methods = METHODS if args.methods is None else [c for c in METHODS if c[0] in args.methods.split(",") + ["ar"]]
    if args.temperature is not None:
        part = run_temperature(args.temperature, methods, args.prompts, args.new_tokens, args.rounds)
        with open(args.part, "w") as f:
            json.dump(part, f)
        return 0
    info = machine_info()
    runs, invariance = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for temperature in TEMPERATURES:
            part_path = os.path.join(tmp, f"{temperature}.json")
            worker = [sys.executable, os.path.abspath(__file__), "--temperature", str(temperature), "--part", part_path,
                      "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
            if args.methods is not None:
                worker += ["--methods", args.methods]
            subprocess.run(worker, check=True)
            with open(part_path) as f:
                part = json.load(f)
            runs += part["runs"]
            invariance[str(temperature)] = part["same_tokens_as_coupled_ar"]
    info["load_average_at_end"] = load_average()
    sd = {str(r["temperature"]): r["coupled_over_rejection"] for r in runs if r["label"] == "sd"}
    results = dict(benchmark="Gumbel coupling vs rejection sampling, every method at its defaults (embedded pair)",
                   machine=info, prompts=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds, batch_size=1,
                   runs=runs, same_tokens_as_coupled_ar=invariance, goal=dict(sd_coupled_over_rejection=GOAL),
                   sd_coupled_over_rejection=sd)
    write_json(args.out, results)
    plot(runs, os.path.splitext(args.out)[0] + ".png")
    rows = []
    for r in runs:
        rej, gum = r["rejection"], r["gumbel"]
        rows.append([r["temperature"], r["label"], rej["tokens_per_second"], gum["tokens_per_second"],
                     r["coupled_over_rejection"], rej["tokens_per_target_call"], gum["tokens_per_target_call"],
                     rej.get("cache_hit_rate", ""), gum.get("cache_hit_rate", "")])
    print(format_table(["T", "method", "rejection tok/s", "gumbel tok/s", "gumbel / rejection", "tok/call rej",
                        "tok/call gumbel", "hit rate rej", "hit rate gumbel"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
