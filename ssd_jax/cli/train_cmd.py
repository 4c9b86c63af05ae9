"""`ssd-jax train` and `ssd-jax distill-draft`."""

from __future__ import annotations

import argparse

from ssd_jax.train.presets import PRESETS


def _add_training_arguments(parser: argparse.ArgumentParser, default_preset: str) -> None:
    parser.add_argument("--data", default=None,
                        help="directory of text/code files (default: this Python's standard library)")
    parser.add_argument("--out", required=True, help="output Hugging Face directory")
    parser.add_argument("--preset", default=default_preset, choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--hidden-size", type=int, default=None, help="override the preset's hidden size")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--intermediate-size", type=int, default=None, help="override the preset's MLP width")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="checkpoints for resuming (default: OUT.work)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="exported weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def _settings(args):
    from ssd_jax.train.trainer import TrainSettings

    return TrainSettings(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
    )


def _sizes(args) -> dict:
    return dict(hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size)


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a Llama language model on a text/code directory")
    _add_training_arguments(train, "target")
    train.add_argument("--vocab-size", type=int, default=4096, help="byte-level BPE vocabulary size")
    train.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    train.set_defaults(func=run_train)

    distill = subparsers.add_parser("distill-draft", help="distil a small draft model from a target")
    distill.add_argument("--target", required=True, help="target model directory (HF or converted)")
    _add_training_arguments(distill, "draft")
    distill.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    distill.set_defaults(func=run_distill)


def run_train(args) -> int:
    from ssd_jax.train.recipes import train_language_model

    out = train_language_model(
        args.out, data_dir=args.data, preset=args.preset, settings=_settings(args), vocab_size=args.vocab_size,
        tokenizer_path=args.tokenizer, workdir=args.workdir, export_dtype=args.dtype, overwrite=args.overwrite,
        **_sizes(args),
    )
    print(out)
    return 0


def run_distill(args) -> int:
    from ssd_jax.train.recipes import distill_draft

    out = distill_draft(
        args.target, args.out, data_dir=args.data, preset=args.preset, settings=_settings(args),
        temperature=args.temperature, workdir=args.workdir, export_dtype=args.dtype, overwrite=args.overwrite,
        **_sizes(args),
    )
    print(out)
    return 0
