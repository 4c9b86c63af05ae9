"""Adaptive speculation against every fixed draft length, on four prompt sets (issue 17).

For each prompt set, temperature and batch size, in one interleaved run (`spec_harness`): AR,
the method at every fixed L in --lengths, and draft_len="auto" (at each --thresholds value). The
acceptance remembered by "auto" (and its verdicts to decode plainly from the start) is cleared before
each set, so every set starts from the prior (the run's one `ssd_jax.Tuner` keeps the measured
costs and calibrations across sets, measured once per run).
Calibrations are measured in the run itself (kept in memory, not read from or written to the
on-disk store, `ssd_jax.runtime.calibration_store`), unless SSD_JAX_CALIBRATION_DIR is set.
--record-calibrations FILE keeps what the run measured, and --replay-calibrations FILE hands a
later run (on another variant of the loop, with the same options) those prices instead of
measuring (`benchmarks/calibration_replay.py`): each process's calibration differs enough to flip
near-tie choices, so only then do two variants' tables differ where their code does.

Prompt sets (the embedded pair's tokenizer):
  code      held-out stdlib code, 128-token prompts (the draft's home ground)
  repeat    repetition-heavy edits: a held-out snippet written three times, then its start (~128)
  short     held-out code, 32-token prompts
  badguess  base64 of random bytes, 64 tokens: text the pair never trained on, where the draft
            guesses worst (measured acceptance at L=5: 0.51 at T=0 and 0.43 at T=1, against 0.61
            on the code set at T=0; English prose is no test: the 11M target falls into
            repeating it, and the draft guesses that perfectly)

Speedups are paired: each of --repeats rounds runs every configuration once, back to back, and a
speedup is the median over rounds of the two configurations' same-round wall-time ratio, so the
machine's drift between rounds cancels (the ratios of best-of times, which carry it, are kept as
*_best_of). Each "auto" config also keeps its first, compiling call's choices and verdicts as
`first_call` (untimed; its verdicts decide whether the timed calls start plain).

Writes benchmarks/results/adaptive.json and adaptive.png (speedup over AR per configuration).
    python benchmarks/bench_adaptive.py [--method sd|bv|gbv|pld|logitspec|csd|ssd|...] [--sets code,short]
        [--batch 1,8] [--temperatures 0,1] [--lengths 1,...,8] [--tree-sizes 8,16,32,64]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.calibration_replay import ReplayError, calibrations  # noqa: E402
from benchmarks.common import OUT_HELP, format_table, machine_info, output_stem, override_policy, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts, repetition_prompts  # noqa: E402
from benchmarks.spec_harness import paired_speedup, run_configs  # noqa: E402
from ssd_jax.tuning.per_call import PerCallMemory  # noqa: E402
from ssd_jax.tuning.ssd_memory import SSDMemory  # noqa: E402

# A table must not depend on calibrations an earlier run left on disk.
os.environ.setdefault("SSD_JAX_CALIBRATION_DIR", "")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Per-call stats kept for every configuration (means over the set's calls; 0 where a method has none).
EXTRA = ("ar_fallback_share", "mean_draft_len", "planned_draft_len", "num_paths", "tree_nodes")


def noise_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Base64 of random bytes, prompt_tokens ids each."""
    import base64

    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < count:
        ids = tokenizer.encode(base64.b64encode(rng.bytes(4 * prompt_tokens)).decode()).ids
        prompts.append(ids[:prompt_tokens])
    return prompts


def prompt_set(name: str, tokenizer, count: int) -> list[list[int]]:
    if name == "code":
        return heldout_prompts(tokenizer, count, prompt_tokens=128, seed=11)
    if name == "repeat":
        return repetition_prompts(tokenizer, count, body_tokens=40, copies=3, lead_tokens=4, seed=12)
    if name == "short":
        return heldout_prompts(tokenizer, count, prompt_tokens=32, seed=13)
    if name == "badguess":
        return noise_prompts(tokenizer, count, prompt_tokens=64)
    raise SystemExit(f"unknown prompt set {name!r}: use code, repeat, short, badguess")


def configs(method: str, lengths: list[int], thresholds: list[float | None],
            tree_sizes: list[int]) -> list[tuple[str, str, dict]]:
    """(label, method, options) for AR, each fixed length, each tree size (LogitSpec, at its
    default length) and each auto threshold (None: a method without one)."""
    # CSD's length is its cap on the draft tokens verified per step (auto: the default cascade's).
    length = "max_draft_tokens" if method == "csd" else "num_draft_tokens"
    out = [("ar", "ar", {})]
    out += [(f"{method} L={n}", method, {length: n}) for n in lengths]
    out += [(f"{method} L=5 N={n}", method, dict(num_draft_tokens=5, tree_capacity=n)) for n in tree_sizes]
    for t in thresholds:
        options = {length: "auto"} if t is None else {length: "auto", "threshold": t}
        out.append((f"{method} auto" + (f" t={t:g}" if len(thresholds) > 1 else ""), method, options))
    return out


def batch_sizes(text: str, prompts: int) -> list[int]:
    """--batch's sizes. Each must divide --prompts, so that every timed call holds exactly that
    many rows (4 prompts at --batch 8 would time one call of 4 rows labelled batch 8); raises
    ValueError naming the size and the prompt count otherwise."""
    sizes = []
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"--batch takes comma-separated integers, got {text!r}") from None
        if size < 1 or prompts % size:
            raise ValueError(f"--batch {size} must be >= 1 and divide --prompts {prompts}, so that every call "
                             f"holds {size} rows; give --prompts a multiple of every batch size")
        sizes.append(size)
    return sizes


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, case in zip(axes[0], results):
        labels = [c["label"] for c in case["configs"]]
        speedups = [c["paired_speedup_vs_ar"] for c in case["configs"]]
        colors = ["#999999" if lab == "ar" else "#d62728" if "auto" in lab else "#1f77b4" for lab in labels]
        ax.bar(range(len(labels)), speedups, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([lab.split(" ", 1)[-1] for lab in labels], rotation=90, fontsize=7)
        ax.set_title(f"{case['set']} T={case['temperature']:g} B={case['batch_size']}", fontsize=8)
    axes[0][0].set_ylabel("speedup over AR (paired, median of rounds)")
    fig.suptitle("Adaptive speculation (red) vs fixed draft lengths (blue), embedded pair", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def auto_ratios(entries: list[dict]) -> tuple[dict | None, list[dict], dict]:
    """(the best fixed setting's entry or None, the "auto" entries, the case's paired ratios:
    best_fixed, auto_vs_ar, auto_vs_best_fixed) of one case's configurations, each entry with its
    paired_speedup_vs_ar."""
    fixed = [e for e in entries if " L=" in e["label"]]   # every fixed setting
    best = max(fixed, key=lambda e: e["paired_speedup_vs_ar"]) if fixed else None
    autos = [e for e in entries if "auto" in e["label"]]
    return best, autos, dict(best_fixed=best and best["label"],
                             auto_vs_ar=[a["paired_speedup_vs_ar"] for a in autos],
                             auto_vs_best_fixed=[paired_speedup(best, a) for a in autos] if best else None)


def forget_choices(tuner: ssd_jax.Tuner) -> None:
    """What a case starts without: the acceptance remembered, the jitted loop's and SSD's verdicts
    (and SSD's lengths run, cost ratios, overheads and paces) and per-call "auto"'s prices and
    probe counts. The measured forward costs, calibrations, AR step ratios and SSD's timed plain
    steps stay: measured once per run, as a process's first calls measure them."""
    tuner.acceptance.clear()
    tuner.loop_verdicts.forget()
    tuner.per_call = PerCallMemory(tuner.measures)
    ssd = SSDMemory(tuner.measures)
    ssd.plain_step_s, ssd.plain_runs = tuner.ssd.plain_step_s, tuner.ssd.plain_runs
    tuner.ssd = ssd


def measure(args, target, draft, sizes: list[int], lengths: list[int], thresholds: list[float | None],
            tree_sizes: list[int]) -> list[dict]:
    """Every set x temperature x batch size's case (AR, the fixed settings and auto, paired),
    printed and written to args.out + ".json" as each is done."""
    results = []
    tuner = ssd_jax.Tuner()   # the run's: every call measures and remembers through it
    for set_name in args.sets.split(","):
        prompts = prompt_set(set_name, target.tokenizer, args.prompts)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for batch_size in sizes:
                forget_choices(tuner)   # and the remembered "decode plainly from the start" verdicts
                cases = configs(args.method, lengths, thresholds, tree_sizes)
                rows = run_configs(target, prompts, [(m, o) for _, m, o in cases], temperature, args.new_tokens,
                                   batch_size=batch_size, draft=draft, repeats=args.repeats,
                                   extra=EXTRA, tuner=tuner)
                calls = -(-len(prompts) // batch_size)
                ar_rate = rows[0]["tokens_per_second"]
                entries = []
                for (lab, _, _), row in zip(cases, rows):
                    for name in EXTRA:
                        row[name] = row.get(name, 0.0) / calls   # per-call means
                    entries.append(dict(label=lab, speedup_vs_ar=row["tokens_per_second"] / ar_rate,
                                        paired_speedup_vs_ar=paired_speedup(rows[0], row), **row))
                best, autos, ratios = auto_ratios(entries)
                # auto_vs_*: paired (medians over rounds of same-round ratios, what docs/benchmarks.md
                # reports); *_best_of: ratios of the fastest runs, which carry the drift between rounds.
                case = dict(set=set_name, temperature=temperature, batch_size=batch_size, prompts=len(prompts),
                            configs=entries, **ratios,
                            auto_vs_ar_best_of=[a["speedup_vs_ar"] for a in autos],
                            auto_vs_best_fixed_best_of=[a["tokens_per_second"] / best["tokens_per_second"]
                                                        for a in autos] if best else None)
                results.append(case)
                print(f"\n{set_name} T={temperature:g} B={batch_size}")
                print(format_table(["config", "tok/s", "x AR", "x AR best-of", "tokens/call", "mean L", "AR share",
                                    "plan L", "paths", "nodes"],
                                   [[e["label"], f"{e['tokens_per_second']:.0f}", f"{e['paired_speedup_vs_ar']:.2f}",
                                     f"{e['speedup_vs_ar']:.2f}",
                                     f"{e['block_efficiency']:.2f}", f"{e['mean_draft_len']:.2f}",
                                     f"{e['ar_fallback_share']:.2f}", f"{e['planned_draft_len']:.1f}",
                                     f"{e['num_paths']:.1f}", f"{e['tree_nodes']:.0f}"]
                                    for e in entries]))
                write_json(args.out + ".json", dict(machine=machine_info(), method=args.method,
                                                   draft_model=args.draft_model, new_tokens=args.new_tokens,
                                                   repeats=args.repeats, policy_overrides=args.policy_fields,
                                                   call_timed=True, results=results))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="code,repeat,short,badguess")
    parser.add_argument("--method", default="sd")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--lengths", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--thresholds", default=None, help="auto's early-stop thresholds (default: the method's)")
    parser.add_argument("--tree-sizes", default="8,16,32,64", help="LogitSpec's tree sizes (at L=5)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per call; the x AR columns are medians over rounds of paired ratios")
    parser.add_argument("--draft-model", default=ssd_jax.defaults.DEFAULT_DRAFT, choices=("draft", "draft_small"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "adaptive"), help=OUT_HELP)
    parser.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE",
                        help="set a field of this backend's policy for the run (repeatable; e.g. "
                             "adaptive_per_call_below_rows=2); adaptive_summary.py leaves such files out")
    replay = parser.add_mutually_exclusive_group()
    replay.add_argument("--record-calibrations", metavar="FILE", help="write the calibrations measured to FILE (JSON)")
    replay.add_argument("--replay-calibrations", metavar="FILE",
                        help="use FILE's calibrations (from --record-calibrations, same options) instead of measuring")
    args = parser.parse_args()
    if args.replay_calibrations and not os.path.exists(args.replay_calibrations):
        parser.error(f"--replay-calibrations {args.replay_calibrations}: no such file "
                     f"(make it with --record-calibrations)")
    args.out = output_stem(args.out)
    args.policy_fields = override_policy(args.policy)
    try:
        sizes = batch_sizes(args.batch, args.prompts)
    except ValueError as err:
        parser.error(str(err))

    target, draft = ssd_jax.default_models(draft=args.draft_model)
    default_threshold = getattr(ssd_jax.methods.METHOD_CLASSES[args.method](), "threshold", None)
    thresholds = [float(t) for t in args.thresholds.split(",")] if args.thresholds else [default_threshold]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    tree_sizes = [int(n) for n in args.tree_sizes.split(",") if n] if args.method == "logitspec" else []
    try:
        with calibrations(args.record_calibrations, args.replay_calibrations):
            results = measure(args, target, draft, sizes, lengths, thresholds, tree_sizes)
    except ReplayError as err:
        raise SystemExit(f"bench_adaptive: {err}") from None
    plot(results, args.out + ".png")
    print(f"\nwrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
