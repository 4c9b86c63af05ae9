"""Verifier benchmarks (not a test): block efficiency and latency of every verifier.

    python benchmarks/bench_verify.py            # full run, ~5-10 minutes on a 2-core CPU
    python benchmarks/bench_verify.py --quick    # smoke run with small sizes

1. Block efficiency = mean tokens emitted per verification (accepted + the next token) on a
   synthetic prefix-dependent target/draft pair: the target's logits after a prefix are
   s * z(prefix), the draft's s * z(prefix) + sigma * n(prefix), with z and n standard normal
   vectors seeded by a hash of the prefix (so paths that share a prefix share rows, as in a real
   token tree). sigma sets how close the draft is (alpha = E sum_x min(p, q) is reported).
   K i.i.d. paths are sampled from the draft; L in {4, 8}, K in {1, 2, 4}.
   greedy / greedy_multipath run the temperature-0 regime instead: the target's argmax chain
   against path 0 = the draft's argmax chain (other paths sampled from q), so their numbers
   answer a different question.
2. Latency under jit of each verifier for V in {32000, 152064}, L = 8, K = 4, B in {1, 16},
   against two baselines over the tokens the target scores (B (K L + 1) tree nodes for
   multi-path, B (L + 1) for single path), both timed in this script, in the same run:
   a. the LM-head matmul + softmax of a model of that vocabulary (hidden 4096 for 32k, the
      Llama-2-7B shape; 3584 for 152k, the Qwen2-7B shape): a strict lower bound of the target
      forward that produces p;
   b. an estimate of the whole target forward of that model shape: the measured time of ONE
      decoder layer times the number of layers, plus the measured LM head (a). The layer is
      `ssd_jax.models.transformer.forward_cached` of a 1-layer ModelConfig of the real shape
      (Llama-2-7B: 32 layers, 32 heads, 32 kv heads, MLP 11008; Qwen2-7B: 28 layers, 28 heads,
      4 kv heads, MLP 18944, qkv bias; head_dim 128, SwiGLU, RMSNorm, RoPE), float32 random
      weights, over the scored tokens (causal path / tree mask) attending to a KV cache of
      --context (default 512) committed positions, cache donated as in a decode loop. Its
      vocabulary is shrunk to 256 so that its own embedding / head are negligible; embedding
      lookup and final norm of the real model are left out (tiny).

Writes benchmarks/results/verify_block_efficiency.json, verify_block_efficiency.png and
verify_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssd_jax import verify  # noqa: E402
from ssd_jax.models import transformer  # noqa: E402
from ssd_jax.models.config import ModelConfig  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.params import init_params  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SINGLE = ["greedy", "tokenwise", "block"]
MULTI = ["greedy_multipath", "specinfer", "spectr", "gbv"]


# --------------------------------------------------------------------------- synthetic pair


def _extend_hash(h, tok):
    return (h * jnp.uint32(16777619)) ^ (tok.astype(jnp.uint32) + jnp.uint32(0x9E3779B9))


def _node_logits(key, h, vocab):
    return jax.random.normal(jax.random.fold_in(key, h), (vocab,))


def make_batch(key, batch, n_paths, length, vocab, scale, sigma, argmax_first_path=False):
    """K i.i.d. draft paths per row and their q / p rows (with argmax_first_path, path 0 is the
    draft's argmax chain instead: the temperature-0 drafts that greedy verification expects).
    Returns paths int32 [B, K, L], q [B, K, L, V], p [B, K, L+1, V]."""
    k_target, k_noise, k_sample, k_root = jax.random.split(key, 4)
    node = jax.vmap(jax.vmap(lambda kk, h: _node_logits(kk, h, vocab), in_axes=(None, 0)),
                    in_axes=(None, 0))

    def rows(h):
        z = node(k_target, h)
        return jax.nn.softmax(scale * z, -1), jax.nn.softmax(scale * z + sigma * node(k_noise, h), -1)

    roots = jax.random.bits(k_root, (batch,), jnp.uint32)
    h = jnp.broadcast_to(roots[:, None], (batch, n_paths))
    toks, qs, ps = [], [], []
    for d in range(length):
        p_d, q_d = rows(h)
        tok = jax.random.categorical(jax.random.fold_in(k_sample, d), jnp.log(q_d)).astype(jnp.int32)
        if argmax_first_path:
            tok = tok.at[:, 0].set(jnp.argmax(q_d[:, 0], -1).astype(jnp.int32))
        toks.append(tok)
        qs.append(q_d)
        ps.append(p_d)
        h = _extend_hash(h, tok)
    ps.append(rows(h)[0])
    return jnp.stack(toks, -1), jnp.stack(qs, -2), jnp.stack(ps, -2)


def efficiency(quick: bool):
    vocab, scale = (128, 2.0) if quick else (512, 2.0)
    batch, n_batches = (256, 1) if quick else (2048, 2)
    sigmas = [0.5, 1.0, 2.0]
    rows = []
    for length in (4, 8):
        for sigma in sigmas:
            make = jax.jit(lambda kk, k_, greedy, s=sigma, l=length:
                           make_batch(kk, batch, k_, l, vocab, scale, s, greedy), static_argnums=(1, 2))
            for n_paths in (1, 2, 4):
                emitted = {name: [] for name in SINGLE + MULTI}
                alphas = []
                for i in range(n_batches):
                    key = jax.random.PRNGKey(1000 * length + 100 * n_paths + i)
                    sampled = make(key, n_paths, False)
                    greedy_batch = make(key, n_paths, True)
                    alphas.append(np.asarray(jnp.minimum(sampled[2][:, 0, 0], sampled[1][:, 0, 0]).sum(-1)))
                    vkey = jax.random.fold_in(key, 7)
                    names = (SINGLE if n_paths == 1 else []) + MULTI
                    for name in names:
                        fn = getattr(verify, name)
                        paths, q, p = greedy_batch if name.startswith("greedy") else sampled
                        if name in SINGLE:
                            res = fn(vkey, paths[:, 0], q[:, 0], p[:, 0])
                        else:
                            res = fn(vkey, paths, q, p)
                        emitted[name].append(np.asarray(res.num_accepted) + 1)
                alpha = float(np.concatenate(alphas).mean())
                for name, chunks in emitted.items():
                    if not chunks:
                        continue
                    tokens = np.concatenate(chunks).astype(np.float64)
                    rows.append({
                        "verifier": name, "L": length, "K": n_paths, "sigma": sigma,
                        "alpha": round(alpha, 4),
                        "block_efficiency": round(float(tokens.mean()), 4),
                        "stderr": round(float(tokens.std(ddof=1) / np.sqrt(tokens.size)), 4),
                        "samples": int(tokens.size),
                        "regime": ("temperature 0: target argmax; path 0 = draft argmax chain, "
                                   "other paths sampled from q") if name.startswith("greedy")
                                  else "temperature 1: paths sampled from q, target sampled",
                    })
                print(f"  efficiency L={length} sigma={sigma} K={n_paths} alpha={alpha:.3f}: " + ", ".join(
                    f"{r['verifier']}={r['block_efficiency']:.3f}" for r in rows
                    if r["L"] == length and r["K"] == n_paths and r["sigma"] == sigma), flush=True)
    config = {"vocab": vocab, "target_logit_scale": scale, "draft_noise_sigmas": sigmas,
              "rows_per_config": batch * n_batches}
    return {"config": config, "results": rows}


def plot_efficiency(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    sigmas = data["config"]["draft_noise_sigmas"]
    fig, axes = plt.subplots(2, len(sigmas), figsize=(4.2 * len(sigmas), 7), sharey="row")
    styles = {"specinfer": "o-", "spectr": "s-", "gbv": "^-", "greedy_multipath": "x:"}
    for i, length in enumerate((4, 8)):
        for j, sigma in enumerate(sigmas):
            ax = axes[i, j]
            sel = [r for r in res if r["L"] == length and r["sigma"] == sigma]
            for name, style in styles.items():
                pts = sorted((r["K"], r["block_efficiency"]) for r in sel if r["verifier"] == name)
                ax.plot([k for k, _ in pts], [e for _, e in pts], style, label=name)
            for name, color in (("tokenwise", "gray"), ("block", "black")):
                val = [r["block_efficiency"] for r in sel if r["verifier"] == name]
                if val:
                    ax.axhline(val[0], color=color, ls="--", lw=1, label=f"{name} (K=1)")
            alpha = sel[0]["alpha"] if sel else float("nan")
            ax.set_title(f"L={length}, sigma={sigma} (alpha={alpha:.2f})")
            ax.set_xticks([1, 2, 4])
            ax.set_xlabel("K (draft paths)")
            if j == 0:
                ax.set_ylabel("tokens per verification")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Block efficiency of the verifiers (synthetic prefix-dependent target/draft, "
                 f"V={data['config']['vocab']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- latency


def _time(fn, *args, reps):
    jax.block_until_ready(fn(*args))                       # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            # other processes share this machine; a load above the core count inflates timings
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


# The target model shape that goes with each vocabulary (Hugging Face config values).
TARGETS = {
    32000: dict(name="Llama-2-7B", model_type="llama", hidden_size=4096, intermediate_size=11008,
                num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, qkv_bias=False),
    152064: dict(name="Qwen2-7B", model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                 num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, qkv_bias=True),
}
LAYER_VOCAB = 256   # vocabulary of the 1-layer model: its embedding / head cost next to nothing


def _layer_config(vocab):
    t = dict(TARGETS[vocab])
    t.pop("name")
    t.update(num_layers=1, vocab_size=LAYER_VOCAB, max_position_embeddings=4096)
    return ModelConfig(**t)


def _tree_inputs(batch, n_paths, length, context):
    """Tokens, positions and ancestor mask of the scored tokens, per row: single path (n_paths 1):
    L + 1 tokens, causal; multi-path: a root then K paths of L nodes (node 1 + k L + d at depth
    d + 1), each node seeing the root and its own path's earlier nodes."""
    if n_paths == 1:
        t = length + 1
        depth = np.arange(t)
        mask = np.tril(np.ones((t, t), bool))
    else:
        t = n_paths * length + 1
        depth = np.concatenate([[0], np.tile(np.arange(1, length + 1), n_paths)])
        path = np.concatenate([[-1], np.repeat(np.arange(n_paths), length)])
        mask = (np.arange(t)[None, :] == 0) | ((path[:, None] == path[None, :]) & (depth[None, :] <= depth[:, None]))
    tokens = np.random.default_rng(t).integers(0, LAYER_VOCAB, (batch, t)).astype(np.int32)
    positions = np.broadcast_to(context + depth, (batch, t)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(np.broadcast_to(mask, (batch, t, t)))


def _time_layer(config, params, batch, n_paths, length, context, reps):
    """Median seconds of one jitted decoder layer over the scored tokens of B rows, with `context`
    committed cache positions; the cache is donated and threaded through the calls (as a decode
    loop does), lengths stay at `context` so every call writes the same slots."""
    tokens, positions, mask = _tree_inputs(batch, n_paths, length, context)
    capacity = tokens.shape[1] + context
    cache = init_cache(config, batch, capacity, per_layer=True)
    kk, kv = jax.random.split(jax.random.PRNGKey(batch * 100 + n_paths))
    cache = cache.replace(
        k=tuple(jax.random.normal(kk, a.shape, a.dtype) for a in cache.k),
        v=tuple(jax.random.normal(kv, a.shape, a.dtype) for a in cache.v),
        lengths=jnp.full((batch,), context, jnp.int32))
    step = jax.jit(lambda prm, tok, pos, c, m: transformer.forward_cached(
        prm, config, tok, pos, c, tree_mask=m), donate_argnums=(3,))
    logits, cache = step(params, tokens, positions, cache, mask)       # compile + warm up
    jax.block_until_ready((logits, cache))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits, cache = step(params, tokens, positions, cache, mask)
        jax.block_until_ready((logits, cache))
        times.append(time.perf_counter() - t0)
    del cache
    return statistics.median(times), times


def latency(quick: bool, context: int = 512):
    length, n_paths = 8, 4
    hidden = {v: t["hidden_size"] for v, t in TARGETS.items()}
    vocabs = [32000] if quick else [32000, 152064]
    batches = [1] if quick else [1, 16]
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows, layers = [], []
    for vocab in vocabs:
        target = TARGETS[vocab]
        lcfg = _layer_config(vocab)
        lparams = transformer.unstack_layers(init_params(lcfg, jax.random.PRNGKey(2)))
        jax.block_until_ready(lparams)
        w = jax.random.normal(jax.random.PRNGKey(1), (hidden[vocab], vocab), jnp.float32) * 0.02
        head = jax.jit(lambda hs, w: jax.nn.softmax(hs @ w, axis=-1))
        for batch in batches:
            key = jax.random.PRNGKey(vocab + batch)
            kq, kp, kt, kh = jax.random.split(key, 4)
            q = jax.nn.softmax(2.0 * jax.random.normal(kq, (batch, n_paths, length, vocab)), -1)
            p = jax.nn.softmax(2.0 * jax.random.normal(kp, (batch, n_paths, length + 1, vocab)), -1)
            paths = jax.random.categorical(kt, jnp.log(q)).astype(jnp.int32)
            jax.block_until_ready((q, p, paths))
            reps = 3 if vocab * batch > 1_000_000 else 7
            base = {}
            for kind, k_paths in (("single", 1), ("multi", n_paths)):
                tokens = batch * (k_paths * length + 1)
                hs = jax.random.normal(kh, (tokens, hidden[vocab]), jnp.float32)
                head_s = _time(head, hs, w, reps=reps)
                del hs
                layer_reps = 3 if batch > 1 else 7
                layer_s, layer_all = _time_layer(lcfg, lparams, batch, k_paths, length, context, layer_reps)
                full_s = target["num_layers"] * layer_s + head_s
                base[kind] = (tokens, head_s, layer_s, full_s)
                layers.append({
                    "V": vocab, "B": batch, "kind": kind, "model": target["name"], "tokens": tokens,
                    "tokens_per_row": k_paths * length + 1, "context": context,
                    "layer_ms": round(1e3 * layer_s, 3),
                    "layer_ms_all_reps": [round(1e3 * x, 3) for x in layer_all],
                    "num_layers": target["num_layers"], "lm_head_ms": round(1e3 * head_s, 3),
                    "full_forward_ms": round(1e3 * full_s, 3),
                })
                print(f"  baseline V={vocab} ({target['name']}) B={batch} {kind} ({tokens} tokens): "
                      f"layer {1e3 * layer_s:.1f} ms x {target['num_layers']} + LM head {1e3 * head_s:.1f} ms "
                      f"= {1e3 * full_s:.0f} ms", flush=True)
            for name in SINGLE + MULTI:
                fn = getattr(verify, name)
                if name in SINGLE:
                    args = (jax.random.PRNGKey(0), paths[:, 0], q[:, 0], p[:, 0])
                    kind = "single"
                else:
                    args = (jax.random.PRNGKey(0), paths, q, p)
                    kind = "multi"
                seconds = _time(fn, *args, reps=reps)
                tokens, head_s, layer_s, full_s = base[kind]
                rows.append({
                    "verifier": name, "V": vocab, "B": batch, "L": length,
                    "K": n_paths if kind == "multi" else 1,
                    "verifier_ms": round(1e3 * seconds, 3),
                    "lm_head_tokens": tokens, "lm_head_hidden": hidden[vocab],
                    "lm_head_ms": round(1e3 * head_s, 3),
                    "ratio_to_lm_head": round(seconds / head_s, 4),
                    "meets_10pct_goal_vs_lm_head": bool(seconds <= 0.1 * head_s),
                    "target_model": target["name"],
                    "layer_ms": round(1e3 * layer_s, 3), "num_layers": target["num_layers"],
                    "full_forward_ms": round(1e3 * full_s, 3),
                    "ratio_to_full_forward": round(seconds / full_s, 4),
                    "meets_10pct_goal": bool(seconds <= 0.1 * full_s),
                })
                print(f"  latency V={vocab} B={batch} {name}: {1e3 * seconds:.2f} ms "
                      f"(LM head {1e3 * head_s:.1f} ms over {tokens} tokens, ratio {seconds / head_s:.3f}; "
                      f"full forward {1e3 * full_s:.0f} ms, ratio {seconds / full_s:.4f})", flush=True)
            del q, p, paths
        del w, lparams
    machine = _machine()
    machine["load_average_1_5_15_at_start"] = load_start
    machine["load_average_1_5_15_at_end"] = machine.pop("load_average_1_5_15")
    return {
        "machine": machine,
        "baseline": "jit(softmax(h @ W)) in float32, h [tokens, hidden], W [hidden, V]; "
                    "tokens = B*(K*L+1) for multi-path, B*(L+1) for single path",
        "full_forward_baseline": (
            "full_forward_ms = num_layers * layer_ms + lm_head_ms (estimate; the layers are identical "
            "in shape so one is timed and multiplied). layer_ms: median of jit(forward_cached) of a "
            "1-layer ModelConfig of the target shape (vocab shrunk to 256), float32 random weights, "
            "params unstacked, per-layer KV cache donated, over the same scored tokens as the LM head "
            "(tree mask for multi-path) plus a KV context of `context` committed positions; RMSNorm, "
            "q/k/v/o (+qkv bias for Qwen2), RoPE, GQA attention, SwiGLU MLP. Left out: embedding "
            "lookup, final norm, sampling, host overhead. meets_10pct_goal is judged against this."),
        "targets": {str(v): t for v, t in TARGETS.items() if v in vocabs},
        "context": context,
        "layers": layers,
        "timing": "median wall time of repeated jitted calls after a warm-up call, block_until_ready; "
                  "7 repeats (3 for V*B > 1e6, and for the B=16 layers). Other processes share this "
                  "machine: see the load averages",
        "results": rows,
    }


# --------------------------------------------------------------------------- main


def _table_efficiency(data):
    lines = ["| verifier | L | sigma | alpha | K=1 | K=2 | K=4 |", "|---|---|---|---|---|---|---|"]
    res = data["results"]
    keys = sorted({(r["verifier"], r["L"], r["sigma"]) for r in res},
                  key=lambda t: (t[1], t[2], (SINGLE + MULTI).index(t[0])))
    for name, length, sigma in keys:
        vals = {r["K"]: r for r in res if (r["verifier"], r["L"], r["sigma"]) == (name, length, sigma)}
        alpha = next(iter(vals.values()))["alpha"]
        cells = [f"{vals[k]['block_efficiency']:.3f}" if k in vals else "" for k in (1, 2, 4)]
        lines.append(f"| {name} | {length} | {sigma} | {alpha:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _table_latency(data):
    lines = ["| verifier | V | B | verifier ms | LM head ms (tokens) | ratio to LM head | "
             "full forward ms | ratio to full forward |", "|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['verifier']} | {r['V']} | {r['B']} | {r['verifier_ms']:.2f} | "
                     f"{r['lm_head_ms']:.1f} ({r['lm_head_tokens']}) | {r['ratio_to_lm_head']:.3f} | "
                     f"{r['full_forward_ms']:.0f} | {r['ratio_to_full_forward']:.4f} |")
    lines += ["", "| model | V | B | tokens | context | 1 layer ms | layers | LM head ms | full forward ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in data["layers"]:
        lines.append(f"| {r['model']} | {r['V']} | {r['B']} | {r['tokens']} | {r['context']} | "
                     f"{r['layer_ms']:.1f} | {r['num_layers']} | {r['lm_head_ms']:.1f} | {r['full_forward_ms']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-efficiency", action="store_true")
    parser.add_argument("--context", type=int, default=512,
                        help="committed KV positions the timed target layer attends to")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    t0 = time.time()
    if not args.skip_efficiency:
        print("block efficiency", flush=True)
        eff = efficiency(args.quick)
        eff["machine"] = _machine()
        with open(os.path.join(RESULTS, "verify_block_efficiency.json"), "w") as f:
            json.dump(eff, f, indent=1)
        plot_efficiency(eff, os.path.join(RESULTS, "verify_block_efficiency.png"))
        print(_table_efficiency(eff))
    if not args.skip_latency:
        print("latency", flush=True)
        lat = latency(args.quick, args.context)
        with open(os.path.join(RESULTS, "verify_latency.json"), "w") as f:
            json.dump(lat, f, indent=1)
        print(_table_latency(lat))
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
