"""The verify forward's attention, stock `sdpa` against the grouped-query layout (`treeflash_hf/engine/attention.py`),
side by side: one verify forward of a tree of N nodes after P cached tokens, the two kernels alternating call by call
(so a drifting host loads both alike). Prints the median of each and their ratio, and checks the logits are
bit-identical.

    .venv/bin/python scripts/tree_attention_ab.py --past 120 300 --nodes 9 13 17

(`dtype="auto"`: the pair's run dtype on this CPU, bfloat16 where it has the arithmetic, else float32.)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from treeflash_hf import reference
from treeflash_hf.engine import verify
from treeflash_hf.engine.cache import growing_cache
from treeflash_hf.engine.tree import DraftTree, TreeBatch


def binary_tree(size: int, vocab_size: int) -> DraftTree:
    """A tree of `size` nodes, node i's parent (i - 1) // 2 (random tokens)."""
    parents = [-1] + [(node - 1) // 2 for node in range(1, size)]
    depths = [0]
    for node in range(1, size):
        depths.append(depths[parents[node]] + 1)
    return DraftTree(torch.randint(0, vocab_size, (size,)), torch.tensor(parents), torch.tensor(depths),
                     torch.zeros(size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--past", nargs="+", type=int, default=[120, 300])
    parser.add_argument("--nodes", nargs="+", type=int, default=[9, 13, 17])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, _ = reference.load(args.pair)
    vocab_size = target.config.vocab_size
    layer_ids = list(drafter.config.target_layer_ids)
    kernels = {"stock": lambda model: contextlib.nullcontext(), "grouped": verify.tree_attention}
    print(f"{args.pair}, {target.dtype}, {args.threads} threads; median ms of one verify forward")
    print("| cached tokens | nodes | stock sdpa | grouped | stock / grouped | logits identical |")
    print("|---|---|---|---|---|---|")
    for past_len in args.past:
        cache = growing_cache(DynamicCache(config=target.config))
        with torch.no_grad():
            target(input_ids=torch.randint(0, vocab_size, (1, past_len)), cache=cache, use_cache=True)
        for size in args.nodes:
            trees = TreeBatch.pack([binary_tree(size, vocab_size)])
            seconds = {name: [] for name in kernels}
            logits = {}
            for repeat in range(args.repeats):
                for name in (list(kernels) if repeat % 2 else list(kernels)[::-1]):
                    verify.tree_attention = kernels[name]  # (what run_target enters)
                    start = time.perf_counter()
                    logits[name], _ = verify.verify_trees(target, trees, cache, torch.tensor([past_len]), None,
                                                          layer_ids, target.device)
                    seconds[name].append(time.perf_counter() - start)
                    cache.crop(-size)
            verify.tree_attention = kernels["grouped"]
            stock, grouped = (statistics.median(seconds[name]) * 1e3 for name in kernels)
            print(f"| {past_len} | {size} | {stock:.2f} | {grouped:.2f} | {stock / grouped:.3f} | "
                  f"{torch.equal(logits['stock'], logits['grouped'])} |")


if __name__ == "__main__":
    main()
