"""Peak host memory of reading a > 1 GB checkpoint, run by tests/test_load_memory.py (Linux), each step
in a fresh process with 8 fake CPU devices. Prints one JSON line.

    python tests/load_memory_script.py write DIR   # a synthetic Llama-shaped float32 HF checkpoint
    python tests/load_memory_script.py new DIR     # read_params_sharded, 1x8 mesh, big leaves split 8 ways
    python tests/load_memory_script.py old DIR     # hf_to_params then jnp.asarray (ssd_jax.load's path)

The writer holds one file's tensors at a time (several files + an index). Readers report: baseline
RSS once jax, ssd_jax and the mesh are up (and one small sharded array made, so the backend's own
one-off allocations are not charged to the reader), peak RSS (VmHWM) after the read, and the bytes
of all device buffers (on CPU devices those live in host memory too).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's ssd_jax / checkpoints_convert first

CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    torch_dtype="float32",
)
SPLIT_BYTES = 1 << 20  # leaves above this are split 8 ways on their last axis, smaller ones replicated


def _hf_shapes() -> dict[str, tuple[int, ...]]:
    d, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * d // CONFIG["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,),
            pre + "self_attn.q_proj.weight": (d, d), pre + "self_attn.k_proj.weight": (kv, d),
            pre + "self_attn.v_proj.weight": (kv, d), pre + "self_attn.o_proj.weight": (d, d),
            pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
            pre + "mlp.down_proj.weight": (d, f),
        })
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (v, d)})
    return shapes


def write(directory: str) -> dict:
    """One safetensors file per layer, one for the embedding, one for the norm and head."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    shapes = _hf_shapes()
    groups: dict[str, list[str]] = {}
    for name in shapes:
        group = name.split(".")[2] if name.startswith("model.layers.") else ("embed" if "embed" in name else "head")
        groups.setdefault(group, []).append(name)
    rng = np.random.default_rng(0)
    weight_map = {}
    for n, (group, names) in enumerate(groups.items(), start=1):
        file = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: rng.random(shapes[name], np.float32) for name in names}, os.path.join(directory, file),
                  metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return dict(checkpoint_bytes=total, largest_tensor_bytes=max(4 * int(np.prod(s)) for s in shapes.values()),
                files=len(groups))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _peak_bytes() -> int:
    # VmHWM belongs to this process's own address space. ru_maxrss does not: Linux carries the
    # parent's high-water mark across fork + exec, so under a large pytest process it reports the
    # parent's peak instead of the reader's.
    return _status_bytes("VmHWM")


def read(directory: str, path: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import ssd_jax  # noqa: F401
    from checkpoints_convert.hf_mapping import hf_to_params
    from checkpoints_convert.safetensors_io import read_hf_tensors
    from checkpoints_convert.sharded_read import read_params_sharded
    from ssd_jax.loading import read_config
    from ssd_jax.models.params import _is_shape, param_shapes

    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    warm = NamedSharding(mesh, PartitionSpec("model"))
    jax.make_array_from_callback((64,), warm, lambda index: np.zeros(64, np.float32)[index]).block_until_ready()
    config = read_config(directory)

    def sharding(shape):
        split = 4 * int(np.prod(shape)) > SPLIT_BYTES
        return NamedSharding(mesh, PartitionSpec(*[None] * (len(shape) - 1), "model") if split else PartitionSpec())

    shardings = jax.tree.map(sharding, param_shapes(config), is_leaf=_is_shape)
    baseline = _rss_bytes()
    baseline_peak = _peak_bytes()
    start = time.perf_counter()
    if path == "new":
        params = read_params_sharded(directory, config, shardings, jnp.float32)
    else:
        params = hf_to_params(config, read_hf_tensors(directory), dtype=jnp.float32)
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype=jnp.float32), params)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    device_bytes = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    split = sum(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
    return dict(path=path, baseline_rss=baseline, baseline_peak=baseline_peak, peak_rss=_peak_bytes(),
                device_bytes=device_bytes, read_s=seconds, devices=len(jax.devices()), split_leaves=split,
                leaves=len(jax.tree.leaves(params)))


if __name__ == "__main__":
    step, directory = sys.argv[1], sys.argv[2]
    print(json.dumps(write(directory) if step == "write" else read(directory, step)))
