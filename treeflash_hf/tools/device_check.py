"""The decode step on an accelerator, ready to run as it is on a machine with a GPU (and, reduced, on a CPU):

    python -m treeflash_hf.tools.device_check                 # CUDA: Qwen3-8B shapes, bf16, random init
    python -m treeflash_hf.tools.device_check --small --device cpu   # the same checks on small models (a dry run)

1. Lossless: on a small random Qwen3 in float32, greedy TreeFlash (treeflash and marginal_tree, budgets 16 and 64,
   batch 4) must give exactly plain `generate()`'s tokens.
2. The step at scale: random-init Qwen3-8B shapes (36 x 4096, GQA 32/8, vocabulary 151,936) in bfloat16 with a
   one-layer drafter, at batch 1/8/64, budget 16/64 and top-M 16/256 (greedy, no lookup branch; M 256 is the bundled
   SmolLM2 drafter's: on an accelerator its stage 2 scores `1 + (D-1)*256` AR rows per batch row, each on a
   256-token shortlist, where M 16 scores `1 + (D-1)*16` on the whole vocabulary): per decode step the host reads
   (`profile.HostReads`) and, on CUDA, the synchronisations `torch.cuda.set_sync_debug_mode("warn")` reports, the
   engine's operators (kernel launches), and the step's time split into the target's forward (its device time
   from the profiler) and the rest (the engine and the drafter).
The table is printed and written as JSON to `$OUT/device_check.json` when `$OUT` is set (the device tool's folder).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import warnings
from pathlib import Path

import torch

from ..arguments import device_name, positive_int
from ..engine import trace
from ..engine.decode import treeflash_generate
from ..recipes.testing import matching_drafter, random_target
from .profile import HostReads, ancestors, profiler_without_native_log, step_counts

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                intermediate_size=12_288)
SMALL = dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384)


def lossless_check(device: torch.device) -> list[str]:
    """Greedy TreeFlash against plain `generate()` on a small float32 model: the failures (empty: identical)."""
    target = random_target("qwen3", seed=3, **SMALL).to(device)
    drafter = matching_drafter(target, num_layers=1, block_size=16, seed=4).to(device)
    with torch.no_grad():  # a working AR layer: drafts that differ from the marginals
        drafter.ar_approximation.d.weight.normal_(0.0, 0.05)
    prompts = torch.randint(0, SMALL["vocab_size"] - 1, (4, 48), generator=torch.Generator().manual_seed(5)).to(device)
    failures = []
    with torch.no_grad():
        plain = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=64, do_sample=False,
                                pad_token_id=0)
        for mode in ("treeflash", "marginal_tree"):
            for budget in (16, 64):
                out = treeflash_generate(target, drafter, prompts, max_new_tokens=64, tree_mode=mode,
                                         tree_budget=budget, tree_lookup=0, pad_token_id=0)
                if not torch.equal(out.sequences, plain):
                    failures.append(f"{mode} @ {budget}")
    return failures


def build_pair(shapes: dict, device: torch.device, dtype: torch.dtype):
    """A random-init target of `shapes` and a one-layer drafter, built on the meta device and initialised on
    `device` (an 8B model initialised on a GPU in seconds, not on the host)."""
    with torch.device("meta"):
        target = random_target("qwen3", **shapes)
        drafter = matching_drafter(target, num_layers=1, block_size=16)
    pair = []
    for model in (target, drafter):
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.fill_(1.0)
                else:
                    parameter.normal_(0.0, 0.02)
            for module in model.modules():  # buffers (rotary frequencies) are recomputed, not random
                if hasattr(module, "inv_freq") and hasattr(module, "rope_init_fn"):
                    inv_freq, scaling = module.rope_init_fn(module.config, device)
                    module.inv_freq.copy_(inv_freq)
                    module.original_inv_freq = inv_freq
                    module.attention_scaling = scaling
        pair.append(model.eval())
    return pair


def step_profile(target, drafter, batch: int, budget: int, top_m: int, new_tokens: int, prompt_len: int,
                 device: torch.device) -> dict:
    """Per decode step of `batch` random prompts: host reads, CUDA-reported syncs, engine and forward operators,
    step time and the target forward's share of it."""
    vocab = target.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def decode_prompts(max_new_tokens: int, profiled: bool):
        reads = HostReads()
        with warnings.catch_warnings(record=True) as caught, reads:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            start = time.perf_counter()
            if profiled:
                with profiler_without_native_log(activities) as profiler:
                    out = treeflash_generate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                             tree_budget=budget, tree_top_m=top_m, tree_lookup=0, pad_token_id=0)
            else:
                profiler = None
                out = treeflash_generate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                         tree_budget=budget, tree_top_m=top_m, tree_lookup=0, pad_token_id=0)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        syncs = sum("synchroniz" in str(warning.message) for warning in caught)
        return out, reads.count, syncs, wall, profiler

    with torch.no_grad():
        decode_prompts(8, profiled=False)  # warm-up
        _, prefill_reads, prefill_syncs, prefill_wall, _ = decode_prompts(1, profiled=False)
        out, reads, syncs, wall, _ = decode_prompts(new_tokens, profiled=False)  # timed without the profiler
        _, _, _, _, profiler = decode_prompts(new_tokens, profiled=True)
    events = profiler.events()
    counts = step_counts(events)
    steps = max(counts["steps"], 1)
    forward_device_seconds = sum(
        getattr(event, "device_time_total", 0.0) for event in events if event.name == trace.TARGET_FORWARD and not
        any(parent.name == trace.PREFILL for parent in ancestors(event))) / 1e6
    step_seconds = (wall - prefill_wall) / steps
    return {"batch": batch, "budget": budget, "top_m": top_m, "steps": counts["steps"], "tau": float(out.tau),
            "host_reads": (reads - prefill_reads) / steps, "cuda_syncs": (syncs - prefill_syncs) / steps,
            "engine_ops": counts["engine_ops"] / steps, "forward_ops": counts["forward_ops"] / steps,
            "step_ms": step_seconds * 1e3,
            "target_forward_share": forward_device_seconds / steps / step_seconds if cuda else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeflash_hf.tools.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small models instead of Qwen3-8B shapes (a dry run)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[16, 64])
    parser.add_argument("--tree-top-m", type=positive_int, nargs="+", default=[16, 256])
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--prompt-len", type=positive_int, default=512)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    failures = lossless_check(device)
    report["lossless_failures"] = failures
    print(f"lossless (float32, small random Qwen3, batch 4): {'identical' if not failures else failures}", flush=True)
    target, drafter = build_pair(SMALL if args.small else QWEN3_8B, device, torch.bfloat16)
    rows = []
    print("| batch | budget | M | steps | host reads | CUDA syncs | engine ops | forward ops | step ms | target "
          "forward share |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for batch, budget, top_m in itertools.product(args.batches, args.budgets, args.tree_top_m):
        row = step_profile(target, drafter, batch, budget, top_m, args.new_tokens, args.prompt_len, device)
        rows.append(row)
        share = "-" if row["target_forward_share"] is None else f"{100 * row['target_forward_share']:.0f}%"
        print(f"| {batch} | {budget} | {top_m} | {row['steps']} | {row['host_reads']:.1f} | {row['cuda_syncs']:.1f} | "
              f"{row['engine_ops']:.0f} | {row['forward_ops']:.0f} | {row['step_ms']:.1f} | {share} |", flush=True)
    report["steps"] = rows
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_check.json").write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
