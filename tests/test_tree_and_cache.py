"""Tree construction, the tree attention mask and cache compaction."""

import contextlib
import itertools
import math

import torch
from transformers import DynamicCache

from treeflash_hf.engine.attention import TREE_SDPA, grouped_layout_is_exact, grouped_query_rows_apply, tree_attention
from treeflash_hf.engine.cache import compact_cache, repack
from treeflash_hf.engine.tree import TreeBatch, best_first_tree, chain_tree, table_children
from treeflash_hf.engine.verify import tree_attention_mask, verify_trees
from treeflash_hf.recipes.testing import random_target


def random_tables(rows: int, k: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(rows, vocab, generator=generator) * 2, dim=-1)
    top = log_probs.topk(k, dim=-1)
    return top.indices, top.values


def marginal_tree(budget: int, depth: int = 4, k: int = 3, vocab: int = 50, seed: int = 0):
    tokens, log_probs = random_tables(depth, k, vocab, seed)
    children_of = table_children(tokens, log_probs, lambda d, t: d)
    return best_first_tree(7, children_of, budget, depth), tokens, log_probs


def test_best_first_tree_is_prefix_closed_and_topological():
    tree, _, _ = marginal_tree(budget=20)
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0 and tree.size == 20
    for node in range(1, tree.size):
        assert 0 <= parents[node] < node
        assert depths[node] == depths[parents[node]] + 1
    # path scores never rise along a path
    scores = tree.path_log_probs.tolist()
    assert all(scores[n] <= scores[parents[n]] + 1e-9 for n in range(1, tree.size))


def test_best_first_tree_is_optimal_for_the_drafter_objective():
    """The popped nodes are the budget-1 best of all possible nodes (brute force over the full K-ary tree)."""
    depth, k = 3, 3
    for budget in (2, 5, 13, 30, 40):
        tree, tokens, log_probs = marginal_tree(budget, depth=depth, k=k, seed=budget)
        all_scores = []
        for length in range(1, depth + 1):
            for ranks in itertools.product(range(k), repeat=length):
                all_scores.append(sum(float(log_probs[d, r]) for d, r in enumerate(ranks)))
        best = sorted(all_scores, reverse=True)[: budget - 1]
        got = sorted(tree.path_log_probs[1:].tolist(), reverse=True)
        assert len(got) == min(budget - 1, len(all_scores))
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, best))
        expected = sum(math.exp(s) for s in best)
        assert math.isclose(tree.expected_accepted_len, expected, rel_tol=1e-5)


def test_leaf_rows_stop_expansion():
    tokens, log_probs = random_tables(1, 4, 50, seed=3)
    children_of = table_children(tokens, log_probs, lambda d, t: 0 if d == 0 else -1)
    tree = best_first_tree(1, children_of, budget=10, max_depth=5)
    assert tree.size == 5 and tree.depths.max() == 1  # root + its 4 children, which are leaves


def test_ancestor_matrix():
    tree, _, _ = marginal_tree(budget=25, depth=4)
    anc = tree.ancestor_matrix()
    parents = tree.parents.tolist()
    for node in range(tree.size):
        expected = {node}
        walker = node
        while parents[walker] >= 0:
            walker = parents[walker]
            expected.add(walker)
        assert set(anc[node].nonzero().flatten().tolist()) == expected


def path_tokens(tree, node):
    parents, tokens, path = tree.parents.tolist(), tree.tokens.tolist(), []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_tree_logits_equal_linear_paths_and_compaction_continues_exactly():
    for arch in ("qwen3", "llama"):
        target = random_target(arch, vocab_size=64, seed=4)
        prompt = torch.tensor([[5, 9, 2, 33, 17, 8]])
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(prompt[:, :-1], cache=cache, use_cache=True)
        tokens, log_probs = random_tables(4, 3, 64, seed=9)
        tree = best_first_tree(int(prompt[0, -1]), table_children(tokens, log_probs, lambda d, t: d), 16, 4)
        past_len = prompt.shape[1] - 1
        logits, _ = verify_trees(target, TreeBatch.pack([tree]), cache, torch.tensor([past_len]), None, [0],
                                 torch.device("cpu"))
        logits = logits[0]
        for node in range(tree.size):
            linear = torch.tensor([prompt[0, :-1].tolist() + path_tokens(tree, node)])
            with torch.no_grad():
                expected = target(linear).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)

        # Keep the deepest node's path, then continue decoding from the compacted cache.
        deepest = int(tree.depths.argmax())
        path_nodes, walker = [], deepest
        while walker >= 0:
            path_nodes.append(walker)
            walker = int(tree.parents[walker])
        path_nodes = path_nodes[::-1]
        compact_cache(cache, past_len, torch.tensor([path_nodes]))
        assert cache.get_seq_length() == past_len + len(path_nodes)
        committed = prompt[0, :-1].tolist() + path_tokens(tree, deepest)
        next_tokens = torch.tensor([[3, 44]])
        positions = torch.arange(len(committed), len(committed) + 2)[None]
        with torch.no_grad():
            continued = target(next_tokens, cache=cache, position_ids=positions, use_cache=True).logits[0]
            fresh = target(torch.tensor([committed + [3, 44]])).logits[0, -2:]
        torch.testing.assert_close(continued, fresh, atol=1e-4, rtol=1e-4)


def test_tree_attention_is_bit_identical_to_stock_sdpa_and_only_inside_the_engine(monkeypatch):
    """The grouped-query layout of the verify step's attention gives the stock `sdpa` path's logits bit for bit (a
    tree mask, a causal mask the model builds, padded rows), takes that layout for every layer, and leaves the model
    on `sdpa` outside (an exception included)."""
    grouped_calls = []  # per SDPA kernel call: whether its queries came laid out per key/value head
    stock_kernel = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, value, *args, **kwargs):
        if query.shape[0] == 2:  # (the model's two rows: not `grouped_layout_is_exact`'s one-row probes)
            grouped_calls.append(query.shape[1] == key.shape[1] == 2 and query.shape[2] > 1)
        return stock_kernel(query, key, value, *args, **kwargs)

    # (the kernel, not this module's function, is watched: a model folder's copy of the engine, loaded by another
    # test, registers its own copy of the function under the same name)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    for dtype in (torch.float32, torch.bfloat16):
        target = random_target("llama", vocab_size=64, num_heads=4, num_kv_heads=2, seed=5).to(dtype)
        prompt = torch.tensor([[5, 9, 2, 33, 17, 8], [0, 0, 4, 12, 40, 3]])
        padding = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
        tokens, log_probs = random_tables(4, 3, 64, seed=9)
        trees = TreeBatch.pack([best_first_tree(root, table_children(tokens, log_probs, lambda d, t: d), 12, 4)
                                for root in (7, 21)])
        positions = torch.tensor([6, 4])[:, None] + trees.depths
        mask = tree_attention_mask(trees, padding.bool(), 6, dtype)
        logits = {}
        for kernel in ("stock", "tree"):
            cache = DynamicCache(config=target.config)
            with torch.no_grad(), (tree_attention(target) if kernel == "tree" else contextlib.nullcontext()):
                prefill = target(prompt, attention_mask=padding, cache=cache, use_cache=True).logits
                verify = target(trees.tokens, position_ids=positions, attention_mask=mask, cache=cache,
                                use_cache=True).logits
            logits[kernel] = (prefill, verify)
            assert target.config._attn_implementation == "sdpa"
        assert all(torch.equal(stock, tree) for stock, tree in zip(logits["stock"], logits["tree"])), dtype
        assert grouped_calls.count(True) == 2 * target.config.num_hidden_layers  # the prefill and the verify
        grouped_calls.clear()
    # a long prefill keeps the stock layout: its mask repeated per query head would outweigh the copies it saves
    attention_layer = target.model.layers[0].self_attn
    key = torch.zeros(1, 2, 1000, 16, dtype=torch.bfloat16)
    long_mask = torch.zeros(1, 1, 1000, 1000, dtype=torch.bfloat16)
    assert not grouped_query_rows_apply(attention_layer, torch.zeros(1, 4, 1000, 16), key, long_mask, 0.0, {})
    assert grouped_query_rows_apply(attention_layer, torch.zeros(1, 4, 64, 16), key, long_mask[:, :, :64], 0.0, {})
    try:
        with tree_attention(target):
            assert target.config._attn_implementation == TREE_SDPA
            raise RuntimeError("inside the forward")
    except RuntimeError:
        pass
    assert target.config._attn_implementation == "sdpa"


def test_tree_attention_is_bit_identical_at_every_tree_size():
    """At every tree size (1-24 nodes) the engine's attention gives the stock `sdpa` logits bit for bit: where torch's
    kernel takes the grouped rows through another product path (some row counts), the stock layout is kept."""
    for dtype in (torch.float32, torch.bfloat16):
        target = random_target("llama", vocab_size=64, num_heads=4, num_kv_heads=2, seed=11).to(dtype)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(torch.arange(1, 30)[None], cache=cache, use_cache=True)
        tokens, log_probs = random_tables(6, 4, 64, seed=3)
        for size in range(1, 25):
            trees = TreeBatch.pack([best_first_tree(7, table_children(tokens, log_probs, lambda d, t: d), size, 6)])
            mask = tree_attention_mask(trees, None, 29, dtype)
            logits = []
            for kernel in (contextlib.nullcontext(), tree_attention(target)):
                with torch.no_grad(), kernel:
                    logits.append(target(trees.tokens, position_ids=29 + trees.depths, attention_mask=mask,
                                         cache=cache, use_cache=True).logits)
                cache.crop(-trees.width)
            assert torch.equal(*logits), (dtype, size)
    assert isinstance(grouped_layout_is_exact(300, 2, 2, 16, torch.float32, 1), bool)  # more queries than probed past


def test_chain_tree_shape():
    tree = chain_tree(4, torch.tensor([1, 2, 3]), torch.log(torch.tensor([0.5, 0.5, 0.5])))
    assert tree.tokens.tolist() == [4, 1, 2, 3] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert math.isclose(tree.expected_accepted_len, 0.5 + 0.25 + 0.125, rel_tol=1e-6)


def test_repack_cuts_the_cache_only_when_it_shrinks():
    """Re-packing moves each row's valid slots to the front and cuts the cache to the longest row. Invalid slots it
    cannot remove (rows of different lengths) must not trigger it: that would copy the whole cache every step."""
    cache = DynamicCache()
    keys = torch.arange(2 * 1 * 8 * 1, dtype=torch.float32).view(2, 1, 8, 1)
    cache.update(keys.clone(), keys.clone() + 100, 0)
    ragged = torch.tensor([[True] * 8, [False] * 6 + [True] * 2])  # row 1's left padding: irreducible
    assert repack(cache, ragged) is ragged and cache.layers[0].keys.shape[2] == 8
    holes = torch.tensor([[True, False, True, False, True, False, True, True],
                          [False, True, True, False, False, True, False, True]])  # 5 and 4 valid of 8
    new_valid = repack(cache, holes)
    layer = cache.layers[0]
    assert layer.keys.shape[2] == 5  # the longest row's valid slots
    assert layer.keys[0, 0, :, 0].tolist() == [0, 2, 4, 6, 7]  # row 0's valid slots, in order
    assert layer.keys[1, 0, :4, 0].tolist() == [9, 10, 13, 15] and new_valid[1].tolist() == [True] * 4 + [False]
    assert torch.equal(layer.values, layer.keys + 100) and new_valid[0].all()
