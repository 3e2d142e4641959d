"""Batched TreeFlash: a left-padded batch decodes every row exactly as that row alone (greedy), with the target's
distribution per row (sampling), and every `generate()` argument keeps its batched meaning."""

import random

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from treeflash_hf import forget_learned_state, treeflash_generate
from treeflash_hf.recipes.testing import ARCHITECTURES, matching_drafter, random_target

from .conftest import randomise_ar_layer
from .test_lossless_sampling import ALPHA, NEW_TOKENS, SAMPLES, TEMPERATURE, TOP_P, VOCAB, chi_square_p, exact_joint

TIE_GAP = 1e-5  # batched and single-row float arithmetic may only disagree where the target's top two are this close
PAD = 255


def left_pad(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def random_prompts(seed: int, count: int, vocab: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 24))] for _ in range(count)]


def assert_same_or_tie(target, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """`got` equals `expected`, or first differs where the target's own top-2 logits (single row, no padding) are
    within `TIE_GAP`: a genuine tie, where any rounding may pick either token."""
    if got == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert first < min(len(got), len(expected)), f"lengths differ without a differing token: {got} vs {expected}"
    with torch.no_grad():
        logits = target(torch.tensor([prompt + expected[:first]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < TIE_GAP, f"row differs at new token {first} where the target's top-2 gap is {gap:.3g} (not a tie)"


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request):
    target = random_target(request.param, vocab_size=256, seed=0)
    target.generation_config.pad_token_id = PAD
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    return target, drafter


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_greedy_rows_match_single_row_decoding(pair, rows):
    target, drafter = pair
    prompts = random_prompts(seed=rows, count=rows)
    references = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
    ids, mask = left_pad(prompts)
    for budget in (1, 4, 16, 64, "auto"):
        for lookup in (0, 6):
            forget_learned_state(drafter)
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=16,
                                  do_sample=False, tree_budget=budget, tree_lookup=lookup,
                                  return_dict_in_generate=True)
            assert out.sequences.shape == (rows, ids.shape[1] + 16)
            for row, prompt in enumerate(prompts):
                assert torch.equal(out.sequences[row, : ids.shape[1]], ids[row])  # the padded prompt, as given
                assert_same_or_tie(target, prompt, out.sequences[row, ids.shape[1]:].tolist(), references[row])
            assert len(out.per_row) == rows and len(out.tau_per_row) == rows
            if budget != "auto":
                assert max(out.tree_sizes) <= budget


def test_rows_stop_at_their_own_eos_and_are_padded_after_it(pair):
    target, drafter = pair
    prompts = random_prompts(seed=21, count=4)
    free = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    eos = free[0][6]  # a token the first row really emits mid-way; other rows emit it elsewhere or never
    references = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=[eos, 254])[0, len(p):].tolist() for p in prompts]
    assert len({len(r) for r in references}) > 1, "the rows should end at different steps"
    ids, mask = left_pad(prompts)
    for budget in (4, 16):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=24,
                              do_sample=False, eos_token_id=[eos, 254], tree_budget=budget)
        assert out.shape[1] == ids.shape[1] + max(len(r) for r in references)
        for row, reference in enumerate(references):
            new = out[row, ids.shape[1]:].tolist()
            assert new[: len(reference)] == reference
            assert all(t == PAD for t in new[len(reference):])  # finished rows padded with pad_token_id


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_batched_generate_arguments(pair):
    """Stopping criteria, logits processors, scores and per-row statistics in a batch, like batched generate()."""
    target, drafter = pair
    prompts = random_prompts(seed=31, count=3)
    ids, mask = left_pad(prompts)
    stop = target.generate(torch.tensor([prompts[1]]), max_new_tokens=16, do_sample=False)[0, len(prompts[1]) + 4]
    criteria = StoppingCriteriaList([StopAfterToken(int(stop))])
    # (with an EOS id, transformers pads every finished row; without one it keeps decoding rows its custom criteria
    # stopped, while TreeFlash always pads them)
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                  stopping_criteria=criteria, eos_token_id=254)
    expected = target.generate(ids, **common)  # transformers' batched plain decoding
    out = target.generate(ids, assistant_model=drafter, tree_budget=8, return_dict_in_generate=True,
                          output_scores=True, **common)
    assert torch.equal(out.sequences, expected)
    new = out.sequences.shape[1] - ids.shape[1]
    assert len(out.scores) == new and out.scores[0].shape == (3, 256)
    for row in range(3):
        emitted = out.sequences[row, ids.shape[1]:].tolist()
        scored = [int(s[row].argmax()) for s, token in zip(out.scores, emitted) if s[row].abs().sum() > 0]
        assert scored == emitted[: len(scored)]
        stats = out.per_row[row]
        assert out.tau_per_row[row] == pytest.approx(1 + sum(stats.accepted_lengths) / len(stats.accepted_lengths))
        assert len(stats.step_kinds) == len(stats.accepted_lengths) == len(stats.tree_sizes)
    assert out.tau == pytest.approx(1 + sum(out.accepted_lengths) / len(out.accepted_lengths))


def test_finished_rows_leave_the_working_batch(pair):
    """Once a row stops, later target forwards no longer carry it."""
    target, drafter = pair
    prompts = random_prompts(seed=41, count=3)
    ids, mask = left_pad(prompts)
    free = target.generate(torch.tensor([prompts[2]]), max_new_tokens=12, do_sample=False)[0, len(prompts[2]):]
    batch_sizes = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: batch_sizes.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                        eos_token_id=int(free[1]), tree_budget=4)
    finally:
        handle.remove()
    assert batch_sizes[0] == 3 and batch_sizes[-1] < 3


@pytest.fixture(scope="module")
def peaked_pair():
    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           seed=21)
    with torch.no_grad():
        target.lm_head.weight.mul_(15.0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=22, block_size=4), std=0.5)
    return target, drafter


def test_sampled_rows_follow_the_target_distribution(peaked_pair, budget=4, lookup=3, copies=10):
    """Each row of a batch (different prompts, so different padding; each prompt `copies` times) samples exactly
    its own distribution."""
    target, drafter = peaked_pair
    prompts = [[1, 4, 2], [3, 0, 5, 5, 1], [2]]
    expected = [exact_joint(target, torch.tensor([p]), TEMPERATURE) for p in prompts]
    wrong = [exact_joint(target, torch.tensor([p]), TEMPERATURE * 1.5) for p in prompts]
    ids, mask = left_pad(prompts * copies, pad=0)
    torch.manual_seed(4321)
    counts = [{} for _ in prompts]
    accepted_total = 0
    for _ in range(SAMPLES // copies):
        forget_learned_state(drafter)
        out = treeflash_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=0, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                                 tree_budget=budget, tree_top_m=VOCAB, tree_top_k=VOCAB, tree_lookup=lookup)
        for row in range(ids.shape[0]):
            outcome = tuple(out.sequences[row, ids.shape[1]:].tolist())
            counts[row % len(prompts)][outcome] = counts[row % len(prompts)].get(outcome, 0) + 1
        accepted_total += sum(out.accepted_lengths)
    assert accepted_total > SAMPLES // 20, "the drafts were almost never accepted: the test would not exercise them"
    for row in range(len(prompts)):
        assert chi_square_p(counts[row], expected[row], SAMPLES) > ALPHA, row
        assert chi_square_p(counts[row], wrong[row], SAMPLES) < ALPHA, row  # power: a nearby wrong one is rejected


def test_num_return_sequences_with_sampling(pair):
    target, drafter = pair
    prompts = random_prompts(seed=51, count=2)
    ids, mask = left_pad(prompts)
    torch.manual_seed(0)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=10, do_sample=True,
                          num_return_sequences=3, tree_budget=8)
    assert out.shape == (6, ids.shape[1] + 10)
    assert torch.equal(out[:3, : ids.shape[1]], ids[:1].expand(3, -1))  # each prompt repeated, in order
    assert torch.equal(out[3:, : ids.shape[1]], ids[1:].expand(3, -1))


def test_row_wise_sampling_settings_process_a_row_alone():
    """Temperature / top-k / top-p process each row on its own (no batch of copies per node), with the values the
    batch-shaped call gives; a processor that reads the sequence keeps the batch-shaped call."""
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from treeflash_hf.engine.accept import RowProcessor

    sampling = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)])
    sequence, scores = torch.tensor([[3, 1, 4]]), torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    alone = RowProcessor(sampling, batch_size=4)
    assert alone.row_wise
    batch_shaped = sampling(sequence.expand(4, -1), scores.expand(4, -1).clone())[2:3]
    assert torch.equal(alone(2, sequence, scores.clone()), batch_shaped)
    assert not RowProcessor(LogitsProcessorList([*sampling, RepetitionPenaltyLogitsProcessor(1.3)]), 4).row_wise
