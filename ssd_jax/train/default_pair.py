"""Rebuilds the embedded default models: `python -m ssd_jax.train.default_pair [--out DIR]`.

Trains the target on the Python standard library, distils the draft and the smaller draft_small
(the first drafter of a two-drafter cascade) from it, and writes all three as Hugging Face
directories (bf16 safetensors) under ssd_jax/assets/models. Resumable: rerun the same command
after an interruption. `--only-draft-small` rebuilds draft_small alone from the existing target.
The settings below are the ones the shipped models used.
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
# A step costs about as much as a draft step (the target's forward dominates). The narrower model
# takes a higher peak rate and more steps: it keeps gaining agreement with the target's argmax
# past the draft's step count (times and agreement: docs/models.md).
DRAFT_SMALL_SETTINGS = TrainSettings(steps=700, batch_size=16, seq_len=256, learning_rate=4e-3, warmup_steps=40,
                                     checkpoint_every=25, eval_every=150, seed=0)


def main(argv=None) -> int:
    from ssd_jax.train.recipes import distill_draft, train_language_model

    parser = argparse.ArgumentParser(prog="python -m ssd_jax.train.default_pair", description=__doc__)
    parser.add_argument("--out", default=ASSETS_DIR, help="directory receiving target/, draft/ and draft_small/")
    parser.add_argument("--workdir", default=os.path.join(os.getcwd(), ".default_pair_work"),
                        help="checkpoints and the tokenizer, for resuming")
    parser.add_argument("--skip-target", action="store_true", help="reuse an existing OUT/target")
    parser.add_argument("--only-draft-small", action="store_true",
                        help="only distil OUT/draft_small from the existing OUT/target (target and draft untouched)")
    args = parser.parse_args(argv)
    target_dir = os.path.join(args.out, "target")
    if not args.only_draft_small:
        if not args.skip_target:
            train_language_model(target_dir, preset="target", settings=TARGET_SETTINGS, vocab_size=4096,
                                 workdir=os.path.join(args.workdir, "target"), overwrite=True)
        distill_draft(target_dir, os.path.join(args.out, "draft"), preset="draft", settings=DRAFT_SETTINGS,
                      workdir=os.path.join(args.workdir, "draft"), overwrite=True)
    distill_draft(target_dir, os.path.join(args.out, "draft_small"), preset="draft_small",
                  settings=DRAFT_SMALL_SETTINGS, workdir=os.path.join(args.workdir, "draft_small"), overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
