"""The code corpus: Python files of this environment (the standard library, and site-packages without the packages
reserved for evaluation), split into training and held-out texts by a stable hash of their path."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from ..training.data import stable_split

# Packages reserved for evaluation: never in any training split (import names; attrs installs `attr` and `attrs`).
RESERVED_PACKAGES = ("networkx", "jsonschema", "click", "flask", "attr", "attrs", "jinja2", "docutils")


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file of this Python's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted((str(p.relative_to(root)), p) for p in files)


def site_package_files(include_reserved: bool = False) -> dict[str, list[tuple[str, Path]]]:
    """Per top-level package of this environment's site-packages, its .py files as (`site-packages/<relative
    path>`, path), sorted. The reserved evaluation packages are left out unless `include_reserved`."""
    root = Path(sysconfig.get_paths()["purelib"])
    packages: dict[str, list[tuple[str, Path]]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        top = relative.parts[0].removesuffix(".py")
        if top.endswith((".dist-info", ".egg-info", ".data")) or top.startswith(("_distutils_hack", "__")):
            continue
        if (top in RESERVED_PACKAGES) != include_reserved or not path.is_file():
            continue
        packages.setdefault(top, []).append((f"site-packages/{relative}", path))
    return packages


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def corpus_split(site_packages: bool = False, package_cap_mb: float = 8.0) -> dict[str, list[str]]:
    """Training texts: the standard library, plus (with `site_packages`) the Python files of the packages installed
    in this environment, the reserved evaluation packages excepted. Files are deduplicated by content (the first
    copy wins, standard library first), each package contributes at most `package_cap_mb` of text (files taken
    in stable-hash order, so one huge package cannot dominate), and every file goes to "train" or "heldout" by a
    stable hash of its path."""
    groups = [stdlib_files()]
    if site_packages:
        for files in site_package_files().values():
            ordered = sorted(files, key=lambda item: hashlib.sha1(item[0].encode()).hexdigest())
            groups.append(ordered)
    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    seen: set[str] = set()
    for index, files in enumerate(groups):
        budget = float("inf") if index == 0 else package_cap_mb * 1e6
        for relative, path in files:
            text = _read(path)
            if text is None or budget <= 0:
                continue
            digest = hashlib.sha1(text.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            budget -= len(text.encode())
            texts[stable_split(relative)].append(text)
    return texts


def reserved_package_texts() -> list[str]:
    """The installed reserved evaluation packages' .py files (code the reference models never saw)."""
    texts = []
    for files in site_package_files(include_reserved=True).values():
        texts.extend(t for _, path in files if (t := _read(path)) is not None)
    return texts
