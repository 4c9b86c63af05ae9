"""Before/after benchmark of the method-object API and the one decode skeleton (issue #14): AR, SD,
BV, GBV, PLD, LogitSpec and CSD on the embedded pair, the code of an earlier commit (old keyword
API, checked out into a temporary git worktree) against the current tree, in one script run.

The two trees cannot share one interpreter, so each side is a persistent worker process that loads
the models once and answers requests ("time method M on prompt i") on stdin/stdout. The parent
interleaves the two sides request by request (alternating which goes first) and keeps each
(side, method, prompt)'s fastest of --rounds calls: slow drifts of the machine's speed hit both
sides alike.

    python benchmarks/bench_api_regression.py --before 6854b0b [--rounds 3] [--prompts 20]

Held-out prompts (benchmarks/heldout_prompts.py), 128 new tokens, batch 1, greedy, each method at
the same configuration on both sides (the old defaults: L=5, K=2, PLD 1..3-grams, LogitSpec 64
nodes, CSD's default cascade). Reports tokens/s per method before and after, the ratio (>= 0.97
passes), compile seconds of each side's first call, and whether both sides produced the same
tokens. Writes benchmarks/results/api_regression.json and api_regression.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
METHODS = ["ar", "sd", "bv", "gbv", "pld", "logitspec", "csd"]

# One side's worker: argv[1] is "old" or "new"; reads "method index" lines, answers JSON lines.
WORKER = r'''
import json, sys, time
api = sys.argv[1]
new_tokens = int(sys.argv[2])
count = int(sys.argv[3])
import jax, ssd_jax
from benchmarks.heldout_prompts import heldout_prompts
target, draft = ssd_jax.default_models(**({} if api == "old" else {"dtype": "float32", "draft": "draft"}))
prompts = heldout_prompts(target.tokenizer, count)
OLD = {"logitspec": dict(tree_capacity=64)}
NEW = {"logitspec": dict(tree_size=64)}

def kwargs(method):
    uses_draft = method not in ("ar", "pld", "logitspec")
    if api == "old":
        return dict(method=method, draft=draft if uses_draft else None, **OLD.get(method, {}))
    m = ssd_jax.methods.METHOD_CLASSES[method](**NEW.get(method, {}))
    return dict(method=m, draft=((draft,) if method == "csd" else draft) if uses_draft else None)

compile_s = {}
print(json.dumps({"ready": len(prompts)}), flush=True)
for line in sys.stdin:
    method, index = line.split()
    out = ssd_jax.generate(target, [prompts[int(index)]], max_new_tokens=new_tokens, key=jax.random.PRNGKey(0),
                           **kwargs(method))
    compile_s.setdefault(method, out.stats["compile_time_s"])
    print(json.dumps(dict(wall=out.stats["wall_time_s"], tokens=out.tokens[0], generated=len(out.tokens[0]),
                          compile_s=compile_s[method])), flush=True)
'''


class Worker:
    """One side's persistent worker process."""

    def __init__(self, tree: str, api: str, new_tokens: int, count: int):
        env = dict(os.environ, PYTHONPATH=tree)
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, api, str(new_tokens), str(count)], cwd=tree,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.count = json.loads(self._line())["ready"]

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with code {self.process.wait()}")
        return line

    def time(self, method: str, index: int) -> dict:
        self.process.stdin.write(f"{method} {index}\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def run(before: str, rounds: int, count: int, new_tokens: int, methods: list[str]) -> dict:
    from benchmarks.common import machine_info

    results = dict(before=before, after=subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                                       capture_output=True, text=True).stdout.strip(),
                   rounds=rounds, prompts=count, new_tokens=new_tokens, machine=machine_info(), methods={})
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", old_tree, before], check=True,
                       capture_output=True)
        try:
            sides = {"before": Worker(old_tree, "old", new_tokens, count), "after": Worker(REPO, "new", new_tokens, count)}
            for method in methods:
                best = {side: [float("inf")] * sides[side].count for side in sides}
                first: dict = {}
                for side, worker in sides.items():  # compile, untimed
                    first[side] = worker.time(method, 0)
                same = True
                for r in range(rounds):
                    for i in range(sides["before"].count):
                        order = ("before", "after") if (r + i) % 2 == 0 else ("after", "before")
                        answers = {side: sides[side].time(method, i) for side in order}
                        for side, answer in answers.items():
                            best[side][i] = min(best[side][i], answer["wall"])
                        same &= answers["before"]["tokens"] == answers["after"]["tokens"]
                        generated = answers["after"]["generated"]
                        best.setdefault("generated", [0] * sides["before"].count)[i] = generated
                row = {}
                tokens = sum(best["generated"])
                for side in sides:
                    row[f"{side}_tokens_per_second"] = tokens / sum(best[side])
                    row[f"{side}_compile_s"] = first[side]["compile_s"]
                row["ratio"] = row["after_tokens_per_second"] / row["before_tokens_per_second"]
                row["same_tokens"] = bool(same)
                results["methods"][method] = row
                print(f"{method}: before {row['before_tokens_per_second']:.0f} tok/s, after "
                      f"{row['after_tokens_per_second']:.0f} tok/s, ratio {row['ratio']:.3f}, compile "
                      f"{row['before_compile_s']:.1f}s -> {row['after_compile_s']:.1f}s, same tokens {same}",
                      flush=True)
            for worker in sides.values():
                worker.close()
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], capture_output=True)
    from benchmarks.common import load_average

    results["load_average_at_end"] = load_average()
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    ratios = [results["methods"][m]["ratio"] for m in methods]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(methods, ratios, color=["tab:green" if r >= 0.97 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.97, color="tab:red", lw=0.8, ls="--")
    ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.2, max(ratios) + 0.05))
    ax.set_ylabel("tokens/s after / before")
    ax.set_title(f"API refactor: {results['before']} -> {results['after']} (embedded pair, batch 1, T=0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git commit of the old code")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    results = run(args.before, args.rounds, args.prompts, args.new_tokens, args.methods.split(","))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "api_regression.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    plot(results, os.path.join(args.out, "api_regression.png"))
    print("wrote", path)
    return results


if __name__ == "__main__":
    main()
