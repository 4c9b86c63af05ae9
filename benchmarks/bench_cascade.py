"""Cascade Speculative Drafting (method "csd") on the embedded models, against autoregressive
decoding and draft-model SD with the top drafter alone, in one run.

Same held-out prompts and harness as bench_speculative.py (benchmarks/spec_harness.run_config),
batch 1, 128 new tokens, temperature 0 and 1: AR, SD (draft, L=4), CSD with [draft, Max-Gram] and
[draft, draft_small, Max-Gram] at several k-matrices. Per configuration: tokens/s and speedup over
AR (wall clock), target calls, drafter calls, block efficiency, the cascade's review statistics,
and beside the clock the cost-model estimate of the speedup (Chen et al.'s expected walltime
improvement: tokens per step times the target's one-token latency over the step's modelled cost),
from per-call latencies of each model measured in this script and the measured acceptance:

    step cost  = t_target(1 + L) + sum over the step's drafter forwards t_drafter(width)
    estimate   = (generated tokens / decode steps) * t_target(1) / step cost

`paper` takes every forward at its one-token latency (the paper's model: a forward costs the same
whatever its width, true for memory-bound accelerators); `width_aware` uses the latency at the
forward's real width (a CPU pays for the extra tokens). Latencies: a forward through the KV cache
(per-layer decode params, as the engines run on CPU) at context 128, repeated inside one jitted
loop, best of 5 (the method of bench_model_costs.py without the per-call dispatch).

Every configuration runs `--repeats` times, interleaved with the others; the fastest pass counts
(other processes share this machine). Writes benchmarks/results/cascade.json and cascade.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import (RESULTS_DIR, cpu_busy_fraction, format_table, load_average, machine_busy,  # noqa: E402
                               machine_info, write_json)
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from benchmarks.spec_harness import generate_kwargs, label, run_config  # noqa: E402
from ssd_jax.draft.cascade_schedule import build_schedule, default_cascade, default_k_matrix  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.transformer import decode_params, forward_cached  # noqa: E402

SD_LENGTH = 4
CASCADE_STATS = ("drafter_calls", "review_rounds", "reviewed_tokens", "review_accepted_tokens")


def cascade_stats(target, prompts, options: dict, temperature: float, new_tokens: int) -> dict:
    """The cascade's per-level stats (lists) summed over the prompts, from an untimed pass with the
    harness's keys (the same tokens as the timed passes)."""
    totals: dict = {}
    for i, prompt in enumerate(prompts):
        stats = ssd_jax.generate(target, [prompt], key=jax.random.PRNGKey(i),
                                 **generate_kwargs("csd", options, None, new_tokens, temperature)).stats
        for name in CASCADE_STATS:
            totals[name] = np.add(totals.get(name, 0), stats[name]).tolist()
    totals["review_acceptance_rate"] = [k / r if r else 0.0 for k, r in
                                        zip(totals["review_accepted_tokens"], totals["reviewed_tokens"])]
    return totals


def _cascade(k_matrix, cap=None, **extra) -> dict:
    options = dict(k_matrix=[list(row) for row in k_matrix], **extra)
    if cap is not None:
        options["max_draft_tokens"] = cap
    return options


def configurations(two_drafters: bool, temperature: float) -> list[tuple[str, dict]]:
    """(method, options) pairs; `drafts` is an int here: how many of [draft, draft_small] to use.
    The first cascade of each drafter count is the default for the temperature (`default_cascade`)."""
    greedy = temperature == 0.0
    configs: list[tuple[str, dict]] = [("ar", {}), ("sd", dict(num_draft_tokens=SD_LENGTH))]
    one = [_cascade(*default_cascade(1, greedy)),
           _cascade(default_k_matrix(1, not greedy), default_cascade(1, not greedy)[1]),
           _cascade([[0, 4, 1], [0, 0, 2], [0, 0, 0]]),
           _cascade([[0, 4, 0], [0, 0, 2], [0, 0, 0]], 8)]
    if greedy:  # the default lenience there is 2: also measure 1
        one += [_cascade(*default_cascade(1, greedy), lenience=1.0),
                _cascade([[0, 4, 0], [0, 0, 1], [0, 0, 0]], 6, lenience=1.0)]
    configs += [("csd", dict(drafts=1, **o)) for o in one]
    if two_drafters:
        two = [_cascade(*default_cascade(2, greedy)),
               _cascade([[0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 2], [0, 0, 0, 0]], 8)]
        configs += [("csd", dict(drafts=2, **o)) for o in two]
    # Name the lenience in every greedy label (the library's default there is 2).
    return [(m, dict(o, lenience=o.get("lenience", 2.0)) if m == "csd" and greedy else o) for m, o in configs]


def cascade_label(options: dict) -> str:
    """e.g. 'csd-d1-k4,1/0,2-L8-l2': drafter count, the k-matrix rows of the reviewers (columns above
    the diagonal), the target's cap and the lenience when set."""
    k = options["k_matrix"]
    rows = "/".join(",".join(map(str, row[r + 1:])) for r, row in enumerate(k[:-1]))
    tag = f"csd-d{options['drafts']}-k{rows}"
    if "max_draft_tokens" in options:
        tag += f"-L{options['max_draft_tokens']}"
    if "lenience" in options:
        tag += f"-l{options['lenience']:g}"
    return tag


def forward_fn(model, width: int, context: int = 128, steps: int = 100):
    """A compiled loop of `steps` forwards of `width` new tokens through the KV cache (batch 1);
    call it with no arguments; each call returns a value to block on."""
    config = model.config
    params = decode_params(model.params, config)

    def run(params):
        cache = init_cache(config, 1, context + 2 * width + 8, params["embed"].dtype, per_layer=True)
        cache = cache.replace(lengths=jnp.array([context], jnp.int32))

        def body(i, carry):
            cache, acc = carry
            tokens = jnp.full((1, width), i % 97, jnp.int32)
            positions = context + jnp.arange(width, dtype=jnp.int32)[None]
            logits, cache = forward_cached(params, config, tokens, positions, cache)
            return cache, acc + logits[0, -1, 0]

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))[1]

    executable = jax.jit(run).lower(params).compile()
    return lambda: executable(params)


def forward_latencies(models: list, keys: set, rounds: int = 7, steps: int = 100) -> dict:
    """(level, width) -> ms per forward: the best of `rounds` passes, interleaved over all keys so
    a burst of load from other processes does not skew one of them."""
    fns = {key: forward_fn(models[key[0]], key[1], steps=steps) for key in sorted(keys)}
    best = {key: float("inf") for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn().block_until_ready()
            best[key] = min(best[key], (time.perf_counter() - start) / steps * 1e3)
    return best


def step_forwards(method: str, options: dict) -> tuple[int, list[tuple[int, int]]]:
    """(target forward width, [(drafter level, forward width) for each drafter forward of a step])."""
    if method == "sd":
        length = options["num_draft_tokens"]
        return length + 1, [(1, 2)] + [(1, 1)] * (length - 1)
    schedule = build_schedule(options["k_matrix"], options["drafts"], options.get("max_draft_tokens"))
    return schedule.target_width + 1, [(r.level, r.pending + r.block_width) for r in schedule.rounds]


def cost_model(method: str, options: dict, tokens_per_step: float, latency) -> dict:
    """The paper's and the width-aware estimates of the speedup over AR (see module docstring)."""
    if method == "ar":
        return dict(paper=1.0, width_aware=1.0)
    target_width, drafter_forwards = step_forwards(method, options)
    ar_step = latency(0, 1)
    paper = ar_step + sum(latency(level, 1) for level, _ in drafter_forwards)
    aware = latency(0, target_width) + sum(latency(level, width) for level, width in drafter_forwards)
    return dict(paper=tokens_per_step * ar_step / paper, width_aware=tokens_per_step * ar_step / aware,
                step_ms_paper=paper, step_ms_width_aware=aware)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    for ax, temperature in zip(axes, (0.0, 1.0)):
        runs = [r for r in results["runs"] if r["temperature"] == temperature and r["method"] != "ar"]
        x = np.arange(len(runs))
        width = 0.27
        ax.bar(x - width, [r["speedup_over_ar"] for r in runs], width, label="measured (wall clock)")
        ax.bar(x, [r["cost_model"]["width_aware"] for r in runs], width, label="cost model, width-aware")
        ax.bar(x + width, [r["cost_model"]["paper"] for r in runs], width, label="cost model, paper")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [r["label"] for r in runs], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"T={temperature:g}")
    axes[0].set_ylabel("speedup over autoregressive")
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle("Cascade Speculative Drafting on the embedded models "
                 f"(CPU, batch 1, {results['new_tokens']} new tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="passes per configuration (the fastest counts)")
    parser.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, 1 pass")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 4, 32, 1
    info = machine_info()
    target, draft = ssd_jax.default_models(draft="draft")
    drafters = [draft, ssd_jax.defaults.shipped_draft("draft_small")]
    models = [target] + drafters
    prompts = heldout_prompts(target.tokenizer, args.prompts)
    runs = []
    for temperature in (0.0, 1.0):
        configs = configurations(len(drafters) > 1, temperature)
        best: dict[int, dict] = {}
        for _ in range(args.repeats):
            for i, (method, options) in enumerate(configs):
                kwargs = dict(options)
                if method == "csd":
                    kwargs["drafts"] = drafters[: options["drafts"]]
                result = run_config(target, prompts, method, kwargs, temperature, args.new_tokens,
                                    draft=draft if method == "sd" else None)
                if i not in best or result["wall_time_s"] < best[i]["wall_time_s"]:
                    best[i] = result
                if method == "csd" and "review_rounds" not in best[i]:
                    best[i].update(cascade_stats(target, prompts, kwargs, temperature, args.new_tokens))
        for i, (method, options) in enumerate(configs):
            runs.append(dict(best[i], method=method, options=options, temperature=temperature))
    # Latencies of every forward width the configurations use, then the cost model per run.
    keys = {(0, 1)}
    for r in runs:
        if r["method"] != "ar":
            target_width, forwards = step_forwards(r["method"], r["options"])
            keys |= {(0, target_width), *forwards} | {(level, 1) for level, _ in forwards}
    latency_ms = forward_latencies(models, keys)
    for temperature in (0.0, 1.0):
        group = [r for r in runs if r["temperature"] == temperature]
        ar_speed = group[0]["tokens_per_second"]
        for result in group:
            method, options = result["method"], result["options"]
            steps = result["target_calls"] - len(prompts)  # the harness counts each call's prefill
            tokens_per_step = (result["tokens"] - len(prompts)) / max(steps, 1)  # the first token is the prefill's
            tag = cascade_label(options) if method == "csd" else label(method, options)
            result.update(label=tag, speedup_over_ar=result["tokens_per_second"] / ar_speed,
                          tokens_per_step=tokens_per_step,
                          cost_model=cost_model(method, options, tokens_per_step, lambda *key: latency_ms[key]))
            if method == "sd":
                result["drafter_calls"] = len(prompts) + steps * SD_LENGTH
            print(f"T={temperature:g} {tag:>40}: {result['tokens_per_second']:7.1f} tok/s  "
                  f"speedup {result['speedup_over_ar']:.2f}x (model {result['cost_model']['width_aware']:.2f}x, "
                  f"paper {result['cost_model']['paper']:.2f}x)  tokens/step {tokens_per_step:.2f}", flush=True)
    info["load_average_at_end"] = load_average()
    info["cpu_busy_after"] = cpu_busy_fraction()
    names = ("target", "draft", "draft_small")
    latencies = {f"{names[level]}@{width}": ms for (level, width), ms in sorted(latency_ms.items())}
    results = dict(benchmark="cascade speculative drafting on the embedded models vs AR and SD (draft alone)",
                   machine=info, machine_busy=machine_busy(info), prompts=len(prompts), new_tokens=args.new_tokens,
                   batch_size=1, repeats=args.repeats, forward_latency_ms=latencies, runs=runs)
    for temperature in (0.0, 1.0):
        sd = next(r for r in runs if r["temperature"] == temperature and r["method"] == "sd")
        csd = max((r for r in runs if r["temperature"] == temperature and r["method"] == "csd"),
                  key=lambda r: r["tokens_per_second"])
        results[f"best_csd_over_sd_t{temperature:g}"] = dict(
            label=csd["label"], ratio=csd["tokens_per_second"] / sd["tokens_per_second"])
    suffix = "_quick" if args.quick else ""
    write_json(os.path.join(RESULTS_DIR, f"cascade{suffix}.json"), results)
    plot(results, os.path.join(RESULTS_DIR, f"cascade{suffix}.png"))
    rows = [[r["temperature"], r["label"], r["tokens_per_second"], r["speedup_over_ar"], r["cost_model"]["width_aware"],
             r["cost_model"]["paper"], r["tokens_per_step"], r["target_calls"], r.get("drafter_calls", "")]
            for r in runs]
    print(format_table(["T", "config", "tok/s", "speedup", "model", "paper", "tok/step", "target calls",
                        "drafter calls"], rows))
    print({k: v for k, v in results.items() if k.startswith("best_csd")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
