"""Before/after benchmark of the method-object API (issue #14): AR, SD, BV, GBV, PLD, LogitSpec
and CSD on the embedded pair, with the old code (old keyword API, checked out from a git commit
into a temporary directory) and the new code, in one run: each side runs in its own subprocess
(the two trees cannot share one interpreter), interleaved round by round, best of N.

    python benchmarks/bench_api_regression.py --before 0f96234 [--rounds 5] [--new-tokens 128]

Held-out prompts (benchmarks/heldout_prompts.py), batch 1, greedy. Reports tokens/s per method
before and after, the ratio (after / before: >= 0.97 passes), and compile seconds of each side's
first call. Writes benchmarks/results/api_regression.json and api_regression.png. Needs a quiet
machine: the lead runs it.
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
METHODS = ["ar", "sd", "bv", "gbv", "pld", "logitspec", "csd"]

# Runs inside one tree (argv: api "old"|"new", method, new tokens, prompt index); prints one JSON line.
WORKER = r'''
import json, sys, time
api, method, new_tokens, index = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import jax, ssd_jax
from benchmarks.heldout_prompts import heldout_prompts
target, draft = ssd_jax.default_models()
prompt = heldout_prompts(target.tokenizer)[index]
kw = dict(max_new_tokens=new_tokens, key=jax.random.PRNGKey(0))
uses_draft = method not in ("ar", "pld", "logitspec")
if api == "old":
    kw.update(method=method, draft=draft if uses_draft else None)
else:
    m = ssd_jax.methods.METHOD_CLASSES[method]()
    kw.update(method=m, draft=((draft,) if method == "csd" else draft) if uses_draft else None)
first = ssd_jax.generate(target, [prompt], **kw)
second = ssd_jax.generate(target, [prompt], **kw)
print(json.dumps(dict(compile_s=first.stats["compile_time_s"], tokens_per_second=second.stats["tokens_per_second"],
                      tokens=second.tokens[0])))
'''


def checkout(commit: str, into: str) -> str:
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", into, commit], check=True,
                   capture_output=True)
    return into


def measure(tree: str, api: str, method: str, new_tokens: int, index: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", WORKER, api, method, str(new_tokens), str(index)], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="git commit of the old code")
    parser.add_argument("--rounds", type=int, default=5, help="best of N per method and side")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    results: dict = {m: dict(old=[], new=[]) for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = checkout(args.before, os.path.join(tmp, "before"))
        try:
            for _ in range(args.rounds):  # interleaved: old, new, old, new ... per method
                for method in methods:
                    for api, tree in (("old", old_tree), ("new", REPO)):
                        results[method][api].append(measure(tree, api, method, args.new_tokens, args.prompt_index))
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], capture_output=True)
    summary = {}
    for method, sides in results.items():
        best = {api: max(r["tokens_per_second"] for r in runs) for api, runs in sides.items()}
        compile_s = {api: min(r["compile_s"] for r in runs) for api, runs in sides.items()}
        same = sides["old"][0]["tokens"] == sides["new"][0]["tokens"]
        summary[method] = dict(tokens_per_second_before=best["old"], tokens_per_second_after=best["new"],
                               ratio=best["new"] / best["old"], within_3_percent=best["new"] >= 0.97 * best["old"],
                               compile_s_before=compile_s["old"], compile_s_after=compile_s["new"], same_tokens=same)
        print(f"{method:10s} before {best['old']:8.1f} tok/s  after {best['new']:8.1f} tok/s  "
              f"ratio {best['new'] / best['old']:.3f}  compile {compile_s['old']:.1f}s -> {compile_s['new']:.1f}s"
              f"  same tokens: {same}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    payload = dict(before=args.before, rounds=args.rounds, new_tokens=args.new_tokens, summary=summary, raw=results)
    with open(os.path.join(HERE, "results", "api_regression.json"), "w") as f:
        json.dump(payload, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(methods, [summary[m]["ratio"] for m in methods])
    ax.axhline(0.97, color="red", linestyle="--", label="-3%")
    ax.set_ylabel("tokens/s after / before")
    ax.set_title(f"API regression vs {args.before} (batch 1, {args.new_tokens} tokens, best of {args.rounds})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results", "api_regression.png"))


if __name__ == "__main__":
    main()
