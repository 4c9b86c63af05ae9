"""The embedded default model pair shipped inside the package (trained by
`python -m ssd_jax.train.default_pair`; see README "Embedded models")."""

from __future__ import annotations

import os

from ssd_jax.errors import CheckpointError
from ssd_jax.model import Model

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "models")
TARGET_DIR = os.path.join(ASSETS_DIR, "target")
DRAFT_DIR = os.path.join(ASSETS_DIR, "draft")


def default_model_dirs() -> tuple[str, str]:
    """(target directory, draft directory) of the shipped Hugging Face checkpoints."""
    for directory in (TARGET_DIR, DRAFT_DIR):
        if not os.path.exists(os.path.join(directory, "config.json")):
            raise CheckpointError(
                f"embedded model missing at {directory}; rebuild with `python -m ssd_jax.train.default_pair`"
            )
    return TARGET_DIR, DRAFT_DIR


def default_models(dtype: str = "float32") -> tuple[Model, Model]:
    """Loads the shipped (target, draft) pair: Llama models trained on the Python standard library
    with a shared 4096-token byte-level BPE tokenizer; the draft is distilled from the target."""
    from ssd_jax.loading import load

    target_dir, draft_dir = default_model_dirs()
    return load(target_dir, dtype=dtype), load(draft_dir, dtype=dtype)
