"""The decoding knobs (`tree_mode`, `tree_budget`, `tree_top_m`, `tree_top_k`, `tree_lookup`) and their
validation."""

from __future__ import annotations

from dataclasses import dataclass, fields

TREE_MODES = ("chain", "marginal_tree", "treeflash")
OPTION_NAMES = ("tree_mode", "tree_budget", "tree_top_m", "tree_top_k", "tree_lookup")


@dataclass(frozen=True)
class TreeOptions:
    """tree_mode: `"chain"` (DFlash), `"marginal_tree"` (DDTree) or `"treeflash"`.
    tree_budget: tokens the target verifies per step, **including the root** (1 = plain decoding), or
        `"auto"`: chosen per step from the target's measured verification cost on this device.
    tree_top_m: M, tokens per depth of the stage-1 top tree (each gets an AR row).
    tree_top_k: K, children kept per (depth, previous token).
    tree_lookup: length of the lookup branch (the tokens that followed the last occurrence of the sequence's
        ending, see `lookup.py`) offered to the best-first search; 0 turns it off. Tree modes only."""

    tree_mode: str = "treeflash"
    tree_budget: int | str = 64
    tree_top_m: int = 16
    tree_top_k: int = 16
    tree_lookup: int = 0

    def __post_init__(self) -> None:
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"tree_mode={self.tree_mode!r} is not a TreeFlash mode: use one of {TREE_MODES}.")
        for name in ("tree_budget", "tree_top_m", "tree_top_k", "tree_lookup"):
            value = getattr(self, name)
            if name == "tree_budget" and value == "auto":
                continue
            least = 0 if name == "tree_lookup" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"{name}={value!r} is invalid: it must be an integer >= {least}"
                    + (" or \"auto\" (the budget counts the root, so 1 means plain decoding)."
                       if name == "tree_budget" else ".")
                )
        if self.tree_lookup and self.tree_mode == "chain":
            raise ValueError(
                f"tree_lookup={self.tree_lookup} needs a tree to add the lookup branch to: use "
                "tree_mode='treeflash' or 'marginal_tree', or tree_lookup=0 with tree_mode='chain'."
            )

    @classmethod
    def resolve(cls, drafter, overrides: dict) -> "TreeOptions":
        """Defaults from the drafter's `generation_config` (then its config), overridden by `overrides`."""
        values = {}
        generation_config = getattr(drafter, "generation_config", None)
        for field in fields(cls):
            value = getattr(generation_config, field.name, None)
            if value is None:
                value = getattr(drafter.config, field.name, None)
            if overrides.get(field.name) is not None:
                value = overrides[field.name]
            if value is not None:
                values[field.name] = value
        if values.get("tree_mode") == "chain" and overrides.get("tree_lookup") is None:
            values["tree_lookup"] = 0  # a default lookup length does not apply to a chain; an explicit one errors
        return cls(**values)
