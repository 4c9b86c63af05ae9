"""Which shipped draft `default_models()` should return (issue 17): SD at its defaults
(draft_len="auto") with the shipped `draft` and with `draft_small`, against AR, on the prompt sets
of `bench_adaptive.py`, in one interleaved run per set and temperature (`spec_harness`).

Writes benchmarks/results/default_draft.json and default_draft.png (speedup over AR per set).
    python benchmarks/bench_default_draft.py [--sets code,repeat,short,badguess] [--prompts 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.bench_adaptive import prompt_set  # noqa: E402
from benchmarks.common import OUT_HELP, format_table, machine_info, output_stem, write_json  # noqa: E402
from benchmarks.spec_harness import run_configs  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DRAFTS = ("draft", "draft_small")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{r['set']}\nT={r['temperature']:g}" for r in results]
    width = 0.38
    for i, name in enumerate(DRAFTS):
        ax.bar([x + (i - 0.5) * width for x in range(len(results))], [r["speedup_vs_ar"][name] for r in results],
               width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("SD (defaults) tokens/s / AR")
    ax.set_title("Default draft choice: SD at draft_len=\"auto\", embedded target", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="code,repeat,short,badguess")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(RESULTS, "default_draft"), help=OUT_HELP)
    args = parser.parse_args()
    args.out = output_stem(args.out)

    target = ssd_jax.default_models()[0]
    drafts = {name: ssd_jax.defaults.shipped_draft(name) for name in ("draft", "draft_small")}
    results = []
    tuner = ssd_jax.Tuner()   # the run's: every call measures and remembers through it
    for set_name in args.sets.split(","):
        prompts = prompt_set(set_name, target.tokenizer, args.prompts)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            rows = {}
            for name in DRAFTS:   # AR is timed beside each draft, so each ratio is from one run
                tuner.acceptance.clear()   # each draft from the prior, and no verdict to decode plainly
                tuner.loop_verdicts.forget()
                ar, sd = run_configs(target, prompts, [("ar", {}), ("sd", {})], temperature, args.new_tokens,
                                     draft=drafts[name], repeats=args.repeats, tuner=tuner)
                ar, sd = ({k: v for k, v in row.items() if k != "tokens"} for row in (ar, sd))
                rows[name] = dict(ar=ar, sd=sd, speedup=sd["tokens_per_second"] / ar["tokens_per_second"])
            case = dict(set=set_name, temperature=temperature, prompts=len(prompts),
                        speedup_vs_ar={n: rows[n]["speedup"] for n in DRAFTS},
                        block_efficiency={n: rows[n]["sd"]["block_efficiency"] for n in DRAFTS},
                        runs={n: rows[n] for n in DRAFTS})
            results.append(case)
            print(f"\n{set_name} T={temperature:g}")
            print(format_table(["draft", "AR tok/s", "SD tok/s", "x AR", "tokens/call"],
                               [[n, f"{rows[n]['ar']['tokens_per_second']:.0f}",
                                 f"{rows[n]['sd']['tokens_per_second']:.0f}", f"{rows[n]['speedup']:.2f}",
                                 f"{rows[n]['sd']['block_efficiency']:.2f}"] for n in DRAFTS]))
            write_json(args.out + ".json", dict(machine=machine_info(), new_tokens=args.new_tokens,
                                               repeats=args.repeats, results=results))
    means = {n: sum(r["speedup_vs_ar"][n] for r in results) / len(results) for n in DRAFTS}
    winner = max(means, key=means.get)
    write_json(args.out + ".json", dict(machine=machine_info(), new_tokens=args.new_tokens, repeats=args.repeats,
                                       results=results, mean_speedup=means, winner=winner))
    plot(results, args.out + ".png")
    print("\nmean SD speedup over AR: " + ", ".join(f"{n} {v:.2f}x" for n, v in means.items()) + f"; best: {winner}")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
