"""EAGLE-3 heads: the published checkpoint layout <-> our `EagleHead` of style "eagle3".

The layout is EAGLE's `LlamaForCausalLMEagle3` (also SpecForge's output): a config.json that is a
Llama config of one layer plus `draft_vocab_size` (and, where the trainer pinned them,
`eagle_aux_hidden_state_layer_ids`), and safetensors with

    fc.weight                          [D, K*D]   the fuse map of the raw features (low, mid, high)
    midlayer.hidden_norm.weight        [D]        norm of the fused hidden (our layers.attn_norm)
    midlayer.input_layernorm.weight    [D]        norm of the token embedding (our embed_norm)
    midlayer.self_attn.{q,k,v}_proj.weight  [*, 2D]  reading cat(embedding, hidden)
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight,
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight        [Vd, D]    the head's own output over its draft vocabulary
    d2t                                int [Vd]   target id - draft id, per draft id
    t2d                                bool [V]   which target tokens the draft vocabulary holds
    embed_tokens.weight                [V, D]     optional: a frozen copy of the target's (the
                                                  head borrows the target's, so it is dropped)

vLLM's speculators re-emit the same weights with `layers.0.` for `midlayer.` and the Llama config
nested under `transformer_layer_config`; both are read. Feature layers: the trainers name the
target layers whose *input* they read (vLLM's `eagle_aux_hidden_state_layer_ids`, default
2, N // 2, N - 3); ours name the layer whose output the head reads, one less.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_convert.convert import _atomic_directory
from checkpoints_convert.hf_mapping import _get, _set, check_tensor_shape
from checkpoints_convert.safetensors_io import read_hf_tensors, write_hf_tensors
from ssd_jax.eagle.checkpoint import save_head
from ssd_jax.eagle.head import EagleHead, HeadConfig, check_draft_vocab, head_param_shapes
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.loading import read_config, read_config_json
from ssd_jax.models.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIXES = ("midlayer.", "layers.0.")
# (checkpoint name after the layer prefix, our leaf path, kind): "linear" is a torch Linear weight
# [out, in] stored as our kernel [in, out]. Layer leaves carry a leading layer axis of 1.
LAYER_ROWS = (
    ("hidden_norm.weight", ("layers", "attn_norm", "scale"), "copy"),
    ("input_layernorm.weight", ("embed_norm", "scale"), "copy"),
    ("self_attn.q_proj.weight", ("layers", "q", "kernel"), "linear"),
    ("self_attn.k_proj.weight", ("layers", "k", "kernel"), "linear"),
    ("self_attn.v_proj.weight", ("layers", "v", "kernel"), "linear"),
    ("self_attn.o_proj.weight", ("layers", "o", "kernel"), "linear"),
    ("post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), "copy"),
    ("mlp.gate_proj.weight", ("layers", "gate", "kernel"), "linear"),
    ("mlp.up_proj.weight", ("layers", "up", "kernel"), "linear"),
    ("mlp.down_proj.weight", ("layers", "down", "kernel"), "linear"),
)
TOP_ROWS = (
    ("fc.weight", ("fuse", "kernel"), "linear"),
    ("norm.weight", ("final_norm", "scale"), "copy"),
    ("lm_head.weight", ("lm_head", "kernel"), "linear"),
)
VOCAB_TENSORS = ("d2t", "t2d")
DROPPED = ("embed_tokens.weight",)


def default_input_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads when its checkpoint does not say: 2, N // 2
    and N - 3 (EAGLE's and vLLM's default)."""
    return (2, num_layers // 2, num_layers - 3)


def _read_config(src: str) -> tuple[dict, dict]:
    """(the head layer's Llama config dict, the EAGLE-3 fields: draft_vocab_size,
    eagle_aux_hidden_state_layer_ids, norm_before_residual, target_hidden_size where present)."""
    top = read_config_json(src, error=CheckpointError)
    layer = dict(top.get("transformer_layer_config") or top)
    extra = {k: top.get(k, layer.get(k)) for k in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                                    "norm_before_residual", "target_hidden_size")}
    for key in ("architectures", "transformer_layer_config", "speculators_config", *extra):
        layer.pop(key, None)
    return layer, extra


def _feature_layers(input_ids, target: ModelConfig) -> tuple[list[int], list[int]]:
    """(our feature layers, sorted; the order of the checkpoint's blocks of fc's input that gives
    them) from the target layer ids whose inputs the head reads."""
    ids = [int(i) for i in input_ids]
    bad = [i for i in ids if not 1 <= i <= target.num_layers]
    if bad:
        raise CheckpointError(f"EAGLE-3 feature layer id(s) {bad} (inputs of target layers) are outside "
                              f"1..{target.num_layers} for a target of {target.num_layers} layers")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"EAGLE-3 feature layer ids {ids} repeat a layer (pass feature_layers= for a "
                              f"target this shallow)")
    order = sorted(range(len(ids)), key=lambda k: ids[k])
    return [ids[k] - 1 for k in order], order


def _stored_names(tensors) -> dict[str, str]:
    """Canonical name ("midlayer." prefix for layer tensors) -> the stored name."""
    names = {}
    for name in tensors.keys():
        canonical = name
        for prefix in LAYER_PREFIXES[1:]:
            if name.startswith(prefix):
                canonical = LAYER_PREFIXES[0] + name[len(prefix):]
        names[canonical] = name
    return names


def _rows():
    return [(LAYER_PREFIXES[0] + name, path, kind) for name, path, kind in LAYER_ROWS] + list(TOP_ROWS)


def _draft_to_target(tensors, names: dict[str, str], draft_vocab: int, vocab: int) -> np.ndarray:
    """The target id of each draft row, int32 [Vd], from d2t (offsets) and checked against t2d."""
    if "d2t" not in names:
        if draft_vocab != vocab:
            raise CheckpointError(f"checkpoint has a draft vocabulary of {draft_vocab} < {vocab} tokens but no d2t "
                                  f"tensor mapping it to the target's")
        return np.arange(vocab, dtype=np.int32)
    offsets = np.asarray(tensors[names["d2t"]])
    check_tensor_shape("d2t", offsets.shape, (draft_vocab,))
    if not np.issubdtype(offsets.dtype, np.integer):
        raise CheckpointError(f"tensor 'd2t' holds {offsets.dtype}, expected integer offsets")
    ids = np.arange(draft_vocab, dtype=np.int64) + offsets.astype(np.int64)
    try:
        check_draft_vocab(ids, vocab)
    except InputError as err:
        raise CheckpointError(f"tensor 'd2t': {err}") from None
    if "t2d" in names:
        t2d = np.asarray(tensors[names["t2d"]]).astype(bool)
        check_tensor_shape("t2d", t2d.shape, (vocab,))
        if int(t2d.sum()) != draft_vocab or not t2d[ids].all():
            raise CheckpointError("tensors 't2d' and 'd2t' disagree on which target tokens the draft vocabulary holds")
    return ids.astype(np.int32)


def eagle3_to_head(src: str, target: ModelConfig, feature_layers: tuple[int, ...] | None = None) -> EagleHead:
    """Reads an EAGLE-3 checkpoint directory (safetensors) as an `EagleHead` of style "eagle3" for a
    target of config `target` (float32 params). feature_layers: ours (the target layers whose
    outputs the head reads), in the order of fc's input blocks; default: from the checkpoint's
    `eagle_aux_hidden_state_layer_ids`, else EAGLE-3's default (`default_input_layer_ids`).
    CheckpointError naming what does not fit: the target's width or vocabulary, a missing,
    unexpected or misshapen tensor, an inconsistent draft vocabulary, norm_before_residual."""
    if not os.path.isdir(src):
        raise CheckpointError(f"EAGLE-3 checkpoint directory {src!r} does not exist")
    layer_hf, extra = _read_config(src)
    if extra["norm_before_residual"]:
        raise CheckpointError("EAGLE-3 heads with norm_before_residual=true are not supported "
                              "(the residual stream would start from the normed hidden)")
    d, vocab = target.hidden_size, target.vocab_size
    for field, value in (("hidden_size", layer_hf.get("hidden_size")), ("target_hidden_size", extra["target_hidden_size"])):
        if value is not None and int(value) != d:
            raise CheckpointError(f"this EAGLE-3 head has {field}={value}; the target's hidden_size is {d}")
    if int(layer_hf.get("vocab_size", vocab)) != vocab:
        raise CheckpointError(f"this EAGLE-3 head is for a vocabulary of {layer_hf['vocab_size']} tokens; "
                              f"the target has {vocab}")
    draft_vocab = int(extra["draft_vocab_size"] or vocab)
    if feature_layers is None:
        input_ids = extra["eagle_aux_hidden_state_layer_ids"] or default_input_layer_ids(target.num_layers)
        layers, order = _feature_layers(input_ids, target)
    else:
        layers, order = [int(i) for i in feature_layers], list(range(len(feature_layers)))
        if layers != sorted(set(layers)):
            raise InputError(f"feature_layers must be distinct and increasing, got {layers}")
    layer_hf["vocab_size"] = vocab
    try:
        config = HeadConfig(feature_layers=tuple(layers), intermediate_size=int(layer_hf["intermediate_size"]),
                            target_model_type=target.model_type, target_hidden_size=d, target_vocab_size=vocab,
                            target_num_layers=target.num_layers, style="eagle3", draft_vocab_size=draft_vocab,
                            layer_hf_config=json.dumps(layer_hf, sort_keys=True))
        config.check_target(target)
        shapes = head_param_shapes(config, target)
    except KeyError as missing:
        raise CheckpointError(f"EAGLE-3 config.json lacks field {missing}") from None
    except InputError as err:
        raise CheckpointError(f"EAGLE-3 checkpoint does not fit the target: {err}") from None

    tensors = read_hf_tensors(src)
    names = _stored_names(tensors)
    params: dict = {}
    for name, path, kind in _rows():
        if name not in names:
            raise CheckpointError(f"EAGLE-3 checkpoint is missing tensor {name!r}")
        array = np.asarray(tensors[names[name]], dtype=np.float32)
        expected = _get(shapes, path)[1:] if path[0] == "layers" else _get(shapes, path)
        check_tensor_shape(name, array.shape, expected[::-1] if kind == "linear" else expected)
        array = array.T if kind == "linear" else array
        if name == "fc.weight":   # blocks of K*D rows in the checkpoint's order -> ours
            array = np.concatenate([array[k * d:(k + 1) * d] for k in order], axis=0)
        _set(params, path, array[None] if path[0] == "layers" else array)
    params["draft_to_target"] = _draft_to_target(tensors, names, draft_vocab, vocab)
    if "embed_tokens.weight" in names:
        check_tensor_shape("embed_tokens.weight", tensors.shape(names["embed_tokens.weight"]), (vocab, d))
    known = {name for name, _, _ in _rows()} | set(VOCAB_TENSORS) | set(DROPPED)
    unexpected = sorted(n for n in names if n not in known)
    if unexpected:
        raise CheckpointError(f"EAGLE-3 checkpoint has tensors this converter does not know: {', '.join(unexpected[:6])}")
    return EagleHead(config=config, params=jax.tree.map(jnp.asarray, params))


def convert_eagle3(src: str, dst: str, target: str, feature_layers: tuple[int, ...] | None = None,
                   dtype: str | None = None, overwrite: bool = False) -> str:
    """EAGLE-3 checkpoint directory src -> our head directory dst (`ssd_jax.eagle.save_head`,
    written atomically) for the target model directory `target` (only its config.json is read).
    Returns dst's absolute path."""
    if not os.path.isdir(target):
        raise InputError(f"target directory {target!r} does not exist")
    head = eagle3_to_head(src, read_config(target), feature_layers)
    return save_head(head, dst, dtype=dtype, overwrite=overwrite)


def head_to_eagle3(head: EagleHead) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, {name: numpy array}) of an "eagle3" head in EAGLE-3's layout, in its
    params' dtypes (d2t int64, t2d bool). InputError for a head of our own style."""
    config = head.config
    if config.style != "eagle3":
        raise InputError(f"only heads of style 'eagle3' have an EAGLE-3 layout; this head's style is {config.style!r}")
    d = config.target_hidden_size
    tensors = {}
    for name, path, kind in _rows():
        array = np.asarray(_get(head.params, path))
        array = array[0] if path[0] == "layers" else array
        tensors[name] = np.ascontiguousarray(array.T if kind == "linear" else array)
    ids = np.asarray(head.params["draft_to_target"]).astype(np.int64)
    tensors["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(config.target_vocab_size, dtype=bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    layer_hf = dict(json.loads(config.layer_hf_config), architectures=[ARCHITECTURE],
                    draft_vocab_size=config.draft_vocab_size, target_hidden_size=d,
                    eagle_aux_hidden_state_layer_ids=[i + 1 for i in config.feature_layers])
    return layer_hf, tensors


def export_eagle3(head: EagleHead, dst: str, overwrite: bool = False) -> str:
    """Writes an "eagle3" head as an EAGLE-3 checkpoint directory (config.json, model.safetensors),
    atomically. Returns dst's absolute path."""
    layer_hf, tensors = head_to_eagle3(head)
    with _atomic_directory(dst, overwrite) as tmp:
        write_hf_tensors(tmp, tensors)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(layer_hf, f, indent=2, sort_keys=True)
    return os.path.abspath(dst)
