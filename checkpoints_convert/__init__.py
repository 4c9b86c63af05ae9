"""Checkpoint conversion: Hugging Face safetensors <-> ssd_jax params (orbax).

    python -m checkpoints_convert SRC DST            # HF directory or hub id -> ours
    python -m checkpoints_convert --to-hf SRC DST    # ours -> HF directory
"""

from checkpoints_convert.convert import export_hf, hf_to_ssd, ssd_to_hf

__all__ = ["export_hf", "hf_to_ssd", "ssd_to_hf"]
