"""What the adaptive loop's own steps cost over the fixed programs' steps at the same cap (issue 17).

A call of draft_len="auto" that ran every step at cap c should cost what fixed L=c costs; what it
costs more is the loop's overhead (its memories, choices, dispatch), which no choice of cap can
win back. This script compiles both programs of one method, batch, prompt set and temperature
through `ssd_jax.generate` and times, interleaved over --rounds rounds, the "auto" program forced
to each cap (the loop inputs its calibration uses, `ssd_jax.tuning.cost_model.force_cap`; forced
plain for cap 0) against the fixed program of that length (AR's for cap 0), each over the whole
call. Per round it reports each program's seconds per target call; the ratio auto / fixed is the
trimmed mean of the rounds' ratios.

    python benchmarks/loop_overhead.py --method bv --set short --batch 8 --caps 0,1,2 [--rounds 15]
        [--policy adaptive_steps_per_check=1 ...]

--policy sets fields of this backend's policy (`ssd_jax.backend.POLICIES`) for the run: on a GPU,
whether the loop's nesting (checks every few steps, caps dispatched per run) is what its steps pay.

Writes STEM.json (default benchmarks/results/loop_overhead_<method>_b<batch>_t<T>_<set>.json; it
holds no "results", so `adaptive_summary.py` skips it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Calibrations are captured here, never read from or written to the on-disk store.
os.environ["SSD_JAX_CALIBRATION_DIR"] = ""

import jax  # noqa: E402
import numpy as np  # noqa: E402

import ssd_jax  # noqa: E402
from benchmarks.bench_adaptive import prompt_set  # noqa: E402
from benchmarks.common import RESULTS_DIR, machine_info, output_stem, override_policy, write_json  # noqa: E402
from benchmarks.spec_harness import generate_kwargs  # noqa: E402
from ssd_jax.runtime import compile_cache  # noqa: E402
from ssd_jax.tuning import cost_model, measure as tuning_measure  # noqa: E402


def captured_program(run_call) -> tuple:
    """(executable, args) of the decode program `run_call()` (one `ssd_jax.generate` call) runs:
    the first decode program it compiled or found in the compile cache (an "auto" call may then
    compile AR's program to judge itself against, `ssd_jax.tuning.against_ar`)."""
    seen = []
    original = compile_cache.PROGRAMS.compiled

    def recording(fn, static_key, *args, **kwargs):
        executable, seconds = original(fn, static_key, *args, **kwargs)
        if isinstance(static_key, tuple) and static_key and static_key[0] == "decode":
            seen.append((executable, args))
        return executable, seconds

    compile_cache.PROGRAMS.compiled = recording
    try:
        run_call()
    finally:
        compile_cache.PROGRAMS.compiled = original
    return seen[0]


def auto_program(target, draft, prompts, method: str, new_tokens: int, temperature: float) -> tuple:
    """(executable, args) of method's "auto" program with its calibrated cost inputs as the last
    argument (`ssd_jax.tuning.measure.calibrated_inputs`)."""
    kwargs = generate_kwargs(method, {"num_draft_tokens": "auto"}, draft, new_tokens, temperature)
    inputs = []
    original = tuning_measure.calibrated_inputs

    def keeping(*args, **kwargs):
        inputs.append(original(*args, **kwargs))
        return inputs[-1]

    tuning_measure.calibrated_inputs = keeping
    try:
        executable, args = captured_program(lambda: ssd_jax.generate(target, prompts, key=jax.random.PRNGKey(0),
                                                                     **kwargs))
    finally:
        tuning_measure.calibrated_inputs = original
    costs = jax.device_put(np.asarray(inputs[-1], np.float32), args[-1].sharding)
    return executable, args[:-1] + (costs,)


def fixed_program(target, draft, prompts, method: str, cap: int, new_tokens: int, temperature: float) -> tuple:
    """(executable, args) of method at fixed draft length `cap` (AR's program for cap 0)."""
    name, options = ("ar", {}) if cap == 0 else (method, {"num_draft_tokens": cap})
    kwargs = generate_kwargs(name, options, draft, new_tokens, temperature)
    return captured_program(lambda: ssd_jax.generate(target, prompts, key=jax.random.PRNGKey(0), **kwargs))


def forced_inputs(cap: int) -> np.ndarray:
    return cost_model.FORCE_PLAIN if cap == 0 else cost_model.force_cap(cap)


def measure(auto, fixed: dict, caps: list[int], new_tokens: int, rounds: int) -> dict:
    """Per cap: both programs' seconds per target call by round and the trimmed-mean ratio."""
    runs = {}
    for cap in caps:
        runs[("auto", cap)] = tuning_measure.timed_run(*auto, new_tokens, forced_inputs(cap))
        runs[("fixed", cap)] = tuning_measure.timed_run(*fixed[cap], new_tokens)
    calls = {}
    for name, run in runs.items():   # warm, and the target calls (the same every round at T=0)
        calls[name] = int(jax.device_get(run()[1].counters["spec"].target_calls))
    per_call = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            per_call[name].append(runs[name]()[0] / calls[name])
    out = {}
    for cap in caps:
        a, f = np.asarray(per_call[("auto", cap)]), np.asarray(per_call[("fixed", cap)])
        out[str(cap)] = dict(auto_target_calls=calls[("auto", cap)], fixed_target_calls=calls[("fixed", cap)],
                             auto_s_per_call=a.tolist(), fixed_s_per_call=f.tolist(),
                             auto_over_fixed=cost_model.trimmed_mean(a / f))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="bv", choices=("sd", "bv", "csd", "pld", "logitspec"))
    parser.add_argument("--set", default="short", choices=("code", "repeat", "short", "badguess"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--caps", default="0,1,2,4", help="caps to compare (0: the loop's plain step against AR)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE",
                        help="set a field of this backend's policy for the run (repeatable)")
    parser.add_argument("--out", default=None, help="path stem of the results (STEM.json)")
    args = parser.parse_args()
    policy = override_policy(args.policy)
    caps = [int(c) for c in args.caps.split(",") if c]
    if args.batch < 1 or args.rounds < 3 or any(c < 0 or c > 8 for c in caps):
        parser.error(f"--batch >= 1, --rounds >= 3 and caps in 0..8, got {args.batch}, {args.rounds}, {caps}")
    target, draft = ssd_jax.default_models()
    prompts = prompt_set(args.set, target.tokenizer, args.batch)
    auto = auto_program(target, draft, prompts, args.method, args.new_tokens, args.temperature)
    fixed = {cap: fixed_program(target, draft, prompts, args.method, cap, args.new_tokens, args.temperature)
             for cap in caps}
    results = measure(auto, fixed, caps, args.new_tokens, args.rounds)
    for cap, row in results.items():
        label = "plain vs AR" if cap == "0" else f"cap {cap} vs L={cap}"
        print(f"{label}: auto/fixed per target call {row['auto_over_fixed']:.3f} "
              f"(calls {row['auto_target_calls']} vs {row['fixed_target_calls']}; "
              f"median s/call {np.median(row['auto_s_per_call']) * 1e3:.3f} vs "
              f"{np.median(row['fixed_s_per_call']) * 1e3:.3f} ms)", flush=True)
    default = f"loop_overhead_{args.method}_b{args.batch}_t{args.temperature:g}_{args.set}"
    stem = output_stem(args.out or os.path.join(RESULTS_DIR, default))
    write_json(stem + ".json", dict(machine=machine_info(), method=args.method, set=args.set, batch=args.batch,
                                    temperature=args.temperature, rounds=args.rounds, new_tokens=args.new_tokens,
                                    policy_overrides=policy, caps=results))
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
