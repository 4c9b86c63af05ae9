"""One `bench_adaptive.py` measurement over several processes, pooled into one results file.

On a shared 2-core VM one process's paired ratios scatter by 2-3% around a cell's value (SSD
at batch 4 on one CPU device: repeat at T=0 read 0.95x, 0.99x, 1.00x and 1.01x AR in four
processes of the same code), more than the margins "auto" is judged by. Much of that is fixed per
process: the calibrations and plain decoding's step are measured once, at a moment of the
machine's drift. Several processes of the same options, every one kept, give the cell's value
with that spread inside it: the rounds of all processes are pooled, and each ratio is the median
over all of them of the same-round ratio (`spec_harness.paired_speedup`), as within one process.

    python benchmarks/pooled_runs.py --processes 3 --out benchmarks/results/adaptive_ssd_b4_pooled \\
        -- --method ssd --batch 4 --temperatures 0 --lengths 4,6 --repeats 10
    python benchmarks/pooled_runs.py --pool STEM_process1.json STEM_process2.json ... --out STEM

Runs bench_adaptive.py once per process (its files STEM_processN.json, marked "not_in_table" so
that `adaptive_summary.py` reads only the pooled STEM.json), then writes STEM.json and STEM.png in
bench_adaptive.py's format, with `processes` (the count), `process_files` and, per cell,
`auto_vs_ar_per_process`. --pool pools files already written.

To compare code versions, give --checkouts NAME=DIR ... (git worktrees of the commits to
compare): each process round runs bench_adaptive.py from every checkout in turn (process 1 of
each, then process 2 of each, ...), so that the versions meet the machine's drift alike, and
each checkout's processes are pooled into STEM_NAME.json (its commit kept as code_state); the
cells' "auto" ratios are then printed side by side. The machine's speed moves enough between
sessions (fixed L=4 of SSD at batch 4 read 0.87-0.95x AR one session, 0.93-1.00x the one before)
that a version measured one day is not comparable with another measured the next.

    git worktree add /tmp/old HEAD~1
    python benchmarks/pooled_runs.py --processes 3 --out /tmp/ab/ssd_b4 --checkouts old=/tmp/old new=. \
        -- --method ssd --batch 4 --temperatures 0 --lengths 4,6 --repeats 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_adaptive import auto_ratios, plot  # noqa: E402
from benchmarks.common import output_stem, write_json  # noqa: E402
from benchmarks.spec_harness import paired_speedup  # noqa: E402

# Per-configuration fields that are lists over one process's rounds: concatenated.
ROUND_FIELDS = ("round_wall_s", "round_tokens")
# Per-configuration fields of one process only (per call, or a first call's): left out.
PROCESS_FIELDS = ("per_call_trace", "first_call", "loop_costs", "acceptance_per_position")


class PoolError(ValueError):
    """Results files that cannot be pooled (not the same measurement)."""


def _same(runs: list[dict[str, Any]], name: str, get) -> Any:
    values = [get(run) for run in runs]
    if any(v != values[0] for v in values[1:]):
        raise PoolError(f"runs differ in {name}: {values}")
    return values[0]


def _pooled_config(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over processes: round lists concatenated, numbers averaged over the
    processes that report them (a process whose "auto" calls all ran AR's program reports no
    acceptance)."""
    pooled: dict[str, Any] = {"label": configs[0]["label"]}
    names = dict.fromkeys(name for c in configs for name in c)
    for name in names:
        if name == "label" or name in PROCESS_FIELDS:
            continue
        values = [c[name] for c in configs if name in c]
        if name in ROUND_FIELDS:
            if len(values) < len(configs):
                raise PoolError(f"{configs[0]['label']}: a process without {name}")
            pooled[name] = [float(x) for v in values for x in v]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            pooled[name] = float(np.mean(values))
    pooled["timing_repeats"] = len(pooled["round_wall_s"])
    return pooled


def _pooled_case(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell (set, temperature, batch) over processes, its ratios recomputed on the pooled
    rounds as bench_adaptive.measure computes them on one process's (`auto_ratios`)."""
    labels = _same(cases, f"configurations of {cases[0]['set']}", lambda c: [e["label"] for e in c["configs"]])
    configs = [_pooled_config([c["configs"][i] for c in cases]) for i in range(len(labels))]
    ar = configs[0]
    for entry in configs:
        entry["paired_speedup_vs_ar"] = paired_speedup(ar, entry)
    _, autos, ratios = auto_ratios(configs)
    return dict(set=cases[0]["set"], temperature=cases[0]["temperature"], batch_size=cases[0]["batch_size"],
                prompts=cases[0]["prompts"], configs=configs, **ratios,
                auto_vs_ar_best_of=[float(np.mean([c["auto_vs_ar_best_of"][i] for c in cases]))
                                    for i in range(len(autos))],
                auto_vs_best_fixed_best_of=None,
                auto_vs_ar_per_process=[c["auto_vs_ar"] for c in cases],
                auto_vs_best_fixed_per_process=[c["auto_vs_best_fixed"] for c in cases])


def pool(runs: list[dict[str, Any]], files: list[str] | None = None) -> dict[str, Any]:
    """bench_adaptive.py results (one per process, the same options) -> one results dict whose
    cells' ratios are medians over every process's rounds. Raises PoolError where the runs are
    not the same measurement (method, options, cells or configurations differ)."""
    if len(runs) < 2:
        raise PoolError(f"pooling needs at least 2 runs, got {len(runs)}")
    for name in ("method", "draft_model", "new_tokens", "repeats", "policy_overrides", "call_timed"):
        _same(runs, name, lambda run: run.get(name))
    _same(runs, "machine", lambda run: (run["machine"].get("cpu_model"), run["machine"].get("cores"),
                                       run["machine"].get("jax_backend"), run["machine"].get("device_kind")))
    _same(runs, "cells", lambda run: [(c["set"], c["temperature"], c["batch_size"], c["prompts"])
                                      for c in run["results"]])
    newest = max(runs, key=lambda run: run["machine"]["date_utc"])
    pooled = {name: value for name, value in runs[0].items() if name not in ("machine", "results", "not_in_table")}
    pooled.update(machine=dict(newest["machine"], date_utc_per_process=[r["machine"]["date_utc"] for r in runs]),
                  processes=len(runs), process_files=list(files or []),
                  results=[_pooled_case([run["results"][i] for run in runs]) for i in range(len(runs[0]["results"]))])
    return pooled


def pool_files(paths: list[str], out: str, code_state: str | None = None) -> dict[str, Any]:
    """Pools the results files at paths into out.json and out.png (bench_adaptive's plot);
    code_state: what code was measured (kept in the file)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    pooled = pool(runs, [os.path.basename(p) for p in paths])
    if code_state:
        pooled["code_state"] = code_state
    write_json(out + ".json", pooled)
    plot(pooled["results"], out + ".png")
    return pooled


def cell_line(case: dict[str, Any], checkout: str = "") -> str:
    """One pooled cell's printed line: "auto" against AR (pooled, and per process) and, where the
    run had fixed settings, against the best of them."""
    per_process = ", ".join(f"{v[0]:.2f}" for v in case["auto_vs_ar_per_process"])
    against_fixed = ("" if case["auto_vs_best_fixed"] is None else
                     f", {case['auto_vs_best_fixed'][0]:.3f} of {case['best_fixed']}")
    return (f"{checkout + ': ' if checkout else ''}{case['set']} T={case['temperature']:g} B={case['batch_size']}: "
            f"auto {case['auto_vs_ar'][0]:.3f}x AR (processes {per_process}){against_fixed}")


def mark_process(path: str, index: int, count: int, pooled_name: str) -> None:
    """Marks one process's results file "not_in_table": the table reads the pooled file."""
    with open(path) as f:
        data = json.load(f)
    data["not_in_table"] = f"process {index} of {count} of the pooled run {pooled_name}"
    write_json(path, data)


def run_processes(bench_args: list[str], stems: dict[str, str], checkouts: dict[str, str], count: int,
                  run=subprocess.run) -> dict[str, list[str]]:
    """count processes of bench_adaptive.py per checkout (name -> repository folder), interleaved
    (process 1 of every checkout, then process 2, ...), each writing stems[name] + "_processN"
    .json and marked "not_in_table"; returns each checkout's files in order. run: what starts a
    process (subprocess.run's signature; tests pass their own)."""
    paths: dict[str, list[str]] = {name: [] for name in checkouts}
    for index in range(1, count + 1):
        for name, folder in checkouts.items():
            stem = f"{stems[name]}_process{index}"
            label = f" ({name})" if len(checkouts) > 1 else ""
            print(f"pooled_runs: process {index} of {count}{label} -> {stem}.json", flush=True)
            bench = os.path.join(os.path.abspath(folder), "benchmarks", "bench_adaptive.py")
            run([sys.executable, bench, *bench_args, "--out", stem], check=True, cwd=folder)
            mark_process(stem + ".json", index, count, os.path.basename(stems[name]) + ".json")
            paths[name].append(stem + ".json")
    return paths


def parse_checkouts(specs: list[str] | None) -> dict[str, str]:
    """NAME=DIR pairs (each DIR a checkout of this repository) -> {name: folder}; none: this one."""
    if not specs:
        return {"": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    checkouts = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise PoolError(f"--checkouts takes NAME=DIR, got {spec!r}")
        if name in checkouts:
            raise PoolError(f"--checkouts names {name!r} twice")
        if not os.path.isfile(os.path.join(folder, "benchmarks", "bench_adaptive.py")):
            raise PoolError(f"--checkouts {name}: {folder!r} has no benchmarks/bench_adaptive.py")
        checkouts[name] = folder
    return checkouts


def _commit(folder: str) -> str | None:
    """The checked-out commit of folder (short hash), None where git cannot tell."""
    try:
        out = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3, help="bench_adaptive.py processes to run (>= 2)")
    parser.add_argument("--out", required=True, help="the pooled file's stem (STEM.json, STEM.png)")
    parser.add_argument("--pool", nargs="+", metavar="FILE", help="pool these results files instead of running")
    parser.add_argument("--code-state", help="what code was measured (a commit), kept in the pooled file")
    parser.add_argument("--checkouts", nargs="+", metavar="NAME=DIR",
                        help="run every process from each of these checkouts, interleaved, one pooled file each")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_adaptive.py's options")
    args = parser.parse_args()
    out = output_stem(args.out)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    try:
        checkouts = parse_checkouts(args.checkouts)
    except PoolError as err:
        parser.error(str(err))
    if args.pool:
        if args.checkouts:
            parser.error("--pool pools files already written: it takes no --checkouts")
        groups = {"": args.pool}
        stems = {"": out}
    else:
        if args.processes < 2:
            parser.error(f"--processes must be at least 2, got {args.processes}")
        if any(a == "--out" or a.startswith("--out=") for a in bench_args):
            parser.error("pass --out to pooled_runs.py, not to bench_adaptive.py")
        # absolute: each process runs in its checkout's folder
        stems = {name: os.path.abspath(f"{out}_{name}" if name else out) for name in checkouts}
        groups = run_processes(bench_args, stems, checkouts, args.processes)
    for name, paths in groups.items():
        code_state = args.code_state if not args.checkouts else _commit(checkouts[name])
        try:
            pooled = pool_files(paths, stems[name], code_state)
        except PoolError as err:
            raise SystemExit(f"pooled_runs: {err}") from None
        for case in pooled["results"]:
            print(cell_line(case, name))
        print(f"wrote {stems[name]}.json and {stems[name]}.png")


if __name__ == "__main__":
    main()
