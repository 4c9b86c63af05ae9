"""The current figures of adaptive speculation ("auto") in one table and one plot.

Keeps, for every method, backend, batch size, temperature and prompt set, the newest measurement
(by its `machine.date_utc`) among the cells of the committed summary (STEM.json, this script's own
output) and the results files of `bench_adaptive.py` in --results (`adaptive*.json`). The files
behind the committed cells are in git history, not in the folder: a new run adds its file, and
this script folds its cells into the summary. A file whose "superseded" field says why (measured
on a loop the library no longer runs) is left out, so is one whose "not_in_table" field says why
(a second process's repeat of cells a fuller run measured: the table keeps the full run, so a
repeat cannot replace a worse first try), and so is one measured with `policy_overrides` (a
backend policy other than the shipped one, `bench_adaptive.py --policy`). Each row of the table
is one method, backend, batch size and temperature over its prompt sets: "auto"'s speedup over AR
and its ratio to the best fixed setting of each set (the lowest and highest over the sets), and
the goals checked per set: auto >= 1.0x AR (>= 0.95x on the badguess set) and auto >= 0.95 of
the best fixed setting. A miss against AR is shown with a 90% interval of the median over its
rounds (`median_interval`), marked "within noise" where that interval reaches the goal: still a
miss, one the rounds cannot place.

Writes STEM.json (the summary's rows, with every cell) and STEM.png (a grid of every set's two
ratios, goal misses in red); --doc puts the table in a Markdown file between its markers
(docs/benchmarks.md).

    python benchmarks/adaptive_summary.py [--results benchmarks/results] [--out benchmarks/results/adaptive_summary]
        [--doc docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OUT_HELP, RESULTS_DIR, output_stem, write_json, write_text  # noqa: E402

GOAL_VS_AR = 1.0
GOAL_VS_AR_BADGUESS = 0.95
GOAL_VS_BEST = 0.95
PLAIN_SHARE = 0.99   # a cell's "auto" steps decoded plainly from which a miss against AR says so
INTERVAL = 0.90      # the coverage of the interval a miss against AR is shown with
SET_ORDER = ("code", "repeat", "short", "badguess")
METHOD_ORDER = ("sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd", "ssd")


class SummaryError(ValueError):
    """A results file that cannot be summarized (not bench_adaptive's format)."""


def machine_label(machine: dict[str, Any]) -> str:
    """A short name for the machine a file was measured on: the accelerator's kind, else the CPU
    model and its core count."""
    if machine.get("jax_backend") in ("gpu", "tpu"):
        return machine.get("device_kind") or machine["jax_backend"].upper()
    model = machine.get("cpu_model") or "CPU"
    short = "AMD EPYC" if "EPYC" in model else "Intel Xeon" if "Xeon" in model else model
    return f"{machine.get('cores', '?')}-core {short}"


def file_cells(path: str) -> list[tuple[tuple, dict[str, Any]]]:
    """[(method, backend, batch, temperature, set), cell] of one results file: auto's paired
    ratios, the best fixed setting and where and when it was measured. A file without "results"
    (a step profile), marked "superseded" or "not_in_table" (a repeat of cells measured in a
    fuller run the table keeps, so a second try cannot replace a worse first one) or measured under
    a policy override gives none; a malformed one raises SummaryError naming it."""
    with open(path) as f:
        data = json.load(f)
    if "results" not in data or data.get("superseded") or data.get("not_in_table") or data.get("policy_overrides"):
        return []
    out = []
    try:
        machine = data["machine"]
        for case in data["results"]:
            if not case.get("auto_vs_ar") or not case.get("auto_vs_best_fixed"):
                continue  # a run without "auto" or without a fixed setting
            auto = next(c for c in case["configs"] if "auto" in c["label"])
            rounds = round_ratios(case["configs"][0], auto)
            key = (data["method"], machine["jax_backend"], case["batch_size"], case["temperature"], case["set"])
            out.append((key, dict(vs_ar=case["auto_vs_ar"][0], vs_best=case["auto_vs_best_fixed"][0],
                                  best_fixed=case["best_fixed"].split(" ", 1)[-1], stamp=machine["date_utc"],
                                  machine=machine_label(machine), rounds=data["repeats"],
                                  processes=data.get("processes", 1),
                                  paired="auto_vs_ar_best_of" in case, per_token="round_tokens" in auto,
                                  call_timed=bool(data.get("call_timed")),
                                  file=os.path.basename(path),
                                  mean_draft_len=auto.get("mean_draft_len"),
                                  ar_share=auto.get("ar_fallback_share"),
                                  vs_ar_interval=None if rounds is None else median_interval(rounds))))
    except (KeyError, IndexError, StopIteration, TypeError, AttributeError) as err:
        raise SummaryError(f"{path}: not a bench_adaptive.py results file ({type(err).__name__}: {err})") from err
    return out


def round_ratios(base: dict[str, Any], other: dict[str, Any]) -> list[float] | None:
    """How many times faster `other` ran than `base` in each round (`spec_harness.paired_speedup`'s
    ratios, of seconds per token where both kept their rounds' tokens); None for a run that kept
    no rounds (best-of times)."""
    if "round_wall_s" not in base or "round_wall_s" not in other:
        return None
    base_s, other_s = list(base["round_wall_s"]), list(other["round_wall_s"])
    if "round_tokens" in base and "round_tokens" in other:
        base_s = [s / t for s, t in zip(base_s, base["round_tokens"])]
        other_s = [s / t for s, t in zip(other_s, other["round_tokens"])]
    return [b / o for b, o in zip(base_s, other_s)]


def median_interval(values: list[float], coverage: float = INTERVAL) -> tuple[float, float] | None:
    """A distribution-free interval for the median of what `values` sample (order statistics: the
    k-th smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - coverage)
    / 2, so it covers the median with at least `coverage`); None where even the smallest and
    largest value cover it less (fewer than 5 values at 90%). Rounds
    are treated as independent draws, which the machine's drift within a process makes them only
    roughly: the interval says how far the table's second decimal can be read, not more."""
    n = len(values)
    below, k = 0.0, 0   # below: P(Binomial(n, 1/2) < k)
    while k < n // 2 and below + math.comb(n, k) / 2 ** n <= (1 - coverage) / 2:
        below += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def result_paths(folder: str) -> list[str]:
    """bench_adaptive.py's results files in folder (this script's own outputs left out)."""
    return sorted(p for p in glob.glob(os.path.join(folder, "adaptive*.json"))
                  if not os.path.basename(p).startswith("adaptive_summary"))


def committed_cells(path: str) -> dict[tuple, dict[str, Any]]:
    """The cells of a summary this script wrote (STEM.json: summary_rows), by (method, backend,
    batch, temperature, set); none where the file does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = json.load(f)
    try:
        return {(row["method"], row["backend"], row["batch"], row["temperature"], name): dict(cell)
                for row in rows for name, cell in row["sets"].items()}
    except (KeyError, TypeError, AttributeError) as err:
        raise SummaryError(f"{path}: not a summary of this script ({type(err).__name__}: {err})") from err


def newest_cells(paths: list[str], start: dict[tuple, dict[str, Any]] | None = None) -> dict[tuple, dict[str, Any]]:
    """Every cell of the files and of `start` (committed_cells), the newest measurement of each
    (method, backend, batch, temperature, set) winning."""
    cells: dict[tuple, dict[str, Any]] = dict(start or {})
    for path in paths:
        for key, cell in file_cells(path):
            if key not in cells or cells[key]["stamp"] < cell["stamp"]:
                cells[key] = cell
    return cells


def meets_vs_ar(set_name: str, cell: dict[str, Any]) -> bool:
    """auto >= 1.0x AR (0.95x on the badguess set), at the table's precision (two decimals)."""
    return round(cell["vs_ar"], 2) >= (GOAL_VS_AR_BADGUESS if set_name == "badguess" else GOAL_VS_AR)


def meets_vs_best(cell: dict[str, Any]) -> bool:
    """auto >= 0.95 of the best fixed setting, at the table's precision."""
    return round(cell["vs_best"], 2) >= GOAL_VS_BEST


def within_noise(set_name: str, cell: dict[str, Any]) -> bool:
    """Whether a miss against AR is within what the cell's rounds can tell apart: its interval
    (`median_interval`) reaches the goal."""
    interval = cell.get("vs_ar_interval")
    goal = GOAL_VS_AR_BADGUESS if set_name == "badguess" else GOAL_VS_AR
    return interval is not None and round(interval[1], 2) >= goal


def goal_misses(set_name: str, cell: dict[str, Any]) -> list[str]:
    """The issue's goals this cell misses, as short phrases ("0.99x AR", "0.94 of L=2"); a miss
    against AR where "auto" decoded plainly on at least PLAIN_SHARE of its steps says so ("0.99x
    AR (plain on 100% of steps)"): there "auto" can at best tie AR, and the VM's noise decides the
    second decimal. A miss against AR shows the interval of its rounds (`median_interval`: "0.99x
    AR (90% 0.97-1.01, within noise)"), with "within noise" where that interval reaches the goal."""
    misses = []
    if not meets_vs_ar(set_name, cell):
        share = cell.get("ar_share")
        notes = [f"plain on {share:.0%} of steps"] if share is not None and share >= PLAIN_SHARE else []
        interval = cell.get("vs_ar_interval")
        if interval is not None:
            noise = ", within noise" if within_noise(set_name, cell) else ""
            notes.append(f"{INTERVAL:.0%} {_span(*interval)}{noise}")
        misses.append(f"{cell['vs_ar']:.2f}x AR" + (f" ({'; '.join(notes)})" if notes else ""))
    if not meets_vs_best(cell):
        misses.append(f"{cell['vs_best']:.2f} of {cell['best_fixed']}")
    return misses


def _order(key: tuple) -> tuple:
    method, backend, batch, temperature = key[:4]
    rank = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
    return (backend != "cpu", backend, rank, method, batch, temperature)


def summary_rows(cells: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method, backend, batch size and temperature: its sets' cells, the range of
    each ratio, the goal misses, and where (machine, date, rounds, files) it was measured."""
    groups: dict[tuple, dict[str, dict]] = {}
    for key, cell in cells.items():
        groups.setdefault(key[:4], {})[key[4]] = cell
    rows = []
    for group in sorted(groups, key=_order):
        sets = dict(sorted(groups[group].items(), key=lambda kv: (SET_ORDER + (kv[0],)).index(kv[0])))
        method, backend, batch, temperature = group
        cells_here = list(sets.values())
        rows.append(dict(method=method, backend=backend, batch=batch, temperature=temperature, sets=sets,
                         vs_ar=(min(c["vs_ar"] for c in cells_here), max(c["vs_ar"] for c in cells_here)),
                         vs_best=(min(c["vs_best"] for c in cells_here), max(c["vs_best"] for c in cells_here)),
                         misses={name: goal_misses(name, c) for name, c in sets.items()
                                 if not (meets_vs_ar(name, c) and meets_vs_best(c))},
                         machines=sorted({c["machine"] for c in cells_here}),
                         dates=sorted({c["stamp"][:10] for c in cells_here}),
                         timing=sorted({_timing(c) for c in cells_here}),
                         files=sorted({c["file"] for c in cells_here})))
    return rows


def _timing(cell: dict[str, Any]) -> str:
    """How a cell's ratios were taken: paired over rounds (of seconds per token where the run kept
    each round's tokens, else of wall times; of whole calls' seconds, host work included, where
    marked "calls": `spec_harness.timed_generate`, else of the decode programs' runs; over the
    rounds of several processes where the file pooled them, `pooled_runs.py`), or best-of times
    (older runs)."""
    if not cell["paired"]:
        return f"best of {cell['rounds']}"
    calls = ", calls" if cell.get("call_timed") else ""
    processes = cell.get("processes", 1)
    rounds = f"{processes} processes x {cell['rounds']} rounds" if processes > 1 else f"{cell['rounds']} rounds"
    return f"paired{' per token' if cell['per_token'] else ''}{calls}, {rounds}"


def _span(low: float, high: float, unit: str = "") -> str:
    return f"{low:.2f}{unit}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}{unit}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of docs/benchmarks.md: one line per row of summary_rows."""
    lines = ["| method | machine | batch | T | sets | auto x AR | auto / best fixed | goals missed | measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        misses = "; ".join(f"{name}: {', '.join(m)}" for name, m in row["misses"].items()) or "none"
        lines.append(f"| {row['method']} | {', '.join(row['machines'])} | {row['batch']} | {row['temperature']:g} "
                     f"| {len(row['sets'])} | {_span(*row['vs_ar'], 'x')} | {_span(*row['vs_best'])} | {misses} "
                     f"| {', '.join(row['dates'])}, {'; '.join(row['timing'])} |")
    return "\n".join(lines) + "\n"


DOC_START = "<!-- adaptive-summary:start -->"
DOC_END = "<!-- adaptive-summary:end -->"


def update_doc(path: str, table: str) -> None:
    """Replaces the table between DOC_START and DOC_END in the Markdown file at path (written
    whole or not at all)."""
    with open(path) as f:
        text = f.read()
    start, end = text.find(DOC_START), text.find(DOC_END)
    if start < 0 or end < start:
        raise SummaryError(f"{path}: no {DOC_START} ... {DOC_END} block to put the table in")
    write_text(path, text[:start + len(DOC_START)] + "\n" + table + text[end:])


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Two grids, rows x prompt sets: auto x AR and auto / best fixed, each cell annotated, the
    cells that miss a goal in red (orange: a miss against AR within its interval, `within_noise`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in SET_ORDER if any(s in r["sets"] for r in rows)]
    labels = [f"{r['method']} {r['backend']} B={r['batch']} T={r['temperature']:g}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.32 * len(rows) + 1.6), sharey=True)
    for ax, field, title in ((axes[0], "vs_ar", "auto x AR"), (axes[1], "vs_best", "auto / best fixed")):
        for i, row in enumerate(rows):
            for j, name in enumerate(sets):
                cell = row["sets"].get(name)
                if cell is None:
                    continue
                missed = not (meets_vs_ar(name, cell) if field == "vs_ar" else meets_vs_best(cell))
                tie = missed and field == "vs_ar" and within_noise(name, cell)
                color = "#f7d59c" if tie else "#f4a6a6" if missed else "#cfe3f3"
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color=color))
                ax.text(j, i, f"{cell[field]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.5, len(sets) - 0.5)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xticks(range(len(sets)))
        ax.set_xticklabels(sets, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels(labels, fontsize=7)
    fig.suptitle("Adaptive speculation, embedded pair: newest measurement per cell\n(red: misses a goal; "
                 f"orange: misses AR within its rounds' {INTERVAL:.0%} interval)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS_DIR, help="folder of bench_adaptive.py's adaptive*.json")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "adaptive_summary"), help=OUT_HELP)
    parser.add_argument("--doc", default=None, help="also put the table in this Markdown file (between its markers)")
    args = parser.parse_args()
    stem = output_stem(args.out)
    cells = newest_cells(result_paths(args.results), committed_cells(stem + ".json"))
    if not cells:
        raise SystemExit(f"no summary at {stem}.json and no adaptive*.json results in {args.results!r}")
    rows = summary_rows(cells)
    table = markdown(rows)
    write_json(stem + ".json", rows)
    plot(rows, stem + ".png")
    if args.doc:
        update_doc(args.doc, table)
    print(table)
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
