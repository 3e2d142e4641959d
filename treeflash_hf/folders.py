"""What a TreeFlash folder carries from this package: the engine modules copied into `custom_generate/`, and checks
on a folder's files. Below `hub.py` (publishing) and `bundle.py` (TreeFlash model folders), which both use it."""

from __future__ import annotations

import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ENGINE_MODULES = ("accept", "budget", "cache", "continuous_batching", "draft", "generation", "learned", "lookup",
                  "options", "sync", "tree", "validation", "verify")


def engine_sources(entry: str) -> dict[str, Path]:
    """`custom_generate/` file name -> the package file it copies: the engine modules, and `entry` as `generate.py`."""
    sources = {f"{module}.py": PACKAGE_DIR / f"{module}.py" for module in ENGINE_MODULES}
    sources["generate.py"] = PACKAGE_DIR / entry
    return sources


def write_custom_generate(folder: Path, entry: str, error: type[Exception] = ValueError) -> Path:
    """Write `folder/custom_generate/`: this package's engine modules copied file for file, the package module
    `entry` as `generate.py`, and the requirements. What was there is replaced, so a dropped module does not linger."""
    generate_dir = Path(folder) / "custom_generate"
    if generate_dir.exists():
        shutil.rmtree(generate_dir)
    generate_dir.mkdir(parents=True)
    for name, source in engine_sources(entry).items():
        shutil.copyfile(source, generate_dir / name)
    (generate_dir / "requirements.txt").write_text("torch\ntransformers>=5.24,<5.25\n")
    missing = missing_relative_imports(generate_dir)
    if missing:  # transformers would then skip custom_generate/ without a word, leaving the plain model
        raise error(f"The engine imports modules that custom_generate/ lacks: {missing}. Add them to "
                           "ENGINE_MODULES in treeflash_hf/hub.py.")
    return generate_dir


def missing_relative_imports(folder: Path) -> list[str]:
    """Modules that the `.py` files of `folder` import relatively (`from .x import y`) but that `folder` lacks."""
    from transformers.dynamic_module_utils import get_relative_imports

    return sorted({name for path in Path(folder).glob("*.py") for name in get_relative_imports(path)
                   if not (Path(folder) / f"{name}.py").exists()})


def weight_shapes(folder: Path, error: type[Exception] = ValueError) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the folder's `*.safetensors` files, read from their headers; a truncated or
    corrupt file raises `error` naming it."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as err:  # safetensors raises its own SafetensorError
            raise error(f"{path} is not a readable safetensors file ({err}): it is truncated or corrupt; "
                        "re-save or re-download it.") from err
    return shapes


