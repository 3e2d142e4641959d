"""The `treeflash-hf` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeflash-hf", description="TreeFlash speculative decoding tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import ablate, bench, convert, demo, evaluate, hub, profile, reference
    from .training import cli as train_cli

    ablate.add_parser(sub)
    bench.add_parser(sub)
    convert.add_parser(sub)
    demo.add_parser(sub)
    evaluate.add_parser(sub)
    hub.add_parser(sub)
    train_cli.add_parser(sub)
    profile.add_parser(sub)
    reference.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
