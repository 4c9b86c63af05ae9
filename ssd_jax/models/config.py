"""`ModelConfig`: one frozen, hashable description of every supported decoder family.

Built from a Hugging Face `config.json` dict (`ModelConfig.from_hf`) and written back
(`ModelConfig.to_hf`). Being hashable, it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from ssd_jax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


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

    Attributes mirror the Hugging Face names where one exists. `norm` is "rms" or "layer";
    `positions` is "rope" or "learned"; `mlp` is "gated" (SwiGLU) or "plain" (fc -> act -> proj).
    `hf_json` keeps the original config.json text so a round trip writes it back unchanged.
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
            raise ConfigError(f"unsupported activation {self.activation!r}; supported: {', '.join(_ACTIVATIONS)}")

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
        per_layer = attn + mlp + 2 * d
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
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta/rope_scaling.
        out["rope_parameters"] = rope
        out["rope_theta"] = self.rope.theta
        out["rope_scaling"] = None if self.rope.rope_type == "default" else dict(rope, type=self.rope.rope_type)
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
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
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
