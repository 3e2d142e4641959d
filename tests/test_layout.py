"""The package's layout rules: dependencies point one way (no import circles, function-level imports included), the
engine is a sub-package of its own, no tracked Python file is a byte copy of another, the README stays short."""

import ast
import hashlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "treeflash_hf"
# sub-package -> the sub-packages it may import (besides itself and the model files); the order of the layout
ALLOWED = {
    "engine": set(),
    "integrations": {"engine"},
    "training": {"engine", "optional"},
    "hub": {"engine", "integrations", "training"},
    "recipes": {"engine", "integrations", "training", "hub", "reference", "arguments", "optional"},
    "tools": {"engine", "integrations", "training", "hub", "recipes", "reference", "arguments", "optional"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["treeflash_hf", *parts])


def package_modules() -> dict[str, Path]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "reference_models" not in p.parts}
    modules.update({f"treeflash_hf.modeling.{p.stem}": p for p in (ROOT / "modeling").glob("*.py")})
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (top level and inside functions)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_import_circles():
    edges = graph()
    # a package's __init__ is imported with any of its modules: count its imports as theirs
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_dependencies_point_one_way():
    wrong = []
    for name, targets in graph().items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] not in ALLOWED:
            continue
        for target in targets:
            other = target.split(".")[1] if target.count(".") >= 1 else ""
            if other in (parts[1], "modeling") or target == "treeflash_hf":
                continue
            if other not in ALLOWED[parts[1]]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layout: " + ", ".join(sorted(wrong))


def test_engine_is_its_own_subpackage():
    engine = {p.stem for p in (PACKAGE / "engine").glob("*.py")}
    assert {"draft", "tree", "verify", "accept", "cache", "decode"} <= engine
    assert not any((PACKAGE / f"{stage}.py").exists() for stage in ("draft", "tree", "verify", "accept", "cache"))


def test_no_tracked_python_file_is_a_copy():
    try:
        tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    seen: dict[str, str] = {}
    copies = []
    for name in tracked.stdout.split():
        text = (ROOT / name).read_bytes()
        if not text.strip():
            continue  # empty __init__.py files
        digest = hashlib.sha256(text).hexdigest()
        if digest in seen:
            copies.append(f"{name} = {seen[digest]}")
        seen.setdefault(digest, name)
    assert not copies, f"byte copies of Python files are tracked: {copies}"


def test_readme_is_for_users():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move details into docs/"
