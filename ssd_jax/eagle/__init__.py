"""Feature-level draft heads (EAGLE-3 style): the head (`EagleHead`), its forwards, training and
checkpoints. A head reads the target's hidden states after named layers and reuses the
target's embedding, final norm and LM head."""

from ssd_jax.eagle.checkpoint import load_head, save_head
from ssd_jax.eagle.head import EagleHead, HeadConfig, default_feature_layers, init_head

__all__ = ["EagleHead", "HeadConfig", "default_feature_layers", "init_head", "load_head", "save_head"]
