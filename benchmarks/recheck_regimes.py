"""Issue 78's "auto" misses measured again, longer: is a cell where "auto" read under 0.95 of the
best fixed length a miss, or the noise of a short measurement?

    python benchmarks/recheck_regimes.py [--source benchmarks/results/regimes.json] [--batches 1]
        [--rounds 6] [--prompts 2] [--sampled-prompts 4] [--out benchmarks/results/regimes_recheck.json]

--source is the merged results (`regimes.json`) or one part of `bench_regimes.py` (a part file
with its sets: a rerun of some methods in a process of their own, `--methods ...`), whose misses
are computed from its own sets.

A regime part (`bench_regimes.py`) times each configuration over 2 prompts a set and 2 rounds: at
T=0 each call's faster run, at T=1 four sampled continuations of 128 tokens, whose acceptance
varies from one to the next. Its "best fixed length" is the best of four such estimates, so their
noise lifts it. This script takes the misses (`goal_report.auto_misses`) of the chosen batch
sizes, groups them by (regime, temperature, batch) and reruns each group's methods (defaults and
every fixed length, AR beside them) on the group's missed sets, in a process of its own, with the
part's own target and draft widenings, `--rounds` rounds and, at T > 0, `--sampled-prompts`
prompts a set. Per miss it reports the original and the rechecked "auto" / best, and the same
statistic over the even and over the odd rounds alone: each half is a measurement of its own, so
their gap shows the noise of a measurement of that size.

Verdicts on the rechecked value: "met" (>= 0.95), "within noise" (>= 0.95 x 0.95, inside this
machine's +-5% of the goal) and "miss".

Parts go to --parts (default benchmarks/results/regimes_parts/recheck/; one already there is kept
unless --fresh). Writes --out (.json) and its plot (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_regimes  # noqa: E402
from benchmarks.common import RESULTS_DIR, machine_info, write_json  # noqa: E402

GOAL = bench_regimes.GOALS["auto_over_best_fixed"]
NOISE = 0.05   # this machine's run-to-run spread


def recheck_groups(misses: list[dict], batches, methods=None) -> list[dict]:
    """The misses of these batch sizes (and methods; None: all) by (kind, ratio, temperature,
    batch): each group's methods and sets (in first-seen order) and its misses. A retrieval
    method's miss (listed under every regime) forms one group per temperature and batch."""
    groups: dict = {}
    for miss in misses:
        if miss["batch_size"] not in batches or (methods is not None and miss["method"] not in methods):
            continue
        retrieval = miss["method"] in bench_regimes.RETRIEVAL_METHODS
        ratio = None if retrieval else int(miss["regime"].split("/")[1])
        key = ("retrieval" if retrieval else "draft", ratio, float(miss["temperature"]), int(miss["batch_size"]))
        group = groups.setdefault(key, dict(kind=key[0], ratio=ratio, temperature=key[2], batch=key[3],
                                            methods=[], sets=[], misses=[]))
        if miss["method"] not in group["methods"]:
            group["methods"].append(miss["method"])
        if miss["set"] not in group["sets"]:
            group["sets"].append(miss["set"])
        if all((m["method"], m["set"]) != (miss["method"], miss["set"]) for m in group["misses"]):
            group["misses"].append(miss)
    return list(groups.values())


def load_source(path: str) -> dict:
    """{"auto_misses": [...], "parts": [...]} of a --source: the merged results' goal report and
    parts, or one part file's misses (`bench_regimes.summarise`, `goal_report`) and that part."""
    with open(path) as f:
        source = json.load(f)
    if "goal_report" in source:
        return dict(auto_misses=source["goal_report"]["auto_misses"], parts=source["parts"])
    if "sets" in source and "kind" in source:
        misses = bench_regimes.goal_report(bench_regimes.summarise([source]))["auto_misses"]
        return dict(auto_misses=misses, parts=[{k: v for k, v in source.items() if k != "sets"}])
    raise SystemExit(f"{path} is neither merged regime results (with a goal_report) nor a regime part (with sets)")


def original_part(parts: list[dict], group: dict) -> dict:
    """The source's part setting that measured this group (its widenings)."""
    for part in parts:
        if (part["kind"], part.get("ratio"), part["temperature"], part["batch_size"]) == (
                group["kind"], group["ratio"], group["temperature"], group["batch"]):
            return part
    raise SystemExit(f"the source has no part for {group['kind']} 1/{group['ratio']} T={group['temperature']:g} "
                     f"batch {group['batch']}")


def round_rate(result: dict, rounds, temperature: float) -> float:
    """tokens/s of one configuration over some of its rounds (indices): at T=0, where every round
    decodes the same tokens, the fastest round; at T > 0 their tokens over their seconds."""
    tokens = np.asarray(result["round_tokens"], float)[list(rounds)]
    seconds = np.asarray(result["round_wall_s"], float)[list(rounds)]
    if temperature == 0:
        return float(np.max(tokens / seconds))
    return float(tokens.sum() / seconds.sum())


def auto_over_best(results: dict, method: str, rate) -> tuple[float, int]:
    """("auto" / best fixed length, that length) of one method in one set's results, each
    configuration's tokens/s given by rate(result)."""
    entries = [r for r in results.values() if r["method"] == method]
    default = next(r for r in entries if not r["options"])
    best = max((r for r in entries if r["fixed_length"] is not None), key=rate)
    return rate(default) / rate(best), best["fixed_length"]


def verdict(value: float) -> str:
    if value >= GOAL:
        return "met"
    return "within noise" if value >= GOAL * (1 - NOISE) else "miss"


def recheck_rows(groups: list[dict], parts: dict) -> list[dict]:
    """Per miss: the original and rechecked "auto"/best, its halves (even and odd rounds) and
    the verdict; parts: each group's rechecked part by its index in groups."""
    rows = []
    for index, group in enumerate(groups):
        part = parts[index]
        temperature = group["temperature"]
        count = part["rounds"]
        for miss in group["misses"]:
            results = part["sets"][miss["set"]]
            value, length = auto_over_best(results, miss["method"], lambda r: r["tokens_per_second"])
            halves = [auto_over_best(results, miss["method"],
                                     lambda r, rounds=rounds: round_rate(r, rounds, temperature))[0]
                      for rounds in (range(0, count, 2), range(1, count, 2))]
            rows.append(dict(miss, original=miss["auto_over_best_fixed"], recheck=round(value, 3),
                             recheck_best_fixed_length=length, halves=[round(h, 3) for h in halves],
                             rounds=count, prompts_per_set=part["prompts_per_set"][miss["set"]],
                             measured_ratio=part.get("measured_ratio"), verdict=verdict(value)))
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']} {r['regime']} T={r['temperature']:g} b{r['batch_size']} {r['set']}" for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.34 * len(rows) + 1.6))
    ax.scatter([r["original"] for r in rows], y, marker="x", color="0.5", label="regime part (2 rounds)")
    recheck = np.asarray([r["recheck"] for r in rows])
    spread = np.asarray([[r["recheck"] - min(r["halves"]), max(r["halves"]) - r["recheck"]] for r in rows]).T
    ax.errorbar(recheck, y, xerr=np.clip(spread, 0, None), fmt="o", color="C0", capsize=3,
                label="recheck (bars: its even and odd rounds alone)")
    ax.axvline(GOAL, color="k", lw=0.8)
    ax.axvline(GOAL * (1 - NOISE), color="k", lw=0.8, ls=":")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel('"auto" / best fixed length (goal 0.95; dotted: 5% under it)')
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=os.path.join(RESULTS_DIR, "regimes.json"))
    parser.add_argument("--batches", default="1")
    parser.add_argument("--methods", default=None, help="only these methods' misses (default: every method's)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set at T=0 (batch 1)")
    parser.add_argument("--sampled-prompts", type=int, default=4, help="prompts per set at T > 0 (batch 1)")
    parser.add_argument("--parts", default=os.path.join(RESULTS_DIR, "regimes_parts", "recheck"))
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "regimes_recheck.json"))
    parser.add_argument("--fresh", action="store_true", help="rerun parts already written")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.prompts < 1 or args.sampled_prompts < 1:
        parser.error(f"--rounds >= 2 (two halves) and prompts >= 1, got {args.rounds}, {args.prompts}, "
                     f"{args.sampled_prompts}")
    source = load_source(args.source)
    batches = tuple(int(b) for b in args.batches.split(","))
    methods = None if args.methods is None else tuple(args.methods.split(","))
    groups = recheck_groups(source["auto_misses"], batches, methods)
    os.makedirs(args.parts, exist_ok=True)
    parts = {}
    for index, group in enumerate(groups):
        setting = original_part(source["parts"], group)
        name = bench_regimes.part_name(group["kind"], group["ratio"], group["temperature"], group["batch"],
                                       tuple(group["methods"]))
        path = os.path.join(args.parts, name)
        print(f"[{index + 1}/{len(groups)}] {name}: {', '.join(group['methods'])} on {', '.join(group['sets'])}",
              flush=True)
        if args.fresh or not os.path.exists(path):
            draft_methods = [m for m in group["methods"] if m in bench_regimes.DRAFT_METHODS]
            run = dict(kind=group["kind"], ratio=group["ratio"], temperature=group["temperature"],
                       batch=group["batch"], per_set=args.prompts if group["temperature"] == 0 else args.sampled_prompts,
                       new_tokens=setting["new_tokens"], rounds=args.rounds, lengths=bench_regimes.FIXED_LENGTHS,
                       methods=draft_methods,
                       retrieval=[m for m in group["methods"] if m in bench_regimes.RETRIEVAL_METHODS],
                       target_widening=setting["target_widening"], draft_menu=bench_regimes.DRAFT_MENU,
                       set_names=group["sets"], draft_widening=setting.get("draft_widening"))
            subprocess.run([sys.executable, bench_regimes.__file__, "--worker", json.dumps(dict(run=run, path=path))],
                           check=True)
        with open(path) as f:
            parts[index] = json.load(f)
    rows = recheck_rows(groups, parts)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("met", "within noise", "miss")}
    write_json(args.out, dict(benchmark="issue 78's auto misses, measured again with more rounds",
                              machine=machine_info(), source=os.path.relpath(args.source, RESULTS_DIR),
                              rounds=args.rounds, prompts=args.prompts, sampled_prompts=args.sampled_prompts,
                              goal=GOAL, noise=NOISE, verdicts=counts, rows=rows))
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    for r in rows:
        print(f"{r['method']:10s} {r['regime']:6s} T={r['temperature']:g} b{r['batch_size']} {r['set']:10s} "
              f"{r['original']:.3f} -> {r['recheck']:.3f} (halves {r['halves'][0]:.3f}, {r['halves'][1]:.3f}; "
              f"L{r['recheck_best_fixed_length']}) {r['verdict']}", flush=True)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
