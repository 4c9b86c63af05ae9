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
slowest row's count: what the loop's model of a batch's steps is judged against). `--priced`
adds each call's steps by cap (the `steps_by_cap` stat) and prices the call and each fixed
length's batch at the program's step prices (its `loop_costs`: the step seconds its calibration
timed at each cap; `ssd_jax.engine.against_ar.call_seconds`): "auto" against the best fixed length as the
loop's own prices see it, which at T=0 is exact and free of the machine's noise (it leaves out
the loop's overhead over a fixed length's program, which only a timed run shows).

    python benchmarks/adaptive_steps.py --method csd --sets short,badguess --temperatures 0 \
        --record /tmp/cal.json                  # variant A
    python benchmarks/adaptive_steps.py --method csd --sets short,badguess --temperatures 0 \
        --replay /tmp/cal.json                  # variant B, the same prices

Writes STEM.json (default benchmarks/results/adaptive_steps.json; it holds no "results", so
`adaptive_summary.py` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The calibrations come from --record / --replay, never from an earlier run's store.
os.environ["SSD_JAX_CALIBRATION_DIR"] = ""

import jax  # noqa: E402
import numpy as np  # noqa: E402

import ssd_jax  # noqa: E402
from benchmarks.bench_adaptive import prompt_set  # noqa: E402
from benchmarks.calibration_replay import ReplayError, calibrations  # noqa: E402
from benchmarks.common import RESULTS_DIR, machine_info, output_stem, write_json  # noqa: E402
from ssd_jax.engine import adaptive, plain_verdicts, ssd_auto  # noqa: E402
from ssd_jax.engine.against_ar import call_seconds, step_price  # noqa: E402


def adopt_loop_policy(name: str) -> None:
    """This process's backend policy takes the adaptive loop's fields of backend `name`'s
    (`ssd_jax.backend.POLICIES`); its other fields (dtype, attention) stay this machine's."""
    from ssd_jax import backend

    here = backend.default_platform()
    loop_fields = {field: getattr(backend.POLICIES[name], field)
                   for field in ("adaptive_steps_per_check", "adaptive_switch_per_step", "adaptive_scan_from_batch")}
    backend.POLICIES[here] = dataclasses.replace(backend.POLICIES[here], **loop_fields)


def summed(counts: list[list[int]]) -> list[int]:
    """Elementwise sums of lists of step counts of unequal lengths (a call that decoded plainly
    throughout reports none)."""
    width = max((len(c) for c in counts), default=0)
    return [sum(c[i] for c in counts if i < len(c)) for i in range(width)]


def method_for(name: str, length):
    """The method object with its draft length set (CSD's max_draft_tokens, the others' draft_len)."""
    field = "max_draft_tokens" if name == "csd" else "draft_len"
    return ssd_jax.methods.METHOD_CLASSES[name](**{field: length})


def steps_by_kind(call: dict) -> str:
    """A call's steps by cap and its plain steps, e.g. "{2: 43, 4: 13, plain: 4}"."""
    parts = [f"{cap}: {n}" for cap, n in enumerate(call["steps_by_cap"], start=1) if n]
    if call["plain_steps"]:
        parts.append(f"plain: {call['plain_steps']}")
    return "{" + ", ".join(parts) + "}"


def run(args) -> list[dict]:
    target, draft = ssd_jax.default_models(draft=args.draft_model)
    probe = method_for(args.method, "auto")
    model_draft = draft if probe.drafts_with_model else None
    lengths = [int(n) for n in args.lengths.split(",") if n] if args.rows or args.priced else []
    out = []
    for set_name in args.sets.split(","):
        prompts = prompt_set(set_name, target.tokenizer, args.prompts)
        chunks = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        for temperature in (float(t) for t in args.temperatures.split(",")):
            adaptive.ACCEPTANCE.clear()
            ssd_auto.forget()
            plain_verdicts.forget()
            calls = []
            for call in range(args.calls):
                # One "call" of the table: every chunk of --batch rows in turn, its steps summed.
                outs = [ssd_jax.generate(target, chunk, max_new_tokens=args.new_tokens, method=probe, draft=model_draft,
                                         temperature=temperature, key=jax.random.PRNGKey(call))
                        for chunk in chunks]
                by_cap = summed([[int(n) for n in o.stats.get("steps_by_cap", [])] for o in outs])
                steps = sum(int(o.stats["target_calls"]) - 1 for o in outs)
                calls.append(dict(target_calls=steps + 1,
                                  mean_draft_len=float(np.mean([o.stats.get("mean_draft_len", 0.0) for o in outs])),
                                  ar_fallback_share=float(np.mean([o.stats.get("ar_fallback_share", 0.0) for o in outs])),
                                  steps_by_cap=by_cap,
                                  plain_steps=steps - sum(by_cap),
                                  loop_costs=next(([float(x) for x in o.stats["loop_costs"]] for o in reversed(outs)
                                                   if o.stats.get("loop_costs")), [])))
            case = dict(set=set_name, temperature=temperature, calls=calls, fixed={})
            for n in lengths:
                fixed = method_for(args.method, n)
                batch_steps = sum(int(ssd_jax.generate(target, chunk, max_new_tokens=args.new_tokens, method=fixed,
                                                       draft=model_draft, temperature=temperature,
                                                       key=jax.random.PRNGKey(0)).stats["target_calls"]) - 1
                                  for chunk in chunks)
                entry = dict(batch=batch_steps + 1)
                if args.rows:
                    entry["rows"] = [int(ssd_jax.generate(target, [p], max_new_tokens=args.new_tokens, method=fixed,
                                                          draft=model_draft, temperature=temperature,
                                                          key=jax.random.PRNGKey(i)).stats["target_calls"])
                                     for i, p in enumerate(prompts)]
                case["fixed"][str(n)] = entry
            # The program's prices, the same for every call (a call run as plain decoding from
            # the start, `plain_verdicts`, reports none: its steps are priced at the program's).
            prices = next((c["loop_costs"] for c in reversed(calls) if c["loop_costs"]), [])
            if args.priced and prices and lengths:
                # Each fixed length's steps at the auto program's price of that cap: how "auto"'s
                # choices compare, free of the machine's noise and of the loop's own overhead.
                fixed_seconds = {n: (case["fixed"][str(n)]["batch"] - 1) * step_price(prices, n) for n in lengths}
                best = min(fixed_seconds, key=fixed_seconds.get)
                for c in calls:
                    c["priced_of_best_fixed"] = fixed_seconds[best] / call_seconds(
                        c["loop_costs"] or prices, c["steps_by_cap"], c["plain_steps"])
                case["priced_best_fixed"] = best
            out.append(case)
            line = " ".join(f"{c['target_calls']}({c['mean_draft_len']:.2f},{c['ar_fallback_share']:.2f})"
                            for c in calls)
            print(f"{set_name} T={temperature:g}: auto steps(mean draft, plain share) {line}", flush=True)
            if "priced_best_fixed" in case:
                caps = " ".join(steps_by_kind(c) for c in calls)
                ratios = " ".join(f"{c['priced_of_best_fixed']:.3f}" for c in calls)
                print(f"    steps by cap {caps}; priced {ratios} of L={case['priced_best_fixed']}", flush=True)
            for n, f in case["fixed"].items():
                print(f"    L={n}: batch {f['batch']}" + (f", rows {f['rows']}" if "rows" in f else ""), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="csd", choices=("sd", "bv", "csd", "pld", "logitspec", "gbv",
                                                             "specinfer", "spectr"))
    parser.add_argument("--sets", default="code,repeat,short,badguess")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--batch", type=int, default=8, help="rows per call (the prompts of each set)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per set (default: --batch), run --batch rows at a time; a call's steps are "
                             "summed over them")
    parser.add_argument("--calls", type=int, default=3, help="calls of auto per set and temperature")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rows", action="store_true", help="also each fixed length's batch and per-prompt steps")
    parser.add_argument("--priced", action="store_true",
                        help="also each fixed length's batch steps, and every call priced against the best of them "
                             "at the program's step prices (the step seconds its calibration timed at each cap)")
    parser.add_argument("--lengths", default="2,4,8", help="the fixed lengths of --rows and --priced")
    parser.add_argument("--draft-model", default=ssd_jax.defaults.DEFAULT_DRAFT, choices=("draft", "draft_small"))
    parser.add_argument("--loop-policy", choices=("native", "gpu", "tpu"), default="native",
                        help="run the adaptive loop as that backend's policy shapes it (its checks per step, "
                             "per-step switch, caps dispatched from which batch) on this machine: with --replay "
                             "of that backend's prices, its choices at T=0 (up to float32 against bf16 tokens)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--record", help="write the calibrations measured to this JSON file")
    group.add_argument("--replay", help="use the calibrations of this JSON file (from --record) instead of measuring")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "adaptive_steps"),
                        help="path stem of the results: STEM.json (a trailing .json is dropped)")
    args = parser.parse_args()
    args.prompts = args.batch if args.prompts is None else args.prompts
    if args.batch < 1 or args.calls < 1 or args.prompts < 1 or args.prompts % args.batch:
        parser.error(f"--batch and --calls must be >= 1 and --prompts a multiple of --batch, got {args.batch}, "
                     f"{args.calls} and {args.prompts}")
    if args.replay and not os.path.exists(args.replay):
        parser.error(f"--replay {args.replay}: no such file (make it with --record)")
    stem = output_stem(args.out)
    if args.loop_policy != "native":
        adopt_loop_policy(args.loop_policy)
    try:
        with calibrations(args.record, args.replay):
            cases = run(args)
    except ReplayError as err:
        raise SystemExit(f"adaptive_steps: {err}") from None
    write_json(stem + ".json", dict(machine=machine_info(), method=args.method, batch=args.batch,
                                    prompts=args.prompts, new_tokens=args.new_tokens, record=args.record, replay=args.replay,
                                    loop_policy=args.loop_policy,
                                    cases=cases))
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
