"""EAGLE-3 checkpoints for tests: random ones written in the published layout, and a reference
forward of the published architecture in torch (written from the architecture, not from our
code), which a converted head must reproduce."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file


def layer_config(target_config, intermediate: int = 48, eps: float = 1e-5, theta: float = 5000.0) -> dict:
    """A one-layer Llama config.json dict as EAGLE-3's trainers write it, for target_config's
    width and vocabulary (its own norm eps and RoPE base, to show they are the head's)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target_config.hidden_size, "intermediate_size": intermediate,
            "num_attention_heads": target_config.num_heads, "num_key_value_heads": target_config.num_kv_heads,
            "head_dim": target_config.head_dim, "num_hidden_layers": 1, "rms_norm_eps": eps,
            "rope_theta": theta, "max_position_embeddings": 512, "vocab_size": target_config.vocab_size,
            "hidden_act": "silu", "tie_word_embeddings": False}


def random_eagle3_tensors(target_config, draft_ids, num_features: int = 3, seed: int = 0, scale: float = 0.3,
                          intermediate: int = 48) -> dict[str, np.ndarray]:
    """Random float32 tensors of an EAGLE-3 head (midlayer names), with d2t and t2d for the
    draft vocabulary draft_ids (target token ids, one per draft row)."""
    rng = np.random.default_rng(seed)
    d, v = target_config.hidden_size, target_config.vocab_size
    q, kv = target_config.num_heads * target_config.head_dim, target_config.num_kv_heads * target_config.head_dim
    shapes = {"fc.weight": (d, num_features * d), "midlayer.self_attn.q_proj.weight": (q, 2 * d),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * d), "midlayer.self_attn.v_proj.weight": (kv, 2 * d),
              "midlayer.self_attn.o_proj.weight": (d, q), "midlayer.mlp.gate_proj.weight": (intermediate, d),
              "midlayer.mlp.up_proj.weight": (intermediate, d), "midlayer.mlp.down_proj.weight": (d, intermediate),
              "lm_head.weight": (len(draft_ids), d)}
    tensors = {name: (scale * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    for name in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[name] = (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    ids = np.asarray(draft_ids, dtype=np.int64)
    tensors["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def write_eagle3(directory: str, config: dict, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def reference_logits(tensors: dict[str, np.ndarray], config: dict, features: np.ndarray, embeds: np.ndarray,
                     positions: np.ndarray) -> np.ndarray:
    """EAGLE-3's first draft step over T positions of one sequence, causal, no cache, in float64
    torch: features [T, K*D] (the target's hidden states, concatenated in fc's order), embeds
    [T, D] (the target's embeddings of the next tokens), positions int [T]. Returns the draft
    logits [T, Vd]."""
    import torch

    w = {k: torch.tensor(np.asarray(a, dtype=np.float64)) for k, a in tensors.items() if k not in ("d2t", "t2d")}
    eps, theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):   # x [T, H, hd]; the rotate-half convention of Llama
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)[:, None, :]
        rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
        return x * angles.cos() + rotated * angles.sin()

    t = features.shape[0]
    pos = torch.tensor(positions, dtype=torch.float64)
    hidden = torch.tensor(np.asarray(features, np.float64)) @ w["fc.weight"].T
    x = torch.cat([rms(torch.tensor(np.asarray(embeds, np.float64)), w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])], dim=-1)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, hd), pos)
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, hd), pos)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv_heads, hd)
    k, v = (a.repeat_interleave(heads // kv_heads, dim=1) for a in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    scores = scores.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * hd)
    hidden = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(hidden, w["midlayer.post_attention_layernorm.weight"])
    gate = m @ w["midlayer.mlp.gate_proj.weight"].T
    hidden = hidden + (torch.nn.functional.silu(gate) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"].T
    return (rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T).numpy()
