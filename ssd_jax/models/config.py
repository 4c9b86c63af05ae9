"""`ModelConfig`: one frozen, hashable description of every supported decoder family.

Built from a Hugging Face `config.json` dict (`ModelConfig.from_hf`) and written back
(`ModelConfig.to_hf`). Being hashable, it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from ssd_jax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

SLIDING, FULL = "sliding_attention", "full_attention"
NORMS = ("rms", "layer", "rms_1p")
MLPS = ("gated", "plain", "moe")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (`rope_type` in SUPPORTED_ROPE_TYPES)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes mirror the Hugging Face names where one exists. `norm` is "rms", "layer" or
    "rms_1p" (Gemma's RMSNorm: the stored scale w is applied as 1 + w, in float32);
    `positions` is "rope" or "learned"; `mlp` is "gated" (SwiGLU/GeGLU), "plain"
    (fc -> act -> proj) or "moe" (a router picking `experts_per_token` of `num_experts` gated
    experts per token, Mixtral). `hf_json` keeps the original config.json text so a round trip
    writes it back unchanged.

    Gemma-family switches: `embed_scale` multiplies embeddings by sqrt(hidden_size);
    `sandwich_norms` adds norms on the attention and MLP outputs before each residual;
    `query_pre_attn_scalar` replaces head_dim in the 1/sqrt scaling of attention scores;
    `attn_logit_softcap` / `final_logit_softcap` apply cap * tanh(x / cap) to attention scores /
    final logits. Per-layer attention: `layer_types` is empty (every layer uses `sliding_window`,
    if set) or one of "sliding_attention" / "full_attention" per layer; `rope_local` is the RoPE
    of the sliding layers when it differs from `rope` (Gemma 3).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    norm: str = "rms"
    positions: str = "rope"
    mlp: str = "gated"
    activation: str = "silu"
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    hf_json: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.rope.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"unsupported activation (hidden_act) {self.activation!r}; supported: {', '.join(_ACTIVATIONS)}")
        if self.norm not in NORMS or self.mlp not in MLPS:
            raise ConfigError(f"unsupported norm {self.norm!r} or mlp {self.mlp!r}; supported: {NORMS}, {MLPS}")
        self._check_layer_types()
        if self.mlp == "moe" and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.experts_per_token} must be between 1 and "
                f"num_local_experts={self.num_experts}"
            )

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
            raise ConfigError(
                f"layer_types {list(self.layer_types)!r} must name {self.num_layers} layers, each "
                f"{SLIDING!r} or {FULL!r}"
            )
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is null")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (None: global), a static tuple of num_layers."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if kind == SLIDING else None for kind in self.layer_types)

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings included, tied head counted once)."""
        d, f, v, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = d * f * (3 if self.mlp == "gated" else 2)
        if self.mlp == "moe":
            mlp = self.num_experts * (3 * d * f + d)
        per_layer = attn + mlp + (4 if self.sandwich_norms else 2) * d
        total = self.num_layers * per_layer + v * d + d
        if not self.tie_word_embeddings:
            total += v * d
        if self.positions == "learned":
            total += self.max_position_embeddings * d
        return total

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dict; raises ConfigError."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type' field")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            fields = _gpt2_fields(hf) if model_type == "gpt2" else _llama_like_fields(model_type, hf)
            fields.update(_FAMILY_FIELDS.get(model_type, lambda hf: {})(hf))
        except KeyError as missing:
            raise ConfigError(f"config.json for model_type {model_type!r} lacks field {missing}") from None
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return cls(
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            hf_json=json.dumps(dict(hf), sort_keys=True),
            **fields,
        )

    def to_hf(self) -> dict[str, Any]:
        """Returns a Hugging Face `config.json` dict for this config.

        Starts from the original config.json when there was one, so unknown keys survive.
        """
        out: dict[str, Any] = json.loads(self.hf_json) if self.hf_json else {}
        out["model_type"] = self.model_type
        out["architectures"] = [_ARCHITECTURES[self.model_type]]
        out["vocab_size"] = self.vocab_size
        out["tie_word_embeddings"] = self.tie_word_embeddings
        out["bos_token_id"] = self.bos_token_id
        out["eos_token_id"] = (
            None if not self.eos_token_ids
            else self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        out["pad_token_id"] = self.pad_token_id
        if self.model_type == "gpt2":
            out.update(
                n_embd=self.hidden_size, n_layer=self.num_layers, n_head=self.num_heads,
                n_positions=self.max_position_embeddings, n_inner=self.intermediate_size,
                layer_norm_epsilon=self.norm_eps, activation_function=self.activation,
            )
            return out
        out.update(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.norm_eps,
            hidden_act=self.activation,
        )
        rope = _rope_to_hf(self.rope)
        # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta/rope_scaling.
        out["rope_parameters"] = rope
        out["rope_theta"] = self.rope.theta
        out["rope_scaling"] = None if self.rope.rope_type == "default" else dict(rope, type=self.rope.rope_type)
        if self.model_type.startswith("gemma") or self.model_type in ("phi3", "mixtral"):
            out.update(_family_to_hf(self))
            return out
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            out["sliding_window"] = self.sliding_window
        return out


_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu", "relu")


def _rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    if FULL in params:  # per-layer-type RoPE: Gemma 3, read by `_gemma3_fields`
        params = dict(params[FULL])
    scaling = dict(hf.get("rope_scaling") or {})
    return _rope_from_dict({**scaling, **params}, hf)


def _rope_from_dict(merged: Mapping[str, Any], hf: Mapping[str, Any]) -> RopeConfig:
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope scaling type rope_type={rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.rope_type == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return out


def _family_to_hf(config: "ModelConfig") -> dict[str, Any]:
    """The config.json keys of the Gemma, Phi-3 and Mixtral families (see `_FAMILY_FIELDS`)."""
    out: dict[str, Any] = {"sliding_window": config.sliding_window, "attention_bias": config.qkv_bias}
    if config.model_type.startswith("gemma"):
        out["hidden_activation"] = config.activation
    if config.model_type in ("gemma2", "gemma3_text"):
        out.update(
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
            attn_logit_softcapping=config.attn_logit_softcap,
            final_logit_softcapping=config.final_logit_softcap,
            layer_types=list(config.layer_types),
        )
    if config.model_type == "gemma3_text":
        local = config.rope_local or config.rope
        out["rope_parameters"] = {FULL: _rope_to_hf(config.rope), SLIDING: _rope_to_hf(local)}
        out["rope_local_base_freq"] = local.theta
    if config.model_type == "mixtral":
        out.update(num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_token)
        out.pop("attention_bias")
    return out


def _refuse(hf: Mapping[str, Any], key: str, supported) -> None:
    """ConfigError naming `key` and its value when the value is not in `supported`."""
    value = hf.get(key)
    if value not in supported:
        raise ConfigError(
            f"config key {key}={value!r} of model_type {hf.get('model_type')!r} is not supported "
            f"(supported: {', '.join(repr(v) for v in supported)})"
        )


def _layer_types(hf: Mapping[str, Any], default_pattern: int) -> tuple[str, ...]:
    """Gemma 2/3 local/global layer pattern: `layer_types`, or every `sliding_window_pattern`-th
    layer global (the rule transformers applies to configs without `layer_types`)."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default_pattern
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"]))


def _gemma_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(hf, "use_bidirectional_attention", (None, False))
    # Gemma 1 checkpoints name the MLP activation hidden_activation (preferred) or hidden_act.
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(
        norm="rms_1p", embed_scale=True, activation=act,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        o_bias=bool(hf.get("attention_bias", False)), sliding_window=None,
    )


def _gemma2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    fields = _gemma_fields(hf)
    fields.update(
        activation=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        sandwich_norms=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
        final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
        sliding_window=hf.get("sliding_window"),
        layer_types=_layer_types(hf, 2),
    )
    return fields


def _gemma3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    fields = _gemma2_fields(hf)
    fields.update(layer_types=_layer_types(hf, 6), qk_norm=True)
    params = dict(hf.get("rope_parameters") or {})
    full = {**dict(params.get(FULL) or {}), **dict(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local = dict(params.get(SLIDING) or {})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    fields.update(rope=_rope_from_dict(full, hf), rope_local=_rope_from_dict(local, hf))
    return fields


def _phi3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    rope = {**dict(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConfigError(f"config key partial_rotary_factor={factor!r} of model_type 'phi3' is not supported (only 1.0)")
    return dict(qkv_bias=False, o_bias=False, mlp_bias=False)


def _mixtral_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    return dict(
        mlp="moe", num_experts=int(hf.get("num_local_experts", 8)),
        experts_per_token=int(hf.get("num_experts_per_tok", 2)), qkv_bias=False, o_bias=False, mlp_bias=False,
    )


def _int_if_whole(value: float | None) -> int | float | None:
    """transformers' strict Gemma configs want an int query_pre_attn_scalar."""
    return int(value) if value is not None and float(value).is_integer() else value


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


# Per-family overrides of the Llama-like fields, applied by `ModelConfig.from_hf`.
_FAMILY_FIELDS = {
    "gemma": _gemma_fields,
    "gemma2": _gemma2_fields,
    "gemma3_text": _gemma3_fields,
    "phi3": _phi3_fields,
    "mixtral": _mixtral_fields,
}


def _llama_like_fields(model_type: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    sliding = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        sliding = None
    qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation=hf.get("hidden_act", "silu"),
        rope=_rope_from_hf(hf),
        qkv_bias=qkv_bias,
        o_bias=model_type in ("llama", "qwen3") and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding,
    )


def _gpt2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise ConfigError(f"gpt2 option {flag}=True is not supported")
    if hf.get("scale_attn_weights") is False:
        raise ConfigError("gpt2 option scale_attn_weights=False is not supported")
    hidden = hf["n_embd"]
    heads = hf["n_head"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=hf["n_positions"],
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        norm="layer",
        positions="learned",
        mlp="plain",
        activation=hf.get("activation_function", "gelu_new"),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )
