"""The draft vocabulary (`draft_vocab_size` / `draft_token_ids`): drafts come from a subset of the target's tokens,
scored on those head rows only; verification, and so the output, stays the target's."""

import json
import math
from unittest import mock

import pytest
import torch
from transformers import AutoModel

from treeflash_hf import TreeFlashCandidateGenerator, TreeOptions
from treeflash_hf.engine.draft import TargetHead
from treeflash_hf.integrations import cpu_linear
from treeflash_hf.training.draft_vocab import frequent_tokens
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.validation import TreeFlashInputError

from .conftest import randomise_ar_layer
from .test_drafter_model import draft_once

VOCAB = 256
PROMPTS = [torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), torch.tensor([[27, 18, 28, 18, 28, 45]])]


@pytest.fixture(scope="module")
def pair():
    target = random_target("qwen3", vocab_size=VOCAB, seed=0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    return target, drafter


def half_vocab(seed: int = 0) -> torch.LongTensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: VOCAB // 2]


def test_marginals_are_the_full_marginals_renormalised_on_the_draft_vocab(pair):
    target, drafter = pair
    options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=4, tree_top_k=4)
    _, full = draft_once(target, drafter, PROMPTS[0], options)
    vocab = half_vocab()
    drafter.set_draft_vocab(vocab)
    try:
        generator, block = draft_once(target, drafter, PROMPTS[0], options)
    finally:
        drafter.set_draft_vocab(None)
    expected = torch.log_softmax(full.marginal_log_probs[:, vocab], dim=-1)
    torch.testing.assert_close(block.marginal_log_probs, expected)
    assert set(block.shortlist.tokens.flatten().tolist()) <= set(vocab.tolist())
    # laid out over the whole vocabulary for callers that index by token id
    spread = generator.full_vocabulary(block.marginal_log_probs)
    assert spread.shape == (block.depth, VOCAB)
    torch.testing.assert_close(spread[:, vocab], block.marginal_log_probs)
    assert torch.isinf(spread).sum() == block.depth * (VOCAB - len(vocab))


@pytest.mark.parametrize("mode", ["chain", "marginal_tree", "treeflash"])
@pytest.mark.parametrize("shortlist", [None, 16])
def test_every_drafted_token_is_in_the_draft_vocab(pair, mode, shortlist):
    target, drafter = pair
    vocab = half_vocab(seed=1)
    allowed = set(vocab.tolist())
    drafter.set_draft_vocab(vocab)
    try:
        for evaluation in ("batched", "lazy"):
            options = TreeOptions(tree_mode=mode, tree_budget=24, tree_top_m=4, tree_top_k=4)
            generator, block = draft_once(target, drafter, PROMPTS[1], options, ar_shortlist=shortlist,
                                          ar_evaluation=evaluation)
            tree = generator.build_tree(block, 24)
            assert tree.tokens.numel() > 1
            assert set(tree.tokens[1:].tolist()) <= allowed, (mode, shortlist, evaluation)
    finally:
        drafter.set_draft_vocab(None)


@pytest.mark.parametrize("mode", ["chain", "marginal_tree", "treeflash"])
def test_greedy_output_with_a_draft_vocab_is_the_targets(pair, mode):
    """The target still emits tokens outside the draft vocabulary: they are its bonus tokens."""
    target, drafter = pair
    vocab = half_vocab(seed=2)
    emitted_outside = 0
    drafter.set_draft_vocab(vocab)
    try:
        for prompt in PROMPTS:
            reference = target.generate(prompt, max_new_tokens=24, do_sample=False)
            emitted_outside += sum(token not in set(vocab.tolist()) for token in reference[0, prompt.shape[1]:].tolist())
            for budget, lookup in ((1, 0), (4, 0), (16, 0)) + (((16, 8),) if mode != "chain" else ()):
                out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                                      tree_mode=mode, tree_budget=budget, tree_lookup=lookup)
                assert torch.equal(out, reference), (mode, budget, lookup)
    finally:
        drafter.set_draft_vocab(None)
    assert emitted_outside > 0


def test_stock_assisted_decoding_gets_full_vocabulary_candidate_logits(pair):
    """Transformers' assisted loop indexes the candidates' logits by token id: they come laid out over the whole
    vocabulary, and its output stays the target's."""
    target, drafter = pair
    prompt = PROMPTS[0]
    reference = target.generate(prompt, max_new_tokens=16, do_sample=False)
    drafter.set_draft_vocab(half_vocab(seed=3))
    try:
        generator = TreeFlashCandidateGenerator(drafter, target, TreeOptions(tree_mode="chain"),
                                                max_length=prompt.shape[1] + 16)
        shapes = []
        original = generator.get_candidates

        def recording(*args, **kwargs):
            candidates, logits = original(*args, **kwargs)
            shapes.append(None if logits is None else tuple(logits.shape))
            return candidates, logits

        generator.get_candidates = recording
        with mock.patch.object(type(target), "_get_candidate_generator", return_value=generator):
            out = target.generate(prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=16,
                                  do_sample=False)
    finally:
        drafter.set_draft_vocab(None)
    assert torch.equal(out, reference)
    assert any(shape is not None and shape[-1] == VOCAB for shape in shapes), shapes


def test_draft_vocab_is_saved_loaded_and_checked(pair, tmp_path):
    target, _ = pair
    drafter = matching_drafter(target, seed=4)
    vocab = half_vocab(seed=4)
    drafter.set_draft_vocab(vocab)
    drafter.save_pretrained(tmp_path / "d")
    loaded = AutoModel.from_pretrained(tmp_path / "d")
    assert loaded.config.draft_vocab_size == len(vocab)
    assert torch.equal(loaded.draft_token_ids, vocab)
    loaded.set_draft_vocab(None)
    assert loaded.config.draft_vocab_size is None and getattr(loaded, "draft_token_ids", None) is None
    for bad in ([1, 1, 2], [0, VOCAB], []):
        with pytest.raises(ValueError, match="distinct token ids"):
            drafter.set_draft_vocab(torch.tensor(bad, dtype=torch.long))
    # a corrupt checkpoint's ids: one clear error when generation starts
    drafter.draft_token_ids[0] = VOCAB + 7
    with pytest.raises(TreeFlashInputError, match="draft vocabulary.*corrupt"):
        target.generate(PROMPTS[0], assistant_model=drafter, max_new_tokens=4, do_sample=False)


def test_head_rows_of_the_draft_vocab_are_gathered_once(pair):
    target, _ = pair
    head = TargetHead(target.lm_head, 64, torch.device("cpu"), torch.float32)
    vocab = half_vocab(seed=5)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head.logits(hidden, vocab), head.logits(hidden)[:, vocab])
    rows = head.weight_rows(vocab).weight
    assert head.weight_rows(vocab).weight is rows  # kept while the ids are the same
    assert head.weight_rows(half_vocab(seed=6)).weight is not rows
    # a head without a dense weight (called as a module) scores every token, then keeps the draft vocabulary's
    called = TargetHead(torch.nn.Sequential(target.lm_head), 64, torch.device("cpu"), torch.float32)
    assert called.weight is None
    torch.testing.assert_close(called.logits(hidden, vocab), head.logits(hidden, vocab))


@pytest.mark.skipif(not cpu_linear.packable_dtypes(), reason="this torch has no oneDNN")
def test_head_rows_take_the_kernel_the_targets_head_runs(pair):
    """A target whose head runs through oneDNN's packed weights (`pack_linears`) has its draft vocabulary's rows
    scored the same way; a stock head keeps the stock product. Both give the rows' logits."""
    target, _ = pair
    vocab, hidden = half_vocab(seed=5), torch.randn(5, 64)
    head = torch.nn.Linear(64, VOCAB, bias=True)
    stock = TargetHead.of(head, 64, torch.device("cpu"), torch.float32)
    assert stock.weight_rows(vocab).packed is None
    expected = stock.logits(hidden, vocab)
    cpu_linear.pack_linears(torch.nn.Sequential(head))
    packed = TargetHead.of(head, 64, torch.device("cpu"), torch.float32)
    assert packed is not stock  # (packing swaps the class in place: the kept TargetHead is made again)
    assert packed.weight_rows(vocab).packed is not None
    calls = []
    with mock.patch("treeflash_hf.engine.draft.packed_product",
                    side_effect=lambda *args: calls.append(1) or cpu_linear.packed_product(*args)):
        with torch.no_grad():
            torch.testing.assert_close(packed.logits(hidden, vocab), expected, rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_frequent_tokens_rank_by_count_and_keep_required_tokens():
    sequences = [[5, 5, 5, 7, 7, 9], [7, 5, 1]]
    ids, coverage = frequent_tokens(sequences, size=2, vocab_size=10)
    assert ids.tolist() == [5, 7] and coverage == pytest.approx(7 / 9)
    ids, _ = frequent_tokens(sequences, size=3, vocab_size=10, required=[2])
    assert ids.tolist() == [2, 5, 7]
    ids, _ = frequent_tokens(sequences, size=12, vocab_size=10)
    assert sorted(ids.tolist()) == list(range(10))  # more than the vocabulary: every token


def test_recipe_gives_a_saved_drafter_its_draft_vocab(pair, tmp_path):
    from treeflash_hf.recipes.drafter_recipe import DRAFT_VOCAB_HEADING, apply_draft_vocab

    target, _ = pair
    folder = tmp_path / "drafter"
    matching_drafter(target, seed=7).save_pretrained(folder)
    (folder / "README.md").write_text("# drafter\n\nTrained here.\n")
    sizes = {"size": 128, "answer_requests": 3, "answer_tokens": 40, "code_tokens": 50, "answer_coverage": 0.9}
    for seed in (7, 8):  # applied twice: the second replaces the first
        apply_draft_vocab(folder, half_vocab(seed=seed), sizes)
    loaded = AutoModel.from_pretrained(folder)
    assert torch.equal(loaded.draft_token_ids, half_vocab(seed=8))
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# drafter") and readme.count(DRAFT_VOCAB_HEADING) == 1 and "128 tokens" in readme
    assert json.loads((folder / "training_summary.json").read_text())["draft_vocab"] == sizes


def test_a_top_k_teacher_on_a_draft_vocab_drops_the_tokens_outside_it():
    """Cached features keep the target's top-K: on a draft vocabulary its entries become columns, and entries
    outside it count nothing in the KL (as the tail beyond K counts nothing)."""
    from treeflash_hf.training.drafter import Teacher

    vocab = torch.tensor([7, 2, 5, 0])
    teacher = Teacher(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), torch.tensor([[2, 6, 0]]))
    columns = teacher.on_columns(vocab, 8)
    assert columns.ids.tolist() == [[1, 0, 3]] and columns.log_probs[0, 1] == -float("inf")
    q = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    expected = 0.5 * (math.log(0.5) - math.log(0.4)) + 0.2 * (math.log(0.2) - math.log(0.3))
    assert columns.kl(q).item() == pytest.approx(expected, rel=1e-5)


def test_a_run_resumes_after_its_drafter_got_a_draft_vocab(tmp_path):
    """A drafter's draft vocabulary is a decoding choice saved with it, not a weight: a run checkpointed without one
    resumes into a drafter that has one (and the other way round), keeping the drafter's."""
    from treeflash_hf.training.checkpoint import latest_checkpoint, load_checkpoint
    from treeflash_hf.training.data import TokenStream
    from treeflash_hf.training.drafter import DrafterLossConfig, train_drafter
    from treeflash_hf.training.loop import LoopConfig

    target = random_target("qwen3", vocab_size=96, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, seed=0)
    data = TokenStream(torch.tensor([3, 17, 5, 40, 22, 9, 61, 13] * 200).numpy(), seq_len=24, seed=0)
    vocab = torch.arange(0, 96, 2)
    for first, then in ((None, vocab), (vocab, None)):
        drafter = matching_drafter(target, num_layers=1, block_size=4, seed=1)
        drafter.set_draft_vocab(first)
        run = tmp_path / f"run-{first is None}"
        config = dict(run_dir=str(run), batch_size=2, lr=1e-3, warmup_steps=1, eval_every=100, save_every=2)
        loss = DrafterLossConfig(stage="backbone", num_anchors=2)
        train_drafter(target, drafter, data, [], loss, LoopConfig(max_steps=2, **config))
        saved = load_checkpoint(latest_checkpoint(run))["model"]
        drafter.set_draft_vocab(then)
        with torch.no_grad():
            drafter.fc.weight.zero_()  # resuming must bring the checkpoint's weights back
        train_drafter(target, drafter, data, [], loss, LoopConfig(max_steps=3, resume=True, **config))
        torch.testing.assert_close(drafter.fc.weight, saved["fc.weight"], atol=5e-3, rtol=0)
        assert drafter.fc.weight.abs().sum() > 0
        assert (getattr(drafter, "draft_token_ids", None) is None) == (then is None)
        assert load_checkpoint(latest_checkpoint(run))["step"] == 3
        assert set(saved) - {"draft_token_ids"} <= set(drafter.state_dict())


@pytest.mark.parametrize("mode", ["marginal_tree", "treeflash"])
def test_a_draft_vocab_smaller_than_top_k_still_drafts(pair, mode):
    target, drafter = pair
    drafter.set_draft_vocab(torch.tensor([5, 9, 1]))
    try:
        reference = target.generate(PROMPTS[0], max_new_tokens=12, do_sample=False)
        for evaluation in ("batched", "lazy"):
            options = TreeOptions(tree_mode=mode, tree_budget=8, tree_top_m=4, tree_top_k=4)
            generator, block = draft_once(target, drafter, PROMPTS[0], options, ar_evaluation=evaluation)
            assert set(generator.build_tree(block, 8).tokens[1:].tolist()) <= {5, 9, 1}
        out = target.generate(PROMPTS[0], assistant_model=drafter, max_new_tokens=12, do_sample=False,
                              tree_mode=mode, tree_budget=8, tree_top_m=4, tree_top_k=4)
    finally:
        drafter.set_draft_vocab(None)
    assert torch.equal(out, reference)
