"""Before/after benchmark of a refactor: every method on the embedded pair, the code of an earlier
commit (checked out into a temporary git worktree) against the current tree, in one script run.

    python benchmarks/bench_api_regression.py --before 8020b28 [--rounds 3] [--prompts 6]

The two trees cannot share one interpreter, so each side is a persistent worker process that loads
the models once and answers requests ("time method M at temperature T on prompt i") on
stdin/stdout. The parent interleaves the two sides request by request (alternating which goes
first) and keeps each (side, method, temperature, prompt)'s fastest of --rounds calls: slow drifts
of the machine's speed hit both sides alike. The workers run with SSD_JAX_DETERMINISTIC_AUTO=1
(a deterministic tuner), so "auto" plans from fixed relative costs on both sides and the same
code must give the same tokens, at T=0 and at T=1.

Every method at its defaults (draft_len "auto"; CSD's default cascade; SSD on one device group),
held-out prompts (benchmarks/heldout_prompts.py), 128 new tokens, batch 1. Reports tokens/s per
method and temperature before and after, the ratio (>= 0.97 passes), and whether both sides gave
the same tokens. Then the main job (`ssd-jax generate "def fibonacci(n):"`'s call: SD at its
defaults with draft_small, 128 tokens, a measuring tuner) in a fresh process per side, no compile
cache and an empty calibration folder: its first call (compile, measurement and run) and the
median of its later calls, the two sides' later calls alternating. Writes benchmarks/results/api_regression.json and api_regression.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
METHODS = ["ar", "sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd", "ssd"]
TEMPERATURES = (0.0, 1.0)
MAIN_PROMPT = "def fibonacci(n):"
MAIN_LATER_CALLS = 5

# One side's worker: reads "method temperature index" lines (or "main"), answers JSON lines.
WORKER = r'''
import json, sys, time
new_tokens, count = int(sys.argv[1]), int(sys.argv[2])
import jax, ssd_jax
from benchmarks.heldout_prompts import heldout_prompts
target, draft = ssd_jax.default_models(draft="draft")
small = ssd_jax.default_models()[1]
prompts = heldout_prompts(target.tokenizer, count)
compile_s = {}
print(json.dumps({"ready": len(prompts)}), flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "main":   # the README's main job: SD at its defaults, draft_small
        ids = target.tokenizer.encode(words[1].replace("\\n", "\n")).ids
        start = time.perf_counter()
        out = ssd_jax.generate(target, [ids], max_new_tokens=new_tokens, method=ssd_jax.SD(), draft=small)
        print(json.dumps(dict(seconds=time.perf_counter() - start, wall=out.stats["wall_time_s"],
                              tokens=out.tokens[0])), flush=True)
        continue
    name, temperature, index = words[0], float(words[1]), int(words[2])
    method = ssd_jax.methods.METHOD_CLASSES[name]()
    uses_draft = name not in ("ar", "pld", "logitspec")
    out = ssd_jax.generate(target, [prompts[index]], max_new_tokens=new_tokens, key=jax.random.PRNGKey(index),
                           method=method, temperature=temperature,
                           draft=((draft,) if name == "csd" else draft) if uses_draft else None)
    compile_s.setdefault((name, temperature), out.stats["compile_time_s"])
    print(json.dumps(dict(wall=out.stats["wall_time_s"], tokens=out.tokens[0], generated=len(out.tokens[0]),
                          compile_s=compile_s[(name, temperature)])), flush=True)
'''


class Worker:
    """One side's persistent worker process (tree: the checkout it imports ssd_jax from)."""

    def __init__(self, tree: str, new_tokens: int, count: int, deterministic: bool, calibration_dir: str = ""):
        env = dict(os.environ, PYTHONPATH=tree, SSD_JAX_CALIBRATION_DIR=calibration_dir, SSD_JAX_COMPILE_CACHE="")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if deterministic:
            env["SSD_JAX_DETERMINISTIC_AUTO"] = "1"
        else:
            env.pop("SSD_JAX_DETERMINISTIC_AUTO", None)
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(new_tokens), str(count)], cwd=tree,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.count = json.loads(self._line())["ready"]

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with code {self.process.wait()}")
        return line

    def ask(self, request: str) -> dict:
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _method_row(sides: dict, method: str, temperature: float, rounds: int) -> dict:
    """One method at one temperature: each side's tokens/s over the prompts (each prompt's fastest
    of `rounds` interleaved calls, after an untimed first call that compiles), their ratio, compile
    seconds and whether the tokens agreed."""
    count = sides["before"].count
    first = {side: worker.ask(f"{method} {temperature} 0") for side, worker in sides.items()}
    best = {side: [float("inf")] * count for side in sides}
    generated, same = [0] * count, True
    for r in range(rounds):
        for i in range(count):
            order = ("before", "after") if (r + i) % 2 == 0 else ("after", "before")
            answers = {side: sides[side].ask(f"{method} {temperature} {i}") for side in order}
            for side, answer in answers.items():
                best[side][i] = min(best[side][i], answer["wall"])
            same &= answers["before"]["tokens"] == answers["after"]["tokens"]
            generated[i] = answers["after"]["generated"]
    row = {f"{side}_tokens_per_second": sum(generated) / sum(best[side]) for side in sides}
    row.update({f"{side}_compile_s": first[side]["compile_s"] for side in sides})
    row["ratio"] = row["after_tokens_per_second"] / row["before_tokens_per_second"]
    row["same_tokens"] = bool(same)
    return row


def _main_jobs(trees: dict, new_tokens: int) -> dict:
    """The main job in a fresh process per side with nothing cached: each side's first call's
    seconds end to end, then MAIN_LATER_CALLS later calls per side, the sides alternating call by
    call, and their median wall seconds."""
    prompt = MAIN_PROMPT.replace("\n", "\\n")
    with tempfile.TemporaryDirectory() as calibrations:
        workers = {side: Worker(tree, new_tokens, 1, deterministic=False,
                                calibration_dir=os.path.join(calibrations, side)) for side, tree in trees.items()}
        jobs = {side: dict(first_call_s=worker.ask(f"main {prompt}")["seconds"], later_calls_s=[])
                for side, worker in workers.items()}
        for call in range(MAIN_LATER_CALLS):
            for side in (("before", "after") if call % 2 == 0 else ("after", "before")):
                jobs[side]["later_calls_s"].append(workers[side].ask(f"main {prompt}")["wall"])
        for worker in workers.values():
            worker.close()
    for job in jobs.values():
        job["later_call_s"] = statistics.median(job["later_calls_s"])
    return jobs


def run(before: str, rounds: int, count: int, new_tokens: int, methods: list[str], main_job: bool = True) -> dict:
    from benchmarks.common import load_average, machine_info

    after = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True).stdout.strip()
    results = dict(before=before, after=after, rounds=rounds, prompts=count, new_tokens=new_tokens,
                   machine=machine_info(), methods={}, main_job={})
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", old_tree, before], check=True,
                       capture_output=True)
        try:
            trees = {"before": old_tree, "after": REPO}
            if main_job:
                results["main_job"] = _main_jobs(trees, new_tokens)
                for side, job in results["main_job"].items():
                    print(f"main job {side}: first call {job['first_call_s']:.2f} s, later calls "
                          f"{job['later_call_s'] * 1e3:.1f} ms", flush=True)
            sides = {side: Worker(tree, new_tokens, count, deterministic=True) for side, tree in trees.items()} \
                if methods else {}
            for method in methods:
                for temperature in TEMPERATURES:
                    row = _method_row(sides, method, temperature, rounds)
                    results["methods"][f"{method}@T={temperature:g}"] = row
                    print(f"{method} T={temperature:g}: before {row['before_tokens_per_second']:.0f} tok/s, after "
                          f"{row['after_tokens_per_second']:.0f} tok/s, ratio {row['ratio']:.3f}, compile "
                          f"{row['before_compile_s']:.1f}s -> {row['after_compile_s']:.1f}s, "
                          f"same tokens {row['same_tokens']}", flush=True)
            for worker in sides.values():
                worker.close()
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], capture_output=True)
    results["load_average_at_end"] = load_average()
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    ratios = [results["methods"][m]["ratio"] for m in names]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ax.bar(names, ratios, color=["tab:green" if r >= 0.97 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.97, color="tab:red", lw=0.8, ls="--")
    ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.2, max(ratios) + 0.05))
    ax.set_ylabel("tokens/s after / before")
    ax.tick_params(axis="x", rotation=60)
    ax.set_title(f"{results['before']} -> {results['after']} (embedded pair, batch 1, deterministic tuner)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git commit of the old code")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; '' for the main job alone")
    parser.add_argument("--no-main-job", action="store_true", help="leave out the main job's timing")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    results = run(args.before, args.rounds, args.prompts, args.new_tokens, methods, main_job=not args.no_main_job)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "api_regression.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    if results["methods"]:
        plot(results, os.path.join(args.out, "api_regression.png"))
    print("wrote", path)
    return results


if __name__ == "__main__":
    main()
