"""Argument types and the flags several `treeflash-hf` commands share, each defined once here (a command passes its
own default where it trains at its own scale)."""

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


def device_name(value: str) -> str:
    """An argparse type for `--device`: `cpu`, or a CUDA device torch sees here (`cuda`, `cuda:1`)."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{value} is not supported: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{value}: torch sees no CUDA device here (torch {torch.__version__}); run on a GPU machine with a CUDA "
            "build of torch, or leave --device out (cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{value}: torch sees {torch.cuda.device_count()} CUDA device(s) here")
    return value


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def add_pair_argument(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """`--pair NAME`: the reference pair a command runs (see `treeflash_hf/recipes/pairs.py`)."""
    from .recipes.pairs import DEFAULT_PAIR, PAIRS

    parser.add_argument("--pair", choices=PAIRS, default=DEFAULT_PAIR,
                        help=f"the reference pair (default {DEFAULT_PAIR}; tiny: the small pair for fast tests)"
                        + help_suffix)


def add_device_argument(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """`--device`: where a command runs its models (checked at parse time: a CUDA device must exist here)."""
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="where the models run: cpu (default), cuda, cuda:1, ..." + help_suffix)


def add_target_quant_argument(parser: argparse.ArgumentParser) -> None:
    """`--target-quant SPEC`: quantize the target before running (see `treeflash_hf/integrations/quantize.py`)."""
    from .integrations.quantize import QUANT_SPECS

    parser.add_argument("--target-quant", choices=QUANT_SPECS, default="none", metavar="SPEC",
                        help=f"quantize the target, float32 compute: {', '.join(QUANT_SPECS)} (default none; needs "
                             "pip install treeflash-hf[quant])")


def add_drafter_arguments(parser: argparse.ArgumentParser, drafter_layers: int, num_anchors: int) -> None:
    """`--drafter-layers`, `--num-anchors`, `--layer-init`, `--decay`, `--ce-weight`: the shape and initialisation of
    a new drafter, the blocks its training samples and its loss."""
    parser.add_argument("--drafter-layers", type=positive_int, default=drafter_layers,
                        help=f"decoder layers of a new drafter (default {drafter_layers})")
    parser.add_argument("--num-anchors", type=positive_int, default=num_anchors,
                        help=f"blocks sampled per training sequence, each drafted from one anchor (default {num_anchors})")
    parser.add_argument("--layer-init", choices=("random", "target"), default="random",
                        help="a new drafter's decoder layers: random (default), or copies of the target's last "
                             "--drafter-layers decoder layers (and its final norm)")
    parser.add_argument("--decay", type=float, default=7.0,
                        help="slot weights exp(-(k-1)/decay) of the loss: a smaller decay favours the first slots "
                             "(default 7)")
    parser.add_argument("--ce-weight", type=float, default=0.0,
                        help="mix of cross-entropy to the data token in the loss, the rest forward KL to the target "
                             "(default 0)")


def add_optimizer_arguments(parser: argparse.ArgumentParser, lr: float, batch_size: int, seq_len: int,
                            continued_lr: float | None = None) -> None:
    """`--lr`, `--batch-size`, `--seq-len`: the optimisation a training command runs. `continued_lr`: the default
    when the command continues a trained model (`--lr` is then None until the command resolves it)."""
    lr_help = f"peak learning rate (default {lr:g}"
    lr_help += f"; {continued_lr:g} when continuing a trained drafter, --init)" if continued_lr else ")"
    parser.add_argument("--lr", type=float, default=None if continued_lr else lr, help=lr_help)
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help=f"sequences per step over all processes together (default {batch_size})")
    parser.add_argument("--seq-len", type=positive_int, default=seq_len,
                        help=f"tokens per training sequence (default {seq_len})")
