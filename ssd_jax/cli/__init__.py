"""The `ssd-jax` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys

from ssd_jax.errors import SsdJaxError

# module name -> registers a subparser via `register(subparsers)` and sets `func`.
SUBCOMMAND_MODULES = ("ssd_jax.cli.generate_cmd", "ssd_jax.cli.train_cmd", "ssd_jax.cli.demo_cmd", "ssd_jax.cli.bigram_cmd")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="ssd-jax", description="Speculative decoding for JAX.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SsdJaxError as err:
        print(f"ssd-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
