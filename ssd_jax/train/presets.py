"""Named model shapes: the embedded target/draft pair and small shapes for quick runs."""

from __future__ import annotations

from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig

# Sized to train on a small CPU in under an hour, with each draft's forward a small fraction of
# the model above it at batch 1: draft of the target, draft_small (the first drafter of a
# two-drafter cascade) of draft (`benchmarks/bench_model_costs.py`; docs/models.md).
PRESETS = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64),
    "draft": dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64),
    "draft_small": dict(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32),
}


def llama_config(preset: str, vocab_size: int, max_position_embeddings: int = 2048, eos_token_id: int = 0,
                 **overrides) -> ModelConfig:
    """A Llama ModelConfig of a named preset (tied embeddings), with field overrides."""
    if preset not in PRESETS:
        raise InputError(f"unknown model preset {preset!r}; available: {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(eos_token_id,), pad_token_id=1, **fields,
    )
