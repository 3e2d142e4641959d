"""`treeflash-hf convert-dflash SRC DST`: write a published drafter (a folder or a Hub id) as a TreeFlash drafter folder
in our layout.

The mapping itself lives with the model (`TreeFlashDrafterModel.from_pretrained`, which loads the published layouts
directly; `configuration_treeflash_drafter.published_config_dict` for the config):
- z-lab DFlash (and SpecForge / speculators exports in its layout): a Qwen3 config plus `block_size`,
  `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`, its RoPE (YaRN, llama3, ...) and
  per-layer sliding windows kept; weights `fc`, `hidden_norm`, `layers.*`, `norm`. The AR layer is added as the
  identity (zero `d`), so the drafter drafts exactly what the DFlash checkpoint drafts.
- The TreeFlash authors' release: the backbone under `model.`, the AR layer as `ar_approximation.{ug,d,norm}`, and
  `treeflash_config.{ar_approximation, candidate_tokens}` (top-level fallbacks; `ar_approximation` null = a plain DFlash
  drafter). A config that declares the AR layer over weights without it is refused, naming the missing keys.
Decoding defaults of a converted drafter are the publisher's (see the config module): the release's tree of
`candidate_tokens` nodes (64 when unnamed), top 16 per depth and 16 children per AR row, no lookup branch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..modeling.configuration_treeflash_drafter import checkpoint_layout
from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel


class ConversionError(ValueError):
    """A source checkpoint that is not in a known DFlash / TreeFlash format, or cannot be fetched."""


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


def check_weights(src: Path) -> None:
    """Every `*.safetensors` file of `src` has a readable header that fits the file (without reading the tensors)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"No *.safetensors weights in {src}.")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as err:
            raise ConversionError(f"{path} is not a readable safetensors file ({err}): it is truncated or corrupt; "
                                  "download the checkpoint again.") from err


def fetch(src: str | Path) -> Path:
    """A local folder as is; a Hub id downloaded (or found in the local cache) with huggingface_hub."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConversionError(f"{src} is a file, not a model folder: pass the folder that holds config.json.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(src))
    except HFValidationError:
        raise ConversionError(f"{src} is neither an existing folder nor a Hub model id (like org/name): check the "
                              "path.") from None
    try:
        return Path(snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors", "*.py", "*.md"]))
    except Exception as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConversionError(
            f"cannot download {src} from the Hugging Face Hub ({type(err).__name__}: {reason[:300]}): unset "
            "HF_HUB_OFFLINE and check the network, log in (`hf auth login`) for a gated or private repo, or download "
            f"it elsewhere with `huggingface-cli download {src} --local-dir DIR` and pass DIR.") from err


def convert(src: str | Path, dst: str | Path | None = None) -> TreeFlashDrafterModel:
    """Load a DFlash / TreeFlash-release drafter (a folder or a Hub id) as a `TreeFlashDrafterModel` in its
    checkpoint's dtype, saved to `dst` in our layout when given."""
    folder = fetch(src)
    if not (folder / "config.json").exists():
        raise ConversionError(f"No config.json in {src}.")
    import json

    source = json.loads((folder / "config.json").read_text())
    if checkpoint_layout(source) is None:
        kind = "is already a TreeFlash drafter" if source.get("model_type") == "treeflash_drafter" else (
            "has no dflash_config or treeflash_config")
        raise ConversionError(f"Not a DFlash drafter config: {folder / 'config.json'} {kind}.")
    check_weights(folder)  # a truncated or corrupt file gets its own clear error
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype="auto").eval()
    if dst is not None:
        model.save_pretrained(dst)
    return model


def run(args: argparse.Namespace) -> int:
    model = convert(args.src, args.dst)
    print(f"converted {args.src} -> {args.dst} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{model.config.tree_mode} tree of {model.config.tree_budget} tokens by default)")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert-dflash", help="Write a published DFlash (z-lab) or TreeFlash-release drafter as a TreeFlash drafter "
                               "folder (SRC: a folder or a Hub id).")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.set_defaults(func=run)
