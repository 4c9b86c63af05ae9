"""Decoder families, the KV cache and the parameter pytree."""

from ssd_jax.models.config import ModelConfig, RopeConfig
from ssd_jax.models.kv_cache import KVCache, commit, compact_path, init_cache, rollback
from ssd_jax.models.params import init_params, param_shapes
from ssd_jax.models.transformer import decode_step, forward_cached, forward_full

__all__ = [
    "KVCache", "ModelConfig", "RopeConfig", "commit", "compact_path", "decode_step", "forward_cached",
    "forward_full", "init_cache", "init_params", "param_shapes", "rollback",
]
