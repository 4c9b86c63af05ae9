"""Hugging Face tensor names <-> our parameter pytree, as one table per family.

Each row maps one HF tensor to one or more leaves of our pytree (`paths`); with several leaves the
HF tensor is their concatenation along the last axis (after the transpose of a "linear" row):
GPT-2's fused Conv1D c_attn, Phi-3's qkv_proj and gate_up_proj. Kinds:
  "copy"      same array;
  "linear"    torch Linear weight [out, in] <-> our kernel [in, out] (a transpose).
Per-layer rows carry "{i}" in the HF name; their arrays are stacked on our leading layer axis.
Per-expert rows (Mixtral) also carry "{j}"; those arrays are stacked on our expert axis, which
follows the layer axis ([N, E, ...]).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from ssd_jax.errors import CheckpointError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import param_shapes


class Row(NamedTuple):
    hf_name: str  # may contain "{i}" (layer index) and "{j}" (expert index)
    paths: tuple[tuple[str, ...], ...]  # our pytree paths, concatenated on the last axis
    kind: str  # "copy" | "linear"


def _row(hf_name: str, path: tuple[str, ...], kind: str) -> Row:
    """A row mapping one HF tensor to one leaf of ours."""
    return Row(hf_name, (path,), kind)


def _fused(hf_name: str, parts: tuple[str, ...], leaf: str, kind: str) -> Row:
    """A row whose HF tensor concatenates layers/<part>/<leaf> for each part, in order."""
    return Row(hf_name, tuple(("layers", part, leaf) for part in parts), kind)


# HF tensors that carry no parameters of ours (buffers saved by old checkpoints).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def _norm_rows(config: ModelConfig, pre: str) -> list[Row]:
    """Per-layer norms: Llama's pair, or Gemma 2/3's four (`sandwich_norms`)."""
    names = [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")]
    if config.sandwich_norms:
        names = [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
                 ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm")]
    return [_row(pre + f"{hf}.weight", ("layers", ours, "scale"), "copy") for hf, ours in names]


def _attention_rows(config: ModelConfig, pre: str) -> list[Row]:
    if config.model_type == "phi3":
        rows = [_fused(pre + "self_attn.qkv_proj.weight", ("q", "k", "v"), "kernel", "linear")]
    else:
        rows = [_row(pre + f"self_attn.{n}_proj.weight", ("layers", n, "kernel"), "linear") for n in "qkv"]
    rows.append(_row(pre + "self_attn.o_proj.weight", ("layers", "o", "kernel"), "linear"))
    if config.qkv_bias:
        rows += [_row(pre + f"self_attn.{n}_proj.bias", ("layers", n, "bias"), "copy") for n in "qkv"]
    if config.o_bias:
        rows.append(_row(pre + "self_attn.o_proj.bias", ("layers", "o", "bias"), "copy"))
    if config.qk_norm:
        rows += [_row(pre + f"self_attn.{n}_norm.weight", ("layers", f"{n}_norm", "scale"), "copy") for n in "qk"]
    return rows


def _mlp_rows(config: ModelConfig, pre: str) -> list[Row]:
    if config.mlp == "moe":  # Mixtral: router + experts w1 (gate), w3 (up), w2 (down)
        moe = pre + "block_sparse_moe."
        rows = [_row(moe + "gate.weight", ("layers", "router", "kernel"), "linear")]
        for hf, ours in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            rows.append(_row(moe + "experts.{j}." + hf + ".weight", ("layers", "experts", ours, "kernel"), "linear"))
        return rows
    if config.model_type == "phi3":
        return [_fused(pre + "mlp.gate_up_proj.weight", ("gate", "up"), "kernel", "linear"),
                _row(pre + "mlp.down_proj.weight", ("layers", "down", "kernel"), "linear")]
    rows = []
    for name in ("gate", "up", "down"):
        rows.append(_row(pre + f"mlp.{name}_proj.weight", ("layers", name, "kernel"), "linear"))
        if config.mlp_bias:
            rows.append(_row(pre + f"mlp.{name}_proj.bias", ("layers", name, "bias"), "copy"))
    return rows


def _llama_rows(config: ModelConfig) -> list[Row]:
    """Llama and the families sharing its names: Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, Mixtral."""
    pre = "model.layers.{i}."
    rows = [
        _row("model.embed_tokens.weight", ("embed",), "copy"),
        _row("model.norm.weight", ("final_norm", "scale"), "copy"),
    ]
    rows += _norm_rows(config, pre) + _attention_rows(config, pre) + _mlp_rows(config, pre)
    if not config.tie_word_embeddings:
        rows.append(_row("lm_head.weight", ("lm_head", "kernel"), "linear"))
    return rows


def _gpt2_rows(config: ModelConfig) -> list[Row]:
    pre = "transformer.h.{i}."
    rows = [
        _row("transformer.wte.weight", ("embed",), "copy"),
        _row("transformer.wpe.weight", ("pos_embed",), "copy"),
        # Conv1D already stores [in, out]; c_attn is q, k, v side by side.
        _fused(pre + "attn.c_attn.weight", ("q", "k", "v"), "kernel", "copy"),
        _fused(pre + "attn.c_attn.bias", ("q", "k", "v"), "bias", "copy"),
    ]
    for hf, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        rows.append(_row(pre + f"{hf}.weight", ("layers", ours, "scale"), "copy"))
        rows.append(_row(pre + f"{hf}.bias", ("layers", ours, "bias"), "copy"))
    for hf, ours in (("attn.c_proj", "o"), ("mlp.c_fc", "fc"), ("mlp.c_proj", "proj")):
        rows.append(_row(pre + f"{hf}.weight", ("layers", ours, "kernel"), "copy"))
        rows.append(_row(pre + f"{hf}.bias", ("layers", ours, "bias"), "copy"))
    rows.append(_row("transformer.ln_f.weight", ("final_norm", "scale"), "copy"))
    rows.append(_row("transformer.ln_f.bias", ("final_norm", "bias"), "copy"))
    if not config.tie_word_embeddings:
        rows.append(_row("lm_head.weight", ("lm_head", "kernel"), "linear"))
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


def _leading_axes(row: Row) -> int:
    """How many of our leaf's leading axes the row's indices stack on (layer, then expert)."""
    return ("{i}" in row.hf_name) + ("{j}" in row.hf_name)


def _indices(config: ModelConfig, row: Row) -> list[tuple[int | None, int | None]]:
    layers = range(config.num_layers) if "{i}" in row.hf_name else [None]
    experts = range(config.num_experts) if "{j}" in row.hf_name else [None]
    return [(i, j) for i in layers for j in experts]


def _expected_hf_shape(row: Row, shapes: dict) -> tuple[int, ...]:
    leaves = [_get(shapes, path)[_leading_axes(row):] for path in row.paths]
    shape = leaves[0][:-1] + (sum(leaf[-1] for leaf in leaves),)
    return shape[::-1] if row.kind == "linear" else shape


def stored_names(config: ModelConfig, names) -> dict[str, str]:
    """Canonical HF name (as in `mapping_rows`) -> the name stored in the checkpoint."""
    return {_canonical_name(config, n): n for n in names}


def row_tensor_names(config: ModelConfig, row: Row) -> dict[tuple[int, ...], str]:
    """(layer[, expert]) position on our leading axes -> canonical HF name; {(): name} if unstacked."""
    return {tuple(k for k in (i, j) if k is not None): row.hf_name.format(i=i, j=j) for i, j in _indices(config, row)}


def lead_shape(config: ModelConfig, row: Row) -> tuple[int, ...]:
    """Sizes of our leading axes that the row stacks on: (), (N,) or (N, E)."""
    return tuple(n for n, key in ((config.num_layers, "{i}"), (config.num_experts, "{j}")) if key in row.hf_name)


def require_tensor(name: str, names: dict[str, str]) -> str:
    """The stored name of canonical `name`; CheckpointError if the checkpoint lacks it."""
    if name not in names:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    return names[name]


def check_tensor_shape(name: str, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)} for this config")


def check_all_used(config: ModelConfig, names: dict[str, str], used: set[str]) -> None:
    """CheckpointError listing tensors no row consumed (ignored buffers and a tied lm_head aside)."""
    tied_head = config.tie_word_embeddings and "lm_head.weight" in names
    unexpected = sorted(n for n in names
                        if n not in used and not _IGNORED.search(n) and not (tied_head and n == "lm_head.weight"))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has tensors this {config.model_type} config does not use: {', '.join(unexpected[:6])}"
        )


def hf_to_params(config: ModelConfig, tensors, dtype, on_tensor=None) -> dict:
    """Builds our params from `tensors` (a mapping HF name -> numpy array, read lazily).

    on_tensor: optional callback run once per HF tensor consumed (for a progress bar).

    Raises CheckpointError naming a missing tensor, an unexpected one or a wrong shape.
    """
    names = stored_names(config, tensors.keys())
    shapes = param_shapes(config)
    used: set[str] = set()
    params: dict = {}
    for row in mapping_rows(config):
        expected = _expected_hf_shape(row, shapes)
        arrays = []
        for i, j in _indices(config, row):
            name = row.hf_name.format(i=i, j=j)
            array = np.asarray(tensors[require_tensor(name, names)])
            check_tensor_shape(name, array.shape, expected)
            used.add(name)
            if on_tensor is not None:
                on_tensor()
            arrays.append(array.T if row.kind == "linear" else array)
        lead = lead_shape(config, row)
        stacked = np.stack(arrays).reshape(lead + arrays[0].shape) if lead else arrays[0]
        sizes = [_get(shapes, path)[-1] for path in row.paths]
        for path, part in zip(row.paths, np.split(stacked, np.cumsum(sizes)[:-1], axis=-1)):
            _set(params, path, part.astype(dtype))
    check_all_used(config, names, used)
    return params


def params_to_hf(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params -> {HF name: numpy array} in the params' dtype, ready for safetensors."""
    out: dict[str, np.ndarray] = {}
    for row in mapping_rows(config):
        stacked = np.concatenate([np.asarray(_get(params, path)) for path in row.paths], axis=-1)
        for i, j in _indices(config, row):
            array = stacked[tuple(k for k in (i, j) if k is not None)]
            out[row.hf_name.format(i=i, j=j)] = np.ascontiguousarray(array.T if row.kind == "linear" else array)
    return out
