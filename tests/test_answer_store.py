"""The answer store (the lookup branch's second source): matching, continuations, its file, its corpus recipe, and
losslessness when the engine reads it."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treeflash_hf import treeflash_generate
from treeflash_hf.engine import answer_store
from treeflash_hf.engine.answer_store import (
    AnswerStore,
    AnswerStoreError,
    answer_store_of,
    attach_answer_store,
)
from treeflash_hf.engine.decode import lookup_branches
from treeflash_hf.engine.lookup import LookupRates
from treeflash_hf.engine.validation import TreeFlashInputError
from treeflash_hf.recipes import corpus
from treeflash_hf.recipes.testing import matching_drafter, random_target

from .conftest import randomise_ar_layer

ANSWERS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 2, 3, 4, 6, 8], [9, 9]]


def test_the_longest_match_proposes_what_most_of_its_occurrences_continue_with():
    store = AnswerStore.from_answers(ANSWERS, vocab_size=16)
    # "2 3 4" ends the sequence (the longer "0 2 3 4" never occurs): followed by 5, 6, 6 -> 6; then one occurrence
    # ends its answer and one goes on with 8: a tie, and the end of an answer wins it (the branch stops)
    match = store.continuation([0, 2, 3, 4], length=5)
    assert (match.tokens, match.order) == ([6], 3)
    assert match.shares == [pytest.approx(2 / 3)]
    # the longer match "7 2 3 4" decides alone, up to the end of its answer
    assert store.continuation([7, 2, 3, 4], length=5).tokens == [6, 8]
    assert store.continuation([7, 2, 3, 4], length=1).tokens == [6]
    # no match runs across the end of an answer: "5 1" spans answers 0 and 1, so only "1" matches
    assert store.continuation([5, 1], length=3) == answer_store.StoreMatch([2, 3, 4], [1.0, 1.0, 1.0], 1)
    assert store.continuation([11, 12], length=3).tokens == []  # nothing matches
    # 9 is followed once by 9 and once by the end of its answer: a tie with the end ends the branch
    assert store.continuation([9], length=4).tokens == []
    # followers that agree too little end it too
    spread = AnswerStore.from_answers([[1, 2], [1, 3], [1, 4], [1, 5]], vocab_size=16)
    assert spread.continuation([1], length=2).tokens == []  # 4 different followers: 1/4 < MIN_SHARE


def test_patterns_longer_than_the_packed_key_are_filtered_on_their_tail():
    # a vocabulary of 2**20 tokens packs 3 tokens a key: 6-token patterns are a key range, then a filter
    big = 2**20
    answers = [[big - 1, 5, 6, 7, 8, 9, 10], [big - 1, 5, 6, 7, 8, 11, 12], [3, 5, 6, 7, 8, 11, 13]]
    store = AnswerStore.from_answers(answers, vocab_size=big)
    assert store.key_tokens == 3
    # followed by 9 and by 11: a tie goes to the smaller id, then its occurrence alone goes on
    assert store.continuation([big - 1, 5, 6, 7, 8], length=2).tokens == [9, 10]
    match = store.continuation([0, big - 1, 5, 6, 7, 8, 11], length=3)
    assert (match.tokens, match.order) == ([12], 6)
    assert store.occurrences([5, 6, 7, 8, 11]).tolist() == [9, 17]


def test_the_vote_is_taken_token_by_token_as_defined():
    """`continuation` counts no votes where every voter continues alike: the same tokens and shares as counting
    every vote (the definition), through ties, answers' ends and the store's end."""
    generator = np.random.default_rng(1)
    answers = [generator.integers(0, 3, size=int(generator.integers(1, 30))).tolist() for _ in range(400)]
    answers.append([0, 1, 2, 0, 1])  # the store ends inside text that occurs elsewhere
    store = AnswerStore.from_answers(answers, vocab_size=8)

    def voted(sequence, length):
        starts, order = store.longest_match(sequence)
        positions, tokens, shares = starts + order, [], []
        while order and len(tokens) < length:
            positions = positions[positions < store.tokens.size]
            if not positions.size:
                break
            following = store.tokens[positions]
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            if values[best] == answer_store.SEPARATOR or counts[best] / following.size < answer_store.MIN_SHARE:
                break
            tokens.append(int(values[best]))
            shares.append(float(counts[best]) / following.size)
            positions = positions[following == values[best]] + 1
        return tokens, shares, order

    lengths = set()
    for _ in range(500):
        answer = answers[int(generator.integers(len(answers)))]
        sequence = answer[: int(generator.integers(1, len(answer) + 1))]
        length = int(generator.integers(1, 40))
        match = store.continuation(sequence, length)
        assert (match.tokens, match.shares, match.order) == voted(sequence, length)
        lengths.add(len(match.tokens))
    assert max(lengths) >= 20 and 0 in lengths


@pytest.mark.parametrize("vocab_size", [12, 2**16, 2**21])  # keys of 8, 3 and 2 tokens
def test_the_longest_match_is_every_occurrence_of_the_longest_suffix_in_index_order(vocab_size):
    """`longest_match` finds the matches of every order from one search of the last key's tokens: the same starts,
    in the same order and sampled alike, as searching each order's pattern on its own (the definition), on
    sequences that match at every order, with more occurrences than voters."""
    generator = np.random.default_rng(0)
    answers = [generator.integers(0, 3, size=int(generator.integers(1, 40))).tolist() for _ in range(600)]
    store = AnswerStore.from_answers(answers, vocab_size=vocab_size)

    def each_order(sequence):
        for order in range(min(answer_store.MAX_ORDER, len(sequence)), 0, -1):
            starts = store.occurrences(sequence[-order:], at_most=answer_store.MAX_VOTERS)
            if starts.size:
                return starts, order
        return np.zeros(0, dtype=np.int64), 0

    orders = set()
    for _ in range(300):
        answer = answers[int(generator.integers(len(answers)))]
        cut = int(generator.integers(1, len(answer) + 1))
        sequence = [int(generator.integers(0, 4))] * int(generator.integers(0, 2)) + answer[:cut]
        starts, order = store.longest_match(sequence)
        expected_starts, expected_order = each_order(sequence)
        assert order == expected_order and np.array_equal(starts, expected_starts)
        orders.add(order)
    assert orders == set(range(1, answer_store.MAX_ORDER + 1))  # every order met
    starts, order = store.longest_match([1, 3])  # (3 never occurs)
    assert order == 0 and starts.size == 0


@pytest.mark.parametrize("vocab_size", [16, 70_000])  # two-byte tokens, and four-byte ones
def test_the_store_file_round_trips_and_bad_files_name_the_fix(tmp_path, vocab_size):
    store = AnswerStore.from_answers([[1, 2, 3], [vocab_size - 1, 0]], vocab_size, {"note": "x"})
    store.save(tmp_path / "answer_store.npz")
    loaded = AnswerStore.load(tmp_path / "answer_store.npz")
    assert np.array_equal(loaded.tokens, store.tokens) and loaded.vocab_size == vocab_size
    assert loaded.metadata == {"note": "x"}
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind
    with pytest.raises(AnswerStoreError, match="No answer store at .* build one"):
        attach_answer_store(object(), tmp_path / "missing.npz")
    (tmp_path / "broken.npz").write_bytes(b"not a store")
    with pytest.raises(AnswerStoreError, match="Cannot read the answer store .* rebuild it"):
        AnswerStore.load(tmp_path / "broken.npz")
    with pytest.raises(AnswerStoreError, match="outside the vocabulary"):
        AnswerStore.from_answers([[vocab_size]], vocab_size)


def test_the_corpus_store_holds_the_answers_and_follows_the_corpus(tmp_path):
    settings = {"answers": {"greedy": True}}
    rows = [corpus.CorpusRow(np.array([7, 7, 1, 2, 3]), 2, corpus.request_id("a"), "magpie"),
            corpus.CorpusRow(np.array([8, 4, 5]), 1, corpus.request_id("b"), "code")]
    corpus.write_shard(tmp_path / "corpus", rows, vocab_size=16, end_token_id=0, generation=settings)
    drafter_folder = tmp_path / "drafter"
    drafter_folder.mkdir()
    path = corpus.ensure_answer_store(drafter_folder, tmp_path / "corpus")
    store = AnswerStore.load(path)
    assert store.tokens.tolist() == [1, 2, 3, -1, 4, 5, -1]  # answers only, prompts left out
    assert corpus.store_is_current(path, tmp_path / "corpus")
    stamp = path.stat().st_mtime_ns
    assert corpus.ensure_answer_store(drafter_folder, tmp_path / "corpus") == path
    assert path.stat().st_mtime_ns == stamp  # current: not written again
    more = [corpus.CorpusRow(np.array([9, 6]), 1, corpus.request_id("c"), "magpie")]
    corpus.write_shard(tmp_path / "corpus", more, vocab_size=16, end_token_id=0, generation=settings)
    assert not corpus.store_is_current(path, tmp_path / "corpus")
    assert AnswerStore.load(corpus.ensure_answer_store(drafter_folder, tmp_path / "corpus")).metadata["answers"] == 3
    assert corpus.ensure_answer_store(drafter_folder, tmp_path / "empty") is None
    with pytest.raises(corpus.CorpusFormatError, match="No corpus shards"):
        corpus.corpus_answer_store(tmp_path / "empty")


def test_the_branch_comes_from_the_source_expected_to_yield_more():
    store = AnswerStore.from_answers([[2, 3, 4, 5, 6, 7, 8, 9]], vocab_size=16)
    rows = SimpleNamespace(token_ids=[[4, 5, 1, 2, 3, 4, 5]], pads=[0])
    rates = LookupRates()
    # the row's own text proposes "4 5 -> 1 2 3 4", the store "2 3 4 5 -> 6 7 8 9": as likely while nothing is
    # learned, and a tie goes to the row's own text
    assert lookup_branches(rows, rates, [4])[1] == [("sequence", 2)]
    assert lookup_branches(rows, rates, [4], store)[1] == [("sequence", 2)]
    for _ in range(10):  # the store's branches of this order are accepted whole
        rates.observe(("store", 4), [6, 7, 8, 9], [6, 7, 8, 9])
    branches, sources = lookup_branches(rows, rates, [4], store)
    assert sources == [("store", 4)] and branches[0][0] == [6, 7, 8, 9]
    for _ in range(60):  # ... then keep failing
        rates.observe(("store", 4), [6, 7, 8, 9], [0])
    assert lookup_branches(rows, rates, [4], store)[1] == [("sequence", 2)]
    assert lookup_branches(rows, rates, [0], store) == ([([], [])], [("none", 0)])  # no branch asked for


@pytest.fixture(scope="module")
def looping_pair():
    target = random_target("qwen3", vocab_size=16, seed=5)
    drafter = randomise_ar_layer(matching_drafter(target, seed=6))
    return target, drafter


@pytest.mark.parametrize("budget", [8, "auto"])
def test_greedy_output_with_the_store_is_the_targets(looping_pair, budget):
    target, drafter = looping_pair
    prompts = [torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[2, 7, 1, 8, 2, 8]])]
    references = [target.generate(prompt, max_new_tokens=40, do_sample=False) for prompt in prompts]
    # the store holds the target's own answers to these prompts (the best case: whole answers to copy)
    store = AnswerStore.from_answers([ref[0, prompt.shape[1]:].tolist() for ref, prompt in zip(references, prompts)],
                                     vocab_size=16)
    attach_answer_store(drafter, store)
    try:
        settings = dict(tree_mode="treeflash", tree_budget=budget, tree_top_m=4, tree_top_k=4, tree_lookup=8)
        accepted = 0
        for prompt, reference in zip(prompts, references):
            out = treeflash_generate(target, drafter, prompt, max_new_tokens=40, **settings)
            assert torch.equal(out.sequences, reference)
            accepted += sum(out.accepted_lengths)
        steps_alone = sum(len(treeflash_generate(target, drafter, p, max_new_tokens=40, tree_mode="treeflash",
                                                 tree_budget=budget, tree_top_m=4, tree_top_k=4,
                                                 tree_lookup=0).accepted_lengths) for p in prompts)
        assert accepted > 0
        assert sum(len(treeflash_generate(target, drafter, p, max_new_tokens=40, **settings).accepted_lengths)
                   for p in prompts) < steps_alone  # copying whole answers takes fewer steps than drafting
    finally:
        attach_answer_store(drafter, None)


def test_a_store_for_another_vocabulary_is_refused(looping_pair):
    target, drafter = looping_pair
    attach_answer_store(drafter, AnswerStore.from_answers([[1, 2, 3]], vocab_size=32))
    try:
        with pytest.raises(TreeFlashInputError, match="vocabulary of 32 tokens, more than this target.s 16"):
            treeflash_generate(target, drafter, torch.tensor([[1, 2]]), max_new_tokens=4, tree_lookup=4)
        # without the lookup branch the store is not read
        treeflash_generate(target, drafter, torch.tensor([[1, 2]]), max_new_tokens=4, tree_lookup=0)
    finally:
        attach_answer_store(drafter, None)


def test_a_drafter_folder_with_a_store_brings_it(tmp_path, looping_pair):
    _, drafter = looping_pair
    fresh = matching_drafter(looping_pair[0], seed=7)
    fresh.save_pretrained(tmp_path)
    AnswerStore.from_answers([[1, 2, 3]], vocab_size=16).save(tmp_path / answer_store.STORE_FILE)
    loaded = type(fresh).from_pretrained(tmp_path)
    assert answer_store_of(loaded).tokens.tolist() == [1, 2, 3, -1]
    attach_answer_store(loaded, None)  # detached: not even the folder's
    assert answer_store_of(loaded) is None
    assert answer_store_of(drafter) is None  # a drafter made in memory has no folder
