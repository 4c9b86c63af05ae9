"""Sharded decoding on meshes of fake CPU devices (issue #15): per (data x model) mesh shape, a
random Llama-shaped target (8 heads, 4 KV heads) and a near copy of it as the draft (noise 0.2% of
each weight's std: SD accepts ~80%; the draft is as large as the target, so SD's speed here says
nothing about a real pair) are loaded from a Hugging Face checkpoint with `ssd_jax.load(path,
mesh=...)`, then AR and SD decode a ragged batch of 4.

    python benchmarks/bench_mesh.py [--shapes 1x1,1x2,2x2,1x4,2x4,1x8] [--new-tokens 32] [--repeats 3]

FAKE CPU DEVICES SHOW CORRECTNESS AND MEMORY, NOT ACCELERATOR SPEED. The 8 "devices" come from
`--xla_force_host_platform_device_count=8`: they share this machine's cores and memory, and their
collectives are memory copies, so splitting a model over more of them does not make it faster (it
usually makes it slower). What the numbers do show: the parameter bytes each device holds (about
total / model-axis size), the compile time of the sharded programs, that every shape decodes the
same tokens as the unsharded model, and the peak host memory of a sharded load against the
checkpoint's size. Tensor-parallel speed needs a real multi-chip mesh (TPU slice, multi-GPU host).

Each shape runs in its own process (so its peak RSS, VmHWM, is its own) with 8 fake devices; the
"unsharded" row is the plain `ssd_jax.load(path)` on one device. Writes benchmarks/results/
mesh_cpu.json and mesh_cpu.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

# benchmarks.common imports jax only inside machine_info, after main sets the device count.
from benchmarks.common import (OUT_HELP, cpu_busy_fraction, format_table, machine_busy, machine_info,  # noqa: E402
                               output_stem, write_json)

FAKE_DEVICES = 8
LABEL = "fake CPU devices: correctness and memory, not accelerator speed"
DEFAULT_SHAPES = "1x1,1x2,2x2,1x4,2x4,1x8"


def _with_fake_devices(env: dict) -> dict:
    env = dict(env)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={FAKE_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes: VmHWM is this process's own peak,
    unlike ru_maxrss, which Linux carries over from the parent across fork + exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _config(size: str):
    import ssd_jax

    hidden, inter, layers, vocab = {"small": (256, 768, 2, 1024), "medium": (512, 1536, 4, 4096)}[size]
    return ssd_jax.ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                               num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=hidden // 8,
                               max_position_embeddings=512, eos_token_ids=())


def write_checkpoints(directory: str, size: str) -> dict:
    """A random target and a noisy copy of it (the draft) as Hugging Face directories."""
    import jax
    import jax.numpy as jnp

    import ssd_jax
    from checkpoints_convert.convert import export_hf
    from ssd_jax.models.params import init_params

    config = _config(size)
    target = ssd_jax.Model(config=config, params=init_params(config, jax.random.PRNGKey(0), scale=0.3))
    leaves, treedef = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + 0.002 * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    draft = target.with_params(jax.tree.unflatten(treedef, noisy))
    tdir = export_hf(target, os.path.join(directory, "target"))
    ddir = export_hf(draft, os.path.join(directory, "draft"))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(tdir, f)) for f in os.listdir(tdir) if f.endswith(".safetensors"))
    return dict(target=tdir, draft=ddir, checkpoint_bytes=checkpoint_bytes,
                largest_tensor_bytes=max(x.nbytes for x in leaves), param_bytes=sum(x.nbytes for x in leaves),
                num_params=sum(x.size for x in leaves), config=dict(hidden=config.hidden_size,
                intermediate=config.intermediate_size, layers=config.num_layers, vocab=config.vocab_size,
                heads=config.num_heads, kv_heads=config.num_kv_heads))


def _prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(2, vocab, size=n).tolist() for n in (12, 5, 20, 9)]


def worker(shape: str, tdir: str, ddir: str, new_tokens: int, repeats: int) -> dict:
    """One mesh shape in this process: load, bytes per device, compile and decode AR and SD."""
    import jax
    import numpy as np

    import ssd_jax

    mesh = None
    if shape != "unsharded":
        data, model = (int(x) for x in shape.split("x"))
        mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])
        jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec())))  # the backend's one-off allocations, before the baseline
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    target = ssd_jax.load(tdir, "float32", mesh=mesh)
    jax.block_until_ready(target.params)
    load_s = time.perf_counter() - start
    load_peak = _status_bytes("VmHWM")
    draft = ssd_jax.load(ddir, "float32", mesh=mesh)
    per_device: dict[int, int] = {}
    for leaf in jax.tree.leaves(target.params):
        for piece in leaf.addressable_shards:
            per_device[piece.device.id] = per_device.get(piece.device.id, 0) + piece.data.nbytes
    prompts = _prompts(target.config.vocab_size)
    row = dict(shape=shape, devices=len(per_device), model_axis=int(mesh.shape["model"]) if mesh else 1,
               data_axis=int(mesh.shape["data"]) if mesh else 1, load_s=load_s, baseline_rss=baseline,
               load_peak_rss=load_peak, load_overhead_bytes=load_peak - baseline,
               max_device_bytes=max(per_device.values()), min_device_bytes=min(per_device.values()),
               all_device_bytes=sum(per_device.values()),
               load_above_buffers_bytes=load_peak - baseline - sum(per_device.values()),
               methods={})
    for name, method in (("ar", ssd_jax.AR()), ("sd", ssd_jax.SD(draft_len=4))):
        kwargs = dict(method=method, draft=draft if name == "sd" else None, max_new_tokens=new_tokens,
                      key=jax.random.PRNGKey(0))
        first = ssd_jax.generate(target, prompts, **kwargs)
        walls = []
        for _ in range(repeats):
            out = ssd_jax.generate(target, prompts, **kwargs)
            walls.append(out.stats["wall_time_s"])
        generated = out.stats["num_generated_tokens"]
        row["methods"][name] = dict(compile_s=first.stats["compile_time_s"], best_wall_s=min(walls),
                                    tokens_per_s=generated / min(walls), generated=generated,
                                    acceptance_rate=out.stats.get("acceptance_rate"), tokens=out.tokens)
    return row


def _run_worker(shape: str, checkpoints: dict, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", shape, checkpoints["target"],
               checkpoints["draft"], "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env=_with_fake_devices(os.environ), timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench_mesh: the {shape} worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["shape"] for r in rows]
    mb = 2**20
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    total = result["checkpoints"]["param_bytes"] / mb
    axes[0].bar(names, [r["max_device_bytes"] / mb for r in rows], color="tab:blue", label="largest device")
    axes[0].plot(names, [total / r["model_axis"] for r in rows], "k_", markersize=22, mew=2, label="total / model axis")
    axes[0].set_ylabel("parameter MiB per device")
    axes[0].set_title("target bytes per device")
    axes[0].legend(fontsize=8)
    x = range(len(rows))
    for offset, name, color in ((-0.2, "ar", "tab:gray"), (0.2, "sd", "tab:orange")):
        axes[1].bar([i + offset for i in x], [r["methods"][name]["tokens_per_s"] for r in rows], width=0.4,
                    color=color, label=name.upper())
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("tokens/s (batch 4)")
    axes[1].set_title("decode speed on fake devices (not accelerator speed)")
    axes[1].legend(fontsize=8)
    checkpoint = result["checkpoints"]["checkpoint_bytes"] / mb
    buffers = [r["all_device_bytes"] / mb for r in rows]
    axes[2].bar(names, buffers, color="tab:blue", label="device buffers (host RAM on CPU)")
    axes[2].bar(names, [max(0.0, r["load_above_buffers_bytes"] / mb) for r in rows], bottom=buffers,
                color="tab:green", label="peak above the buffers")
    axes[2].axhline(checkpoint, color="k", ls="--", lw=1, label=f"checkpoint {checkpoint:.0f} MiB")
    axes[2].set_ylabel("MiB")
    axes[2].set_title("load: peak RSS - baseline")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("mesh (data x model)")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"bench_mesh: {LABEL}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated data x model mesh shapes")
    parser.add_argument("--size", choices=("small", "medium"), default="medium")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "mesh_cpu"), help=OUT_HELP)
    parser.add_argument("--worker", nargs=3, metavar=("SHAPE", "TARGET_DIR", "DRAFT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = output_stem(args.out)
    if args.worker:
        shape, tdir, ddir = args.worker
        print(json.dumps(worker(shape, tdir, ddir, args.new_tokens, args.repeats)))
        return

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for shape in shapes:
        parts = shape.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"--shapes: {shape!r} is not DATAxMODEL with positive integers")
        if int(parts[0]) * int(parts[1]) > FAKE_DEVICES:
            parser.error(f"--shapes: {shape!r} needs {int(parts[0]) * int(parts[1])} devices; there are {FAKE_DEVICES}")
    os.environ.update(_with_fake_devices(os.environ))

    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = write_checkpoints(tmp, args.size)
        for shape in ["unsharded"] + shapes:
            print(f"bench_mesh: {shape} ...", file=sys.stderr, flush=True)
            rows.append(_run_worker(shape, checkpoints, args))
    reference = rows[0]["methods"]
    for row in rows:
        for name, m in row["methods"].items():
            m["same_tokens_as_unsharded"] = m["tokens"] == reference[name]["tokens"]
    for row in rows:
        for m in row["methods"].values():
            del m["tokens"]
    info["cpu_busy_after"] = cpu_busy_fraction()
    checkpoints = {k: v for k, v in checkpoints.items() if k not in ("target", "draft")}
    result = dict(label=LABEL, machine=info, machine_busy=machine_busy(info), checkpoints=checkpoints,
                  new_tokens=args.new_tokens, batch=4, repeats=args.repeats, rows=rows)
    write_json(args.out + ".json", result)
    plot(result, args.out + ".png")
    mb = 2**20
    table = []
    for r in rows:
        ar, sd = r["methods"]["ar"], r["methods"]["sd"]
        table.append([r["shape"], r["devices"], f"{r['max_device_bytes'] / mb:.1f}",
                      f"{checkpoints['param_bytes'] / mb / r['model_axis']:.1f}",
                      f"{r['load_overhead_bytes'] / mb:.0f}", f"{r['load_above_buffers_bytes'] / mb:.0f}",
                      f"{ar['tokens_per_s']:.0f}", f"{sd['tokens_per_s']:.0f}", f"{ar['compile_s']:.1f}",
                      f"{sd['compile_s']:.1f}", ar["same_tokens_as_unsharded"] and sd["same_tokens_as_unsharded"]])
    print(f"{LABEL}; checkpoint {checkpoints['checkpoint_bytes'] / mb:.0f} MiB "
          f"(largest tensor {checkpoints['largest_tensor_bytes'] / mb:.1f} MiB)")
    print(format_table(["mesh", "devices", "MiB/device", "total/model", "load peak MiB", "above buffers",
                        "AR tok/s", "SD tok/s", "AR compile s", "SD compile s", "same tokens"], table))
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
