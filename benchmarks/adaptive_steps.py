"""Step counts of adaptive speculation under one calibration, to compare variants of the loop.

Timing a change to the adaptive loop (`ssd_jax/engine/adaptive_loop.py`) is slow and noisy on a
small CPU: a cell moves by +-0.05 between processes, and each process calibrates its own step
prices, which alone can flip a near-tie between two caps. Step counts under the same prices do
not move, so this script records the calibrations one process measured (`--record FILE`) and
feeds them, in the same order, to another (`--replay FILE`), run on the other variant of the code.
At T=0 the counts are then exact to compare (the programs' text differs between variants, so the
on-disk calibration store, keyed by that text, cannot share them).

For each prompt set and temperature it prints, per call of "auto" (the acceptance remembered
between calls is kept, as in `bench_adaptive.py`, and cleared between sets): the target calls the
batch took, the mean draft length and the share of steps decoded plainly. `--rows` adds the fixed
lengths' step counts of the batch and of each prompt alone (at T=0 a batch takes exactly its
slowest row's count: what the loop's model of a batch's steps is judged against).

    python benchmarks/adaptive_steps.py --method csd --sets short,badguess --temperatures 0 \
        --record /tmp/cal.json                  # variant A
    python benchmarks/adaptive_steps.py --method csd --sets short,badguess --temperatures 0 \
        --replay /tmp/cal.json                  # variant B, the same prices

Writes STEM.json (default benchmarks/results/adaptive_steps.json; it holds no "results", so
`adaptive_summary.py` skips it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The calibrations come from --record / --replay, never from an earlier run's store.
os.environ["SSD_JAX_CALIBRATION_DIR"] = ""

import jax  # noqa: E402

import ssd_jax  # noqa: E402
from benchmarks.bench_adaptive import prompt_set  # noqa: E402
from benchmarks.calibration_replay import ReplayError, calibrations  # noqa: E402
from benchmarks.common import RESULTS_DIR, machine_info, output_stem, write_json  # noqa: E402
from ssd_jax.engine import adaptive, plain_verdicts, ssd_auto  # noqa: E402


def method_for(name: str, length):
    """The method object with its draft length set (CSD's max_draft_tokens, the others' draft_len)."""
    field = "max_draft_tokens" if name == "csd" else "draft_len"
    return ssd_jax.methods.METHOD_CLASSES[name](**{field: length})


def run(args) -> list[dict]:
    target, draft = ssd_jax.default_models(draft=args.draft_model)
    probe = method_for(args.method, "auto")
    model_draft = draft if probe.drafts_with_model else None
    lengths = [int(n) for n in args.lengths.split(",") if n] if args.rows else []
    out = []
    for set_name in args.sets.split(","):
        prompts = prompt_set(set_name, target.tokenizer, args.batch)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            adaptive.ACCEPTANCE.clear()
            ssd_auto.forget()
            plain_verdicts.forget()
            calls = []
            for call in range(args.calls):
                o = ssd_jax.generate(target, prompts, max_new_tokens=args.new_tokens, method=probe,
                                     draft=model_draft, temperature=temperature, key=jax.random.PRNGKey(call))
                calls.append(dict(target_calls=int(o.stats["target_calls"]),
                                  mean_draft_len=float(o.stats.get("mean_draft_len", 0.0)),
                                  ar_fallback_share=float(o.stats.get("ar_fallback_share", 0.0))))
            case = dict(set=set_name, temperature=temperature, calls=calls, fixed={})
            for n in lengths:
                fixed = method_for(args.method, n)
                batch = ssd_jax.generate(target, prompts, max_new_tokens=args.new_tokens, method=fixed,
                                         draft=model_draft, temperature=temperature, key=jax.random.PRNGKey(0))
                rows = [int(ssd_jax.generate(target, [p], max_new_tokens=args.new_tokens, method=fixed,
                                             draft=model_draft, temperature=temperature,
                                             key=jax.random.PRNGKey(i)).stats["target_calls"])
                        for i, p in enumerate(prompts)]
                case["fixed"][str(n)] = dict(batch=int(batch.stats["target_calls"]), rows=rows)
            out.append(case)
            line = " ".join(f"{c['target_calls']}({c['mean_draft_len']:.2f},{c['ar_fallback_share']:.2f})"
                            for c in calls)
            print(f"{set_name} T={temperature:g}: auto steps(mean draft, plain share) {line}", flush=True)
            for n, f in case["fixed"].items():
                print(f"    L={n}: batch {f['batch']}, rows {f['rows']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="csd", choices=("sd", "bv", "csd", "pld", "logitspec", "gbv",
                                                             "specinfer", "spectr"))
    parser.add_argument("--sets", default="code,repeat,short,badguess")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--batch", type=int, default=8, help="rows per call (the prompts of each set)")
    parser.add_argument("--calls", type=int, default=3, help="calls of auto per set and temperature")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rows", action="store_true", help="also each fixed length's batch and per-prompt steps")
    parser.add_argument("--lengths", default="2,4,8", help="the fixed lengths of --rows")
    parser.add_argument("--draft-model", default=ssd_jax.defaults.DEFAULT_DRAFT, choices=("draft", "draft_small"))
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--record", help="write the calibrations measured to this JSON file")
    group.add_argument("--replay", help="use the calibrations of this JSON file (from --record) instead of measuring")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "adaptive_steps"),
                        help="path stem of the results: STEM.json (a trailing .json is dropped)")
    args = parser.parse_args()
    if args.batch < 1 or args.calls < 1:
        parser.error(f"--batch and --calls must be >= 1, got {args.batch} and {args.calls}")
    if args.replay and not os.path.exists(args.replay):
        parser.error(f"--replay {args.replay}: no such file (make it with --record)")
    stem = output_stem(args.out)
    try:
        with calibrations(args.record, args.replay):
            cases = run(args)
    except ReplayError as err:
        raise SystemExit(f"adaptive_steps: {err}") from None
    write_json(stem + ".json", dict(machine=machine_info(), method=args.method, batch=args.batch,
                                    new_tokens=args.new_tokens, record=args.record, replay=args.replay,
                                    cases=cases))
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
