"""Sampled TreeFlash output must follow exactly the target's distribution.

On a 6-token vocabulary the exact joint distribution of the first three generated tokens (216 outcomes) is
computed from the target, with the same logits processors (temperature, top-p). Speculative samples from
each mode are compared to it with a chi-square goodness-of-fit test at significance 1e-3: with the fixed seeds
below the outcome is deterministic, and for a correct sampler the chance that a given seed fails is 0.1% per
comparison. A power check makes sure the test can fail: the same samples must reject the distribution of a
slightly different temperature. Samples are drawn as batches of the same prompt (each row samples on its own;
one case draws them one call each, the batch-of-one path).
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from treeflash_hf import forget_learned_state, treeflash_generate
from treeflash_hf.engine.lookup import StepScheduler
from treeflash_hf.recipes.testing import matching_drafter, random_target
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from .conftest import randomise_ar_layer

VOCAB = 6
NEW_TOKENS = 3
SAMPLES = 2000
ROWS_PER_CALL = 25  # samples drawn per call, as a batch of the same prompt
ALPHA = 1e-3
TEMPERATURE, TOP_P = 0.8, 0.95


@pytest.fixture(scope="module")
def peaked_pair():
    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           seed=21)
    with torch.no_grad():  # sharpen the random head so that distributions are far from uniform
        target.lm_head.weight.mul_(15.0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=22, block_size=4), std=0.5)
    return target, drafter


def exact_joint(target, prompt: torch.LongTensor, temperature: float) -> dict[tuple[int, ...], float]:
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(TOP_P)])
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            grown = {}
            for prefix, p in probs.items():
                ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long).reshape(1, -1)], dim=-1)
                logits = target(ids).logits[:, -1].float()
                next_p = torch.softmax(processors(ids, logits), dim=-1)[0].tolist()
                for token, q in enumerate(next_p):
                    grown[prefix + (token,)] = p * q
            probs = grown
    return probs


def chi_square_p(counts: dict, expected_probs: dict, total: int) -> float:
    """Chi-square p-value; outcomes with expected count < 5 are pooled into one cell."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for outcome, p in expected_probs.items():
        if p * total < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += p * total
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(p * total)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    "mode,budget,lookup,rows",
    [("treeflash", 4, 0, 1), ("treeflash", 16, 0, ROWS_PER_CALL), ("marginal_tree", 3, 0, ROWS_PER_CALL),
     ("chain", 4, 0, ROWS_PER_CALL), ("treeflash", 4, 3, ROWS_PER_CALL), ("treeflash", 4, "only", ROWS_PER_CALL),
     ("treeflash", "auto", 3, ROWS_PER_CALL)],
)
def test_speculative_sampling_matches_target_distribution(peaked_pair, mode, budget, lookup, rows, monkeypatch):
    """lookup: length of the lookup branch in the tree, or "only": every step where some row has a match verifies
    the lookup branches alone (the drafter is skipped). rows: samples per call (a batch of the same prompt)."""
    target, drafter = peaked_pair
    if lookup == "only":
        monkeypatch.setattr(StepScheduler, "choose", lambda self, branches, **_:
                            "draft" if all(branch is None for branch in branches) else "lookup")
        lookup = 3
    prompt = torch.tensor([[1, 4, 2]])
    expected = exact_joint(target, prompt, TEMPERATURE)
    torch.manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    accepted_total = 0
    for _ in range(SAMPLES // rows):
        # each call starts afresh: carried over, auto's schedule would settle on plain steps for this tiny pair
        forget_learned_state(drafter)
        out = treeflash_generate(
            target, drafter, prompt.repeat(rows, 1), max_new_tokens=NEW_TOKENS, do_sample=True,
            temperature=TEMPERATURE, top_p=TOP_P, tree_mode=mode, tree_budget=budget, tree_top_m=VOCAB,
            tree_top_k=VOCAB, tree_lookup=lookup, pad_token_id=0,
        )
        for outcome in out.sequences[:, prompt.shape[1]:].tolist():
            counts[tuple(outcome)] = counts.get(tuple(outcome), 0) + 1
        accepted_total += sum(out.accepted_lengths)
    assert accepted_total > SAMPLES // 20, "the drafts were almost never accepted: the test would not exercise them"
    assert chi_square_p(counts, expected, SAMPLES) > ALPHA
    # Power check: the same samples reject a nearby wrong distribution.
    wrong = exact_joint(target, prompt, TEMPERATURE * 1.5)
    assert chi_square_p(counts, wrong, SAMPLES) < ALPHA
