"""Tiny random Hugging Face checkpoints, one per supported family variant, saved locally."""

from __future__ import annotations

import os

FAMILY_CONFIGS = {
    # Llama 3 with rope_scaling type llama3 (original context short enough to bite) and GQA.
    "llama3": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0,
    ),
    # Llama 2 shape with MQA, tied embeddings and head_dim != hidden / heads.
    "llama_mqa_tied": dict(
        model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=80,
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    # Mistral with a sliding window shorter than the test sequences.
    "mistral": dict(
        model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
        sliding_window=6,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
        max_position_embeddings=256,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=128),
}

# The Gemma, Phi-3 and Mixtral families (tests/test_families.py), kept out of FAMILY_CONFIGS so the
# per-family parametrisation of test_parity.py does not grow; odd shapes on purpose.
NEW_FAMILY_CONFIGS = {
    # Gemma: MQA, head_dim 16 != 48 / 4, tied embeddings, GeGLU (tanh GELU), (1 + w) norms.
    "gemma": dict(
        model_type="gemma", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=96,
        max_position_embeddings=256, hidden_act="gelu_pytorch_tanh",
    ),
    # Gemma 2: sliding (window 5) / global layers, both soft-caps biting, query_pre_attn_scalar.
    "gemma2": dict(
        model_type="gemma2", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=96,
        max_position_embeddings=256, query_pre_attn_scalar=20, sliding_window=5,
        attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
    ),
    # Gemma 3: local (window 5, theta 10k) / global (theta 1e6, linear x4) layers, q/k norms.
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
        max_position_embeddings=256, query_pre_attn_scalar=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=4.0,
    ),
    # Phi-3: fused qkv_proj and gate_up_proj, GQA, a sliding window of 7.
    "phi3": dict(
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
        original_max_position_embeddings=256, sliding_window=7,
    ),
    # Mixtral: 4 experts top-2, head_dim 16 != 48 / 4.
    "mixtral": dict(
        model_type="mixtral", hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
    ),
}


def make_hf_model(family: str, directory: str, seed: int = 0, init_std: float = 0.15):
    """Saves a random `family` model (safetensors) to directory; returns the torch model (eval, fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict({**FAMILY_CONFIGS, **NEW_FAMILY_CONFIGS}[family])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, initializer_range=init_std, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms start at 1 / 0; perturb them so they are exercised
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.add_(0.05 * torch.randn_like(param))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return model
