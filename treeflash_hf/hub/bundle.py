"""`treeflash-hf bundle`: a TreeFlash model folder, a target that generates with TreeFlash by default.

Layout: the target's own files (weights, config, generation config, tokenizer; copied, or left untouched when the
folder is the target's own folder), `treeflash.json` (the drafter: a path relative to the folder, or a Hub id) and
`custom_generate/` (`bundle_generate.py` as `generate.py` and the engine modules, copied from this package).

    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)   # TreeFlash generate()
    model = AutoModelForCausalLM.from_pretrained(FOLDER)                           # the plain target

Writing is idempotent: re-running `bundle` on a folder refreshes `custom_generate/` and `treeflash.json` and copies
only target files that changed, so the bundled reference target (`reference_models/target/`, whose drafter is
`../drafter`) is refreshed in place without touching its weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..integrations.folder_generate import BUNDLE_FILE, drafter_reference
from .folders import weight_shapes, write_custom_generate

# what `bundle` writes itself, or leaves to `push` (the model card); never copied from the target
OWN_ENTRIES = ("README.md", "custom_generate", BUNDLE_FILE)
PROBE_TEXT = "def main():\n    return 0\n"


class BundleError(ValueError):
    """A target / drafter pair that cannot make a TreeFlash folder; the message says why and what to pass."""


def is_bundle(folder: str | Path) -> bool:
    return (Path(folder) / BUNDLE_FILE).is_file()


def model_dir(name: str | Path) -> Path:
    """A local folder for `name` (a folder, or a Hub id fetched into the Hugging Face cache)."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name)))


def check_pair_configs(target_dir: Path, drafter_dir: Path) -> None:
    """The drafter fits the target (layers, width, vocabulary), checked on meta-device models built from the two
    configs, so no weights are read."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import treeflash_hf  # noqa: F401  (registers the drafter config)

    from ..engine.validation import TreeFlashInputError, check_pair

    drafter_config = AutoConfig.from_pretrained(drafter_dir)
    if drafter_config.model_type != "treeflash_drafter":
        raise BundleError(f"{drafter_dir} is not a TreeFlash drafter (model_type {drafter_config.model_type!r}): "
                          "import a DFlash checkpoint with `treeflash-hf convert-dflash SRC DST` first.")
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target_dir), dtype=torch.float32)
        drafter = AutoModel.from_config(drafter_config, dtype=torch.float32)
    try:
        check_pair(target, drafter)
    except TreeFlashInputError as err:
        raise BundleError(f"The drafter {drafter_dir} does not fit the target {target_dir}: {err}") from err


def copy_model_files(source: Path, out: Path) -> None:
    """Copy the target's files (all but `OWN_ENTRIES` and hidden entries) into `out`; a file whose size and
    modification time already match is left alone, so a re-run does not copy the weights again."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.name in OWN_ENTRIES or entry.name.startswith("."):
            continue
        destination = out / entry.name
        if entry.is_dir():
            shutil.copytree(entry, destination, dirs_exist_ok=True)
            continue
        same = destination.exists() and destination.stat().st_size == entry.stat().st_size and int(
            destination.stat().st_mtime) == int(entry.stat().st_mtime)
        if not same:
            shutil.copy2(entry, destination)


def copy_tokenizer(source: Path, out: Path) -> None:
    """Copy the tokenizer of `source` into `out` byte for byte: the files its `save_pretrained` would write, taken
    from `source` where they exist there (a re-save would add loading arguments to `tokenizer_config.json`)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for written in AutoTokenizer.from_pretrained(source).save_pretrained(tmp):
            name = Path(written).name
            shutil.copy2(source / name if (source / name).is_file() else written, out / name)


def write_chat_template(template: str, out: Path) -> None:
    """Give the folder's tokenizer `template` as its chat template (`chat_template.jinja`, which transformers reads)."""
    from transformers import AutoTokenizer

    (out / "chat_template.jinja").write_text(template)
    if AutoTokenizer.from_pretrained(out).chat_template != template:
        raise BundleError(f"The tokenizer in {out} has a chat template of its own that overrides --chat-template: "
                          "edit its tokenizer_config.json instead.")


def check_tokenizer(folder: Path) -> None:
    """The folder must carry a tokenizer: without one, `AutoTokenizer` silently encodes everything to no tokens."""
    from transformers import AutoTokenizer

    try:
        ids = AutoTokenizer.from_pretrained(folder)(PROBE_TEXT)["input_ids"]
    except (OSError, ValueError) as err:
        raise BundleError(f"{folder} has no usable tokenizer ({err}): pass --tokenizer DIR.") from err
    if not ids:
        raise BundleError(f"{folder} has no tokenizer files (its tokenizer encodes text to nothing): pass "
                          "--tokenizer DIR.")


def write_bundle_code(out: Path, drafter_ref: str) -> None:
    """Write `custom_generate/` (the engine, generated from this package) and `treeflash.json` (the drafter reference)."""
    write_custom_generate(out, "folder_generate", BundleError)
    (out / BUNDLE_FILE).write_text(json.dumps({"drafter": drafter_ref}, indent=2) + "\n")


def default_drafter_ref(drafter: str, drafter_dir: Path, out: Path) -> str:
    """A local drafter is recorded by its path relative to the folder; a Hub drafter by its id."""
    if Path(drafter).is_dir():
        return Path(os.path.relpath(drafter_dir.resolve(), out.resolve())).as_posix()
    return str(drafter)


def check_drafter_ref(out: Path, drafter_dir: Path) -> None:
    """The recorded reference must resolve, and a local one must be the drafter that was checked."""
    try:
        resolved = drafter_reference(str(out))
    except OSError as err:
        raise BundleError(str(err)) from err
    if os.path.isdir(resolved):
        recorded = json.loads((Path(resolved) / "config.json").read_text())
        if recorded != json.loads((drafter_dir / "config.json").read_text()):
            raise BundleError(f"--drafter-ref resolves to {resolved}, which is not the drafter {drafter_dir}: record "
                              "the same drafter (or leave --drafter-ref out).")


def write_bundle(target: str | Path, drafter: str | Path, out: str | Path, drafter_ref: str | None = None,
                 tokenizer: str | Path | None = None, chat_template: str | Path | None = None) -> Path:
    """Write (or refresh) the TreeFlash model folder `out` for `target` and `drafter` (folders or Hub ids).

    `drafter_ref` is what the folder records (default: the drafter's path relative to `out`, or its Hub id);
    `tokenizer` a tokenizer to save into the folder when the target's own folder has none; `chat_template` a Jinja
    file to give the folder's tokenizer (chat endpoints such as `transformers serve`'s need one). Returns `out`.
    """
    target_dir, drafter_dir, out = model_dir(target), model_dir(drafter), Path(out)
    for folder in (target_dir, drafter_dir):
        if not (folder / "config.json").is_file():
            raise BundleError(f"{folder} has no config.json: pass a model folder (or a Hub id).")
    check_pair_configs(target_dir, drafter_dir)
    weight_shapes(target_dir, BundleError)
    if not (out.exists() and out.resolve() == target_dir.resolve()):
        copy_model_files(target_dir, out)
    if tokenizer is not None:
        copy_tokenizer(model_dir(tokenizer), out)
    if chat_template is not None:
        write_chat_template(Path(chat_template).read_text(), out)
    check_tokenizer(out)
    write_bundle_code(out, drafter_ref or default_drafter_ref(str(drafter), drafter_dir, out))
    check_drafter_ref(out, drafter_dir)
    return out


def run(args: argparse.Namespace) -> int:
    out = write_bundle(args.target, args.drafter, args.out, args.drafter_ref, args.tokenizer, args.chat_template)
    reference = json.loads((out / BUNDLE_FILE).read_text())["drafter"]
    print(f"wrote {out}: {args.target} generating with TreeFlash (drafter {reference}).\n"
          f"  AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)  # TreeFlash generate()\n"
          f"  transformers serve {out} --trust-remote-code")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bundle", help="Write a TreeFlash model folder: a target that generates with TreeFlash by default.")
    parser.add_argument("--target", required=True, help="the target model folder or Hub id")
    parser.add_argument("--drafter", required=True, help="its TreeFlash drafter: a folder or Hub id")
    parser.add_argument("--out", required=True, help="the folder to write (may be the target's own folder)")
    parser.add_argument("--drafter-ref", help="what the folder records as its drafter: a path relative to --out, or "
                                              "a Hub id (default: --drafter's relative path, or its Hub id)")
    parser.add_argument("--tokenizer", help="a tokenizer to save into the folder (default: the target's own)")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for the folder's tokenizer, "
                                                                "for targets whose tokenizer has none")
    parser.set_defaults(func=run)
