"""The shared measurement harness of the speculative benchmarks: one configuration of
`ssd_jax.generate` over the held-out prompts, batched, with its totals.

Every benchmark that compares decoding methods (draft-model SD, retrieval drafting, cascades, SSD)
runs its configurations through `run_config`, so their numbers are comparable: same prompts, same
keys, the first call compiles and is not timed, wall time is the sum of the timed calls, each
timed end to end (`timed_generate`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

import ssd_jax

# Options that name a configuration in labels, in this order, with their short prefixes.
_LABEL_PARTS = (("num_draft_tokens", "L"), ("max_draft_tokens", "L"), ("num_paths", "K"), ("logitspec_topk", "k"), ("tree_capacity", "N"),
                ("lenience", "l"), ("k_matrix", "km"), ("fanout_budget", "F"), ("coupling", ""))
# Options of a configuration that are `generate` arguments, not method fields.
CALL_OPTIONS = ("drafts", "coupling", "head")


def label(method: str, options: dict) -> str:
    """A short name of a configuration, e.g. 'gbv-L8-K4'."""
    parts = [method]
    for name, prefix in _LABEL_PARTS:
        if name in options:
            value = options[name]
            parts.append(prefix + ("x".join(map(str, np.ravel(value))) if not np.isscalar(value) else str(value)))
    return "-".join(parts)


def batches(prompts: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Consecutive groups of batch_size prompts (the last may be shorter)."""
    return [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]


# Stats of a configuration's first (compiling, untimed) call kept as its "first_call" where the
# call ran the adaptive loop: that call's verdicts (`ssd_jax.tuning.against_ar`,
# `ssd_jax.tuning.plain_verdicts`) decide whether the timed calls after it start plain, and its
# choices are otherwise lost (an H200 run of SD at batch 8 timed only AR's program after one).
FIRST_CALL_STATS = ("target_calls", "planned_draft_len", "mean_draft_len", "ar_fallback_share", "steps_by_cap", "loses_to_ar",
                    "priced_speedup_vs_ar", "ar_step_over_loop_plain", "loop_costs")


def _totals(outs: list, walls: list[float], rounds: list[float], round_tokens: list[float], batch_size: int,
            first: dict, repeats: int, extra) -> dict:
    """Sums one configuration's per-call stats (outs: every call of every round; counts are per
    round, the mean over rounds) and fastest wall times (walls); rounds: its wall time in each
    round (summed over calls); round_tokens: the tokens it generated in each round; first: the
    stats of its first, compiling call (`FIRST_CALL_STATS`). timed_calls_calibration_s: the
    calibrations the timed calls made (left out of their times, `timed_generate`)."""
    compile_s = first["compile_time_s"]
    calibration_s = sum(float(o.stats.get("calibration_time_s") or 0.0) for o in outs)
    tokens = sum(o.stats["num_generated_tokens"] for o in outs) / repeats
    wall = sum(walls)
    row_calls = sum(o.stats["num_generated_tokens"] / o.stats.get("block_efficiency", 1.0) for o in outs) / repeats
    result = dict(tokens=tokens, wall_time_s=wall, tokens_per_second=tokens / wall,
                  target_calls=sum(o.stats["target_calls"] for o in outs) / repeats,
                  block_efficiency=tokens / row_calls,
                  compile_time_s=compile_s, timed_calls_calibration_s=calibration_s,
                  batch_size=batch_size, timing_repeats=repeats,
                  round_wall_s=[float(x) for x in rounds], round_tokens=[float(x) for x in round_tokens])
    drafts = sum(o.stats.get("num_drafts", 0) for o in outs)
    if drafts:
        # A call that decoded plainly from the start (SSD "auto" after its verdict) drafted nothing
        # and reports no acceptance.
        accepted = sum(o.stats.get("num_accepted_tokens", 0) for o in outs)
        drafted = sum(o.stats.get("num_draft_tokens", 0) for o in outs)
        # Under draft_len="auto" the length, hence the width of per-position counts, varies by call.
        counts = [np.array(o.stats.get("accepted_per_position", ()), float) for o in outs]
        width = max(len(c) for c in counts)
        per_position = np.sum([np.pad(c, (0, width - len(c))) for c in counts], axis=0)
        result.update(acceptance_rate=accepted / max(drafted, 1), mean_acceptance_length=1 + accepted / drafts,
                      acceptance_per_position=(per_position / drafts).tolist())
    for name in extra or ():
        result[name] = float(sum(o.stats.get(name) or 0.0 for o in outs)) / repeats
    if "loop_costs" in outs[0].stats:
        # The adaptive loop's calibrated inputs of the first timed call (AR step s, speculative
        # step s without draft forwards, s per draft forward or verified token, prior acceptance,
        # forced cap): what its choices between speculating and plain decoding were made from.
        result["loop_costs"] = [float(x) for x in outs[0].stats["loop_costs"]]
    if "loop_costs" in first:
        result["first_call"] = {name: _plain(first[name]) for name in FIRST_CALL_STATS if name in first}
    if first.get("per_call") or (first.get("method") == "ssd" and first.get("adaptive")):
        result["per_call_trace"] = [call_trace(stats) for stats in [first] + [o.stats for o in outs]]
    return result


# SSD "auto" calls that ran SSD also say where they first switched to plain decoding, how often
# they resumed SSD after a plain stretch, the plain step
# they were judged against (`ssd_auto.plain_step_seconds`), their judged steps' seconds and
# pace, and the pace over all their SSD steps: a process whose plain step read high kept
# speculating where SSD lost (batch 4).
SSD_TRACE_STATS = ("switched_to_plain_at_step", "ssd_resumed", "plain_step_s", "judged_step_s", "judged_pace_tokens",
                   "call_pace_tokens", "observed_acceptance", "plain_read_acceptance", "plain_read_s")


def call_trace(stats: dict) -> dict:
    """What one per-call "auto" call (`ssd_jax.tuning.per_call`, or SSD's) ran and what it cost:
    its length (0: AR's program), path count where chosen, SSD's `SSD_TRACE_STATS` where it ran
    SSD, seconds (the call end to end but its compile and calibrations
    where timed, `timed_generate`; else the run), compile and calibration seconds, target calls and tokens; a
    configuration's first, untimed call first in its list,
    then its timed calls in the order they ran (prompt by prompt, each prompt's rounds in turn)."""
    seconds = stats.get("call_wall_s", stats["wall_time_s"])
    out = dict(length=int(stats.get("planned_draft_len", 0)), wall_s=float(seconds),
               compile_s=float(stats.get("compile_time_s") or 0.0),
               calibration_s=float(stats.get("calibration_time_s") or 0.0), target_calls=int(stats["target_calls"]),
               tokens=int(stats["num_generated_tokens"]))
    if stats.get("chosen_paths") is not None:   # None: the call ran AR's program
        out["paths"] = int(stats["chosen_paths"])
    for name in SSD_TRACE_STATS if stats.get("method") == "ssd" else ():   # (SD's calls observe acceptance too)
        if stats.get(name) is not None:
            out[name] = float(stats[name])
    return out


def timed_generate(target, prompts, **kwargs):
    """`ssd_jax.generate` timed end to end: its stats' call_wall_s is the whole call's seconds but
    the compile and the calibrations it reports, so host work counts (the prompts' preparation, "auto"'s choice and
    its measuring runs, the output's conversion), which wall_time_s (the decode program's run)
    leaves out: "auto" chosen per call did ~1.6 ms of host work a call that AR's did not (CPU;
    ~10% of a 128-token call of the embedded pair on an H200) before its choice was cached, and
    ratios of program times did not show it. Compiling is left out as every configuration's
    first, untimed call leaves it out: once per program and process (a persistent compilation
    cache keeps it across processes), where "auto" compiles each program it tries on a timed
    call (compile_time_s says how long; on a GPU 7-11 s a program). Calibrations
    (calibration_time_s: timings of a program's steps or forwards that the tuner keeps per program
    and machine) are left out alike: a user's machine makes each once, where a timed call that
    met a new program paid it (CSD at 1/5 of a target step: one round 9.1 s against 1.6 s)."""
    start = time.perf_counter()
    out = ssd_jax.generate(target, prompts, **kwargs)
    once = float(out.stats.get("compile_time_s") or 0.0) + float(out.stats.get("calibration_time_s") or 0.0)
    out.stats["call_wall_s"] = time.perf_counter() - start - once
    return out


def _plain(value):
    """A stat as JSON takes it (numpy scalars and arrays to Python's)."""
    return np.asarray(value).tolist()


def method_object(method: str, options: dict):
    """A configuration (method name, options named as in the labels: num_draft_tokens, num_paths,
    tree_capacity, ...) -> its `ssd_jax.methods` object; `drafts` and `coupling` are `generate`'s
    (`CALL_OPTIONS`, see `generate_kwargs`)."""
    from ssd_jax.generate import OLD_OPTIONS
    from ssd_jax.methods import METHOD_CLASSES

    fields = {OLD_OPTIONS.get(k, k): v for k, v in options.items() if k not in CALL_OPTIONS}
    return METHOD_CLASSES[method](**fields)


def generate_kwargs(method: str, options: dict, draft, new_tokens: int, temperature: float, tuner=None) -> dict:
    """`ssd_jax.generate`'s keyword arguments for one configuration: the method object, the
    draft (a list of drafters in options["drafts"] becomes CSD's tuple, largest first), the
    coupling (options["coupling"], else generate's default) and the `ssd_jax.Tuner` (None: the
    default one)."""
    kwargs = dict(max_new_tokens=new_tokens, method=method_object(method, options), temperature=temperature)
    if "coupling" in options:
        kwargs["coupling"] = options["coupling"]
    if tuner is not None:
        kwargs["tuner"] = tuner
    if "drafts" in options:
        kwargs["draft"] = tuple(options["drafts"])
    elif "head" in options:   # EAGLE's feature-level head
        kwargs["draft"] = options["head"]
    elif method not in ("ar", "pld", "logitspec") and draft is not None:
        kwargs["draft"] = draft
    return kwargs


def run_configs(target, prompts, configs: list[tuple[str, dict]], temperature: float, new_tokens: int, *,
                batch_size: int = 1, draft=None, extra=None, repeats: int = 1, tuner=None) -> list[dict]:
    """Generates new_tokens for every prompt with every (method, options) configuration,
    interleaved: for each batch of prompts, `repeats` rounds in which every configuration runs
    once, each round starting one configuration later than the one before (so none always runs
    right after the same one), and each call keeps its fastest run. Slow drifts of the machine's
    speed then hit all configurations alike, and the ratios between them stay honest;
    `paired_speedup` compares two configurations round by round. At temperature > 0 each round
    samples with keys of its own (the same for every configuration): one sampled continuation
    per prompt made a configuration's speed that continuation's luck (short prompts at T=1:
    position-1 acceptance 0.70 in SD L=4's continuations, 0.81 in L=2's), and the best fixed
    setting of a set was partly the luckiest one; at T=0 every round decodes the same tokens.

    Returns one dict per configuration: tokens, wall_time_s (the sum of each call's fastest run,
    every call timed end to end: `timed_generate`),
    tokens_per_second, target_calls (summed over calls, mean over rounds; a batched call counts
    its loop steps once), block_efficiency (generated
    tokens / target calls per row), compile_time_s, round_wall_s (the wall time of each round,
    summed over calls), round_tokens (the tokens generated in each round), and for speculative
    methods acceptance_rate, mean_acceptance_length, acceptance_per_position; stats keys named
    in `extra` are summed.
    The draft is passed to every method but "ar" and the retrieval methods; tuner (an
    `ssd_jax.Tuner`, None: the default one) to every call.
    """
    kwargs = [generate_kwargs(method, options, draft, new_tokens, temperature, tuner) for method, options in configs]
    groups = batches(prompts, batch_size)
    first = [ssd_jax.generate(target, groups[0], key=jax.random.PRNGKey(999), **kw).stats for kw in kwargs]
    outs = [[] for _ in configs]
    walls = [[] for _ in configs]
    rounds = np.zeros((len(configs), repeats))
    round_tokens = np.zeros((len(configs), repeats))
    for i, group in enumerate(groups):
        best = [float("inf")] * len(configs)
        for r in range(repeats):
            key = jax.random.PRNGKey(i if temperature == 0 else i * repeats + r)
            for c in np.roll(np.arange(len(configs)), -r):
                out = timed_generate(target, group, key=key, **kwargs[c])
                best[c] = min(best[c], out.stats["call_wall_s"])
                rounds[c, r] += out.stats["call_wall_s"]
                round_tokens[c, r] += out.stats["num_generated_tokens"]
                outs[c].append(out)
        for c in range(len(configs)):
            walls[c].append(best[c])
    return [_totals(outs[c], walls[c], rounds[c], round_tokens[c], batch_size, first[c], repeats, extra)
            for c in range(len(configs))]


def paired_speedup(base: dict, other: dict) -> float:
    """How many times faster `other` ran than `base` (two rows of one `run_configs` call): the
    median over rounds of the ratio of their times in the same round. Unlike the ratio of
    best-of times, a drift of the machine's speed between rounds (tens of percent within a
    minute on a shared VM) cancels, since both sides of each ratio ran within seconds. Rows with
    round_tokens compare seconds per generated token."""
    base_s, other_s = np.asarray(base["round_wall_s"]), np.asarray(other["round_wall_s"])
    if "round_tokens" in base and "round_tokens" in other:
        # Seconds per generated token: at T > 0 each configuration samples its own continuation,
        # and one that stops early at an EOS would otherwise look faster.
        base_s, other_s = base_s / np.asarray(base["round_tokens"]), other_s / np.asarray(other["round_tokens"])
    return float(np.median(base_s / other_s))


def run_config(target, prompts, method: str, options: dict, temperature: float, new_tokens: int, *,
               batch_size: int = 1, draft=None, extra=None, repeats: int = 1, tuner=None) -> dict:
    """`run_configs` for one configuration."""
    return run_configs(target, prompts, [(method, options)], temperature, new_tokens, batch_size=batch_size,
                       draft=draft, extra=extra, repeats=repeats, tuner=tuner)[0]


def transformers_rates(model_dir: str, prompts, temperature: float, new_tokens: int, variants: dict) -> dict:
    """tokens/s of transformers' `generate` on the same checkpoint and prompts, one entry per
    variant (name -> extra generate kwargs, e.g. {"ar": {}, "assisted": {"assistant_model": m}});
    each variant is warmed up on the first prompt, then timed over all prompts (batch 1)."""
    import os
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for name, extra in variants.items():
        kwargs = dict(max_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=1, **extra)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        with torch.no_grad():
            target.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
            tokens, start = 0, time.perf_counter()
            for i, prompt in enumerate(prompts):
                torch.manual_seed(i)
                generated = target.generate(torch.tensor([prompt]), **kwargs)
                tokens += generated.shape[1] - len(prompt)
            wall = time.perf_counter() - start
        out[name] = dict(tokens=tokens, wall_time_s=wall, tokens_per_second=tokens / wall)
    return out
