"""Autoregressive decoding: ssd_jax vs transformers' `generate`, same checkpoint, same prompts.

A random Llama-shaped checkpoint (~110M parameters, float32) is built with transformers, saved
with `save_pretrained` (safetensors) and loaded by both libraries. Greedy decoding of exactly
`--new-tokens` tokens (the config has no EOS id, so nothing stops early), batch 1 and batch 8
(ragged prompts: ssd_jax takes them as they are, transformers gets them left-padded with an
attention mask). ssd_jax's compile time is reported apart; every timing after a warm-up call,
repeats interleaved between the two libraries so that load from other processes hits both alike.

    python benchmarks/bench_ar.py            # full run, a few minutes
    python benchmarks/bench_ar.py --quick    # small model, 32 tokens: a smoke test

Writes benchmarks/results/ar_vs_transformers.json and .png (`_quick` suffix with --quick).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `ssd_jax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    RESULTS_DIR, cpu_busy_fraction, format_table, load_average, machine_busy, machine_info, summarize, timed,
    weight_stream_roofline, write_json,
)

FULL_MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=True)
QUICK_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=8000, tie_word_embeddings=True)
PAD_ID = 0  # transformers' left padding; prompts never contain it


def build_checkpoint(directory: str, shape: dict, seed: int):
    """Saves a random Llama checkpoint without EOS/BOS ids; returns the torch model (eval, fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(directory, safe_serialization=True)
    return model


def make_prompts(rng: np.random.RandomState, batch: int, vocab: int, lo: int, hi: int) -> list[list[int]]:
    """batch prompts of random ids in [3, vocab) with lengths in [lo, hi] (the first one of length hi)."""
    lengths = [hi] + list(rng.randint(lo, hi + 1, size=batch - 1))
    return [rng.randint(3, vocab, size=n).tolist() for n in lengths]


def left_padded(prompts: list[list[int]]):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(model, prompts, new_tokens: int) -> list[list[int]]:
    import torch

    ids, mask = left_padded(prompts)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_ID,
        )
    return out[:, ids.shape[1]:].tolist()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Rows identical, and per row the number of leading tokens that agree."""
    prefix = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {
        "rows_identical": sum(a == b for a, b in zip(ours, theirs)),
        "rows": len(ours),
        "agreeing_prefix_per_row": prefix,
        "token_match_fraction": float(np.mean([x == y for a, b in zip(ours, theirs) for x, y in zip(a, b)])),
    }


def bench_batch(model, hf_model, prompts, new_tokens: int, repeats: int) -> dict:
    import ssd_jax

    batch = len(prompts)
    total = batch * new_tokens

    # ssd_jax: the first call compiles (reported apart), the second is the warm-up.
    first = ssd_jax.generate(model, prompts, max_new_tokens=new_tokens)
    compile_s = first.stats["compile_time_s"]
    ssd_jax.generate(model, prompts, max_new_tokens=new_tokens)
    hf_tokens = hf_generate(hf_model, prompts, new_tokens)  # warm-up

    ours_wall, ours_e2e, hf_wall = [], [], []
    for _ in range(repeats):
        seconds, out = timed(lambda: ssd_jax.generate(model, prompts, max_new_tokens=new_tokens))
        assert out.stats["compile_time_s"] == 0.0, "a warm call recompiled"
        ours_e2e.append(seconds)
        ours_wall.append(out.stats["wall_time_s"])
        seconds, hf_tokens = timed(lambda: hf_generate(hf_model, prompts, new_tokens))
        hf_wall.append(seconds)

    lengths = {len(row) for row in out.tokens} | {len(row) for row in hf_tokens}
    assert lengths == {new_tokens}, f"expected exactly {new_tokens} new tokens per row, got lengths {lengths}"
    ours = summarize(ours_wall)
    e2e = summarize(ours_e2e)
    hf = summarize(hf_wall)
    for s in (ours, e2e, hf):
        s["tokens_per_s_best"] = total / s["best_s"]
        s["tokens_per_s_median"] = total / s["median_s"]
    return {
        "batch_size": batch,
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens_per_row": new_tokens,
        "ssd_jax": {
            "compile_time_s": compile_s,
            "decode": ours,  # GenerateOutput.stats wall_time_s: the compiled program (prefill + loop)
            "end_to_end": e2e,  # ssd_jax.generate as a user calls it (prompt prep, transfers included)
            "target_calls": out.stats["target_calls"],
        },
        "transformers": {"generate": hf},
        "ratio_best": e2e["tokens_per_s_best"] / hf["tokens_per_s_best"],
        "ratio_median": e2e["tokens_per_s_median"] / hf["tokens_per_s_median"],
        "agreement": agreement(out.tokens, hf_tokens),
    }


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {r['batch_size']}" for r in results]
    ours = [r["ssd_jax"]["end_to_end"]["tokens_per_s_best"] for r in results]
    theirs = [r["transformers"]["generate"]["tokens_per_s_best"] for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar(x - 0.2, ours, 0.4, label="ssd_jax (jax.jit while_loop)")
    ax.bar(x + 0.2, theirs, 0.4, label="transformers generate (torch)")
    for i, r in enumerate(results):
        ax.annotate(f"{r['ratio_best']:.2f}x", (x[i] - 0.2, ours[i]), ha="center", va="bottom")
    ax.set_xticks(x, labels)
    ax.set_ylabel("generated tokens / s (best of repeats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, 32 new tokens")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (128; 32 with --quick)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per library and batch (5; 2 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (2 if args.quick else 5)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    import torch

    torch.set_num_threads(os.cpu_count())
    import ssd_jax
    from ssd_jax.loop.autoregressive import unroll_layers

    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    rng = np.random.RandomState(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_ar_") as directory:
        hf_model = build_checkpoint(directory, shape, args.seed)
        model = ssd_jax.load(directory)
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert num_params == model.config.num_params, (num_params, model.config.num_params)
    assert not model.config.eos_token_ids, "the benchmark checkpoint must have no EOS id"

    results = []
    for batch in batch_sizes:
        prompts = make_prompts(rng, batch, shape["vocab_size"], 32, 64)
        print(f"batch {batch}: prompt lengths {[len(p) for p in prompts]}", flush=True)
        results.append(bench_batch(model, hf_model, prompts, new_tokens, repeats))

    roofline = weight_stream_roofline(num_params)
    report = {
        "benchmark": "autoregressive greedy decoding, ssd_jax vs transformers generate",
        "machine": info,
        "model": {
            "family": "llama (random init, std 0.02)", **shape, "dtype": "float32",
            "num_params": num_params, "ssd_jax_layers_unrolled": unroll_layers(),
        },
        "settings": {
            "new_tokens": new_tokens, "repeats": repeats, "greedy": True, "seed": args.seed,
            "transformers_padding": "left, with attention_mask",
            "tokens_per_s": "batch x new tokens / wall time of the whole call (prefill included), after warm-up",
            "ratio": "ssd_jax end-to-end tokens/s over transformers tokens/s (best of repeats; median too)",
        },
        "results": results,
        # Batch 1 reads every weight once per token: these bound batch-1 tokens/s from above.
        "batch1_roofline_tokens_per_s": roofline,
    }
    report["machine"]["load_average_at_end"] = load_average()
    report["machine"]["cpu_busy_after"] = cpu_busy_fraction()
    report["machine"]["busy"] = machine_busy(report["machine"])
    suffix = "_quick" if args.quick else ""
    json_path = write_json(os.path.join(args.out_dir, f"ar_vs_transformers{suffix}.json"), report)
    png_path = os.path.join(args.out_dir, f"ar_vs_transformers{suffix}.png")
    busy = " - MACHINE BUSY, unreliable" if report["machine"]["busy"] else ""
    plot(results, png_path, f"{num_params / 1e6:.1f}M-param Llama, fp32, greedy, {new_tokens} new tokens\n"
                            f"{info['cpu_model']}, {info['cores']} cores{busy}")

    rows = []
    for r in results:
        o, e, h = r["ssd_jax"]["decode"], r["ssd_jax"]["end_to_end"], r["transformers"]["generate"]
        a = r["agreement"]
        rows.append([
            r["batch_size"], e["tokens_per_s_best"], e["tokens_per_s_median"], o["tokens_per_s_best"],
            h["tokens_per_s_best"], h["tokens_per_s_median"], f"{r['ratio_best']:.2f}x", f"{r['ratio_median']:.2f}x",
            r["ssd_jax"]["compile_time_s"], f"{a['rows_identical']}/{a['rows']}",
        ])
    print()
    print(f"model: {num_params:,} params (Llama, fp32), {new_tokens} new tokens/row, greedy; "
          f"{info['cpu_model']}, {info['cores']} cores; CPU busy with other work before/after: "
          f"{info['cpu_busy_before']}/{info['cpu_busy_after']}")
    print(format_table(
        ["batch", "ssd_jax tok/s", "(median)", "(in-program)", "transformers tok/s", "(median)",
         "ratio", "(median)", "compile s", "rows equal"],
        rows,
    ))
    print(f"\nbatch-1 bounds from streaming {roofline['bytes_per_pass'] / 1e6:.0f} MB of fp32 weights per token: "
          f"memory read {roofline['read_only_passes_per_s']:.0f} tok/s, one jax matvec "
          f"{roofline['jax_matvec_passes_per_s']:.0f} tok/s, one torch matvec "
          f"{roofline.get('torch_matvec_passes_per_s', float('nan')):.0f} tok/s")
    if report["machine"]["busy"]:
        print("\nWARNING: other processes were using the CPU before or after the run (cpu_busy_before/after);"
              " these timings, torch's above all, are not reliable. Rerun on a quiet machine.")
    print(f"\nwrote {json_path}\n      {png_path}")
    return report


if __name__ == "__main__":
    main()
