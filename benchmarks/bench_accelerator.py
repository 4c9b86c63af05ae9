"""Decoding on an accelerator: AR against the memory roofline, verification width, and the
speculative methods on the embedded pair.

Three parts (each writes its section of one JSON file and a plot):
  (a) roofline   AR tokens/s at batch 1 and 8 for random-init Llama models of 1B- and 8B-class
                 shapes (Llama-3.2-1B and Llama-3.1-8B) in bf16, against the HBM roofline:
                     roofline tokens/s = B * bandwidth / (weight bytes + B * KV bytes per step)
                 weight bytes: every parameter read once per step (the embedding table only as the
                 tied LM head); KV bytes: one row's keys and values over the mean live context.
                 Bandwidth: the device's datasheet peak, and a measured device-to-device copy.
  (b) width      the target forward (one row, 512 tokens of context in the cache) against the
                 number of tokens verified at once, 1..64: when is wide verification nearly free.
  (c) methods    the embedded pair on held-out prompts: SD, GBV, LogitSpec, CSD and SSD against
                 AR in one interleaved run (benchmarks/spec_harness.run_configs), T=0 and T=1.

    python benchmarks/bench_accelerator.py                 # all parts, on the default backend
    python benchmarks/bench_accelerator.py --parts a,b --quick   # tiny shapes: checks the script

Writes benchmarks/results/accelerator_<device>.json and accelerator_<device>_{roofline,width,
methods}.png (or --out DIR). Numbers mean something only on an accelerator; on a CPU, --quick
just proves that the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, machine_info  # noqa: E402
from ssd_jax.backend import policy_for  # noqa: E402
from ssd_jax.runtime.loop_params import loop_params  # noqa: E402
from ssd_jax.models.config import ModelConfig, RopeConfig  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.params import init_params  # noqa: E402
from ssd_jax.models.transformer import forward_cached  # noqa: E402

# Datasheet HBM bandwidth in bytes/s, by a substring of the device kind.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 3.0e11, "TPU v4": 1.2e12,
                  "TPU v5 lite": 8.19e11, "TPU v5e": 8.19e11, "TPU v3": 9.0e11, "TPU v2": 7.0e11}


def llama_shape(name: str, quick: bool) -> ModelConfig:
    """The 1B- or 8B-class Llama shape (Llama-3.2-1B, Llama-3.1-8B); --quick: a tiny stand-in."""
    if quick:
        shapes = {"1B": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=64, vocab_size=1024, tie_word_embeddings=True),
                  "8B": dict(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=2,
                             head_dim=64, vocab_size=1024, tie_word_embeddings=False)}
    else:
        shapes = {"1B": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                             head_dim=64, vocab_size=128256, tie_word_embeddings=True),
                  "8B": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                             head_dim=128, vocab_size=128256, tie_word_embeddings=False)}
    return ModelConfig(model_type="llama", max_position_embeddings=8192, norm_eps=1e-5,
                       rope=RopeConfig(theta=500000.0), **shapes[name])


def random_model(config: ModelConfig, dtype) -> ssd_jax.Model:
    params = jax.jit(lambda k: init_params(config, k, dtype))(jax.random.PRNGKey(0))
    return ssd_jax.Model(config=config, params=jax.block_until_ready(params))


def device_kind() -> str:
    return jax.devices()[0].device_kind


def peak_bandwidth() -> float | None:
    kind = device_kind()
    for name, value in PEAK_BANDWIDTH.items():
        if name.lower() in kind.lower():
            return value
    return None


def measured_copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written), best of `repeats`."""
    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(copy(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(copy(x))
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def bytes_per_step(config: ModelConfig, batch: int, context: float, param_bytes: int, cache_bytes: int) -> float:
    """Weights read once per decode step (embedding table only as the tied head) plus every row's
    keys and values over `context` tokens."""
    weights = config.num_params * param_bytes
    if not config.tie_word_embeddings:
        weights -= config.vocab_size * config.hidden_size * param_bytes  # the table is gathered, not read
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * cache_bytes
    return weights + batch * kv


def part_roofline(args, bandwidths: dict) -> list[dict]:
    rows = []
    dtype = jnp.dtype(args.dtype)
    for shape in args.shapes.split(","):
        config = llama_shape(shape, args.quick)
        model = random_model(config, dtype)
        for batch in (1, 8):
            rng = np.random.default_rng(batch)
            prompts = [rng.integers(2, config.vocab_size, args.prompt_tokens).tolist() for _ in range(batch)]
            ssd_jax.generate(model, prompts, max_new_tokens=args.new_tokens, method="ar")  # compile
            walls = []
            for _ in range(args.repeats):
                out = ssd_jax.generate(model, prompts, max_new_tokens=args.new_tokens, method="ar")
                walls.append(out.stats["wall_time_s"])
            tokens = out.stats["num_generated_tokens"]
            rate = tokens / min(walls)
            context = args.prompt_tokens + args.new_tokens / 2
            step_bytes = bytes_per_step(config, batch, context, dtype.itemsize, dtype.itemsize)
            row = dict(shape=shape, batch=batch, params=config.num_params, dtype=str(dtype),
                       prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, tokens_per_second=rate,
                       step_ms=1000 * batch / rate, bytes_per_step=step_bytes,
                       compile_time_s=out.stats["compile_time_s"])
            for name, bw in bandwidths.items():
                if bw:
                    roof = batch * bw / step_bytes
                    row[f"roofline_{name}_tokens_per_second"] = roof
                    row[f"fraction_of_{name}_roofline"] = rate / roof
            rows.append(row)
            print(f"[a] {shape} B={batch}: {rate:.1f} tok/s ({row['step_ms']:.2f} ms/step), "
                  + ", ".join(f"{row[k]:.2f} of {k[12:-9]}" for k in row if k.startswith("fraction_of_")), flush=True)
        del model
    return rows


def part_width(args) -> list[dict]:
    rows = []
    dtype = jnp.dtype(args.dtype)
    target, _ = ssd_jax.default_models()
    models = {f"embedded-target-{jnp.dtype(target.dtype).name}": target}
    for shape in args.shapes.split(","):
        models[f"llama-{shape}-{dtype}"] = None
    context = 512
    for name, model in models.items():
        if model is None:
            model = random_model(llama_shape(name.split("-")[1], args.quick), dtype)
        config, params = model.config, loop_params(model)  # the layout the decode loops run on
        cache_dtype = params["embed"].dtype
        per_layer = isinstance(params["layers"], tuple)
        fn = jax.jit(lambda p, tok, pos, cache: forward_cached(p, config, tok, pos, cache)[0])
        base = None
        for width in (1, 2, 4, 8, 16, 32, 64):
            cache = init_cache(config, 1, context + 64, cache_dtype, per_layer=per_layer)
            cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
            tokens = jnp.asarray(np.random.default_rng(width).integers(2, config.vocab_size, (1, width)), jnp.int32)
            positions = context + jnp.arange(width, dtype=jnp.int32)[None]
            jax.block_until_ready(fn(params, tokens, positions, cache))
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.width_iters):
                    out = fn(params, tokens, positions, cache)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - start) / args.width_iters)
            base = base or best
            rows.append(dict(model=name, width=width, context=context, forward_ms=1000 * best,
                             ratio_to_width_1=best / base))
            print(f"[b] {name} width {width}: {1000 * best:.3f} ms ({best / base:.2f}x width 1)", flush=True)
        del model, params
    return rows


def method_configs(temperature: float) -> list[tuple[str, dict]]:
    return [("ar", {}), ("sd", {}), ("gbv", {}), ("logitspec", {}), ("logitspec", {"tree_capacity": 16}),
            ("csd", {}), ("ssd", {})]


def part_methods(args) -> list[dict]:
    from benchmarks.heldout_prompts import heldout_prompts
    from benchmarks.spec_harness import label, run_configs

    target, draft = ssd_jax.default_models(draft="draft")  # the draft of the GPU tables in docs/benchmarks.md
    prompts = heldout_prompts(target.tokenizer, count=args.prompts)
    rows = []
    for temperature in (0.0, 1.0):
        configs = method_configs(temperature)
        results = run_configs(target, prompts, configs, temperature, args.method_tokens, draft=draft,
                              repeats=args.repeats)
        ar = results[0]["tokens_per_second"]
        for (method, options), result in zip(configs, results):
            rows.append(dict(label=label(method, options), method=method, options=options, temperature=temperature,
                             speedup_over_ar=result["tokens_per_second"] / ar, **result))
            print(f"[c] T={temperature} {rows[-1]['label']}: {result['tokens_per_second']:.0f} tok/s, "
                  f"{rows[-1]['speedup_over_ar']:.2f}x AR, block efficiency {result['block_efficiency']:.2f}",
                  flush=True)
    return rows


def part_attention(args) -> list[dict]:
    """Exploration for the backend policy: the reference attention (ssd_jax's einsum + masked
    softmax) against `jax.nn.dot_product_attention` per implementation, at decode shapes of the
    8B-class model (32 heads, 8 KV heads, head_dim 128), 512 tokens of context."""
    from ssd_jax.models.transformer import _attend

    config = llama_shape("8B", args.quick)
    dtype = jnp.dtype(args.dtype)
    rows = []
    rows += _prefill_attention(args, config, dtype)
    context, capacity = 512, 576
    for batch in (1, 8):
        for width in (1, 16, 64):
            rng = jax.random.split(jax.random.PRNGKey(width), 3)
            q = jax.random.normal(rng[0], (batch, width, config.num_heads, config.head_dim), dtype)
            k = jax.random.normal(rng[1], (batch, config.num_kv_heads, capacity, config.head_dim), dtype)
            v = jax.random.normal(rng[2], (batch, config.num_kv_heads, capacity, config.head_dim), dtype)
            slots = jnp.arange(capacity)[None, None, :]
            mask = jnp.broadcast_to(slots < context + 1 + jnp.arange(width)[None, :, None], (batch, width, capacity))
            variants = {"reference": jax.jit(lambda q, k, v, m: _attend(config, q, k, v, m))}
            for impl in ("xla", "cudnn"):
                def dpa(q, k, v, m, impl=impl):
                    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
                    return jax.nn.dot_product_attention(q, kt, vt, mask=m[:, None], implementation=impl)
                variants[f"dpa_{impl}_mask"] = jax.jit(dpa)
            rows += _time_variants(args, variants, (q, k, v, mask), dict(batch=batch, width=width, context=context))
    return rows


def _time_variants(args, variants: dict, inputs: tuple, labels: dict) -> list[dict]:
    """Times each jitted variant on the same inputs (best of --repeats, --width-iters calls
    each); the first variant is the reference of max_abs_diff. A variant that fails to compile
    is recorded with its error."""
    rows = []
    ref = None
    for name, fn in variants.items():
        try:
            out = jax.block_until_ready(fn(*inputs))
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.width_iters):
                    out = fn(*inputs)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - start) / args.width_iters)
            out = np.asarray(out, np.float32).reshape(-1)
            ref = out if ref is None else ref
            err = float(np.abs(out - ref).max())
            rows.append(dict(labels, variant=name, ms=1000 * best, max_abs_diff=err))
            print(f"[d] {labels} {name}: {1000 * best:.4f} ms, diff {err:.3g}", flush=True)
        except Exception as e:  # noqa: BLE001 - exploration: record what does not run
            rows.append(dict(labels, variant=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"[d] {labels} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return rows


def _prefill_attention(args, config: ModelConfig, dtype) -> list[dict]:
    """A causal prompt of T tokens attending to itself: the reference attention (a [T, T] mask)
    against `ssd_jax.models.attention.causal_attention` per implementation."""
    from ssd_jax.models.attention import causal_attention
    from ssd_jax.models.transformer import _attend

    rows = []
    for batch, t in ((1, 128), (1, 512), (1, 2048), (8, 512)):
        if args.quick and t > 128:
            continue
        rng = jax.random.split(jax.random.PRNGKey(t), 3)
        q = jax.random.normal(rng[0], (batch, t, config.num_heads, config.head_dim), dtype)
        k = jax.random.normal(rng[1], (batch, t, config.num_kv_heads, config.head_dim), dtype)
        v = jax.random.normal(rng[2], (batch, t, config.num_kv_heads, config.head_dim), dtype)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
        variants = {"reference": jax.jit(lambda q, k, v, m: _attend(config, q, k.transpose(0, 2, 1, 3),
                                                                    v.transpose(0, 2, 1, 3), m))}
        for impl in ("xla", "cudnn"):
            variants[f"causal_{impl}"] = jax.jit(lambda q, k, v, m, impl=impl: causal_attention(q, k, v,
                                                                                                  implementation=impl))
        rows += _time_variants(args, variants, (q, k, v, mask), dict(batch=batch, prefill=t))
    return rows


def part_policy(args) -> list[dict]:
    """The decode attention choice measured end to end: the policy's own platform entry with
    decode_attention "reference" and "xla", on the embedded pair (AR, SD, LogitSpec-N16, CSD at
    T=0, interleaved) and on the 1B shape (AR at batch 1 and 2)."""
    from benchmarks.heldout_prompts import heldout_prompts
    from benchmarks.spec_harness import label, run_configs
    from ssd_jax import backend
    from ssd_jax.runtime import compile_cache

    platform = backend.default_platform()
    original = backend.POLICIES[platform]
    target, draft = ssd_jax.default_models(draft="draft")  # the draft of the GPU tables in docs/benchmarks.md
    prompts = heldout_prompts(target.tokenizer, count=max(2, args.prompts // 2))
    big = random_model(llama_shape("1B", args.quick), jnp.dtype(args.dtype))
    configs = [("ar", {}), ("sd", {}), ("logitspec", {"tree_capacity": 16}), ("csd", {})]
    rows = []
    try:
        for attention in ("reference", "xla"):
            backend.POLICIES[platform] = dataclasses.replace(original, decode_attention=attention)
            compile_cache.clear()
            results = run_configs(target, prompts, configs, 0.0, args.method_tokens, draft=draft, repeats=args.repeats)
            for (method, options), result in zip(configs, results):
                rows.append(dict(model="embedded", decode_attention=attention, label=label(method, options),
                                 tokens_per_second=result["tokens_per_second"]))
                print(f"[f] {attention} embedded {rows[-1]['label']}: {result['tokens_per_second']:.0f} tok/s", flush=True)
            for batch in (1, 2):
                prompt = np.random.default_rng(0).integers(2, big.config.vocab_size, args.prompt_tokens).tolist()
                out = ssd_jax.generate(big, [prompt] * batch, max_new_tokens=args.new_tokens)
                wall = min(ssd_jax.generate(big, [prompt] * batch, max_new_tokens=args.new_tokens).stats["wall_time_s"]
                           for _ in range(args.repeats))
                rate = out.stats["num_generated_tokens"] / wall
                rows.append(dict(model="llama-1B", batch=batch, decode_attention=attention, tokens_per_second=rate,
                                 step_ms=1000 * batch / rate))
                print(f"[f] {attention} 1B B={batch}: {rate:.0f} tok/s, {1000 * batch / rate:.3f} ms/step", flush=True)
    finally:
        backend.POLICIES[platform] = original
        compile_cache.clear()
    return rows


def part_matvec(args) -> list[dict]:
    """The 1B shape's weight matrices at 1 and 2 rows: time and bytes/s of x [M, K] @ W [K, N]
    (bf16, f32 accumulation as the model's dense layers do), and of the same product with the
    weight stored transposed, W^T [N, K]."""
    config = llama_shape("1B", args.quick)
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = {"qkv": (d, qkv), "o": (config.num_heads * config.head_dim, d), "gate_up": (d, 2 * f),
              "down": (f, d), "lm_head": (d, v)}
    dtype = jnp.dtype(args.dtype)
    rows = []
    for name, (k, n) in shapes.items():
        w = jax.random.normal(jax.random.PRNGKey(k + n), (k, n), dtype)
        wt = w.T.copy()
        for m in (1, 2):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), dtype)
            variants = {"x@W": jax.jit(lambda x, w, wt: jnp.einsum("mk,kn->mn", x, w)),
                        "x@W f32 acc": jax.jit(lambda x, w, wt: jnp.einsum("mk,kn->mn", x, w,
                                                                           preferred_element_type=jnp.float32)),
                        "W^T x": jax.jit(lambda x, w, wt: jnp.einsum("mk,nk->mn", x, wt))}
            for row in _time_variants(args, variants, (x, w, wt), dict(matrix=name, k=k, n=n, rows=m)):
                if "ms" in row:
                    row["bytes_per_s"] = k * n * dtype.itemsize / (row["ms"] / 1000)
                rows.append(row)
    return rows


def part_layout(args) -> list[dict]:
    """Exploration for the backend policy: AR on the 1B shape and on the embedded target with
    layers scanned (stacked params) against unrolled (`decode_params`), f32 against bf16."""
    from ssd_jax.loop import autoregressive

    rows = []
    original = autoregressive.unroll_layers
    target, _ = ssd_jax.default_models()
    models = {"embedded-f32": target, "embedded-bf16": target.with_params(
        jax.tree.map(lambda a: a.astype(jnp.bfloat16), target.params)),
        "llama-1B-bf16": random_model(llama_shape("1B", args.quick), jnp.bfloat16)}
    try:
        for name, model in models.items():
            for unroll in (False, True):
                autoregressive.unroll_layers = lambda model=None, unroll=unroll: unroll
                prompts = [np.random.default_rng(0).integers(2, model.config.vocab_size, args.prompt_tokens).tolist()]
                out = ssd_jax.generate(model, prompts, max_new_tokens=args.new_tokens, method="ar")
                compile_s = out.stats["compile_time_s"]
                walls = [ssd_jax.generate(model, prompts, max_new_tokens=args.new_tokens, method="ar").stats["wall_time_s"]
                         for _ in range(args.repeats)]
                rate = out.stats["num_generated_tokens"] / min(walls)
                rows.append(dict(model=name, unrolled=unroll, tokens_per_second=rate, compile_time_s=compile_s))
                print(f"[e] {name} unrolled={unroll}: {rate:.0f} tok/s, compile {compile_s:.1f}s", flush=True)
    finally:
        autoregressive.unroll_layers = original
    return rows


def plot(results: dict, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    device = results["device"]
    if results.get("roofline"):
        fig, ax = plt.subplots(figsize=(7, 4))
        rows = results["roofline"]
        names = [f"{r['shape']} B={r['batch']}" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["tokens_per_second"] for r in rows], 0.4, label="ssd_jax AR")
        key = "roofline_datasheet_tokens_per_second" if "roofline_datasheet_tokens_per_second" in rows[0] \
            else "roofline_measured_copy_tokens_per_second"
        ax.bar(x + 0.2, [r[key] for r in rows], 0.4, label=key.replace("_tokens_per_second", "").replace("_", " "))
        for i, r in enumerate(rows):
            frac = r.get("fraction_of_datasheet_roofline", r.get("fraction_of_measured_copy_roofline"))
            ax.text(i - 0.2, r["tokens_per_second"], f"{frac:.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, names)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"AR decode vs HBM roofline, bf16 ({device})")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{prefix}_roofline.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    if results.get("width"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in dict.fromkeys(r["model"] for r in results["width"]):
            rows = [r for r in results["width"] if r["model"] == name]
            ax.plot([r["width"] for r in rows], [r["ratio_to_width_1"] for r in rows], marker="o", label=name)
        ax.axhline(1.3, color="gray", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens verified in one forward")
        ax.set_ylabel("forward time / time of 1 token")
        ax.set_title(f"Verification width, batch 1, 512 tokens of context ({device})")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{prefix}_width.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    if results.get("methods"):
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = list(dict.fromkeys(r["label"] for r in results["methods"]))
        x = np.arange(len(labels))
        for i, temperature in enumerate((0.0, 1.0)):
            by = {r["label"]: r["speedup_over_ar"] for r in results["methods"] if r["temperature"] == temperature}
            ax.bar(x + (i - 0.5) * 0.4, [by.get(lab, 0) for lab in labels], 0.4, label=f"T={temperature:g}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylabel("speedup over AR")
        ax.set_title(f"Embedded pair, held-out prompts, batch 1 ({device})")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{prefix}_methods.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few tokens (checks the script)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--method-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width-iters", type=int, default=20)
    parser.add_argument("--shapes", default="1B,8B", help="Llama shapes for parts a and b")
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.method_tokens = 16, 16, 16
        args.prompts, args.repeats, args.width_iters = 2, 1, 2
    parts = set(args.parts.split(","))
    device = device_kind()
    results = dict(device=device, backend_policy=dataclasses.asdict(policy_for(None)), machine=machine_info(),
                   quick=args.quick, args=vars(args))
    if "a" in parts:
        bandwidths = dict(datasheet=peak_bandwidth(), measured_copy=measured_copy_bandwidth(0.25 if args.quick else 2))
        results["bandwidth_bytes_per_s"] = bandwidths
        print(f"bandwidth: {bandwidths}", flush=True)
        results["roofline"] = part_roofline(args, bandwidths)
    if "b" in parts:
        results["width"] = part_width(args)
    if "c" in parts:
        results["methods"] = part_methods(args)
    if "d" in parts:
        results["attention"] = part_attention(args)
    if "e" in parts:
        results["layout"] = part_layout(args)
    if "f" in parts:
        results["policy"] = part_policy(args)
    if "g" in parts:
        results["matvec"] = part_matvec(args)
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
    prefix = os.path.join(args.out, f"accelerator_{slug}{args.tag}")
    with open(prefix + ".json.tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(prefix + ".json.tmp", prefix + ".json")
    results["plots"] = [] if args.no_plot else plot(results, prefix)
    print("wrote", prefix + ".json", *results["plots"])
    return results


if __name__ == "__main__":
    main()
