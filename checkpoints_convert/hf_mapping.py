"""Hugging Face tensor names <-> our parameter pytree, as one table per family.

Each row says where one HF tensor lives in our pytree and how it is transformed:
  "copy"      same array;
  "linear"    torch Linear weight [out, in] <-> our kernel [in, out] (a transpose);
  "split_qkv" GPT-2's fused Conv1D c_attn ([in, 3*out] weight, [3*out] bias) <-> q, k, v.
Per-layer rows carry "{i}" in the HF name; their arrays are stacked on our leading layer axis.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from ssd_jax.errors import CheckpointError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import param_shapes


class Row(NamedTuple):
    hf_name: str  # may contain "{i}" (layer index)
    path: tuple[str, ...]  # our pytree path; for split_qkv the parent of q/k/v
    kind: str  # "copy" | "linear" | "split_qkv"


# HF tensors that carry no parameters of ours (buffers saved by old checkpoints).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def _llama_rows(config: ModelConfig) -> list[Row]:
    pre = "model.layers.{i}."
    rows = [
        Row("model.embed_tokens.weight", ("embed",), "copy"),
        Row("model.norm.weight", ("final_norm", "scale"), "copy"),
        Row(pre + "input_layernorm.weight", ("layers", "attn_norm", "scale"), "copy"),
        Row(pre + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), "copy"),
    ]
    for name in ("q", "k", "v", "o"):
        rows.append(Row(pre + f"self_attn.{name}_proj.weight", ("layers", name, "kernel"), "linear"))
    if config.qkv_bias:
        rows += [Row(pre + f"self_attn.{n}_proj.bias", ("layers", n, "bias"), "copy") for n in "qkv"]
    if config.o_bias:
        rows.append(Row(pre + "self_attn.o_proj.bias", ("layers", "o", "bias"), "copy"))
    if config.qk_norm:
        rows += [Row(pre + f"self_attn.{n}_norm.weight", ("layers", f"{n}_norm", "scale"), "copy") for n in "qk"]
    for name in ("gate", "up", "down"):
        rows.append(Row(pre + f"mlp.{name}_proj.weight", ("layers", name, "kernel"), "linear"))
        if config.mlp_bias:
            rows.append(Row(pre + f"mlp.{name}_proj.bias", ("layers", name, "bias"), "copy"))
    if not config.tie_word_embeddings:
        rows.append(Row("lm_head.weight", ("lm_head", "kernel"), "linear"))
    return rows


def _gpt2_rows(config: ModelConfig) -> list[Row]:
    pre = "transformer.h.{i}."
    rows = [
        Row("transformer.wte.weight", ("embed",), "copy"),
        Row("transformer.wpe.weight", ("pos_embed",), "copy"),
        Row(pre + "attn.c_attn.weight", ("layers", "qkv", "kernel"), "split_qkv"),
        Row(pre + "attn.c_attn.bias", ("layers", "qkv", "bias"), "split_qkv"),
    ]
    for hf, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        rows.append(Row(pre + f"{hf}.weight", ("layers", ours, "scale"), "copy"))
        rows.append(Row(pre + f"{hf}.bias", ("layers", ours, "bias"), "copy"))
    for hf, ours in (("attn.c_proj", "o"), ("mlp.c_fc", "fc"), ("mlp.c_proj", "proj")):
        # Conv1D already stores [in, out].
        rows.append(Row(pre + f"{hf}.weight", ("layers", ours, "kernel"), "copy"))
        rows.append(Row(pre + f"{hf}.bias", ("layers", ours, "bias"), "copy"))
    rows.append(Row("transformer.ln_f.weight", ("final_norm", "scale"), "copy"))
    rows.append(Row("transformer.ln_f.bias", ("final_norm", "bias"), "copy"))
    if not config.tie_word_embeddings:
        rows.append(Row("lm_head.weight", ("lm_head", "kernel"), "linear"))
    return rows


def mapping_rows(config: ModelConfig) -> list[Row]:
    return _gpt2_rows(config) if config.model_type == "gpt2" else _llama_rows(config)


def _canonical_name(config: ModelConfig, name: str) -> str:
    """GPT-2 checkpoints exist with and without the 'transformer.' prefix."""
    if config.model_type == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _expected_hf_shape(config: ModelConfig, row: Row, shapes: dict) -> tuple[int, ...]:
    if row.kind == "split_qkv":
        leaf = row.path[-1]
        q = _get(shapes, ("layers", "q", leaf))[1:]
        return q[:-1] + (3 * q[-1],)
    shape = _get(shapes, row.path)
    if row.path[0] == "layers":
        shape = shape[1:]
    return shape[::-1] if row.kind == "linear" else shape


def hf_to_params(config: ModelConfig, tensors, dtype, on_tensor=None) -> dict:
    """Builds our params from `tensors` (a mapping HF name -> numpy array, read lazily).

    on_tensor: optional callback run once per HF tensor consumed (for a progress bar).

    Raises CheckpointError naming a missing tensor, an unexpected one or a wrong shape.
    """
    names = {_canonical_name(config, n): n for n in tensors.keys()}
    shapes = param_shapes(config)
    used: set[str] = set()
    params: dict = {}
    for row in mapping_rows(config):
        layer_ids = range(config.num_layers) if "{i}" in row.hf_name else [None]
        per_layer = []
        for i in layer_ids:
            name = row.hf_name.format(i=i)
            if name not in names:
                raise CheckpointError(f"checkpoint is missing tensor {name!r}")
            array = np.asarray(tensors[names[name]])
            expected = _expected_hf_shape(config, row, shapes)
            if tuple(array.shape) != tuple(expected):
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(expected)} for this config"
                )
            used.add(name)
            if on_tensor is not None:
                on_tensor()
            per_layer.append(array.T if row.kind == "linear" else array)
        stacked = np.stack(per_layer) if layer_ids != [None] else per_layer[0]
        if row.kind == "split_qkv":
            q, k, v = np.split(stacked, 3, axis=-1)
            for part, value in zip("qkv", (q, k, v)):
                _set(params, ("layers", part, row.path[-1]), value.astype(dtype))
        else:
            _set(params, row.path, stacked.astype(dtype))
    tied_head = config.tie_word_embeddings and "lm_head.weight" in names
    unexpected = sorted(n for n in names if n not in used and not _IGNORED.search(n) and not (tied_head and n == "lm_head.weight"))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has tensors this {config.model_type} config does not use: {', '.join(unexpected[:6])}"
        )
    return params


def params_to_hf(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params -> {HF name: numpy array} in the params' dtype, ready for safetensors."""
    out: dict[str, np.ndarray] = {}
    for row in mapping_rows(config):
        if row.kind == "split_qkv":
            leaf = row.path[-1]
            stacked = np.concatenate([np.asarray(params["layers"][p][leaf]) for p in "qkv"], axis=-1)
        else:
            stacked = np.asarray(_get(params, row.path))
        if "{i}" not in row.hf_name:
            out[row.hf_name] = np.ascontiguousarray(stacked.T if row.kind == "linear" else stacked)
            continue
        for i in range(config.num_layers):
            array = stacked[i]
            out[row.hf_name.format(i=i)] = np.ascontiguousarray(array.T if row.kind == "linear" else array)
    return out
