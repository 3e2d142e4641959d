"""`treeflash-hf ablate`: the paper's ablations of the AR layer, each trained the same short way, with several seeds.

Variants (all start from the pair's drafter's backbone, AR layer re-initialised to zero):
`swiglu` (the paper's layer, backbone frozen), `linear` (no gate), `two_prev` (conditions on two previous
tokens), `full_finetune` (SwiGLU, backbone trained too). Each trains stage `ar` for the same number of steps per
seed (the seed draws the data and anchors), then reports held-out KL of the AR distribution and greedy τ of
`treeflash` (drafter alone, no lookup) at each budget, per seed and as the mean over seeds.

On the real pair (`--pair smollm2-135m`, the default) training reads the recipe's feature store (`reference
train-drafter` writes it: the target ran once over every window) and τ is measured on held-out chat requests; on
`--pair tiny` (or `--models`, a reference-suite folder) it runs the live target over the suite's token streams and
measures on held-out code.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch

from ..arguments import add_pair_argument, positive_int
from ..optional import pyplot

VARIANTS = {
    "swiglu": ({}, False),
    "linear": ({"ar_type": "linear"}, False),
    "two_prev": ({"ar_num_prev_tokens": 2}, False),
    "full_finetune": ({}, True),
}


def variant_drafter(base, overrides: dict):
    from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel
    from ..training.drafter import AR_PREFIX

    config = type(base.config).from_dict({**base.config.to_dict(), **overrides})
    model = TreeFlashDrafterModel(config)
    backbone = {k: v for k, v in base.state_dict().items() if not k.startswith(AR_PREFIX)}
    model.load_state_dict(backbone, strict=False)
    return model.eval()


def greedy_tau(target, drafter, prompts_ids, budget: int, max_new_tokens: int, tree_options: dict | None = None
               ) -> float:
    """Greedy τ of `treeflash` with the drafter alone; `tree_options` (e.g. `tree_top_m`) override its defaults."""
    accepted, steps = 0, 0
    for ids in prompts_ids:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                              tree_mode="treeflash", tree_budget=budget, tree_lookup=0,  # the drafter alone
                              return_dict_in_generate=True, **(tree_options or {}))
        accepted += sum(out.accepted_lengths)
        steps += len(out.accepted_lengths)
    return 1 + accepted / max(steps, 1)


def live_trainer(target, args: argparse.Namespace):
    """Stage ar against the live target over the reference suite's token streams (`--reference-work`)."""
    import numpy as np

    from ..training.data import TokenStream
    from ..training.drafter import DrafterLossConfig, train_drafter
    from ..training.loop import LoopConfig

    train_ids = np.load(Path(args.reference_work) / "train.npy")
    heldout_ids = np.load(Path(args.reference_work) / "heldout.npy")

    def train(drafter, run_dir: Path, seed: int, full_finetune: bool) -> dict:
        heldout = TokenStream(heldout_ids, 256, seed=12).eval_batches(8, 4)
        loop = LoopConfig(run_dir=str(run_dir), max_steps=args.steps, batch_size=8, lr=args.lr,
                          warmup_steps=max(1, args.steps // 10), eval_every=args.steps, save_every=args.steps,
                          seed=seed, resume=True)
        return train_drafter(target, drafter, TokenStream(train_ids, 256, seed=11 + seed), heldout,
                             DrafterLossConfig(stage="ar"), loop, full_finetune=full_finetune)

    return train


def cached_trainer(target, args: argparse.Namespace):
    """Stage ar from the recipe's feature store (`--store`), as the bundled drafter was trained."""
    from ..recipes.drafter_recipe import train_stage
    from ..training.drafter import DrafterLossConfig
    from ..training.features import FeatureStore

    loss = DrafterLossConfig()  # the recipe's loss: its default slot decay, no cross-entropy

    def train(drafter, run_dir: Path, seed: int, full_finetune: bool) -> dict:
        store = FeatureStore(args.store, seed=seed)
        hyper = SimpleNamespace(num_anchors=48, batch_size=4, lr=args.lr, seed=seed, decay=loss.decay,
                                ce_weight=loss.ce_weight)
        return train_stage("ar", target, drafter, store, run_dir, hyper, fixed_steps=args.steps,
                           full_finetune=full_finetune)

    return train


def summarize_seeds(per_seed: list[dict]) -> dict:
    """Mean and spread (min, max) of every metric over the seeds' rows."""
    return {key: {"mean": statistics.fmean(row[key] for row in per_seed),
                  "min": min(row[key] for row in per_seed), "max": max(row[key] for row in per_seed)}
            for key in per_seed[0] if key != "seed"}


def plot_ablation(rows: dict, budgets: list[int], seeds: list[int], out_dir: Path) -> Path:
    """τ at each budget and held-out KL of the AR distribution per variant: means over seeds, min-max whiskers."""
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(rows)
    fig, (tau_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(budgets)
    for index, budget in enumerate(budgets):
        cells = [rows[name]["summary"][f"tau_{budget}"] for name in names]
        means = [cell["mean"] for cell in cells]
        spread = [[cell["mean"] - cell["min"] for cell in cells], [cell["max"] - cell["mean"] for cell in cells]]
        tau_ax.bar([i + (index - (len(budgets) - 1) / 2) * width for i in range(len(names))], means, width,
                   yerr=spread, capsize=3, label=f"budget {budget}")
    kl = [rows[name]["summary"]["heldout_kl_ar"] for name in names]
    kl_ax.bar(range(len(names)), [cell["mean"] for cell in kl],
              yerr=[[c["mean"] - c["min"] for c in kl], [c["max"] - c["mean"] for c in kl]], capsize=3)
    for ax, label in ((tau_ax, "τ (treeflash, drafter alone)"), (kl_ax, "held-out KL, AR distribution")):
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    tau_ax.legend(fontsize=8)
    fig.suptitle(f"AR-layer ablations (mean over seeds {seeds}, min-max)")
    fig.tight_layout()
    path = out_dir / "ablation.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from .. import reference
    from ..recipes.prompt_sets import load_prompts

    torch.set_num_threads(args.threads)
    cached = args.models is None and args.pair != "tiny"
    target, base, tokenizer = reference.load(args.models or args.pair)
    # training computes in float32 (under bfloat16 autocast); τ is measured in the pair's own run dtype
    run_dtype = target.dtype
    target, base = target.float(), base.float()
    train = cached_trainer(target, args) if cached else live_trainer(target, args)
    prompt_set = "instruct-heldout" if cached else "stdlib-heldout"
    prompts = [tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"][:, -256:]
               for p in load_prompts(prompt_set, args.num_prompts, tokenizer)]
    work = Path(args.work or ("ablation_work" + ("/smollm2" if cached else "")))
    rows = {}
    for name in args.variants:
        overrides, full = VARIANTS[name]
        per_seed = []
        for seed in args.seeds:
            drafter = variant_drafter(base, overrides)
            summary = train(drafter, work / f"{name}-seed{seed}", seed, full)
            final = summary["curve"][-1]
            drafter = drafter.to(run_dtype).eval()
            target.to(run_dtype)
            row = {"seed": seed, "heldout_kl_ar": final.get("eval_ar_kl"),
                   "heldout_kl_marginal": final.get("eval_backbone_kl"), "minutes": summary["minutes"],
                   **{f"tau_{b}": greedy_tau(target, drafter, prompts, b, args.max_new_tokens) for b in args.budgets}}
            target.to(torch.float32)
            per_seed.append(row)
            print(name, json.dumps(row), flush=True)
        rows[name] = {"seeds": per_seed, "summary": summarize_seeds(per_seed)}
    print(f"\n{'variant':15s} {'held-out KL':>12s} " + " ".join(f"{'tau@' + str(b):>16s}" for b in args.budgets)
          + f"   (mean over seeds {args.seeds}, min-max)")
    for name, row in rows.items():
        cells = [row["summary"][f"tau_{b}"] for b in args.budgets]
        kl = row["summary"]["heldout_kl_ar"]
        print(f"{name:15s} {kl['mean']:12.4f} " + " ".join(
            f"{c['mean']:6.2f} ({c['min']:.2f}-{c['max']:.2f})" for c in cells))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"pair": args.models or args.pair, "steps": args.steps,
                                               "seeds": args.seeds, "budgets": args.budgets, "prompts": prompt_set,
                                               "variants": rows}, indent=2))
    if args.plot:
        print(f"wrote {plot_ablation(rows, args.budgets, args.seeds, Path(args.plot))}")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ablate", help="Train and measure the AR-layer ablations.")
    add_pair_argument(parser, " (unless --models is given)")
    parser.add_argument("--models", help="a reference-suite folder `reference build` wrote (instead of --pair)")
    parser.add_argument("--store", default="reference_work/smollm2/features",
                        help="the real pair's feature store (`reference train-drafter` writes it)")
    parser.add_argument("--reference-work", default="reference_work",
                        help="the tiny pair's token streams (`reference build` writes them)")
    parser.add_argument("--work", help="checkpoints (default ablation_work, ablation_work/smollm2 for the real pair)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=positive_int, default=150)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[16, 64])
    parser.add_argument("--num-prompts", type=positive_int, default=6)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--plot", help="write ablation.png here")
    parser.set_defaults(func=run)
