"""The embedded default models shipped inside the package (trained by
`python -m ssd_jax.train.default_pair`; see docs/models.md): the target and two drafts distilled
from it, `draft_small` (one layer; the default) and `draft` (two layers, wider; the second stage
of a two-drafter cascade)."""

from __future__ import annotations

import os

from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.model import Model

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "models")
TARGET_DIR = os.path.join(ASSETS_DIR, "target")
DRAFT_DIR = os.path.join(ASSETS_DIR, "draft")
DRAFT_SMALL_DIR = os.path.join(ASSETS_DIR, "draft_small")
EAGLE_HEAD_DIR = os.path.join(ASSETS_DIR, "eagle_head")

# The draft `default_models()` pairs with the target: draft_small accepts nearly as much as the
# wider draft at a fraction of its forward's cost, so SD runs faster with it
# (`benchmarks/bench_default_draft.py`; docs/benchmarks.md, "The shipped draft").
DEFAULT_DRAFT = "draft_small"
_REBUILD = {"draft": "python -m ssd_jax.train.default_pair",
            "draft_small": "python -m ssd_jax.train.default_pair --only-draft-small"}


def _require(directory: str, rebuild: str) -> None:
    if not os.path.exists(os.path.join(directory, "config.json")):
        raise CheckpointError(f"embedded model missing at {directory}; rebuild with `{rebuild}`")


def shipped_draft_dir(name: str = DEFAULT_DRAFT) -> str:
    """Directory of the shipped draft called `name` ("draft_small" or "draft")."""
    directories = {"draft": DRAFT_DIR, "draft_small": DRAFT_SMALL_DIR}
    if name not in directories:
        raise InputError(f"draft must be one of {sorted(directories)}, got {name!r}")
    _require(directories[name], _REBUILD[name])
    return directories[name]


def default_model_dirs(draft: str = DEFAULT_DRAFT) -> tuple[str, str]:
    """(target directory, draft directory) of the shipped Hugging Face checkpoints; `draft` names
    the shipped draft ("draft_small", the default, or "draft")."""
    draft_dir = shipped_draft_dir(draft)
    _require(TARGET_DIR, "python -m ssd_jax.train.default_pair")
    return TARGET_DIR, draft_dir


def default_models(dtype: str | None = None, *, draft: str = DEFAULT_DRAFT, mesh=None,
                   rules=None) -> tuple[Model, Model]:
    """Loads the shipped (target, draft) pair: Llama models trained on the Python standard library
    with a shared 4096-token byte-level BPE tokenizer; the drafts are distilled from the target.
    draft: which shipped draft ("draft_small": one layer, the fastest SD pair on the benchmarks;
    "draft": two wider layers, higher acceptance at a few times the cost per forward).
    dtype: as in `ssd_jax.load` (None: the backend policy's, float32 on CPU); mesh, rules: both
    models sharded on that mesh (see `ssd_jax.shard`; the target's 6 heads and the drafts' 2 need
    a "model" axis of size 1 or 2)."""
    from ssd_jax.loading import load

    target_dir, draft_dir = default_model_dirs(draft)
    return load(target_dir, dtype=dtype, mesh=mesh, rules=rules), load(draft_dir, dtype=dtype, mesh=mesh, rules=rules)


def shipped_draft(name: str = DEFAULT_DRAFT, dtype: str | None = None, *, mesh=None, rules=None) -> Model:
    """Loads one shipped draft by name ("draft_small" or "draft"), e.g. the other stage of a
    two-drafter cascade: `target, draft = default_models(draft="draft")` then
    `shipped_draft("draft_small")`."""
    from ssd_jax.loading import load

    return load(shipped_draft_dir(name), dtype=dtype, mesh=mesh, rules=rules)


def default_small_draft(dtype: str | None = None) -> Model:
    """Loads the shipped draft_small (same as `shipped_draft("draft_small", dtype)`)."""
    return shipped_draft("draft_small", dtype)


def default_eagle_head(dtype: str | None = None):
    """The shipped feature-level draft head (`ssd_jax.eagle.EagleHead`) of the embedded target,
    trained by `python -m ssd_jax.train.default_head` (docs/models.md); use it with
    `method=ssd_jax.EAGLE()`. dtype: as `default_models` (None: the backend policy's)."""
    from ssd_jax.backend import policy_for
    from ssd_jax.eagle.checkpoint import load_head

    if not os.path.exists(os.path.join(EAGLE_HEAD_DIR, "head_config.json")):
        raise CheckpointError(f"embedded head missing at {EAGLE_HEAD_DIR}; rebuild with "
                              f"`python -m ssd_jax.train.default_head`")
    return load_head(EAGLE_HEAD_DIR, dtype=dtype or policy_for(None).dtype)
