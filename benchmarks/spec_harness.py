"""The shared measurement harness of the speculative benchmarks: one configuration of
`ssd_jax.generate` over the held-out prompts, batched, with its totals.

Every benchmark that compares decoding methods (draft-model SD, retrieval drafting, cascades, SSD)
runs its configurations through `run_config`, so their numbers are comparable: same prompts, same
keys, the first call compiles and is not timed, wall time is the sum of the timed calls.
"""

from __future__ import annotations

import jax
import numpy as np

import ssd_jax

# Options that name a configuration in labels, in this order, with their short prefixes.
_LABEL_PARTS = (("num_draft_tokens", "L"), ("num_paths", "K"), ("logitspec_topk", "k"), ("tree_capacity", "N"),
                ("lenience", "l"), ("k_matrix", "km"), ("fanout_budget", "F"))


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


def run_config(target, prompts, method: str, options: dict, temperature: float, new_tokens: int, *,
               batch_size: int = 1, draft=None, extra: dict | None = None) -> dict:
    """Generates new_tokens for every prompt with one method; returns the totals.

    Keys: tokens, wall_time_s, tokens_per_second, target_calls (summed over calls; a batched call
    counts its loop steps once), block_efficiency (generated tokens / target calls per row),
    compile_time_s, and for speculative methods acceptance_rate, mean_acceptance_length,
    acceptance_per_position. Any stats key listed in `extra` is summed over calls.
    """
    kwargs = dict(max_new_tokens=new_tokens, method=method, temperature=temperature, **options)
    if draft is not None:
        kwargs["draft"] = draft
    groups = batches(prompts, batch_size)
    warm = ssd_jax.generate(target, groups[0], key=jax.random.PRNGKey(999), **kwargs)
    totals = dict(tokens=0, wall=0.0, drafts=0, accepted=0, drafted=0, calls=0, row_calls=0)
    summed = {name: 0.0 for name in (extra or {})}
    per_position = None
    for i, group in enumerate(groups):
        out = ssd_jax.generate(target, group, key=jax.random.PRNGKey(i), **kwargs)
        s = out.stats
        totals["tokens"] += s["num_generated_tokens"]
        totals["wall"] += s["wall_time_s"]
        totals["calls"] += s["target_calls"]
        totals["row_calls"] += s["num_generated_tokens"] / s.get("block_efficiency", 1.0)
        for name in summed:
            summed[name] += float(s.get(name, 0.0))
        if "num_drafts" in s:
            totals["drafts"] += s["num_drafts"]
            totals["accepted"] += s["num_accepted_tokens"]
            totals["drafted"] += s["num_draft_tokens"]
            pos = np.array(s["accepted_per_position"], float)
            per_position = pos if per_position is None else per_position + pos
    result = dict(tokens=totals["tokens"], wall_time_s=totals["wall"],
                  tokens_per_second=totals["tokens"] / totals["wall"], target_calls=totals["calls"],
                  block_efficiency=totals["tokens"] / totals["row_calls"],
                  compile_time_s=warm.stats["compile_time_s"], batch_size=batch_size)
    if totals["drafts"]:
        result.update(acceptance_rate=totals["accepted"] / max(totals["drafted"], 1),
                      mean_acceptance_length=1 + totals["accepted"] / totals["drafts"],
                      acceptance_per_position=(per_position / totals["drafts"]).tolist())
    result.update(summed)
    return result


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
