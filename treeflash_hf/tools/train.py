"""`treeflash-hf train`: train a drafter stage for any target (one CPU, one GPU, or several processes with DDP
under `accelerate launch` / `torchrun`). `--seed` fixes the whole run, the new drafter's initialisation included."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..arguments import (add_drafter_arguments, add_optimizer_arguments, add_target_quant_argument, device_name,
                         non_negative_int, positive_int)
from ..optional import require


def load_data(path: str, seq_len: int, seed: int, pad_token_id: int):
    """A token stream (`.npy`) or a self-distillation set (a `datasets.save_to_disk` folder)."""
    from ..training.data import MaskedSequences, TokenStream, load_tokens

    source = Path(path)
    if source.suffix == ".npy":
        return TokenStream(load_tokens(source), seq_len, seed=seed)
    if (source / "dataset_info.json").exists():
        datasets = require("datasets")

        return MaskedSequences(datasets.load_from_disk(str(source)), seq_len, pad_token_id, seed=seed)
    raise SystemExit(f"error: {source} is neither a .npy token stream nor a saved datasets folder.")


def run(args: argparse.Namespace) -> int:
    from accelerate import PartialState
    from transformers import AutoModel, AutoModelForCausalLM

    import treeflash_hf  # noqa: F401

    from ..hub.convert import convert
    from ..integrations.quantize import quantize_target
    from ..training.drafter import DrafterLossConfig, new_drafter, train_drafter
    from ..training.loop import LoopConfig

    # Under a multi-process launch each process gets its own device (cuda:<local rank>, or the CPU).
    device = torch.device(args.device) if args.device else PartialState(cpu=not torch.cuda.is_available()).device
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    # recalibration: the drafter learns the features and distributions of the quantized model it will draft for
    target = quantize_target(target, args.target_quant)
    torch.manual_seed(args.seed)  # the new drafter (or the layers a converted checkpoint lacks) starts seeded
    if args.drafter is None:
        if args.mask_token_id is None:
            raise SystemExit("error: a new drafter needs --mask-token-id (a reserved token of the target's vocabulary).")
        drafter = new_drafter(target, args.drafter_layers, args.block_size, args.mask_token_id,
                              layer_init=args.layer_init)
    elif "dflash_config" in json.loads((Path(args.drafter) / "config.json").read_text()):
        drafter = convert(args.drafter).float()
    else:
        drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32)
    drafter = drafter.to(device)
    pad = target.generation_config.pad_token_id or 0
    train = load_data(args.data, args.seq_len, seed=args.seed, pad_token_id=pad)
    heldout = []
    if args.heldout:
        held = load_data(args.heldout, args.seq_len, seed=args.seed + 1, pad_token_id=pad)
        heldout = [held.batch(10**6 + i, args.batch_size) for i in range(args.eval_batches)]
    loss_config = DrafterLossConfig(stage=args.stage, num_anchors=args.num_anchors, decay=args.decay,
                                    ce_weight=args.ce_weight)
    loop = LoopConfig(run_dir=str(Path(args.out) / "run"), max_steps=args.steps, max_minutes=args.minutes,
                      batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                      eval_every=args.eval_every, save_every=args.save_every, seed=args.seed, resume=args.resume,
                      mixed_precision=args.mixed_precision)
    summary = train_drafter(target, drafter, train, heldout, loss_config, loop, full_finetune=args.full_finetune)
    state = PartialState()
    if state.is_main_process:
        for param in drafter.parameters():
            param.requires_grad = True
        final = Path(args.out) / "final"
        drafter.save_pretrained(final)
        (final / "training_summary.json").write_text(json.dumps({args.stage: summary}, indent=2))
        print(f"saved {final}")
    state.wait_for_everyone()
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="Train a drafter stage (backbone or ar) for a target.")
    parser.add_argument("--stage", choices=["backbone", "ar"], required=True)
    add_target_quant_argument(parser)
    parser.add_argument("--target", required=True, help="the target model folder or Hub id")
    parser.add_argument("--drafter", help="a TreeFlash drafter or DFlash checkpoint to continue from")
    parser.add_argument("--data", required=True, help=".npy token stream or a self-distillation dataset folder")
    parser.add_argument("--heldout", help="held-out data for periodic evaluation")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=positive_int, default=1000)
    parser.add_argument("--minutes", type=float)
    add_optimizer_arguments(parser, lr=6e-4, batch_size=8, seq_len=256)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=50)
    add_drafter_arguments(parser, drafter_layers=5, num_anchors=16)
    parser.add_argument("--full-finetune", action="store_true")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--mask-token-id", type=non_negative_int)
    parser.add_argument("--eval-every", type=positive_int, default=200)
    parser.add_argument("--eval-batches", type=positive_int, default=4)
    parser.add_argument("--save-every", type=positive_int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no",
                        help="autocast for the losses; weights and optimizer state stay float32")
    parser.add_argument("--device", type=device_name,
                        help="default: this process's accelerator device (a GPU if any, else the CPU)")
    parser.set_defaults(func=run)
