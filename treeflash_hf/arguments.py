"""Argument types and shared options of the `treeflash-hf` commands (below `cli.py` and every command module)."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1."""
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be an integer >= 1")
    return number


def non_negative_int(value: str) -> int:
    """An argparse type: an integer >= 0."""
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be an integer >= 0")
    return number


def tree_budget(value: str) -> int | str:
    """An argparse type for `--tree-budget`: `"auto"` or an integer >= 1 (the budget counts the root)."""
    if value == "auto":
        return value
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: it must be \"auto\" or an integer >= 1 (the budget counts the root, so 1 "
            "means plain decoding)")
    return number


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def add_pair_argument(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """`--pair NAME`: the reference pair a command runs (see `treeflash_hf/pairs.py`)."""
    from .pairs import DEFAULT_PAIR, PAIRS

    parser.add_argument("--pair", choices=PAIRS, default=DEFAULT_PAIR,
                        help=f"the reference pair (default {DEFAULT_PAIR}; tiny: the small pair for fast tests)"
                        + help_suffix)


def add_target_quant_argument(parser: argparse.ArgumentParser) -> None:
    """`--target-quant SPEC`: quantize the target before running (see `treeflash_hf/quantize.py`)."""
    from .quantize import QUANT_SPECS

    parser.add_argument("--target-quant", choices=QUANT_SPECS, default="none", metavar="SPEC",
                        help=f"quantize the target, float32 compute: {', '.join(QUANT_SPECS)} (default none; needs "
                             "pip install treeflash-hf[quant])")
