"""`treeflash-hf ablate`: the paper's ablations on the reference suite, each trained the same short way.

Variants (all start from the reference drafter's backbone, AR layer re-initialised to zero):
`swiglu` (the paper's layer, backbone frozen), `linear` (no gate), `two_prev` (conditions on two previous
tokens), `full_finetune` (SwiGLU, backbone trained too). Each trains stage `ar` for the same number of
steps, then reports held-out KL of the AR distribution and greedy τ of `treeflash` at each budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VARIANTS = {
    "swiglu": ({}, False),
    "linear": ({"ar_type": "linear"}, False),
    "two_prev": ({"ar_num_prev_tokens": 2}, False),
    "full_finetune": ({}, True),
}


def variant_drafter(base, overrides: dict):
    from .modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

    config = type(base.config).from_dict({**base.config.to_dict(), **overrides})
    model = TreeFlashDrafterModel(config)
    backbone = {k: v for k, v in base.state_dict().items() if not k.startswith("ar_approximation.")}
    model.load_state_dict(backbone, strict=False)
    return model.eval()


def greedy_tau(target, drafter, prompts_ids, budget: int, max_new_tokens: int) -> float:
    accepted, steps = 0, 0
    for ids in prompts_ids:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                              tree_mode="treeflash", tree_budget=budget, tree_lookup=0,  # the drafter alone
                              return_dict_in_generate=True)
        accepted += sum(out.accepted_lengths)
        steps += len(out.accepted_lengths)
    return 1 + accepted / max(steps, 1)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from . import reference
    from .prompt_sets import load_prompts
    from .training.data import TokenStream
    from .training.drafter import DrafterLossConfig, train_drafter
    from .training.loop import LoopConfig

    torch.set_num_threads(args.threads)
    target, base, tokenizer = reference.load(args.models)
    work = Path(args.work)
    train_ids = np.load(Path(args.reference_work) / "train.npy")
    heldout_ids = np.load(Path(args.reference_work) / "heldout.npy")
    train = TokenStream(train_ids, 256, seed=11)
    heldout = TokenStream(heldout_ids, 256, seed=12).eval_batches(8, 4)
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"][:, -256:]
               for p in load_prompts("stdlib-heldout", args.num_prompts)]
    rows = {}
    for name in args.variants:
        overrides, full = VARIANTS[name]
        drafter = variant_drafter(base, overrides)
        loop = LoopConfig(run_dir=str(work / name), max_steps=args.steps, batch_size=8, lr=args.lr,
                          warmup_steps=max(1, args.steps // 10), eval_every=args.steps, save_every=args.steps,
                          resume=True)
        summary = train_drafter(target, drafter, train, heldout, DrafterLossConfig(stage="ar"), loop,
                                full_finetune=full)
        drafter.eval()
        final = summary["curve"][-1]
        rows[name] = {"heldout_kl_ar": final.get("eval_ar_kl"), "heldout_kl_marginal": final.get("eval_backbone_kl"),
                      "minutes": summary["minutes"],
                      **{f"tau_{b}": greedy_tau(target, drafter, prompts, b, args.max_new_tokens)
                         for b in args.budgets}}
        print(name, json.dumps(rows[name]))
    print(f"\n{'variant':15s} {'held-out KL':>12s} " + " ".join(f"{'tau@' + str(b):>8s}" for b in args.budgets))
    for name, row in rows.items():
        print(f"{name:15s} {row['heldout_kl_ar']:12.4f} " + " ".join(f"{row[f'tau_{b}']:8.2f}" for b in args.budgets))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"steps": args.steps, "budgets": args.budgets, "variants": rows},
                                              indent=2))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ablate", help="Train and measure the AR-layer ablations.")
    parser.add_argument("--models", help="reference-suite folder (default: the bundled one)")
    parser.add_argument("--reference-work", default="reference_work", help="token streams from `reference build`")
    parser.add_argument("--work", default="ablation_work")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.set_defaults(func=run)
