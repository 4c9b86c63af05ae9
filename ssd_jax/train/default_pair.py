"""Rebuilds the embedded default pair: `python -m ssd_jax.train.default_pair [--out DIR]`.

Trains the target on the Python standard library, distils the draft from it, and writes both
as Hugging Face directories (bf16 safetensors) under ssd_jax/assets/models. Resumable: rerun
the same command after an interruption. The settings below are the ones the shipped pair used.
"""

from __future__ import annotations

import argparse
import os
import sys

from ssd_jax.defaults import ASSETS_DIR
from ssd_jax.train.trainer import TrainSettings

TARGET_SETTINGS = TrainSettings(steps=450, batch_size=16, seq_len=256, learning_rate=2e-3, warmup_steps=40,
                                checkpoint_every=25, eval_every=150, seed=0)
DRAFT_SETTINGS = TrainSettings(steps=300, batch_size=16, seq_len=256, learning_rate=3e-3, warmup_steps=30,
                               checkpoint_every=25, eval_every=100, seed=0)


def main(argv=None) -> int:
    from ssd_jax.train.recipes import distill_draft, train_language_model

    parser = argparse.ArgumentParser(prog="python -m ssd_jax.train.default_pair", description=__doc__)
    parser.add_argument("--out", default=ASSETS_DIR, help="directory receiving target/ and draft/")
    parser.add_argument("--workdir", default=os.path.join(os.getcwd(), ".default_pair_work"),
                        help="checkpoints and the tokenizer, for resuming")
    parser.add_argument("--skip-target", action="store_true", help="reuse an existing OUT/target")
    args = parser.parse_args(argv)
    target_dir = os.path.join(args.out, "target")
    if not args.skip_target:
        train_language_model(target_dir, preset="target", settings=TARGET_SETTINGS, vocab_size=4096,
                             workdir=os.path.join(args.workdir, "target"), overwrite=True)
    distill_draft(target_dir, os.path.join(args.out, "draft"), preset="draft", settings=DRAFT_SETTINGS,
                  workdir=os.path.join(args.workdir, "draft"), overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
