"""The engine's kernels for its target forwards (`treeflash_hf/engine/kernels.py`) side by side: one verify forward of
a tree of N nodes after P cached tokens on the model's own kernels ("stock"), with the grouped-query attention alone
("attention", `engine/attention.py`), with the attention and the fused products of `engine/onednn.py` ("products"),
and with every engine kernel ("engine": those and the lean forward of `engine/lean_forward.py`), the arms alternating
call by call (so a drifting host loads all alike). Prints the median of
each, the ratios to stock, and whether the logits are bit-identical to stock.

    .venv/bin/python scripts/engine_kernels_ab.py --past 120 300 --nodes 1 9 13 17

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
from treeflash_hf.engine.attention import tree_attention
from treeflash_hf.engine.onednn import fused_products
from treeflash_hf.engine.kernels import engine_kernels
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


@contextlib.contextmanager
def products(model):
    """The engine's attention and fused products, the model's own forward."""
    with tree_attention(model), fused_products(model):
        yield


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
    kernels = {"stock": lambda model: contextlib.nullcontext(), "attention": tree_attention,
               "products": products, "engine": engine_kernels}
    print(f"{args.pair}, {target.dtype}, {args.threads} threads; median ms of one verify forward")
    print("| cached tokens | nodes | stock | attention | products | engine | stock / attention | stock / products "
          "| stock / engine | logits identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for past_len in args.past:
        cache = growing_cache(DynamicCache(config=target.config))
        with torch.no_grad():
            target(input_ids=torch.randint(0, vocab_size, (1, past_len)), cache=cache, use_cache=True)
        for size in args.nodes:
            trees = TreeBatch.pack([binary_tree(size, vocab_size)])
            seconds = {name: [] for name in kernels}
            logits = {}
            for repeat in range(args.repeats):
                order = list(kernels)[repeat % len(kernels):] + list(kernels)[: repeat % len(kernels)]
                for name in order:
                    verify.engine_kernels = kernels[name]  # (what run_target enters)
                    start = time.perf_counter()
                    logits[name], _ = verify.verify_trees(target, trees, cache, torch.tensor([past_len]), None,
                                                          layer_ids, target.device)
                    seconds[name].append(time.perf_counter() - start)
                    cache.crop(-size)
            verify.engine_kernels = engine_kernels
            stock, attention, fused, engine = (statistics.median(seconds[name]) * 1e3 for name in kernels)
            identical = all(torch.equal(logits["stock"], logits[name]) for name in kernels)
            print(f"| {past_len} | {size} | {stock:.2f} | {attention:.2f} | {fused:.2f} | {engine:.2f} | "
                  f"{stock / attention:.3f} | {stock / fused:.3f} | {stock / engine:.3f} | {identical} |")


if __name__ == "__main__":
    main()
