"""`ssd-jax train`, `ssd-jax distill-draft` and `ssd-jax train-head`."""

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
    _add_optimiser_arguments(parser, steps=1000, batch_size=16, seq_len=256, lr=1e-3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="exported weights")


def _add_optimiser_arguments(parser: argparse.ArgumentParser, *, steps: int, batch_size: int, seq_len: int,
                             lr: float) -> None:
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="checkpoints for resuming (default: OUT.work)")
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

    head = subparsers.add_parser("train-head", help="train a feature-level draft head (EAGLE-3 style) for a target")
    head.add_argument("--target", default=None, help="target model directory (default: the embedded target)")
    head.add_argument("--data", default=None,
                      help="directory of text/code files (default: this Python's standard library)")
    head.add_argument("--out", required=True, help="output head directory")
    head.add_argument("--feature-layers", default=None,
                      help="comma-separated target layer indices the head reads (default: a low, a middle and "
                           "the last layer)")
    head.add_argument("--intermediate-size", type=int, default=None, help="the head layer's MLP width "
                      "(default: the target's)")
    head.add_argument("--passes", type=int, default=4, help="draft depths trained at once (training-time test)")
    head.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    _add_optimiser_arguments(head, steps=600, batch_size=8, seq_len=128, lr=2e-3)
    head.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="saved weights")
    head.set_defaults(func=run_train_head)


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


def run_train_head(args) -> int:
    from ssd_jax.defaults import TARGET_DIR
    from ssd_jax.eagle.training import train_head
    from ssd_jax.errors import InputError
    from ssd_jax.loading import load

    layers = None
    if args.feature_layers is not None:
        try:
            layers = tuple(int(i) for i in args.feature_layers.split(","))
        except ValueError:
            raise InputError(f"--feature-layers takes comma-separated integers, got {args.feature_layers!r}") from None
    head = train_head(load(args.target or TARGET_DIR, dtype="float32"), args.out, data_dir=args.data,
                      settings=_settings(args), feature_layers=layers, intermediate_size=args.intermediate_size,
                      passes=args.passes, temperature=args.temperature, workdir=args.workdir,
                      export_dtype=args.dtype, overwrite=args.overwrite)
    print(head.path)
    return 0
