"""Checkpoint conversion: Hugging Face safetensors <-> ssd_jax params (orbax).

    python -m checkpoints_convert SRC DST            # HF directory or hub id -> ours
    python -m checkpoints_convert --to-hf SRC DST    # ours -> HF directory
    python -m checkpoints_convert --eagle3 --target TARGET_DIR SRC DST   # EAGLE-3 head -> our head directory
    python -m checkpoints_convert --to-eagle3 SRC DST                   # and back
"""

from checkpoints_convert.convert import export_hf, hf_to_ssd, ssd_to_hf
from checkpoints_convert.eagle3 import convert_eagle3, eagle3_to_head, export_eagle3

__all__ = ["convert_eagle3", "eagle3_to_head", "export_eagle3", "export_hf", "hf_to_ssd", "ssd_to_hf"]
