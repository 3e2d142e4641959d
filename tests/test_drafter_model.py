"""The drafter model: zero-initialised AR layer, Auto-class registration, save/load, remote code, stock DFlash."""

import json
import os
import subprocess
import sys
import textwrap
from unittest import mock

import torch
from transformers import AutoConfig, AutoModel

from treeflash_hf import TreeFlashCandidateGenerator, TreeFlashDrafterConfig, TreeFlashDrafterModel, TreeOptions
from treeflash_hf.engine.draft import DraftContext
from treeflash_hf.recipes.testing import matching_drafter, random_target

from .conftest import randomise_ar_layer


def draft_once(target, drafter, prompt, options, scored_depth=None, **generator_attributes):
    generator = TreeFlashCandidateGenerator(drafter, target, options)
    for name, value in generator_attributes.items():
        setattr(generator, name, value)
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    context = DraftContext(generator.context_features(out.hidden_states, slice(None)),
                           torch.arange(prompt.shape[1])[None])
    anchor = int(out.logits[0, -1].argmax())
    blocks = generator.draft([anchor], torch.tensor([prompt.shape[1]]), context,
                             max_depth=drafter.config.block_size - 1, scored_depth=scored_depth)
    return generator, blocks[0]


def test_fresh_drafter_ar_tables_are_the_marginal_tables(qwen3_pair):
    target, drafter = qwen3_pair
    assert torch.count_nonzero(drafter.ar_approximation.d.weight) == 0
    options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=4, tree_top_k=5)
    # Full-vocabulary rows and shortlisted rows (the shortlist carries the marginal's mass) alike.
    for shortlist in (None, 12):
        generator, block = draft_once(target, drafter, torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), options,
                                      ar_shortlist=shortlist)
        assert (block.shortlist is None) == (shortlist is None)
        table = generator.ar_tables([block], block.depth)[0]
        marginal_top = block.marginal_log_probs.topk(5, dim=-1)
        # row [d, j]: the children (depth d+1) of the j-th top token at depth d (the root at d = 0)
        assert torch.equal(table.child_tokens[0, 0], marginal_top.indices[0])
        torch.testing.assert_close(table.child_log_probs[0, 0], marginal_top.values[0])
        for depth in range(1, block.depth):
            for j in range(table.top.shape[1]):
                assert torch.equal(table.child_tokens[depth, j], marginal_top.indices[depth])
                torch.testing.assert_close(table.child_log_probs[depth, j], marginal_top.values[depth])


def test_lazy_and_batched_stage_two_build_the_same_tree(qwen3_pair):
    target, _ = qwen3_pair
    drafter = randomise_ar_layer(matching_drafter(target, seed=1), std=0.05)
    for budget in (2, 8, 16, 64):
        options = TreeOptions(tree_mode="treeflash", tree_budget=budget, tree_top_m=6, tree_top_k=5)
        generator, block = draft_once(target, drafter, torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), options)
        generator.ar_evaluation = "batched"
        batched = generator.build_tree(block, budget)
        generator.ar_evaluation = "lazy"
        lazy = generator.build_tree(block, budget)
        assert torch.equal(batched.tokens, lazy.tokens) and torch.equal(batched.parents, lazy.parents)
        assert batched.size <= budget and (batched.depths.max() > 1 or budget < 16)


def test_lazy_stage_two_computes_every_row_in_shared_rounds_and_builds_the_batched_trees(qwen3_pair):
    target, _ = qwen3_pair
    lookups = [None, ([5, 9, 2], [-0.5, -0.7, -0.9])]  # a lookup branch below the second row's root
    for variant in ({}, {"ar_num_prev_tokens": 2}):
        drafter = randomise_ar_layer(matching_drafter(target, seed=1, **variant), std=0.05)
        options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=6, tree_top_k=5)
        generator, first = draft_once(target, drafter, torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), options)
        second = draft_once(target, drafter, torch.tensor([[2, 7, 1, 8, 2, 8]]), options)[1]

        def lazy(blocks, row_lookups):
            generator.ar_evaluation = "lazy"
            with mock.patch.object(generator, "ar_rows", wraps=generator.ar_rows) as calls:
                trees = generator.build_trees(blocks, 16, row_lookups).trees
            return trees, calls.call_count

        generator.ar_evaluation = "batched"
        batched = generator.build_trees([first, second], 16, lookups).trees
        trees, calls = lazy([first, second], lookups)
        for expected, tree in zip(batched, trees):
            assert torch.equal(expected.tokens, tree.tokens) and torch.equal(expected.parents, tree.parents)
        assert int(trees[0].depths.max()) > 1 and 5 in trees[1].tokens.tolist()
        # one call per round for every row: as many as the row that needs the most rounds alone
        alone = [lazy([block], [lookup])[1] for block, lookup in zip([first, second], lookups)]
        assert 1 <= calls == max(alone) < 16, (calls, alone)


def test_stage_two_scores_at_least_the_top_m_tokens_so_every_tree_node_can_have_children(qwen3_pair):
    from treeflash_hf.engine.draft import MIN_AR_SHORTLIST

    target, _ = qwen3_pair
    drafter = randomise_ar_layer(matching_drafter(target, seed=1), std=0.05)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    small = TreeOptions(tree_mode="treeflash", tree_budget=64, tree_top_m=4, tree_top_k=5)
    assert draft_once(target, drafter, prompt, small)[1].shortlist.tokens.shape[-1] == MIN_AR_SHORTLIST
    options = TreeOptions(tree_mode="treeflash", tree_budget=64, tree_top_m=100, tree_top_k=5)
    generator, block = draft_once(target, drafter, prompt, options)
    assert block.shortlist.tokens.shape[-1] == 100  # a CPU shortlist as wide as M
    tree = generator.build_tree(block, 64)
    top = generator.top_tokens(block)  # S_d: the nodes that can have children
    inner = [(d, t) for d, t in zip(tree.depths.tolist(), tree.tokens.tolist()) if 0 < d < block.depth]
    assert inner and all(t in top[d - 1] for d, t in inner)


def test_trees_of_a_few_scored_depths_are_the_trees_of_every_depth(qwen3_pair):
    target, _ = qwen3_pair
    drafter = randomise_ar_layer(matching_drafter(target, seed=1), std=0.05)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    depths = []
    for mode, budget in (("treeflash", 4), ("treeflash", 16), ("treeflash", 64), ("marginal_tree", 16)):
        options = TreeOptions(tree_mode=mode, tree_budget=budget, tree_top_m=6, tree_top_k=5)
        generator, full = draft_once(target, drafter, prompt, options)
        reference = generator.build_tree(full, budget)
        reference_depth = int(reference.depths.max())
        depths.append(reference_depth)
        for scored in sorted({1, max(1, reference_depth - 1), reference_depth, reference_depth + 1}):
            generator, block = draft_once(target, drafter, prompt, options, scored_depth=scored)
            assert block.depth == scored and block.unscored_hidden.shape[0] == full.depth - scored
            tree = generator.build_tree(block, budget)
            # a tree short of the scored depth is final; one that reaches it gets the rest scored and searched again
            stopped = generator.search_stopped_at_scored_depth([block], int(tree.depths.max()))
            assert stopped == (scored <= reference_depth)
            if stopped:
                generator.score_deeper([block])
                assert block.unscored_hidden is None and block.depth == full.depth
                torch.testing.assert_close(block.marginal_log_probs, full.marginal_log_probs)
                if full.shortlist is not None:
                    assert torch.equal(block.shortlist.tokens, full.shortlist.tokens)
                tree = generator.build_tree(block, budget)
            assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.parents, reference.parents)
    assert max(depths) >= 3  # some tree deep enough that scoring fewer depths first is a real difference


def test_drafted_steps_score_one_depth_past_the_recent_trees():
    from treeflash_hf.engine.decode import deepest_node
    from treeflash_hf.engine.learned import ScoredDepth
    from treeflash_hf.engine.tree import TreeBatch, chain_tree

    def chain(depth: int):
        return chain_tree(0, torch.zeros(depth, dtype=torch.long), torch.zeros(depth))

    scored = ScoredDepth(window=2)
    assert scored.depth(15) == 15  # nothing seen yet: every depth
    assert deepest_node(TreeBatch.pack([chain(3), chain(1)])) == 3
    scored.observe(deepest_node(TreeBatch.pack([chain(3), chain(1)])))  # a step's deepest tree counts
    assert scored.depth(15) == 4 and scored.depth(3) == 3
    assert scored.depth(15, longest_branch=6) == 7  # a lookup branch ends above the scored depth
    scored.observe(1)
    scored.observe(2)
    assert scored.depth(15) == 3  # the 3-deep step left the window


def test_trained_ar_layer_changes_the_tables(qwen3_pair):
    target, _ = qwen3_pair
    drafter = randomise_ar_layer(matching_drafter(target, seed=1), std=0.2)
    options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=4, tree_top_k=5)
    generator, block = draft_once(target, drafter, torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), options)
    table = generator.ar_tables([block], block.depth)[0]
    assert not torch.allclose(table.child_log_probs[0, 0], block.marginal_log_probs.topk(5, dim=-1).values[0])


def test_ablation_variants_build_and_decode():
    target = random_target("qwen3", seed=0)
    reference = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False)
    for variant in ({"ar_type": "linear"}, {"ar_num_prev_tokens": 2}):
        drafter = randomise_ar_layer(matching_drafter(target, **variant))
        out = target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=12,
                              do_sample=False, tree_mode="treeflash", tree_budget=16)
        assert torch.equal(out, reference), variant


def test_save_and_load_round_trip(tmp_path, qwen3_pair):
    target, _ = qwen3_pair
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    drafter.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "modeling_treeflash_drafter.py",
            "configuration_treeflash_drafter.py"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "treeflash_drafter"
    assert config["auto_map"]["AutoModel"].endswith("TreeFlashDrafterModel")
    assert isinstance(AutoConfig.from_pretrained(tmp_path), TreeFlashDrafterConfig)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, TreeFlashDrafterModel)
    original, reloaded = drafter.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[k], reloaded[k]) for k in original)


def test_remote_code_loads_in_a_fresh_process_without_the_package(tmp_path, qwen3_pair):
    _, drafter = qwen3_pair
    drafter.save_pretrained(tmp_path / "drafter")
    torch.manual_seed(0)
    noise = torch.randn(1, drafter.config.block_size, drafter.config.hidden_size)
    context = torch.randn(1, 5, len(drafter.config.target_layer_ids) * drafter.config.hidden_size)
    torch.save({"noise": noise, "context": context}, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.modules["treeflash_hf"] = None  # importing the package would fail: prove it is not needed
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(tmp_path / "drafter")!r}, trust_remote_code=True)
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        with torch.no_grad():
            out = model(noise_embeds=inputs["noise"], context_hidden_states=inputs["context"]).last_hidden_state
        torch.save({{"out": out, "state": model.state_dict(), "cls": type(model).__module__}}, {str(tmp_path / "out.pt")!r})
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=env)
    result = torch.load(tmp_path / "out.pt")
    assert "treeflash_hf" not in result["cls"]
    assert torch.equal(result["out"], expected)
    state = drafter.state_dict()
    assert all(torch.equal(state[k], result["state"][k]) for k in state)


def test_stock_dflash_path_runs_our_weights(qwen3_pair):
    """`speculation_type="dflash"` leaves decoding to transformers' own linear DFlash loop."""
    target, drafter = qwen3_pair
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=20,
                          do_sample=False)
    assert torch.equal(out, reference)


def test_candidate_generator_runs_inside_stock_assisted_decoding(qwen3_pair):
    target, drafter = qwen3_pair
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    generator = TreeFlashCandidateGenerator(drafter, target, TreeOptions(tree_mode="chain"),
                                            max_length=prompt.shape[1] + 20)
    calls = []
    original = generator.get_candidates

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    generator.get_candidates = counting
    with mock.patch.object(type(target), "_get_candidate_generator", return_value=generator):
        out = target.generate(prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=20,
                              do_sample=False)
    assert torch.equal(out, reference)
    assert len(calls) > 1
