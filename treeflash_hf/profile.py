"""`treeflash-hf profile`: where the time of one decode step goes (target forward vs. drafting vs. tree
building vs. acceptance vs. cache work), on random-init models of a chosen size. No download."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch

from . import generation
from .draft import TreeFlashCandidateGenerator
from .testing import matching_drafter, random_target

STAGES = {
    "draft (drafter forward + marginals)": (TreeFlashCandidateGenerator, "draft"),
    "tree (AR tables + best-first)": (TreeFlashCandidateGenerator, "build_tree"),
    "verify (target forward)": (generation, "verify_tree"),
    "accept (walk)": (generation, "walk_tree"),
    "commit (cache compaction)": (generation, "compact_cache"),
}


@contextlib.contextmanager
def stage_timers(totals: dict[str, float]):
    """Wrap each pipeline stage with a wall-clock timer for the duration of the block."""
    originals = []
    for name, (owner, attribute) in STAGES.items():
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(owner, attribute, timed)
    try:
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def profile_budget(target, drafter, prompt, budget: int, mode: str, new_tokens: int) -> tuple[dict, int, float]:
    totals: dict[str, float] = defaultdict(float)
    with stage_timers(totals):
        start = time.perf_counter()
        out = generation.treeflash_generate(target, drafter, prompt, max_new_tokens=new_tokens, tree_mode=mode,
                                            tree_budget=budget, tree_lookup=0)  # the drafter pipeline only
        wall = time.perf_counter() - start
    return totals, len(out.tree_sizes), wall


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    target = random_target("qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                           intermediate_size=3 * args.hidden)
    drafter = matching_drafter(target, num_layers=args.drafter_layers, block_size=args.block_size)
    params = sum(p.numel() for p in target.parameters()) / 1e6
    print(f"target: random Qwen3, {params:.1f}M parameters; drafter: {args.drafter_layers} layers, "
          f"block {args.block_size}; prompt {args.prompt_len} tokens; {args.threads} threads; mode {args.mode}")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab - 1, (1, args.prompt_len), generator=generator)
    with torch.no_grad():
        profile_budget(target, drafter, prompt, args.budgets[0], args.mode, 8)  # warm-up
        start = time.perf_counter()
        target.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        plain_ms = (time.perf_counter() - start) / args.new_tokens * 1e3
    print(f"plain generate(): {plain_ms:.1f} ms per token")
    for budget in args.budgets:
        totals, steps, wall = profile_budget(target, drafter, prompt, budget, args.mode, args.new_tokens)
        step_ms = wall / max(steps, 1) * 1e3
        print(f"\nbudget {budget}: {steps} steps, {step_ms:.1f} ms per step (wall, incl. prefill share)")
        staged = sum(totals.values())
        for name in STAGES:
            print(f"  {name:38s} {totals[name] / steps * 1e3:7.2f} ms/step  {100 * totals[name] / wall:5.1f}%")
        other = wall - staged
        print(f"  {'other (prefill, Python glue)':38s} {other / steps * 1e3:7.2f} ms/step  {100 * other / wall:5.1f}%")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("profile", help="Profile the decode step on random-init models.")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--mode", default="treeflash", choices=["chain", "marginal_tree", "treeflash"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.set_defaults(func=run)
