"""Publishing drafters and TreeFlash model folders: the repo layout `push` uploads (and `--dry-run` writes), model
cards, the upload.

Drafter layout: `config.json` (with `auto_map`), `model.safetensors` (sharded when large), `generation_config.json`
(tree defaults), the remote-code model files, `README.md` (model card) and `custom_generate/` (the engine
modules, copied from this package, plus `generate.py`).
TreeFlash model folder (`treeflash-hf bundle`, see bundle.py): the target's files, `treeflash.json` (the drafter's
Hub id), `custom_generate/` and a model card saying what it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .folders import PACKAGE_DIR, weight_shapes
from .folders import write_custom_generate
CARD_TEMPLATES = {"drafter": "treeflash_drafter.md", "bundle": "treeflash_target.md"}
REQUIRED_CONFIG_FIELDS = ("model_type", "hidden_size", "vocab_size", "block_size", "mask_token_id",
                          "target_layer_ids", "num_target_layers", "auto_map")


class PublishError(ValueError):
    """A drafter or TreeFlash model folder that would not load from the Hub (or cannot reach it); the message says
    what is missing and what to do."""


def card_template_path(kind: str = "drafter") -> Path:
    source = PACKAGE_DIR.parent / "hub_cards" / CARD_TEMPLATES[kind]
    if source.exists():
        return source
    return PACKAGE_DIR / "hub_cards" / CARD_TEMPLATES[kind]  # installed (non-editable) copy


def eval_results(bench: dict, base_model: str) -> tuple[list, str]:
    """`EvalResult`s for the card metadata and a Markdown table, from a `treeflash-hf bench` JSON report."""
    from huggingface_hub import EvalResult

    rows = ["| method | budget | τ | tokens/s | speedup | identical |", "|---|---|---|---|---|---|"]
    results = []
    for label, row in bench["results"].items():
        rows.append(f"| {row['method']} | {row['budget'] or '-'} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | "
                    f"{row.get('speedup', float('nan')):.2f}x | {row.get('identical_to_autoregressive', '-')} |")
        if row["method"] in ("chain", "marginal_tree", "treeflash", "auto"):
            for metric, value in (("tau", row["tau"]), ("speedup", row.get("speedup"))):
                if value is None:
                    continue
                results.append(EvalResult(
                    task_type="text-generation", dataset_type=str(bench.get("prompts", "custom")),
                    dataset_name=str(bench.get("prompts", "custom")), metric_type=metric,
                    metric_name=f"{metric} ({label}, T={bench['temperature']})", metric_value=round(float(value), 4),
                ))
    note = (f"Measured with `treeflash-hf bench` ({bench.get('prompts')} prompts, {bench['max_new_tokens']} new "
            f"tokens, temperature {bench['temperature']}, device {bench['device']}), all methods side by side.")
    return results, note + "\n\n" + "\n".join(rows)


def render_card(drafter_dir: Path, repo_id: str, base_model: str, bench: dict | None = None,
                license: str = "apache-2.0"):
    """The model card (a `huggingface_hub.ModelCard`) for the drafter in `drafter_dir`."""
    from huggingface_hub import ModelCard, ModelCardData

    config = json.loads((drafter_dir / "config.json").read_text())
    results, eval_section = ([], "No benchmark was given when this card was rendered.")
    if bench is not None:
        results, eval_section = eval_results(bench, base_model)
    data = ModelCardData(
        base_model=base_model, library_name="transformers", license=license, pipeline_tag="text-generation",
        tags=["speculative-decoding", "treeflash", "dflash", "drafter"], model_name=repo_id.split("/")[-1],
        eval_results=results or None,
    )
    summary_path = drafter_dir / "training_summary.json"
    training = "No training summary was found next to the weights."
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        lines = []
        for stage, info in summary.items():
            if isinstance(info, dict) and "steps" in info:
                last = info["curve"][-1] if info.get("curve") else {}
                lines.append(f"- stage `{stage}`: {info['steps']} steps, {info.get('tokens', 0)} tokens, "
                             f"{info.get('minutes', 0):.1f} min; final loss {last.get('loss', float('nan')):.4f}")
        training = "\n".join(lines) or training
    return ModelCard.from_template(
        data, template_path=str(card_template_path()), repo_id=repo_id, base_model=base_model,
        num_layers=config["num_hidden_layers"], block_size=config["block_size"],
        target_layer_ids=config["target_layer_ids"], tree_mode=config.get("tree_mode"),
        tree_budget=config.get("tree_budget"), tree_top_m=config.get("tree_top_m"),
        tree_top_k=config.get("tree_top_k"), tree_lookup=config.get("tree_lookup", 0), training_section=training, eval_section=eval_section,
    )


def prepare_repo(drafter_dir: str | Path, out_dir: str | Path, repo_id: str, base_model: str | None = None,
                 bench: dict | None = None, max_shard_size: str = "2GB") -> Path:
    """Write, into `out_dir`, exactly the files `push` uploads."""
    from transformers import AutoModel

    import treeflash_hf  # noqa: F401  (registers the drafter class)

    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    check_model_folder(drafter_dir)
    drafter = AutoModel.from_pretrained(drafter_dir, dtype="auto")
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(out_dir, max_shard_size=max_shard_size)  # config + auto_map + remote code + weights
    drafter.generation_config.save_pretrained(out_dir)
    write_custom_generate(out_dir, "hub_generate", PublishError)
    if (drafter_dir / "training_summary.json").exists():
        shutil.copyfile(drafter_dir / "training_summary.json", out_dir / "training_summary.json")
    base = base_model or drafter.config.to_dict().get("base_model") or "unknown"
    render_card(out_dir, repo_id, base, bench).save(out_dir / "README.md")
    check_publishable(out_dir)
    return out_dir


def check_model_folder(folder: Path) -> None:
    """A folder with a config and readable weights (a truncated or corrupt weights file is named)."""
    if not (folder / "config.json").is_file():
        raise PublishError(f"{folder} is not a model folder (no config.json): pass the folder that holds the model.")
    weight_shapes(folder, PublishError)


def check_publishable(folder: Path) -> None:
    """Refuse a folder that would not load: missing files or config fields, weights that do not match."""
    from .bundle import is_bundle

    folder = Path(folder)
    if is_bundle(folder):
        check_bundle_publishable(folder)
        return
    missing = [name for name in ("config.json", "README.md", "generation_config.json",
                                 "modeling_treeflash_drafter.py", "configuration_treeflash_drafter.py",
                                 "custom_generate/generate.py") if not (folder / name).exists()]
    if missing:
        raise PublishError(f"{folder} cannot be published: missing {missing}. Write it with `treeflash-hf push "
                           "--dry-run DIR` (which renders the card and copies the code).")
    config = json.loads((folder / "config.json").read_text())
    absent = [f for f in REQUIRED_CONFIG_FIELDS if f not in config]
    if absent:
        raise PublishError(f"{folder}/config.json lacks {absent}: save the drafter with treeflash-hf's classes.")
    found = weight_shapes(folder, PublishError)
    if not found:
        raise PublishError(f"{folder} has no safetensors weights.")
    from transformers import AutoConfig

    import treeflash_hf  # noqa: F401
    from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in
                    TreeFlashDrafterModel(AutoConfig.from_pretrained(folder)).state_dict().items()}
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) or [k for k in expected if expected[k] != found.get(k)]
        raise PublishError(f"The weights in {folder} do not match its config (first differences: {wrong[:5]}).")


# ---- TreeFlash model folders (a target that generates with TreeFlash, see bundle.py) ---------------------------

def hub_drafter_ref(folder: Path, drafter_ref: str | None) -> str:
    """The drafter a published folder records: `drafter_ref`, else the folder's own record. It must be a Hub id: a
    Hub repo cannot reach a local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from ..integrations.folder_generate import BUNDLE_FILE

    reference = drafter_ref or json.loads((folder / BUNDLE_FILE).read_text())["drafter"]
    try:
        validate_repo_id(reference)
        hub_id = drafter_ref is not None or not (folder / reference).is_dir()
    except HFValidationError:
        hub_id = False
    if not hub_id:
        raise PublishError(
            f"The drafter of {folder} is the local path {reference!r}, which a Hub repo cannot reach: push the "
            "drafter first (`treeflash-hf push DRAFTER_DIR --repo-id ORG/DRAFTER`), then pass --drafter-ref "
            "ORG/DRAFTER.")
    return reference


def render_bundle_card(folder: Path, repo_id: str, base_model: str | None, drafter_ref: str,
                       bench: dict | None = None, license: str = "apache-2.0"):
    """The model card (a `huggingface_hub.ModelCard`) of a TreeFlash model folder."""
    from huggingface_hub import ModelCard, ModelCardData

    config = json.loads((folder / "config.json").read_text())
    results, eval_section = ([], "No benchmark was given when this card was rendered.")
    if bench is not None:
        results, eval_section = eval_results(bench, base_model or repo_id)
    data = ModelCardData(
        base_model=base_model, library_name="transformers", license=license, pipeline_tag="text-generation",
        tags=["speculative-decoding", "treeflash", "custom_generate"], model_name=repo_id.split("/")[-1],
        eval_results=results or None,
    )
    return ModelCard.from_template(
        data, template_path=str(card_template_path("bundle")), repo_id=repo_id,
        base_model=base_model or "the target", architecture=(config.get("architectures") or ["?"])[0],
        drafter=drafter_ref, eval_section=eval_section,
    )


def prepare_bundle_repo(folder: str | Path, out_dir: str | Path, repo_id: str, base_model: str | None = None,
                        bench: dict | None = None, drafter_ref: str | None = None) -> Path:
    """Write, into `out_dir`, exactly the files `push` uploads for the TreeFlash model folder `folder`: its target
    files, fresh `custom_generate/` code, `treeflash.json` naming the drafter's Hub id, and the card."""
    from .bundle import copy_model_files, write_bundle_code

    folder, out_dir = Path(folder), Path(out_dir)
    reference = hub_drafter_ref(folder, drafter_ref)
    weight_shapes(folder, PublishError)
    copy_model_files(folder, out_dir)
    write_bundle_code(out_dir, reference)
    render_bundle_card(out_dir, repo_id, base_model, reference, bench).save(out_dir / "README.md")
    check_publishable(out_dir)
    return out_dir


def check_bundle_publishable(folder: Path) -> None:
    """Refuse a TreeFlash model folder that would not load from the Hub: missing files, a drafter recorded as a local
    path, no tokenizer, weights whose shapes do not match the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .bundle import BundleError, check_tokenizer

    missing = [name for name in ("config.json", "README.md", "custom_generate/generate.py")
               if not (folder / name).exists()]
    if missing:
        raise PublishError(f"{folder} cannot be published: missing {missing}. Write it with `treeflash-hf push "
                           "FOLDER --dry-run DIR` (which renders the card and copies the code).")
    hub_drafter_ref(folder, None)
    try:
        check_tokenizer(folder)
    except BundleError as err:
        raise PublishError(str(err)) from err
    found = weight_shapes(folder, PublishError)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [k for k in found if k in expected and found[k] != expected[k]]
    if not found or wrong or not set(found) & set(expected):
        raise PublishError(f"The weights in {folder} do not match its config (first differences: "
                           f"{wrong[:5] or sorted(found)[:5]}).")


def push(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
         commit_message: str = "Upload TreeFlash drafter", token: str | None = None, api=None) -> str:
    """Create the repo if needed and upload `folder` (already checked) with `HfApi`. Returns the commit URL.
    Failures to reach the Hub or to authenticate raise `PublishError` saying what to do."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    check_publishable(folder)
    if api is None and (token or get_token()) is None:
        raise PublishError("No Hugging Face token: log in with `hf auth login` or set HF_TOKEN (or write the repo "
                           "locally with --dry-run DIR).")
    api = api or HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                 commit_message=commit_message, repo_type="model")
    except LocalTokenNotFoundError as err:
        raise PublishError(f"No Hugging Face token: log in with `hf auth login` or set HF_TOKEN ({err}).") from err
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        fix = ("check the token (`hf auth login` or HF_TOKEN) and that it may write to " + repo_id
               if status in (401, 403) else "check --repo-id and the token")
        raise PublishError(f"The Hub refused the upload to {repo_id} ({' '.join(str(err).split())}): {fix}.") from err
    except Exception as err:
        if not is_network_error(err):
            raise
        raise PublishError(f"Cannot reach the Hugging Face Hub ({type(err).__name__}: {err}): check the network "
                           "connection (and that HF_HUB_OFFLINE is unset), or write the repo locally with "
                           "--dry-run DIR.") from err
    return str(getattr(info, "commit_url", info))


def is_network_error(err: BaseException) -> bool:
    """A connection failure: Python's own, or one of the HTTP client huggingface_hub uses (httpx2, httpx)."""
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in ("TransportError", "TimeoutException") and cls.__module__.split(".")[0] in
               ("httpx", "httpx2") for cls in type(err).__mro__)


def run_push(args: argparse.Namespace) -> int:
    from .bundle import is_bundle

    folder = Path(args.folder)
    if not folder.is_dir():
        raise PublishError(f"{folder} is not a folder: pass a drafter folder or a TreeFlash model folder "
                           "(`treeflash-hf bundle`).")
    bench = json.loads(Path(args.bench_json).read_text()) if args.bench_json else None
    if is_bundle(folder):
        def prepare(out):
            return prepare_bundle_repo(folder, out, args.repo_id, args.base_model, bench, args.drafter_ref)
    elif args.drafter_ref:
        raise PublishError(f"--drafter-ref applies to TreeFlash model folders; {folder} is not one (no "
                           "treeflash.json).")
    else:
        def prepare(out):
            return prepare_repo(folder, out, args.repo_id, args.base_model, bench)
    if args.dry_run:
        written = prepare(args.dry_run)
        print(f"dry run: wrote {written} (what would be uploaded to {args.repo_id}); nothing was uploaded")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        print(push(prepare(tmp), args.repo_id, args.private, args.revision, args.commit_message))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "push", help="Publish a drafter folder or a TreeFlash model folder to the Hub (or --dry-run DIR).")
    parser.add_argument("folder", help="a drafter folder, or a TreeFlash model folder written by `bundle`")
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--base-model", help="the target's Hub id, for the card metadata")
    parser.add_argument("--drafter-ref", help="TreeFlash model folders: the drafter's Hub id to record (needed when "
                                              "the folder records a local path)")
    parser.add_argument("--bench-json", help="a `treeflash-hf bench --json` report for the card")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision")
    parser.add_argument("--commit-message", default="Upload TreeFlash model")
    parser.add_argument("--dry-run", metavar="DIR", help="write the repo folder locally; upload nothing")
    parser.set_defaults(func=run_push)
