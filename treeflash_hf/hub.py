"""Publishing drafters: the repo layout `push` uploads (and `--dry-run` writes), model cards, the upload.

Layout: `config.json` (with `auto_map`), `model.safetensors` (sharded when large), `generation_config.json`
(tree defaults), the remote-code model files, `README.md` (model card) and `custom_generate/` (the engine
modules, copied from this package, plus `generate.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
CARD_TEMPLATE = PACKAGE_DIR.parent / "hub_cards" / "treeflash_drafter.md"
ENGINE_MODULES = ("accept", "budget", "cache", "draft", "generation", "learned", "lookup", "options", "tree",
                  "validation", "verify")
REQUIRED_CONFIG_FIELDS = ("model_type", "hidden_size", "vocab_size", "block_size", "mask_token_id",
                          "target_layer_ids", "num_target_layers", "auto_map")


class PublishError(ValueError):
    """A drafter folder that would not load from the Hub; the message says what is missing."""


def card_template_path() -> Path:
    if CARD_TEMPLATE.exists():
        return CARD_TEMPLATE
    return PACKAGE_DIR / "hub_cards" / "treeflash_drafter.md"  # installed (non-editable) copy


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
    drafter = AutoModel.from_pretrained(drafter_dir, dtype="auto")
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(out_dir, max_shard_size=max_shard_size)  # config + auto_map + remote code + weights
    drafter.generation_config.save_pretrained(out_dir)
    generate_dir = out_dir / "custom_generate"
    generate_dir.mkdir(exist_ok=True)
    for module in ENGINE_MODULES:
        shutil.copyfile(PACKAGE_DIR / f"{module}.py", generate_dir / f"{module}.py")
    shutil.copyfile(PACKAGE_DIR / "hub_generate.py", generate_dir / "generate.py")
    (generate_dir / "requirements.txt").write_text("torch\ntransformers>=5.24,<5.25\n")
    if (drafter_dir / "training_summary.json").exists():
        shutil.copyfile(drafter_dir / "training_summary.json", out_dir / "training_summary.json")
    base = base_model or drafter.config.to_dict().get("base_model") or "unknown"
    render_card(out_dir, repo_id, base, bench).save(out_dir / "README.md")
    check_publishable(out_dir)
    return out_dir


def check_publishable(folder: Path) -> None:
    """Refuse a folder that would not load: missing files or config fields, weights that do not match."""
    from safetensors import safe_open

    folder = Path(folder)
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
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise PublishError(f"{folder} has no safetensors weights.")
    from transformers import AutoConfig

    import treeflash_hf  # noqa: F401
    from .modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in
                    TreeFlashDrafterModel(AutoConfig.from_pretrained(folder)).state_dict().items()}
    found = {}
    for path in weight_files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                found[key] = tuple(handle.get_slice(key).get_shape())
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) or [k for k in expected if expected[k] != found.get(k)]
        raise PublishError(f"The weights in {folder} do not match its config (first differences: {wrong[:5]}).")


def push(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
         commit_message: str = "Upload TreeFlash drafter", token: str | None = None, api=None) -> str:
    """Create the repo if needed and upload `folder` (already checked) with `HfApi`. Returns the commit URL."""
    from huggingface_hub import HfApi

    check_publishable(folder)
    api = api or HfApi(token=token)
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                             commit_message=commit_message, repo_type="model")
    return str(getattr(info, "commit_url", info))


def run_push(args: argparse.Namespace) -> int:
    bench = json.loads(Path(args.bench_json).read_text()) if args.bench_json else None
    if args.dry_run:
        folder = prepare_repo(args.drafter_dir, args.dry_run, args.repo_id, args.base_model, bench)
        print(f"dry run: wrote {folder} (what would be uploaded to {args.repo_id}); nothing was uploaded")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare_repo(args.drafter_dir, tmp, args.repo_id, args.base_model, bench)
        print(push(folder, args.repo_id, args.private, args.revision, args.commit_message))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("push", help="Publish a drafter folder to the Hub (or --dry-run DIR).")
    parser.add_argument("drafter_dir")
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--base-model", help="the target's Hub id, for the card metadata")
    parser.add_argument("--bench-json", help="a `treeflash-hf bench --json` report for the card")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision")
    parser.add_argument("--commit-message", default="Upload TreeFlash drafter")
    parser.add_argument("--dry-run", metavar="DIR", help="write the repo folder locally; upload nothing")
    parser.set_defaults(func=run_push)
