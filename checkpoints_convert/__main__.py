"""Command line: `python -m checkpoints_convert [--to-hf] SRC DST`."""

from __future__ import annotations

import argparse
import sys

from ssd_jax.errors import SsdJaxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face checkpoint to ssd_jax's format (orbax), or back with --to-hf.",
    )
    parser.add_argument("src", help="source directory (HF directory or hub id; with --to-hf an ssd_jax directory)")
    parser.add_argument("dst", help="destination directory (must not exist or be empty unless --overwrite)")
    parser.add_argument("--to-hf", action="store_true", help="write a Hugging Face directory instead")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype to write (default: float32, or the source's with --to-hf)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from checkpoints_convert.convert import hf_to_ssd, ssd_to_hf

    try:
        if args.to_hf:
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
