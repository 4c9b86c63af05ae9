"""What a one-shot `ssd-jax generate` costs end to end, in fresh processes: the README's main job
without --compare, as a user runs it once. Each configuration runs in three states of the
machine's caches (`$XDG_CACHE_HOME/ssd_jax`: the command line's compile cache and adaptive
speculation's calibrations), each run a new process:

    first   an empty cache directory (a new machine or user)
    later   the same directory again (every later run)
    no_xla  the same directory with the compile cache off (SSD_JAX_COMPILE_CACHE=''): the programs
            compiled anew, the calibrations read back (what every later run cost before the command
            line kept its programs)

The states are interleaved per repeat and configuration (first, later, no_xla on one directory,
then the next configuration), so a drift of the machine's speed hits all of them alike. Per run:
the process's wall time, and from its stats the compile, cost-measurement and decode seconds. At
T=0 the runs of a configuration must print the same tokens in every state ("same_tokens_at_t0":
a program read back whole decodes what the compiled one did; a warning where they differ).

A streamed configuration ("sd+stream") prints its text, not JSON: only its process time is kept.

Writes benchmarks/results/startup.json and startup.png (median wall seconds per configuration and
state, stacked by where the time went).
    python benchmarks/bench_startup.py [--repeats 3] [--configs ar,sd,sd:4] [--prompt "def fibonacci(n):"]
    python benchmarks/bench_startup.py --configs ar@1,pld@1 --prompt "..." --out benchmarks/results/startup_pld_t1
    python benchmarks/bench_startup.py --configs ar+stream,sd+stream --out benchmarks/results/startup_stream
    python benchmarks/bench_startup.py --configs sd --repeats 1 --states first,later   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OUT_HELP, format_table, machine_info, output_stem, write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATES = ("first", "later", "no_xla")
# Environment variables that would point a run at caches other than the run's own directory.
CACHE_ENV = ("SSD_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR", "SSD_JAX_CALIBRATION_DIR",
             "SSD_JAX_DETERMINISTIC_AUTO")
PARTS = ("compile_time_s", "cost_measure_time_s", "wall_time_s")


def config_args(config: str) -> list[str]:
    """Command-line options of a configuration: "ar", "sd" (its defaults: draft_len "auto"), "sd:4"
    (a fixed draft length), each optionally at a temperature ("pld@1") and streamed ("sd+stream")."""
    config, streamed = (config[:-len("+stream")], True) if config.endswith("+stream") else (config, False)
    config, _, temperature = config.partition("@")
    method, _, length = config.partition(":")
    return (["--method", method] + (["--num-draft-tokens", length] if length else [])
            + (["--temperature", temperature] if temperature else []) + (["--stream"] if streamed else ["--json"]))


def one_run(config: str, prompt: str, new_tokens: int, cache_home: str, state: str) -> dict:
    """One `ssd-jax generate --json` process: wall seconds and the stats' parts."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env["XDG_CACHE_HOME"] = cache_home
    if state == "no_xla":
        env["SSD_JAX_COMPILE_CACHE"] = ""
    command = [sys.executable, "-m", "ssd_jax.cli", "generate", prompt, "--max-new-tokens",
               str(new_tokens)] + config_args(config)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: {config} ({state}) failed:\n{done.stderr[-2000:]}")
    if "--stream" in command:   # the text, then a line of stats without the times: the process's only
        return dict(process_s=wall, tokens=0, token_ids=None, **{part: 0.0 for part in PARTS})
    printed = json.loads(done.stdout)
    stats = printed["stats"]
    return dict(process_s=wall, tokens=int(stats["num_generated_tokens"]), token_ids=printed["tokens"],
                **{part: float(stats.get(part) or 0.0) for part in PARTS})


def greedy(config: str) -> bool:
    """Whether a configuration decodes at T=0 (the command line's default temperature)."""
    _, _, temperature = config.removesuffix("+stream").partition("@")
    return not temperature or float(temperature) == 0


def agreement(config: str, runs: dict[str, list[dict]]) -> bool | None:
    """At T=0, whether every run of a configuration (each state and repeat: compiled afresh, read
    back from the compile cache and the program store, or compiled without them) printed the same
    tokens; None where that is not a check (sampling, or streamed runs, which print no tokens). A
    program read back whole (`ssd_jax.runtime.program_store`) must decode what the compiled one did."""
    printed = [r["token_ids"] for state_runs in runs.values() for r in state_runs if r.get("token_ids") is not None]
    if not greedy(config) or not printed:
        return None
    return all(p == printed[0] for p in printed)


def summary(runs: list[dict]) -> dict:
    """Medians over a configuration's runs in one state."""
    return {key: float(np.median([r[key] for r in runs])) for key in ("process_s",) + PARTS}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results)
    states = [s for s in STATES if s in results[configs[0]]]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.26
    colors = dict(compile_time_s="#c44e52", cost_measure_time_s="#dd8452", wall_time_s="#4c72b0",
                  rest="#bbbbbb")
    names = dict(compile_time_s="compile (or load)", cost_measure_time_s="cost measurement",
                 wall_time_s="decode", rest="imports, model load, other")
    streamed = [c.endswith("+stream") for c in configs]   # their stats are not split
    for s, state in enumerate(states):
        xs = np.asarray([c + (s - (len(states) - 1) / 2) * width for c in range(len(configs))])
        bottom = np.zeros(len(configs))
        for part in PARTS + ("rest",):
            if part == "rest":
                values = np.asarray([results[c][state]["process_s"] for c in configs]) - bottom
            else:
                values = np.asarray([results[c][state][part] for c in configs])
            split = ~np.asarray(streamed)
            ax.bar(xs[split], values[split], width * 0.92, bottom=bottom[split], color=colors[part],
                   label=names[part] if s == 0 and split.any() else None)
            bottom = bottom + values
        if any(streamed):
            whole = np.asarray(streamed)
            ax.bar(xs[whole], bottom[whole], width * 0.92, color="#8172b3", hatch="//",
                   label="streamed run (not split)" if s == 0 else None)
        for x, total in zip(xs, bottom):
            ax.text(x, total, f"{state}\n{total:.1f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs)
    ax.set_ylabel("seconds (median process)")
    ax.set_ylim(0, max(results[c][s]["process_s"] for c in configs for s in states) * 1.25)
    ax.set_title("One-shot `ssd-jax generate` (128 tokens): first run, later runs, later runs without "
                 "the compile cache", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="ar,sd,sd:4",
                        help="ar, sd (defaults), sd:L (fixed length); @T for a temperature (pld@1); "
                             "+stream streamed (sd+stream: its process time only, the streamed text has no "
                             "JSON stats)")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--states", default=",".join(STATES),
                        help=f"which of {', '.join(STATES)} to run (first always runs: it fills the cache)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "startup"), help=OUT_HELP)
    args = parser.parse_args()
    states = [s for s in STATES if s in args.states.split(",") or s == "first"]
    unknown = set(args.states.split(",")) - set(STATES)
    if unknown:
        parser.error(f"unknown --states {', '.join(sorted(unknown))} (choose among {', '.join(STATES)})")
    args.out = output_stem(args.out)
    configs = args.configs.split(",")

    runs = {c: {s: [] for s in states} for c in configs}
    scratch = tempfile.mkdtemp(prefix="ssd_jax_startup_")
    try:
        for r in range(args.repeats):
            for config in configs:
                home = os.path.join(scratch, f"{r}_{config.replace(':', '_').replace('@', '_t').replace('+', '_')}")
                for state in states:
                    run = one_run(config, args.prompt, args.new_tokens, home, state)
                    runs[config][state].append(run)
                    print(f"repeat {r + 1}/{args.repeats} {config:6s} {state:7s} {run['process_s']:6.2f} s "
                          f"(compile {run['compile_time_s']:.2f}, measure {run['cost_measure_time_s']:.2f}, "
                          f"decode {run['wall_time_s']:.2f})", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results = {c: {s: summary(runs[c][s]) for s in states} for c in configs}
    agreed = {c: agreement(c, runs[c]) for c in configs}
    for config, same in agreed.items():
        if same is False:
            print(f"bench_startup: WARNING: {config}'s runs printed different tokens at T=0 across states "
                  "(a program read back decodes otherwise, or a per-call choice took another program whose "
                  "numerics differ)")
    base = next((results[c] for c in configs if c.partition("@")[0].removesuffix("+stream") == "ar"), None)
    print()
    print(format_table(["config", "state", "process s", "compile s", "measure s", "decode s", "x AR's process"],
                       [[c, s, f"{v['process_s']:.2f}", f"{v['compile_time_s']:.2f}",
                         f"{v['cost_measure_time_s']:.2f}", f"{v['wall_time_s']:.3f}",
                         f"{v['process_s'] / base[s]['process_s']:.2f}" if base else "-"]
                        for c in configs for s, v in results[c].items()]))
    write_json(args.out + ".json", dict(machine=machine_info(), prompt=args.prompt, new_tokens=args.new_tokens,
                                       repeats=args.repeats, states=states, results=results,
                                       same_tokens_at_t0=agreed, runs=runs))
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
