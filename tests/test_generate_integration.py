"""`target.generate(assistant_model=drafter, ...)`: arguments honoured the way transformers users expect."""

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from treeflash_hf import TreeOptions, treeflash_generate
from treeflash_hf.recipes.testing import matching_drafter, random_target

from .conftest import randomise_ar_layer
from .oracle import OracleCandidateGenerator

PROMPT = torch.tensor([[11, 42, 7, 99, 3, 250, 18]])


class Collector(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended += 1


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.fixture(scope="module")
def pair():
    target = random_target("qwen3", seed=0)
    return target, randomise_ar_layer(matching_drafter(target, seed=1))


def test_streamer_gets_every_token_then_end(pair):
    target, drafter = pair
    streamer = Collector()
    out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=15, do_sample=False, streamer=streamer,
                          tree_budget=8)
    assert streamer.chunks[0] == PROMPT.tolist()  # the prompt first, like stock generate()
    streamed = [token for chunk in streamer.chunks[1:] for token in chunk]
    assert streamed == out[0, PROMPT.shape[1]:].tolist() and streamer.ended == 1


def test_return_dict_has_statistics_and_scores(pair):
    target, drafter = pair
    out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=15, do_sample=False, tree_budget=8,
                          return_dict_in_generate=True, output_scores=True, output_logits=True)
    new_tokens = out.sequences.shape[1] - PROMPT.shape[1]
    assert new_tokens == 15
    assert len(out.scores) == len(out.logits) == new_tokens
    assert [int(s.argmax()) for s in out.scores] == out.sequences[0, PROMPT.shape[1]:].tolist()
    assert len(out.accepted_lengths) == len(out.tree_sizes) == len(out.expected_accepted_lengths)
    # prefill emits one token, every verification step emits accepted + 1 (the last step may be cut short)
    assert 1 + sum(a + 1 for a in out.accepted_lengths) >= new_tokens
    assert out.tau == pytest.approx(1 + sum(out.accepted_lengths) / len(out.accepted_lengths))
    assert max(out.tree_sizes) <= 8


def test_stopping_criteria_checked_token_by_token():
    """With deep acceptance, a stop in the middle of an accepted block must not let later tokens through."""
    target = random_target("qwen3", seed=5)
    drafter = randomise_ar_layer(matching_drafter(target, seed=6))
    reference = target.generate(PROMPT, max_new_tokens=60, do_sample=False)[0].tolist()
    generated = reference[PROMPT.shape[1]:]
    stop_at = next(i for i in range(12, len(generated)) if generated.index(generated[i]) == i)
    stop_token = generated[stop_at]
    expected_len = PROMPT.shape[1] + stop_at + 1
    options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=8, tree_top_k=8)
    oracle = OracleCandidateGenerator(drafter, target, options, reference, seed=3, miss_prob=0.0, max_rank=0)
    out = treeflash_generate(target, drafter, PROMPT, max_new_tokens=40, candidate_generator=oracle,
                             stopping_criteria=StoppingCriteriaList([StopAfterToken(stop_token)]), tree_budget=16,
                             tree_top_m=8, tree_top_k=8)
    assert out.sequences[0].tolist() == reference[:expected_len]
    assert max(out.accepted_lengths) >= 3  # blocks really were accepted several tokens at a time


def test_stock_stopping_criteria_argument(pair):
    target, drafter = pair
    reference = target.generate(PROMPT, max_new_tokens=30, do_sample=False)[0].tolist()
    stop_token = reference[PROMPT.shape[1] + 5]
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    expected = target.generate(PROMPT, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                          stopping_criteria=criteria)
    assert torch.equal(out, expected)


def test_attention_mask_and_left_padding(pair):
    target, drafter = pair
    ones = torch.ones_like(PROMPT)
    reference = target.generate(PROMPT, attention_mask=ones, max_new_tokens=12, do_sample=False)
    out = target.generate(PROMPT, attention_mask=ones, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, reference)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), ones], dim=1)
    reference = target.generate(padded, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(padded, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                          tree_budget=16)
    assert torch.equal(out, reference)


def test_knobs_from_generation_config_and_per_call_overrides(pair):
    target, drafter = pair
    saved = drafter.generation_config
    try:
        drafter.generation_config = GenerationConfig(tree_mode="chain", tree_budget=3)
        out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=10, return_dict_in_generate=True)
        assert max(out.tree_sizes) == 3
        out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=10, return_dict_in_generate=True,
                              tree_budget=5, tree_mode="marginal_tree")
        assert max(out.tree_sizes) == 5
    finally:
        drafter.generation_config = saved


def test_plain_function_matches_generate(pair):
    target, drafter = pair
    via_generate = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                                   tree_budget=16)
    plain = treeflash_generate(target, drafter, PROMPT, max_new_tokens=12, tree_budget=16)
    assert torch.equal(plain.sequences, via_generate)


def test_other_assistants_keep_stock_behaviour(pair):
    target, _ = pair
    small = random_target("qwen3", num_layers=1, seed=9)
    reference = target.generate(PROMPT, max_new_tokens=10, do_sample=False)
    out = target.generate(PROMPT, assistant_model=small, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, reference)
    with pytest.raises(TypeError, match="apply only to TreeFlash"):
        target.generate(PROMPT, max_new_tokens=3, tree_budget=4)
