"""The embedded default models shipped inside the package (trained by
`python -m ssd_jax.train.default_pair`; see README "Embedded models"): the (target, draft) pair
and draft_small, a cheaper draft for the first stage of a two-drafter cascade."""

from __future__ import annotations

import os

from ssd_jax.errors import CheckpointError
from ssd_jax.model import Model

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "models")
TARGET_DIR = os.path.join(ASSETS_DIR, "target")
DRAFT_DIR = os.path.join(ASSETS_DIR, "draft")
DRAFT_SMALL_DIR = os.path.join(ASSETS_DIR, "draft_small")


def _require(directory: str, rebuild: str) -> None:
    if not os.path.exists(os.path.join(directory, "config.json")):
        raise CheckpointError(f"embedded model missing at {directory}; rebuild with `{rebuild}`")


def default_model_dirs() -> tuple[str, str]:
    """(target directory, draft directory) of the shipped Hugging Face checkpoints."""
    for directory in (TARGET_DIR, DRAFT_DIR):
        _require(directory, "python -m ssd_jax.train.default_pair")
    return TARGET_DIR, DRAFT_DIR


def default_models(dtype: str | None = None, *, mesh=None, rules=None) -> tuple[Model, Model]:
    """Loads the shipped (target, draft) pair: Llama models trained on the Python standard library
    with a shared 4096-token byte-level BPE tokenizer; the draft is distilled from the target.
    dtype: as in `ssd_jax.load` (None: the backend policy's, float32 on CPU); mesh, rules: both
    models sharded on that mesh (see `ssd_jax.shard`; the target's 6 heads and the draft's 2 need a
    "model" axis of size 1 or 2)."""
    from ssd_jax.loading import load

    target_dir, draft_dir = default_model_dirs()
    return load(target_dir, dtype=dtype, mesh=mesh, rules=rules), load(draft_dir, dtype=dtype, mesh=mesh, rules=rules)


def default_small_draft(dtype: str | None = None) -> Model:
    """Loads the shipped draft_small: a one-layer Llama distilled from the embedded target like the
    draft (same tokenizer), a few times cheaper per forward than the draft at batch 1; meant to
    draft for the draft in a two-drafter cascade."""
    from ssd_jax.loading import load

    _require(DRAFT_SMALL_DIR, "python -m ssd_jax.train.default_pair --only-draft-small")
    return load(DRAFT_SMALL_DIR, dtype=dtype)
