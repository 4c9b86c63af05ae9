"""Command line: `python -m checkpoints_convert [--to-hf] SRC DST`, and for EAGLE-3 heads
`python -m checkpoints_convert --eagle3 --target TARGET_DIR SRC DST` (and `--to-eagle3` back)."""

from __future__ import annotations

import argparse
import sys

from ssd_jax.errors import SsdJaxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face checkpoint to ssd_jax's format (orbax), or back with --to-hf; or an "
                    "EAGLE-3 head to an ssd_jax head directory (--eagle3 --target TARGET_DIR), or back (--to-eagle3).",
    )
    parser.add_argument("src", help="source directory (HF directory or hub id; with --to-hf an ssd_jax directory)")
    parser.add_argument("dst", help="destination directory (must not exist or be empty unless --overwrite)")
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--to-hf", action="store_true", help="write a Hugging Face directory instead")
    direction.add_argument("--eagle3", action="store_true",
                           help="SRC is an EAGLE-3 head checkpoint: write an ssd_jax head directory (needs --target)")
    direction.add_argument("--to-eagle3", action="store_true",
                           help="SRC is an ssd_jax head directory of style eagle3: write an EAGLE-3 checkpoint")
    parser.add_argument("--target", default=None, help="with --eagle3: the target model's directory (its config.json)")
    parser.add_argument("--feature-layers", default=None,
                        help="with --eagle3: comma-separated target layers whose outputs the head reads, in the "
                             "order of its fc input (default: from the checkpoint, else EAGLE-3's default)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype to write (default: float32, or the source's with --to-hf)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from checkpoints_convert.convert import hf_to_ssd, ssd_to_hf
    from checkpoints_convert.eagle3 import convert_eagle3, export_eagle3
    from ssd_jax.eagle import load_head
    from ssd_jax.errors import InputError

    try:
        if args.eagle3:
            if args.target is None:
                raise InputError("--eagle3 needs --target TARGET_DIR (the model the head drafts for)")
            layers = None
            if args.feature_layers is not None:
                try:
                    layers = tuple(int(i) for i in args.feature_layers.split(","))
                except ValueError:
                    raise InputError(f"--feature-layers takes comma-separated integers, got "
                                     f"{args.feature_layers!r}") from None
            out = convert_eagle3(args.src, args.dst, args.target, feature_layers=layers, dtype=args.dtype,
                                 overwrite=args.overwrite)
        elif args.to_eagle3:
            out = export_eagle3(load_head(args.src, dtype=args.dtype), args.dst, overwrite=args.overwrite)
        elif args.to_hf:
            out = ssd_to_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
        else:
            out = hf_to_ssd(args.src, args.dst, dtype=args.dtype or "float32", overwrite=args.overwrite)
    except SsdJaxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
