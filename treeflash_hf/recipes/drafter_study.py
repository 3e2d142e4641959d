"""`treeflash-hf reference drafter-study`: drafter designs compared at equal CPU time on one feature store.

Each variant is a new drafter trained by the recipe's own stages (`drafter_recipe.train_stage`) for the same
minutes on the same store (`reference train-drafter --stages windows features` builds it), with the same seed, so
the same batches and anchors at every step; what differs is the variant's one change to the recipe:

| variant | change |
|---|---|
| `baseline` | the recipe: 1 decoder layer, random initialisation, forward KL to the top-K teacher, slot decay 7 |
| `two_layers` | 2 decoder layers (about 1.5x the step's cost, so fewer steps in the same minutes) |
| `target_init` | the decoder layer starts as the target's last one (`--layer-init target`) |
| `ce` | 0.1 cross-entropy to the data token mixed into the loss |
| `decay4` | slot decay 4: the loss weights the first drafted slots more |
| `vocab<N>` | the baseline drafting from the N most frequent tokens of the work folder's draft vocabulary (a prefix of it) |
| `chat<N>` | the baseline on the first N chat training windows only (`--chat-windows`): a point of the data-scaling curve |

A variant trains stage `backbone` for `--minutes` (and stage `ar` for `--ar-minutes` after it, when > 0), then its
held-out metrics (the store's held-out windows: KL to the target, slot-1 top-1, the greedy acceptance proxy, i.e.
the expected leading slots whose argmax is the target's) are kept in `<work>/study/<variant>/result.json`. A
variant with a result is not trained again, so the study resumes variant by variant and a longer one can be added
later; `results.json`, a table and a plot of the held-out acceptance proxy against training minutes are written
after every variant. The minutes are wall-clock minutes: compare variants trained under the same load.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from ..arguments import add_device_argument, add_drafter_arguments, add_optimizer_arguments, positive_int
from ..optional import pyplot

# a variant's name -> its overrides of the recipe's arguments
VARIANTS = {
    "baseline": {},
    "two_layers": {"drafter_layers": 2},
    "target_init": {"layer_init": "target"},
    "ce": {"ce_weight": 0.1},
    "decay4": {"decay": 4.0},
}
# sized variants: `<prefix><N>` sets the argument to N
SIZED_VARIANTS = {"chat": "chat_windows", "vocab": "draft_vocab_size"}
METRICS = ("kl", "top1_slot1", "top1_mean", "accept_proxy")


def sized_variant(name: str) -> tuple[str, int] | None:
    """`(argument, N)` of a sized variant name (`chat560`, `vocab4096`), or None."""
    for prefix, argument in SIZED_VARIANTS.items():
        size = name[len(prefix):]
        if name.startswith(prefix) and size.isdigit() and int(size) > 0:
            return argument, int(size)
    return None


def variant_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The recipe's arguments for variant `name`."""
    overrides = dict([sized]) if (sized := sized_variant(name)) is not None else VARIANTS[name]
    variant = copy.copy(args)
    for key, value in overrides.items():
        setattr(variant, key, value)
    return variant


def train_variant(target, tokenizer, store_dir: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    """One variant: a new drafter through stage backbone (and ar), time-bounded; its summary and held-out metrics."""
    from .drafter_recipe import load_draft_vocab, load_stage, new_drafter, open_store, train_stage, uses_bfloat16

    drafter = new_drafter(target, args, tokenizer)
    token_ids = load_draft_vocab(Path(args.work))
    if args.draft_vocab_size is not None:
        if token_ids is None or args.draft_vocab_size > len(token_ids):
            raise SystemExit(f"error: a vocab{args.draft_vocab_size} variant drafts from a prefix of the work folder's "
                             f"draft vocabulary, which holds {0 if token_ids is None else len(token_ids)} tokens: "
                             "choose a smaller size, or a larger vocabulary with the recipe's vocab stage.")
        token_ids = token_ids[: args.draft_vocab_size]
    if token_ids is not None:
        drafter.set_draft_vocab(token_ids)
    store = open_store(store_dir, target, args, autocast=uses_bfloat16(args, target))
    result = {"drafter_layers": args.drafter_layers, "layer_init": args.layer_init, "decay": args.decay,
              "draft_vocab": None if token_ids is None else len(token_ids),
              "ce_weight": args.ce_weight, "chat_windows": store.chat_window_count,
              "chat_answer_tokens": store.chat_answer_tokens, "parameters": sum(p.numel() for p in drafter.parameters())}
    stages = [("backbone", args.minutes)] + ([("ar", args.ar_minutes)] if args.ar_minutes else [])
    for stage, minutes in stages:
        if stage == "ar":
            load_stage(drafter, run_dir / "backbone")
        summary = train_stage(stage, target, drafter, store, run_dir / stage, args, minutes)
        evaluated = [row for row in summary["curve"] if f"eval_{stage}_kl" in row]
        result[stage] = {"steps": summary["steps"], "minutes": round(summary["minutes"], 2),
                         **{metric: round(evaluated[-1][f"eval_{stage}_{metric}"], 4) for metric in METRICS},
                         "curve": [{"minutes": round(row["step"] / summary["steps"] * summary["minutes"], 2),
                                    **{metric: round(row[f"eval_{stage}_{metric}"], 4) for metric in METRICS}}
                                   for row in evaluated]}
    return result


def table(results: dict) -> str:
    """The variants side by side (markdown)."""
    lines = ["| variant | layers | init | decay | CE | draft vocabulary | chat windows (answer tokens) | stage | steps | "
             "minutes | held-out KL | slot-1 top-1 | accept proxy |", "|" + "---|" * 13]
    for name, result in results.items():
        for stage in ("backbone", "ar"):
            if stage in result:
                row = result[stage]
                lines.append(f"| {name} | {result['drafter_layers']} | {result['layer_init']} | {result['decay']:g} | "
                             f"{result['ce_weight']:g} | {result['draft_vocab'] or 'all'} | "
                             f"{result['chat_windows']:,} ({result['chat_answer_tokens']:,}) "
                             f"| {stage} | {row['steps']} | {row['minutes']:.1f} | {row['kl']:.3f} | "
                             f"{row['top1_slot1']:.3f} | {row['accept_proxy']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Held-out acceptance proxy against training minutes, one line per variant and stage."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        for stage, style in (("backbone", "-"), ("ar", "--")):
            if stage in result:
                curve = result[stage]["curve"]
                ax.plot([row["minutes"] for row in curve], [row["accept_proxy"] for row in curve], style,
                        marker="o", markersize=3, label=f"{name} ({stage})")
    ax.set_xlabel("training minutes (wall clock)")
    ax.set_ylabel("held-out acceptance proxy (greedy leading slots)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    from .drafter_recipe import load_target

    work = Path(args.work)
    store_dir = work / "features"
    if not (store_dir / "store.json").exists():
        raise SystemExit(f"error: {store_dir} holds no feature store: build one first with `treeflash-hf reference "
                         f"train-drafter --work {work} --stages windows features` (`--stages windows` for a study "
                         "with --online-features).")
    unknown = [name for name in args.variants if name not in VARIANTS and sized_variant(name) is None]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}, "
                         "vocab<N> (drafting from N tokens) or chat<N> (the baseline on N chat windows).")
    torch.set_num_threads(args.threads)
    args.target_quant = "none"
    target, tokenizer = load_target(args)
    study = work / "study"
    results_file = study / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name in args.variants:
        result_file = study / name / "result.json"
        if not result_file.exists():
            print(f"study: variant {name}", flush=True)
            result = train_variant(target, tokenizer, store_dir, study / name, variant_args(args, name))
            result_file.write_text(json.dumps(result, indent=2))
        results[name] = json.loads(result_file.read_text())
        results_file.write_text(json.dumps(results, indent=2))
        (study / "results.md").write_text(table(results))
        plot(results, study / "accept_proxy.png")
    print(table(results))
    return 0


def add_parser(subparsers) -> None:
    from .drafter_recipe import add_compute_dtype_argument, add_online_features_argument, add_shape_arguments

    parser = subparsers.add_parser("drafter-study", help="drafter designs compared at equal CPU time on one feature "
                                                         "store (resumable)")
    parser.add_argument("--work", default="reference_work/smollm2",
                        help="a `reference train-drafter` work folder with its feature store (default %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help=f"{', '.join(VARIANTS)}; vocab<N>: drafting from N tokens; chat<N>: the baseline on N "
                             "chat windows (default: the named variants)")
    parser.add_argument("--minutes", type=float, default=8, help="stage backbone's minutes per variant")
    parser.add_argument("--ar-minutes", type=float, default=0, help="stage ar's minutes per variant after it (0: none)")
    parser.add_argument("--threads", type=positive_int, default=1)
    add_device_argument(parser)
    add_online_features_argument(parser)
    add_compute_dtype_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-fraction", type=float, default=0.8, help="share of each batch from chat windows")
    add_drafter_arguments(parser, drafter_layers=1, num_anchors=48)
    add_shape_arguments(parser)
    add_optimizer_arguments(parser, lr=6e-4, batch_size=4, seq_len=512)
    parser.set_defaults(func=run, chat_windows=None, draft_vocab_size=None)
