"""`treeflash-hf convert-dflash SRC DST`: import a published DFlash drafter (z-lab format) or a TreeFlash
checkpoint in the authors' release format as a TreeFlash drafter.

z-lab DFlash: a Qwen3 config plus `block_size`, `num_target_layers` and `dflash_config: {mask_token_id,
target_layer_ids}`; weights `fc`, `hidden_norm`, `layers.*`, `norm`. The AR layer is added zero-initialised,
so the converted drafter drafts exactly what the DFlash checkpoint drafts.
TreeFlash release: the backbone under `model.`, the AR layer as `ar_approximation.{ug,d,norm}`, and a
`treeflash_config` dict in the config.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel
from ..training.drafter import AR_PREFIX


class ConversionError(ValueError):
    """A source checkpoint that is not in a known DFlash / TreeFlash format."""


def read_weights(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"No *.safetensors weights in {src}.")
    weights = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except Exception as err:
            raise ConversionError(f"{path} is not a readable safetensors file ({err}): it is truncated or corrupt; "
                                  "download the checkpoint again.") from err
    return weights


def convert_config(source: dict) -> tuple[TreeFlashDrafterConfig, str]:
    """Map a DFlash or TreeFlash-release config dict to ours; returns (config, source format name)."""
    dflash = source.get("dflash_config") or {}
    treeflash = source.get("treeflash_config") or {}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "block_size")
               if k not in source]
    if missing or ("mask_token_id" not in dflash and "mask_token_id" not in source):
        raise ConversionError(f"Not a DFlash drafter config: missing {missing or ['dflash_config.mask_token_id']}.")
    rope = source.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", source.get("rope_theta", 1_000_000.0))
    ar_type = treeflash.get("ar_approximation", "swiglu")
    config = TreeFlashDrafterConfig(
        vocab_size=source["vocab_size"], hidden_size=source["hidden_size"],
        intermediate_size=source.get("intermediate_size", 4 * source["hidden_size"]),
        num_hidden_layers=source["num_hidden_layers"], num_attention_heads=source["num_attention_heads"],
        num_key_value_heads=source.get("num_key_value_heads", source["num_attention_heads"]),
        head_dim=source.get("head_dim"), hidden_act=source.get("hidden_act", "silu"),
        max_position_embeddings=source.get("max_position_embeddings", 40960),
        rms_norm_eps=source.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        attention_bias=source.get("attention_bias", False), block_size=source["block_size"],
        mask_token_id=dflash.get("mask_token_id", source.get("mask_token_id")),
        num_target_layers=source.get("num_target_layers", 36),
        target_layer_ids=dflash.get("target_layer_ids", source.get("target_layer_ids")),
        ar_type=ar_type, ar_intermediate_size=treeflash.get("ar_intermediate_size"),
        tree_top_m=treeflash.get("top_m", 16), tree_top_k=treeflash.get("top_k", 16),
        tree_budget=treeflash.get("tree_size", 64),
    )
    return config, ("treeflash-release" if treeflash else "dflash")


def convert(src: str | Path, dst: str | Path | None = None) -> TreeFlashDrafterModel:
    """Load a DFlash / TreeFlash-release folder as a `TreeFlashDrafterModel` (saved to `dst` when given)."""
    src = Path(src)
    if not (src / "config.json").exists():
        raise ConversionError(f"No config.json in {src}.")
    config, source_format = convert_config(json.loads((src / "config.json").read_text()))
    weights = read_weights(src)
    if source_format == "treeflash-release" or any(k.startswith("model.") for k in weights):
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
    if "ar_approximation.ug.weight" in weights and config.ar_intermediate_size * 2 != weights[
            "ar_approximation.ug.weight"].shape[0]:
        config.ar_intermediate_size = weights["ar_approximation.ug.weight"].shape[0] // 2
    model = TreeFlashDrafterModel(config)
    expected = model.state_dict()
    unknown = sorted(set(weights) - set(expected))
    missing_backbone = sorted(k for k in set(expected) - set(weights) if not k.startswith(AR_PREFIX))
    if unknown or missing_backbone:
        raise ConversionError(f"Weights do not fit a DFlash drafter: unexpected {unknown[:5]}, "
                              f"missing {missing_backbone[:5]}.")
    for key, value in weights.items():
        if value.shape != expected[key].shape:
            raise ConversionError(f"{key}: shape {tuple(value.shape)} in the checkpoint, "
                                  f"{tuple(expected[key].shape)} from its config.")
    model.load_state_dict(weights, strict=False)  # a DFlash source leaves the AR layer zero-initialised
    dtype = next(iter(weights.values())).dtype
    model = model.to(dtype).eval()
    if dst is not None:
        model.save_pretrained(dst)
    return model


def run(args: argparse.Namespace) -> int:
    model = convert(args.src, args.dst)
    print(f"converted {args.src} -> {args.dst} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("convert-dflash", help="Import a DFlash (or TreeFlash release) checkpoint.")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.set_defaults(func=run)
