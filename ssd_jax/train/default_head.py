"""Rebuilds the embedded feature-level head: `python -m ssd_jax.train.default_head [--out DIR]`.

Trains an EAGLE-3 style head (`ssd_jax.eagle`) for the embedded target on the Python standard
library and writes it to ssd_jax/assets/models/eagle_head (float32 safetensors, its config and
training report). Resumable: rerun the same command after an interruption. The settings below
are the ones the shipped head used (times and acceptance: docs/models.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from ssd_jax.defaults import ASSETS_DIR, TARGET_DIR
from ssd_jax.train.trainer import TrainSettings

# The target's forward over each batch costs more than the head's training-time test; a narrower
# MLP than the target's (1024) keeps the shipped head small.
HEAD_SETTINGS = TrainSettings(steps=1200, batch_size=8, seq_len=128, learning_rate=2e-3, warmup_steps=50,
                              checkpoint_every=100, eval_every=300, seed=0)
HEAD_INTERMEDIATE_SIZE = 512
HEAD_PASSES = 4


def main(argv=None) -> int:
    from ssd_jax.eagle.training import train_head
    from ssd_jax.loading import load

    parser = argparse.ArgumentParser(prog="python -m ssd_jax.train.default_head", description=__doc__)
    parser.add_argument("--out", default=os.path.join(ASSETS_DIR, "eagle_head"), help="the head's directory")
    parser.add_argument("--workdir", default=os.path.join(os.getcwd(), ".default_head_work"),
                        help="orbax checkpoints, for resuming")
    parser.add_argument("--steps", type=int, default=HEAD_SETTINGS.steps)
    args = parser.parse_args(argv)
    settings = TrainSettings(**dict(HEAD_SETTINGS.__dict__, steps=args.steps))
    train_head(load(TARGET_DIR, dtype="float32"), args.out, settings=settings,
               intermediate_size=HEAD_INTERMEDIATE_SIZE, passes=HEAD_PASSES, workdir=args.workdir, overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
