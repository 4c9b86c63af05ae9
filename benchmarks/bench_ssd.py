"""SSD (speculative speculative decoding, Saguaro) on the embedded pair, against SD and AR.

Held-out prompts (benchmarks/heldout_prompts.py), 128 new tokens, batch 1, temperature 0 and 1.
Every setup runs in its own worker process, because the device count and the CPU runtime's
dispatch mode are fixed when jax starts:
  one_device        1 CPU device, default (asynchronous) dispatch: AR, SD (L=4), SSD colocated.
  two_devices       2 fake CPU devices (--xla_force_host_platform_device_count=2), asynchronous
                    dispatch: SSD with the target on cpu:0 and the draft on cpu:1. XLA:CPU runs
                    asynchronously dispatched programs one after another, across devices, so the
                    groups cannot overlap here (the overlap probe shows it).
  two_devices_sync  2 fake CPU devices with jax_cpu_enable_async_dispatch=False: each program runs
                    in the thread that dispatches it and SSD dispatches the draft's from its own
                    thread, so target and draft compute at once. AR and SD are measured here too:
                    every method gets the same 2 cores (XLA's intra-op threads use both).
  two_devices_1t    as two_devices_sync with single-threaded programs (--xla_cpu_multi_thread_eigen
                    =false intra_op_parallelism_threads=1): each group on "its own core".
Each worker runs an overlap probe: a single-threaded program (a chain of small matmuls) alone, on
both devices dispatched from one thread, and with device 1's dispatched from a second thread
(ratio to alone ~1: the devices computed at once; ~2: they took turns).

SSD configurations: L=4, fan-out budget 10, uniform vs geometric fan-out, Saguaro C in {1, 0.5}
(T=1 only: at T=0 C has no effect), fallback "jit" (and one "ngram"). Reported per run: hit rate
(by accepted length), tokens/s, speedup over AR and SD, the time breakdown (waiting on the steps,
fallback drafting at fresh starts, host), and SSD's predicted tokens/s from measured hit rate and
latencies (verify T_v, build T_b, the cache lookup T_s, fallback T_f, each timed alone in
sync-timing mode) and the host's work per step h (what the sync-timing runs spent outside them):
    device step = max(T_v, T_b) + T_s + (1 - p_hit) T_f         split groups
    device step = T_v + T_b + T_s + (1 - p_hit) T_f             colocated
    step = max(device step, h),  tokens/s = mean acceptance length / step
(the SSD paper's model: a hit hides all drafting, a miss adds the fallback; the build overlaps
the verify only when the groups are on different devices; the host queues each step before it
reads the one before, so its work overlaps the devices' and slows the loop only where it is
the larger).
Writes benchmarks/results/ssd.json and ssd.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TWO = "--xla_force_host_platform_device_count=2"
# setup -> (XLA_FLAGS, CPU asynchronous dispatch)
SETUPS = {
    "one_device": ("", True),
    "two_devices": (TWO, True),
    "two_devices_sync": (TWO, False),
    "two_devices_1t": (TWO + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1", False),
}
LENGTH, BUDGET = 4, 10


def ssd_configs(temperature: float, quick: bool) -> list[dict]:
    configs = [dict(fanout="geometric"), dict(fanout="uniform")]
    if temperature > 0 and not quick:
        configs += [dict(fanout="geometric", saguaro_c=0.5), dict(fanout="uniform", saguaro_c=0.5)]
    if not quick:
        configs += [dict(fanout="geometric", fanout_budget=BUDGET // 2), dict(fanout="geometric", fallback="ngram")]
    return [dict(dict(num_draft_tokens=LENGTH, fanout_budget=BUDGET), **c) for c in configs]


def ssd_label(options: dict) -> str:
    parts = ["ssd", options["fanout"][:4]]
    if options["fanout_budget"] != BUDGET:
        parts.append(f"B{options['fanout_budget']}")
    if options.get("saguaro_c", 1.0) != 1.0:
        parts.append(f"C{options['saguaro_c']:g}")
    if options.get("fallback", "jit") != "jit":
        parts.append(options["fallback"])
    return "-".join(parts)


# ---------------------------------------------------------------------------------- worker side

def overlap_probe(repeats: int = 20) -> dict | None:
    """Median ms of a single-threaded program (3000 chained 96x96 matmuls) on device 0 alone, on
    devices 0 and 1 dispatched from this thread, and with device 1's from a second thread."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp

    devices = jax.devices()
    if len(devices) < 2:
        return None

    @jax.jit
    def chain(x, w):
        return jax.lax.fori_loop(0, 3000, lambda i, x: jnp.tanh(x @ w), x)

    args = [(jax.device_put(jnp.ones((1, 96)), d), jax.device_put(jnp.eye(96) * 0.5, d)) for d in devices[:2]]
    pool = ThreadPoolExecutor(1)

    def median_ms(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times) * 1e3)

    def threaded():
        other = pool.submit(lambda: chain(*args[1]).block_until_ready())
        chain(*args[0]).block_until_ready()
        other.result()

    one = median_ms(lambda: chain(*args[0]).block_until_ready())
    both = median_ms(lambda: jax.block_until_ready([chain(*a) for a in args]))
    both_threads = median_ms(threaded)
    pool.shutdown()
    return dict(one_ms=one, both_one_thread_ms=both, both_two_threads_ms=both_threads,
                ratio_one_thread=both / one, ratio_two_threads=both_threads / one)


def device_step(t_v: float, t_b: float, t_s: float, t_f: float, hit_rate: float, colocated: bool) -> float:
    """Seconds of an SSD step on the devices (module docstring): verify and build in turn
    (colocated) or at once (split), then the lookup, and the fallback on a miss."""
    return (t_v + t_b if colocated else max(t_v, t_b)) + t_s + (1 - hit_rate) * t_f


def run_ssd(target, draft, prompts, temperature, new_tokens, options, *, sync_prompts: int = 5,
            colocate: bool = False) -> dict:
    """SSD over the prompts one at a time (a warm-up call first, as spec_harness.run_config), then
    sync-timing runs on the first sync_prompts prompts for the programs' own latencies."""
    import jax

    from benchmarks.spec_harness import method_object
    from ssd_jax.runtime.prompts import prepare_prompts
    from ssd_jax.ssd.host_loop import generate_ssd
    from ssd_jax.ssd.call import ssd_engine_options
    from ssd_jax.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature)

    devices = dict(target_devices=[0], draft_devices=[0]) if colocate else {}

    def call(prompt, key, sync=False):
        batch = prepare_prompts([prompt], target.config, new_tokens)
        kwargs = ssd_engine_options(method_object("ssd", dict(options, **devices)))
        return generate_ssd(target, draft, batch, new_tokens, sampling, key, sync_timing=sync, **kwargs).stats

    call(prompts[0], jax.random.PRNGKey(999))
    runs = [call(p, jax.random.PRNGKey(i)) for i, p in enumerate(prompts)]
    sync = [call(p, jax.random.PRNGKey(i), sync=True) for i, p in enumerate(prompts[:sync_prompts])]
    total = lambda key: float(sum(r[key] for r in runs))  # noqa: E731
    steps, lookups = total("num_drafts"), total("cache_lookups")
    outcomes = np.sum([r["outcomes_by_accepted_length"] for r in runs], axis=0)
    hits_by_k = np.sum([[0 if h is None else h * n for h, n in zip(r["hit_rate_by_accepted_length"],
                                                                     r["outcomes_by_accepted_length"])]
                        for r in runs], axis=0)
    latency = {k: float(np.mean([s["latency_s"][k] for s in sync if s["latency_s"].get(k) is not None] or [0.0]))
               for k in ("verify_s", "build_s", "select_s", "fallback_s")}
    result = dict(
        tokens=int(total("num_generated_tokens")), wall_time_s=total("wall_time_s"),
        tokens_per_second=total("num_generated_tokens") / total("wall_time_s"),
        steps=int(steps), mean_acceptance_length=1 + total("num_accepted_tokens") / steps,
        acceptance_rate=total("num_accepted_tokens") / total("num_draft_tokens"),
        cache_hit_rate=float(hits_by_k.sum() / lookups) if lookups else 0.0,
        hit_rate_by_accepted_length=[float(h / n) if n else None for h, n in zip(hits_by_k, outcomes)],
        outcomes_by_accepted_length=outcomes.tolist(),
        fallback_rows=int(total("fallback_rows")),
        colocated=runs[0]["colocated"], final_fanout=runs[-1]["fanout"],
        time_per_step_ms={name: total(key) / steps * 1e3 for name, key in (
            ("waiting_steps", "time_waiting_steps_s"), ("fallback_drafting", "time_fallback_drafting_s"),
            ("host", "time_host_s"))},
        latency_ms={k[:-2]: v * 1e3 for k, v in latency.items()},
        compile_time_s=runs[0]["compile_time_s"],
    )
    p = result["cache_hit_rate"]
    t_v, t_b, t_s, t_f = (latency[k] for k in ("verify_s", "build_s", "select_s", "fallback_s"))
    ideal = device_step(t_v, t_b, t_s, t_f, p, result["colocated"])
    # The host's work per step: what the sync-timing runs spent outside the programs they timed
    # (a lookup that drafted a miss counted as a lookup plus a fallback).
    programs = sum(s["num_drafts"] * (s["latency_s"]["verify_s"] + s["latency_s"]["build_s"]
                                      + (s["latency_s"]["select_s"] or 0.0))
                   + s["fallback_calls"] * (s["latency_s"]["fallback_s"] or 0.0) for s in sync)
    host = max(0.0, sum(s["wall_time_s"] for s in sync) - programs) / sum(s["num_drafts"] for s in sync)
    result["host_work_ms_per_step"] = host * 1e3
    result["predicted"] = dict(
        step_ms_no_host=ideal * 1e3, step_ms=max(ideal, host) * 1e3,
        tokens_per_second_no_host=result["mean_acceptance_length"] / ideal,
        tokens_per_second=result["mean_acceptance_length"] / max(ideal, host))
    result["measured_step_ms"] = result["wall_time_s"] / steps * 1e3
    return result


def worker(setup: str, quick: bool, prompts_count: int, new_tokens: int) -> dict:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", SETUPS[setup][1])
    import ssd_jax
    from benchmarks.common import machine_info
    from benchmarks.heldout_prompts import heldout_prompts
    from benchmarks.spec_harness import run_config

    info = machine_info()
    target, draft = ssd_jax.default_models(draft="draft")  # the draft the SSD table in docs/benchmarks.md used
    prompts = heldout_prompts(target.tokenizer, prompts_count)
    runs = []
    two = len(jax.devices()) > 1
    for temperature in (0.0, 1.0):
        if setup != "two_devices":
            for method, options in (("ar", {}), ("sd", dict(num_draft_tokens=LENGTH))):
                r = run_config(target, prompts, method, options, temperature, new_tokens,
                               draft=None if method == "ar" else draft)
                r.update(method=method, label=method if method == "ar" else f"sd-L{LENGTH}", options=options)
                if method == "sd":
                    r["step_ms"] = r["wall_time_s"] / (r["tokens"] / r["mean_acceptance_length"]) * 1e3
                runs.append(dict(r, temperature=temperature, setup=setup))
                print(f"[{setup}] T={temperature:g} {r['label']}: {r['tokens_per_second']:.1f} tok/s", flush=True)
        placements = [False] + ([True] if two and setup != "two_devices" else [])  # + colocated reference
        for options, colocate in [(o, c) for o in ssd_configs(temperature, quick) for c in placements]:
            if colocate and options != ssd_configs(temperature, quick)[0]:
                continue
            r = run_ssd(target, draft, prompts, temperature, new_tokens, options, colocate=colocate)
            r.update(method="ssd", label=ssd_label(options) + ("-colocated" if colocate else ""), options=options,
                     temperature=temperature, setup=setup)
            runs.append(r)
            print(f"[{setup}] T={temperature:g} {r['label']}: {r['tokens_per_second']:.1f} tok/s hit "
                  f"{r['cache_hit_rate']:.3f} step {r['measured_step_ms']:.2f} ms (predicted "
                  f"{r['predicted']['step_ms']:.2f}) latencies {r['latency_ms']}", flush=True)
    from benchmarks.common import cpu_busy_fraction, load_average

    info.update(cpu_busy_after=cpu_busy_fraction(), load_average_at_end=load_average())
    return dict(setup=setup, machine=info, overlap_probe=overlap_probe(), runs=runs)


# ---------------------------------------------------------------------------------- parent side

def plot(results: dict, path: str) -> None:
    """Left, middle: tokens/s per setup and method at T=0 and T=1 (bars measured, black ticks:
    SSD's predicted tokens/s with host overhead). Right: hit rate by outcome depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 9), gridspec_kw=dict(width_ratios=[1, 1, 0.9]))
    colors = {"ar": "C0", "sd": "C1", "ssd": "C2"}
    for ax, temperature in zip(axes[:2], (0.0, 1.0)):
        runs = [r for r in results["runs"] if r["temperature"] == temperature]
        y = np.arange(len(runs))[::-1]
        ax.barh(y, [r["tokens_per_second"] for r in runs], color=[colors[r["method"]] for r in runs])
        for yi, r in zip(y, runs):
            if r["method"] == "ssd":
                ax.plot(r["predicted"]["tokens_per_second"], yi, "k|", markersize=12)
        ax.set_yticks(y, [f"{r['setup']}: {r['label']}" for r in runs], fontsize=7)
        ax.set_xlabel("tokens/s (black tick: SSD predicted from its latencies and hit rate)")
        ax.set_title(f"T={temperature:g}")
    ax = axes[2]
    for r in results["runs"]:
        if r["method"] == "ssd" and r["setup"] == "one_device":
            rates = [np.nan if h is None else h for h in r["hit_rate_by_accepted_length"]]
            ax.plot(range(len(rates)), rates, marker="o", label=f"{r['label']} T={r['temperature']:g}")
    ax.set_xlabel("accepted draft tokens k (verification outcome depth)")
    ax.set_ylabel("cache hit rate")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.suptitle(f"SSD vs SD vs AR on the embedded pair (CPU, {results['machine_cores']} cores, batch 1, "
                 f"{results['new_tokens']} new tokens, L={results['num_draft_tokens']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REFERENCE_SETUP = {"two_devices": "one_device"}  # setups without their own AR/SD runs


def summarize(all_runs: list[dict]) -> dict:
    """Speedups over AR and SD of the same setup (same dispatch mode; two_devices uses
    one_device's) and over the fastest SD of any setup; the best SSD per temperature."""
    out = {}
    for temperature in (0.0, 1.0):
        same = [r for r in all_runs if r["temperature"] == temperature]
        refs = {}
        for method in ("ar", "sd"):
            refs[method] = {r["setup"]: r for r in same if r["method"] == method}
        best_sd = max(refs["sd"].values(), key=lambda r: r["tokens_per_second"])
        for r in same:
            setup = REFERENCE_SETUP.get(r["setup"], r["setup"])
            r["speedup_over_ar"] = r["tokens_per_second"] / refs["ar"][setup]["tokens_per_second"]
            r["speedup_over_sd"] = r["tokens_per_second"] / refs["sd"][setup]["tokens_per_second"]
            r["speedup_over_best_sd"] = r["tokens_per_second"] / best_sd["tokens_per_second"]
            if r["method"] == "ssd":
                r["predicted"]["speedup_over_sd"] = (r["predicted"]["tokens_per_second"]
                                                     / refs["sd"][setup]["tokens_per_second"])
        ssd = [r for r in same if r["method"] == "ssd"]
        best = max(ssd, key=lambda r: r["tokens_per_second"])
        out[f"t{temperature:g}"] = dict(
            ar_tokens_per_second={k: r["tokens_per_second"] for k, r in refs["ar"].items()},
            sd_tokens_per_second={k: r["tokens_per_second"] for k, r in refs["sd"].items()},
            best_ssd=f"{best['label']} ({best['setup']})", best_ssd_tokens_per_second=best["tokens_per_second"],
            best_ssd_speedup_over_same_setup_sd=best["speedup_over_sd"],
            best_ssd_speedup_over_best_sd=best["speedup_over_best_sd"],
            best_ssd_predicted_speedup_over_sd=best["predicted"]["speedup_over_sd"],
            hit_rates={f"{r['label']} ({r['setup']})": r["cache_hit_rate"] for r in ssd})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, fewer configurations")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of " + ", ".join(SETUPS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replot", action="store_true", help="redraw the figure from the saved JSON")
    args = parser.parse_args(argv)
    if args.replot:
        from benchmarks.common import RESULTS_DIR

        suffix = "_quick" if args.quick else ""
        with open(os.path.join(RESULTS_DIR, f"ssd{suffix}.json")) as f:
            plot(json.load(f), os.path.join(RESULTS_DIR, f"ssd{suffix}.png"))
        return 0
    if args.quick:
        args.prompts, args.new_tokens = 4, 32
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.quick, args.prompts, args.new_tokens)), flush=True)
        return 0

    from benchmarks.common import RESULTS_DIR, format_table, write_json

    workers = []
    for setup in args.setups.split(","):
        env = dict(os.environ, XLA_FLAGS=SETUPS[setup][0], JAX_PLATFORMS="cpu")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", setup, "--prompts", str(args.prompts),
               "--new-tokens", str(args.new_tokens)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
        if proc.returncode or not lines:
            raise SystemExit(f"worker {setup} failed with code {proc.returncode}")
        workers.append(json.loads(lines[-1][len("RESULT "):]))
    runs = [r for w in workers for r in w["runs"]]
    results = dict(
        benchmark="SSD (Saguaro) vs SD vs AR on the embedded pair, held-out prompts, batch 1",
        prompts=args.prompts, new_tokens=args.new_tokens, num_draft_tokens=LENGTH, fanout_budget=BUDGET,
        machine_cores=workers[0]["machine"]["cores"],
        machine={w["setup"]: w["machine"] for w in workers},
        overlap_probe={w["setup"]: w["overlap_probe"] for w in workers},
        summary=summarize(runs), runs=runs)
    suffix = "_quick" if args.quick else ""
    write_json(os.path.join(RESULTS_DIR, f"ssd{suffix}.json"), results)
    plot(results, os.path.join(RESULTS_DIR, f"ssd{suffix}.png"))
    rows = []
    for r in runs:
        pred = r.get("predicted", {})
        rows.append([r["temperature"], r["setup"], r["label"], r["tokens_per_second"], r["speedup_over_ar"],
                     r["speedup_over_sd"], r["speedup_over_best_sd"], r.get("cache_hit_rate", ""),
                     r.get("mean_acceptance_length", 1.0), pred.get("tokens_per_second", ""),
                     pred.get("tokens_per_second_no_host", "")])
    print(format_table(["T", "setup", "method", "tok/s", "vs AR", "vs SD", "vs best SD", "hit rate", "mean acc len",
                        "predicted tok/s", "predicted, no host"], rows))
    print("overlap probe:", results["overlap_probe"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
