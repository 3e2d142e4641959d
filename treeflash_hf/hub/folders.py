"""The code a TreeFlash folder carries, generated from this package's own modules (never kept as committed copies).

- `custom_generate/` of a TreeFlash model folder or a published drafter repo: the entry module (`folder_generate` or
  `hub_generate` of `treeflash_hf.integrations`) as `generate.py`, plus every package module it imports, directly
  or not, flattened into one folder. transformers loads `custom_generate/` as a flat set of files with relative
  imports, so `from ..engine.tree import X` is written `from .tree import X`; only the engine and the integrations
  may travel (a module of another sub-package is refused: the folder would not load without the package).
- the drafter's model files (`modeling/`'s configuration and model modules): what `trust_remote_code=True` loads.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# sub-packages whose modules may travel in custom_generate/ (they import only torch and transformers)
TRAVELLING_PACKAGES = ("engine", "integrations")
MODEL_CODE_FILES = ("configuration_treeflash_drafter.py", "modeling_treeflash_drafter.py")
REQUIREMENTS = "torch\ntransformers>=5.24,<5.25\n"
RELATIVE_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from (?P<dots>\.+)(?P<module>[\w.]*) import (?P<names>\([^)]*\)|[^\n]*)",
                             re.M)


class FolderCodeError(ValueError):
    """A package module that cannot travel in a folder's `custom_generate/`."""


def module_path(package: str, module: str) -> Path:
    return PACKAGE_DIR / package / f"{module}.py"


def imported_modules(source: str, package: str) -> list[tuple[str, str]]:
    """(sub-package, module) of each package module `source` (a module of `package`) imports relatively."""
    found = []
    for match in RELATIVE_IMPORT.finditer(source):
        dots, module = len(match["dots"]), match["module"]
        if dots == 1 and module:
            found.append((package, module.split(".")[0]))
        elif dots == 1:  # from . import a, b
            names = match["names"].strip("()").replace("\n", " ").split(",")
            found.extend((package, name.split(" as ")[0].strip()) for name in names if name.strip())
        elif dots == 2 and "." in module:
            sub, leaf = module.split(".", 1)
            found.append((sub, leaf.split(".")[0]))
        elif dots == 2 and module:  # from ..engine import a, b
            names = match["names"].strip("()").replace("\n", " ").split(",")
            found.extend((module, name.split(" as ")[0].strip()) for name in names if name.strip())
        else:
            found.append(("", module or "."))
    return found


def flattened(source: str) -> str:
    """`source` with its imports of other travelling sub-packages written as imports from the same folder."""
    def rewrite(match: re.Match) -> str:
        package, _, leaf = match["module"].partition(".")
        if len(match["dots"]) == 2 and package in TRAVELLING_PACKAGES:
            return f"{match['indent']}from .{leaf} import {match['names']}"
        return match.group(0)

    return RELATIVE_IMPORT.sub(rewrite, source)


def custom_generate_files(entry: str) -> dict[str, str]:
    """`custom_generate/` file name -> text: `integrations/<entry>.py` as `generate.py` and, flattened, every package
    module it needs (followed through the relative imports of each)."""
    files: dict[str, str] = {}
    origin: dict[str, str] = {}
    pending = [("integrations", entry)]
    while pending:
        package, module = pending.pop()
        name = "generate.py" if (package, module) == ("integrations", entry) else f"{module}.py"
        if name in files:
            if origin[name] != f"{package}.{module}":
                raise FolderCodeError(f"custom_generate/ would hold two {name}: {origin[name]} and {package}.{module}; "
                                      "rename one of them.")
            continue
        if package not in TRAVELLING_PACKAGES or not module_path(package, module).is_file():
            raise FolderCodeError(f"{origin.get(name, entry)} imports {package or 'treeflash_hf'}.{module}, which cannot "
                                  f"travel in custom_generate/ (only {', '.join(TRAVELLING_PACKAGES)} modules do).")
        source = module_path(package, module).read_text()
        files[name], origin[name] = flattened(source), f"{package}.{module}"
        pending.extend(imported_modules(source, package))
    return dict(sorted(files.items()))


def write_custom_generate(folder: Path, entry: str, error: type[Exception] = ValueError) -> Path:
    """Write `folder/custom_generate/` for the entry module `entry` (see `custom_generate_files`) and its
    requirements. What was there is replaced, so a dropped module does not linger."""
    try:
        files = custom_generate_files(entry)
    except FolderCodeError as err:
        raise error(str(err)) from err
    generate_dir = Path(folder) / "custom_generate"
    if generate_dir.exists():
        shutil.rmtree(generate_dir)
    generate_dir.mkdir(parents=True)
    for name, text in files.items():
        (generate_dir / name).write_text(text)
    (generate_dir / "requirements.txt").write_text(REQUIREMENTS)
    return generate_dir


def model_code_files() -> dict[str, str]:
    """The drafter's model files (`trust_remote_code=True` loads them from a drafter folder): name -> text."""
    from .. import modeling

    folder = Path(modeling.__file__).resolve().parent
    return {name: (folder / name).read_text() for name in MODEL_CODE_FILES}


def write_model_code(folder: Path) -> None:
    for name, text in model_code_files().items():
        (Path(folder) / name).write_text(text)


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
