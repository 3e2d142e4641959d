"""The lookup branch (`tree_lookup`): n-gram matching, merging into the best-first search, the schedule that
skips the drafter, and losslessness with it."""

import copy
import pickle
import threading

import pytest
import torch
from transformers import GenerationConfig

from treeflash_hf import TreeOptions, forget_learned_state, treeflash_generate
from treeflash_hf.engine.draft import TreeDrafter
from treeflash_hf.engine.learned import learned_state
from treeflash_hf.engine.lookup import (
    LookupRates,
    StepScheduler,
    expected_accepted,
    ngram_continuation,
    useful_length,
    with_lookup_branch,
)
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.tree import best_first_tree, table_children

from .conftest import randomise_ar_layer


def test_ngram_continuation_prefers_the_longest_most_recent_match():
    sequence = torch.tensor([5, 6, 7, 1, 9, 6, 7, 2, 3, 8, 6, 7])
    # "6 7" occurs at 1 and 5: the most recent earlier occurrence (5) proposes what followed it.
    assert ngram_continuation(sequence, max_ngram=2, length=3) == ([2, 3, 8], 2)
    # With trigrams, "8 6 7" never occurred before, so the bigram decides.
    assert ngram_continuation(sequence, max_ngram=3, length=2) == ([2, 3], 2)
    # "9 6 7" occurred once: the trigram wins over the more recent bigram.
    assert ngram_continuation(torch.tensor([9, 6, 7, 4, 6, 7, 5, 9, 6, 7]), 3, 2) == ([4, 6], 3)
    assert ngram_continuation(torch.tensor([1, 2, 3]), 3, 4) == ([], 0)
    # Periodic text: the copy at distance 3 continues over its own output, past the end of the sequence.
    assert ngram_continuation(torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), 3, 7) == ([3, 1, 2, 3, 1, 2, 3], 3)
    assert ngram_continuation(torch.tensor([4]), 3, 4) == ([], 0)


def test_ngram_continuation_is_the_windowed_search():
    """The one-pass search gives what comparing every window of each length gives (the definition), on random
    sequences over few tokens (matches of every length, several occurrences each)."""
    def windowed(sequence, max_ngram, length):
        total = sequence.shape[0]
        for n in range(min(max_ngram, total - 1), 0, -1):
            windows = sequence[: total - 1].unfold(0, n, 1)
            starts = (windows == sequence[total - n :]).all(dim=-1).nonzero()[:, 0]
            if starts.numel():
                period = sequence[int(starts[-1]) + n :].tolist()
                return (period * (length // len(period) + 1))[:length], n
        return [], 0

    generator = torch.Generator().manual_seed(0)
    lengths = set()
    for trial in range(400):
        sequence = torch.randint(0, 2 + trial % 5, (int(torch.randint(1, 60, (1,), generator=generator)),),
                                 generator=generator)
        for max_ngram in (1, 3, 5):
            expected = windowed(sequence, max_ngram, 7)
            assert ngram_continuation(sequence, max_ngram, 7) == expected
            assert ngram_continuation(sequence.tolist(), max_ngram, 7) == expected
            lengths.add(expected[1])
    assert lengths == {0, 1, 2, 3, 4, 5}


def test_lookup_branch_is_merged_into_the_best_first_search():
    # Marginal-style tables: every depth offers tokens 10, 11 with log-probs -0.125, -2.5.
    children = table_children(torch.tensor([[10, 11]] * 4), torch.tensor([[-0.125, -2.5]] * 4), lambda d, t: d)
    plain = best_first_tree(0, children, budget=5, max_depth=4)
    assert 42 not in plain.tokens.tolist()
    branch = with_lookup_branch(children, [42, 43, 10], [-0.0625] * 3)
    tree = best_first_tree(0, branch, budget=5, max_depth=4)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    # the branch root -> 42 -> 43 -> 10 is in the tree, each node below the previous one
    first = tokens.index(42)
    second = tokens.index(43)
    assert parents[first] == 0 and parents[second] == first
    assert any(t == 10 and parents[i] == second for i, t in enumerate(tokens))
    # A branch token the drafter already proposes keeps the larger of the two log-probs, children stay sorted.
    merged = with_lookup_branch(children, [11], [-1.0])(0, 0)
    assert merged == ([10, 11], [-0.125, -1.0])
    assert with_lookup_branch(children, [10], [-1.0])(0, 0) == ([10, 11], [-0.125, -2.5])
    # off the branch, the tables are untouched
    assert with_lookup_branch(children, [42, 43], [-0.0625] * 2)(1, 10) == ([10, 11], [-0.125, -2.5])


def test_lookup_rates_learn_per_depth_up_to_the_first_miss():
    BIGRAM = ("sequence", 2)
    rates = LookupRates(priors=(0.5,) * 6, prior_count=2.0, decay=1.0)
    rates.observe(BIGRAM, proposed=[1, 2, 3, 4], target_tokens=[1, 2, 9, 4])  # depths 1, 2 hit; 3 misses; 4 untried
    assert rates.rate(BIGRAM, depth=1) == pytest.approx((1 + 1) / (1 + 2))
    assert rates.rate(BIGRAM, depth=2) == pytest.approx((1 + 1) / (1 + 2))
    assert rates.rate(BIGRAM, depth=3) == pytest.approx((0 + 1) / (1 + 2))
    assert rates.rate(BIGRAM, depth=4) == rates.rate(BIGRAM, depth=3)  # one bucket for depths 3-4
    assert rates.rate(("sequence", 1)) == pytest.approx(0.5)
    # The branch is cut after the first token whose path probability drops below the floor.
    assert useful_length(rates.log_probs(BIGRAM, 10), min_path_prob=0.4) == 3  # path probs 2/3, 4/9, 4/27 (kept)
    assert useful_length(rates.log_probs(BIGRAM, 10), min_path_prob=1e-9) == 10


def test_scheduler_skips_the_drafter_only_when_that_is_faster():
    scheduler = StepScheduler(explore_every=1000)
    expected = expected_accepted(LookupRates().log_probs(("sequence", 2), 4))  # a 4-token branch from a bigram match
    assert scheduler.choose([expected]) == "draft"  # nothing measured yet
    scheduler.observe("draft", seconds=0.010, accepted=[3], branch_expected=[expected])
    assert scheduler.choose([expected]) == "lookup"  # a draft step is measured, a lookup step not yet: try it
    scheduler.observe("lookup", seconds=0.004, accepted=[2], branch_expected=[expected])
    branch = 1 + expected
    faster_alone = branch / 0.004 > (branch + scheduler.drafter_gain) / 0.010
    assert scheduler.choose([expected]) == ("lookup" if faster_alone else "draft")
    scheduler.drafter_gain = 10.0  # the drafter adds a lot: drafting wins
    assert scheduler.choose([expected]) == "draft"
    assert scheduler.choose([None]) == "draft"  # no branch, and plain steps are not allowed: draft
    # Plain steps (auto budget only) win when the drafter's tokens are not worth its time.
    auto = StepScheduler(allow_plain=True, explore_every=3)
    auto.observe("draft", seconds=0.010, accepted=[1], branch_expected=[None])  # 2 tokens in 10 ms
    assert auto.choose([None]) == "plain"  # untried
    auto.observe("plain", seconds=0.004, accepted=[0], branch_expected=[None])  # 1 token in 4 ms
    kinds = [auto.choose([None]) for _ in range(11)]
    # every 3rd step drafts anyway; drafting still loses, so the next try waits twice as long (6 steps)
    assert kinds == ["plain", "draft"] + ["plain"] * 5 + ["draft"] + ["plain"] * 3
    auto.drafter_gain = None
    auto.draft_tokens = 10.0  # the drafter now yields 10 tokens per 10 ms: drafting wins, its wait resets
    assert auto.choose([None]) == "draft"
    # ... and the losing plain kind is retried after its own wait, so one bad measurement cannot bar it
    assert [auto.choose([None]) for _ in range(4)] == ["draft", "plain", "draft", "draft"]
    auto.draft_tokens = 2.0
    assert [auto.choose([None]) for _ in range(3)] == ["plain", "plain", "draft"]
    # A plain step costs at least the target's forward over one token per row: judged at that bound until it is
    # measured, and not tried while it would lose even at the bound
    bounded = StepScheduler(allow_plain=True, explore_every=2)
    bounded.observe("draft", seconds=0.010, accepted=[1], branch_expected=[None])  # 2 tokens in 10 ms
    assert [bounded.choose([None], lower_bounds={"plain": 0.006}) for _ in range(6)] == ["draft"] * 6
    assert bounded.choose([None], lower_bounds={"plain": 0.004}) == "plain"  # 1 token in 4 ms could win: tried
    bounded.observe("plain", seconds=0.0055, accepted=[0], branch_expected=[None])  # measured: it loses
    assert [bounded.choose([None], lower_bounds={"plain": 0.004}) for _ in range(4)] == ["draft", "plain"] + \
        ["draft"] * 2  # it could still win at its bound: retried after its wait
    assert [bounded.choose([None], lower_bounds={"plain": 0.006}) for _ in range(8)] == ["draft"] * 8
    # The scheduler says which of its choices are tries (an untried or a losing kind), so that a drafted try is
    # built at the width the drafted kind would use rather than explored wider on top
    tries = StepScheduler(allow_plain=True, explore_every=2)
    assert tries.choose([None]) == "draft" and tries.explored  # untried
    tries.observe("draft", seconds=0.010, accepted=[1], branch_expected=[None])
    assert tries.choose([None]) == "plain" and tries.explored  # untried
    tries.observe("plain", seconds=0.004, accepted=[0], branch_expected=[None])
    assert [(tries.choose([None]), tries.explored) for _ in range(6)] == [("draft", True)] + [("plain", False)] * 3 \
        + [("draft", True), ("plain", False)]  # drafting loses (2 tokens in 10 ms): tried after its waits
    # A batch step is judged on the batch: tokens summed over rows, times learned per number of rows.
    batched = StepScheduler(allow_plain=True, explore_every=1000)
    batched.observe("draft", seconds=0.010, accepted=[1], branch_expected=[None])
    batched.observe("plain", seconds=0.004, accepted=[0], branch_expected=[None])
    assert batched.choose([None]) == "plain"
    assert batched.choose([None, None]) == "draft"  # nothing measured for two rows yet: try each kind
    batched.observe("draft", seconds=0.011, accepted=[3, 3], branch_expected=[None, None])
    assert batched.choose([None, None]) == "plain"  # untried for two rows
    batched.observe("plain", seconds=0.006, accepted=[0, 0], branch_expected=[None, None])
    assert batched.expected_tokens([None, None])["plain"] == 2.0
    draft_rate = batched.expected_tokens([None, None])["draft"] / 0.011
    assert batched.choose([None, None]) == ("draft" if draft_rate > 2 / 0.006 else "plain")


@pytest.fixture(scope="module")
def looping_pair():
    """A small-vocabulary random target: its greedy continuations repeat, so the lookup branch matches often."""
    target = random_target("qwen3", vocab_size=16, seed=5)
    drafter = randomise_ar_layer(matching_drafter(target, seed=6))
    return target, drafter


class ContextCheckingGenerator(TreeDrafter):
    """Asserts that every draft sees the drafter context of every committed position before its anchor,
    whether or not earlier steps skipped the drafter."""

    def draft(self, anchor_tokens, anchor_positions, context, max_depth, prev_tokens=None, scored_depth=None):
        cached = self.cache.get_seq_length() if self.key_valid is None else self.key_valid.sum(dim=1)
        new = context.features.shape[1] if context.valid is None else context.valid.sum(dim=1)
        assert torch.equal(torch.as_tensor(cached + new).expand(len(anchor_tokens)), anchor_positions)
        return super().draft(anchor_tokens, anchor_positions, context, max_depth, prev_tokens, scored_depth)


@pytest.mark.parametrize("schedule", ["measured", "always_lookup", "lookup_or_plain"])
@pytest.mark.parametrize("mode,budget", [("treeflash", 8), ("marginal_tree", 4), ("treeflash", "auto")])
def test_greedy_output_with_lookup_is_the_targets(looping_pair, mode, budget, schedule, monkeypatch):
    target, drafter = looping_pair
    if schedule == "always_lookup":
        monkeypatch.setattr(StepScheduler, "choose",
                            lambda self, branches, **_: "draft" if branches == [None] else "lookup")
    if schedule == "lookup_or_plain":  # every kind of step, the drafter skipped as often as possible
        kinds = iter(["draft", "plain", "plain"] * 100)
        monkeypatch.setattr(StepScheduler, "choose",
                            lambda self, branches, **_: next(kinds) if branches == [None] else "lookup")
    options = TreeOptions(tree_mode=mode, tree_budget=budget, tree_top_m=4, tree_top_k=4, tree_lookup=5)
    skipped_steps = 0
    for prompt in ([[3, 1, 4, 1, 5]], [[2, 7, 1, 8, 2, 8]]):
        prompt = torch.tensor(prompt)
        reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
        generator = ContextCheckingGenerator(drafter, target, options)
        out = treeflash_generate(target, drafter, prompt, max_new_tokens=40, candidate_generator=generator,
                                 tree_mode=mode, tree_budget=budget, tree_top_m=4, tree_top_k=4, tree_lookup=5)
        assert torch.equal(out.sequences, reference), (mode, budget, schedule)
        skipped_steps += sum(kind != "draft" for kind in out.step_kinds)
        assert len(out.step_kinds) == len(out.accepted_lengths)
        assert all(size == 1 for size, kind in zip(out.tree_sizes, out.step_kinds) if kind == "plain")
    if schedule != "measured":
        assert skipped_steps > 0, "no step skipped the drafter: the test would not exercise it"


def test_lookup_needs_a_tree_and_a_non_negative_length():
    with pytest.raises(ValueError, match="tree_lookup"):
        TreeOptions(tree_mode="chain", tree_lookup=4)
    with pytest.raises(ValueError, match="tree_lookup=-1"):
        TreeOptions(tree_lookup=-1)


def test_learned_state_carries_over_calls_per_pair_and_settings(looping_pair):
    target, drafter = looping_pair
    forget_learned_state(drafter)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    settings = dict(tree_mode="treeflash", tree_budget="auto", tree_top_m=4, tree_top_k=4, tree_lookup=5)
    options = TreeOptions(**settings)
    greedy = GenerationConfig(do_sample=False)
    first = treeflash_generate(target, drafter, prompt, max_new_tokens=30, **settings)
    state = learned_state(drafter, target, options, greedy)
    steps_seen = dict(state.schedule.seconds)
    assert steps_seen, "the first call's measurements were not kept"
    assert state.auto_budget is not None and state.auto_budget.verified_extent > 0
    second = treeflash_generate(target, drafter, prompt, max_new_tokens=30, **settings)
    assert learned_state(drafter, target, options, greedy) is state  # the same state, grown by the second call
    assert torch.equal(first.sequences, second.sequences)  # what is verified changed, never what is emitted
    # Other settings learn apart: another budget, or sampling.
    fixed = TreeOptions(**{**settings, "tree_budget": 8})
    assert learned_state(drafter, target, fixed, greedy) is not state
    assert learned_state(drafter, target, fixed, greedy).auto_budget is None
    assert learned_state(drafter, target, options, GenerationConfig(do_sample=True, temperature=0.7)) is not state
    # Another thread learns apart, so concurrent generate() calls never race on one state.
    other_thread: list = []
    worker = threading.Thread(target=lambda: other_thread.append(learned_state(drafter, target, options, greedy)))
    worker.start()
    worker.join()
    assert other_thread[0] is not state
    # Copies and pickles of the drafter start afresh (and do not drag the target along).
    for copied in (copy.deepcopy(drafter), pickle.loads(pickle.dumps(drafter))):
        assert not learned_state(copied, target, options, greedy).schedule.seconds
    assert learned_state(drafter, target, options, greedy) is state
    forget_learned_state(drafter)
    fresh = learned_state(drafter, target, options, greedy)
    assert fresh is not state and not fresh.schedule.seconds


def test_a_drafted_step_is_judged_by_the_part_of_the_branch_its_tree_holds():
    # a 20-token branch verified alone may yield 6 tokens; a drafted tree of 8 nodes holds 7 of them, worth 2
    scheduler = StepScheduler(explore_every=1000)
    scheduler.observe("draft", seconds=0.010, accepted=[3], branch_expected=[2.0])  # the drafter added 1
    scheduler.observe("lookup", seconds=0.009, accepted=[6], branch_expected=[6.0])
    assert scheduler.drafter_gain == 1.0
    assert scheduler.expected_tokens([6.0], in_tree=[2.0]) == {"draft": 1 + 2.0 + 1.0, "lookup": 1 + 6.0}
    assert scheduler.choose([6.0], in_tree=[2.0]) == "lookup"  # 7 tokens in 9 ms beat 4 in 10
    # judged by the whole branch, the drafted step would be credited with tokens its tree cannot hold (8 in 10 ms)
    assert scheduler.expected_tokens([6.0])["draft"] == 1 + 6.0 + 1.0
    assert scheduler.choose([6.0]) == "draft"
