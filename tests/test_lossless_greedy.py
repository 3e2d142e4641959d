"""Greedy TreeFlash output must be token-identical to `target.generate()` without an assistant."""

import random

import pytest
import torch

from treeflash_hf import TreeOptions, treeflash_generate
from treeflash_hf.recipes.testing import ARCHITECTURES, matching_drafter, random_target

from .conftest import randomise_ar_layer
from .oracle import OracleCandidateGenerator

MODES = ("chain", "marginal_tree", "treeflash")
BUDGETS = (1, 4, 16, 64)
VOCAB = 256


def prompts(seed: int, count: int = 3) -> list[torch.LongTensor]:
    rng = random.Random(seed)
    return [torch.tensor([[rng.randrange(VOCAB - 1) for _ in range(rng.randint(3, 20))]]) for _ in range(count)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request):
    target = random_target(request.param, vocab_size=VOCAB, seed=0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    return target, drafter


@pytest.mark.parametrize("mode", MODES)
def test_random_drafter_matches_target(pair, mode):
    target, drafter = pair
    for prompt in prompts(seed=11):
        reference = target.generate(prompt, max_new_tokens=24, do_sample=False)
        for budget in BUDGETS:
            out = target.generate(
                prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, tree_mode=mode,
                tree_budget=budget, return_dict_in_generate=True,
            )
            assert torch.equal(out.sequences, reference), (mode, budget)
            assert max(out.tree_sizes) <= budget


@pytest.mark.parametrize("mode", MODES)
def test_runs_that_end_at_eos_match_target(pair, mode):
    """EOS is a token the target really emits mid-continuation: generation stops exactly there."""
    target, drafter = pair
    for prompt in prompts(seed=12, count=2):
        free_run = target.generate(prompt, max_new_tokens=20, do_sample=False)
        eos = int(free_run[0, prompt.shape[1] + 9])
        reference = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos)
        assert reference.shape[1] <= prompt.shape[1] + 10 and int(reference[0, -1]) == eos
        for budget in (4, 64):
            out = target.generate(
                prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=[eos, VOCAB + 5],
                tree_mode=mode, tree_budget=budget,
            )
            assert torch.equal(out, reference), (mode, budget)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("mode,scoring", [(mode, "learned") for mode in MODES] +
                         [(mode, "random") for mode in MODES if mode != "chain"])
def test_oracle_drafter_deep_acceptance(arch, mode, scoring, monkeypatch):
    """A drafter that puts the target's own continuation into the tree (at varying ranks, sometimes missing a
    depth): long accepted paths, many compactions, bonus tokens from branches — and still identical output.
    `scoring="random"`: each draft scores a random 1-3 depths up front (any number must leave the trees alone)."""
    if scoring == "random":
        from treeflash_hf.engine.learned import ScoredDepth

        rng = random.Random(11)
        monkeypatch.setattr(ScoredDepth, "depth", lambda self, limit, longest_branch=0: min(limit, rng.randint(1, 3)))
    partly_scored = deepened = 0
    target = random_target(arch, vocab_size=VOCAB, seed=5)
    drafter = randomise_ar_layer(matching_drafter(target, seed=6, block_size=8))
    for prompt_index, prompt in enumerate(prompts(seed=13, count=2)):
        max_new = 48
        reference = target.generate(prompt, max_new_tokens=max_new + 16, do_sample=False)[0].tolist()
        expected = torch.tensor([reference[: prompt.shape[1] + max_new]])
        for budget in (4, 16, 64):
            options = TreeOptions(tree_mode=mode, tree_budget=budget, tree_top_m=8, tree_top_k=8)
            oracle = OracleCandidateGenerator(drafter, target, options, reference, seed=prompt_index * 7 + budget,
                                              max_rank=1)
            out = treeflash_generate(
                target, drafter, prompt, max_new_tokens=max_new, candidate_generator=oracle, tree_mode=mode,
                tree_budget=budget, tree_top_m=8, tree_top_k=8,
            )
            assert torch.equal(out.sequences, expected), (arch, mode, budget)
            assert max(out.accepted_lengths) >= (3 if budget >= 16 else 1), out.accepted_lengths
            assert out.tau > (1.5 if budget >= 16 else 1.0)
            partly_scored, deepened = partly_scored + oracle.partly_scored_drafts, deepened + oracle.deepened_drafts
    if scoring == "random":
        assert partly_scored > 0 and deepened > 0  # (the oracle's deep trees ask for the rest on most steps)
