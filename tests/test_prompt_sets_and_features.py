"""Prompt sets (chat messages through the chat template; evaluation requests never trained on) and the cached
target features the drafter recipe trains from."""

import json

import numpy as np
import pytest
import torch

from treeflash_hf import reference
from treeflash_hf.recipes.prompt_sets import (
    PromptFileError,
    eval_requests,
    grow_training_requests,
    load_prompts,
    training_requests,
)
from treeflash_hf.training.drafter import DrafterLossConfig, block_loss_terms, drafter_loss_terms, sample_anchors
from treeflash_hf.training.features import FeatureStore, copy_windows, create_store, fill_store

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


class TinyChatTokenizer:
    chat_template = TEMPLATE

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


def test_jsonl_lines_take_prompts_or_chat_messages(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"prompt": "def f():"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert load_prompts(str(path), tokenizer=TinyChatTokenizer()) == ["def f():", "<user>hi<a>"]
    with pytest.raises(PromptFileError, match="chat messages need a tokenizer with a chat template"):
        load_prompts(str(path), tokenizer=None)
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(PromptFileError, match=r'set.jsonl:1: expected .* "messages" list'):
        load_prompts(str(path), tokenizer=TinyChatTokenizer())


def test_instruction_set_is_held_out_from_training_requests():
    requests = eval_requests()
    assert len(requests) == 36 and len(set(requests)) == 36
    prompts = load_prompts("instruct-heldout", 6, tokenizer=TinyChatTokenizer())
    assert prompts[0].startswith("<user>Write a Python function") and len(prompts) == 6
    code = ['def area(width, height):\n    """Return the area of a rectangle."""\n    return width * height\n']
    training = training_requests(code, count=40, seed=1)
    assert len(training) == 40 and not set(training) & set(requests)
    assert any("area(width, height)" in r for r in training)  # a code request from the corpus's docstring


def test_grown_training_requests_keep_the_first_and_add_new_ones():
    code = [f'def f{i}(x):\n    """Return the number x plus the constant {i}."""\n    return x + {i}\n' for i in range(30)]
    first = training_requests(code, count=20, seed=3)
    grown = grow_training_requests(code, first, count=60, seed=3)
    assert grown[:20] == first and len(grown) == 60 and len(set(grown)) == 60
    assert not set(grown) & set(eval_requests())
    new_functions = {f"f{i}(" for i in range(30) if any(f"f{i}(" in r for r in grown[20:])}
    assert new_functions - {f"f{i}(" for i in range(30) if any(f"f{i}(" in r for r in first)}  # unseen functions
    assert grow_training_requests(code, [], count=20, seed=3) == first  # an empty list grows into the first set


@pytest.fixture(scope="module")
def tiny():
    return reference.load("tiny", dtype=torch.float32)


def test_cached_features_give_the_live_loss(tiny, tmp_path):
    """Training from the store equals training against the live target when the cache keeps the whole vocabulary."""
    target, drafter, tokenizer = tiny
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(3, target.config.vocab_size, (3, 65), generator=generator).numpy()
    masks = np.ones_like(windows, dtype=np.uint8)
    layers = list(drafter.config.target_layer_ids)
    vocab = target.config.vocab_size
    create_store(tmp_path, windows, masks, layers, target.config.hidden_size, top_k=vocab, heldout=1)
    assert fill_store(target, tmp_path, batch_size=2, minutes=0) == 0  # no time: nothing written, nothing done
    assert fill_store(target, tmp_path, batch_size=2) == 3
    store = FeatureStore(tmp_path)
    ids, mask, context, teacher = store.rows(np.arange(1, 3))
    assert torch.equal(ids, torch.from_numpy(windows[1:3]).long())
    config = DrafterLossConfig(stage="ar", num_anchors=4)
    anchors = sample_anchors(2, 64, drafter.config.block_size, 4, torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        live = drafter_loss_terms(target, drafter, ids, config, anchors)
    with torch.no_grad():
        cached = block_loss_terms(drafter, target.get_input_embeddings(), target.get_output_embeddings(), ids,
                                  context.float(), teacher, config, anchors)
    # the store holds bfloat16 features and float16 log-probs of a bfloat16-autocast forward
    assert float(cached.loss_sum) == pytest.approx(float(live.loss_sum), rel=0.05)
    assert len(store.heldout_batches(4)) == 1 and store.batch(0, 2)[0].shape == (2, 65)


def test_a_recalibration_store_reuses_the_first_windows_for_another_target(tiny, tmp_path):
    """`copy_windows`: the source's held-out windows and its first training windows, laid out empty for a second
    target; filled without autocast (a quantized target computes in its own dtype)."""
    target, drafter, _ = tiny
    windows = torch.randint(3, target.config.vocab_size, (5, 33), generator=torch.Generator().manual_seed(2)).numpy()
    layers, hidden = list(drafter.config.target_layer_ids), target.config.hidden_size
    create_store(tmp_path / "full", windows, np.ones_like(windows, dtype=np.uint8), layers, hidden, top_k=4, heldout=2)
    copy_windows(tmp_path / "full", tmp_path / "recal", 2, layers, hidden, top_k=4)
    meta = json.loads((tmp_path / "recal" / "store.json").read_text())
    assert meta["windows"] == 4 and meta["heldout"] == 2 and meta["done"] == 0
    assert meta["chat_chunks"] == []  # none of its own yet: the quantized target's own answers may grow it
    assert fill_store(target, tmp_path / "recal", batch_size=4, autocast=False) == 4
    ids, _, context, teacher = FeatureStore(tmp_path / "recal").rows(np.arange(4))
    assert torch.equal(ids, torch.from_numpy(windows[:4]).long())
    with torch.no_grad():  # float32 features, rounded to the store's bfloat16
        out = target(ids[:, :-1], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(context.float(), expected, rtol=1e-2, atol=1e-2)


def test_an_ablation_variant_trains_from_the_feature_store(tiny, tmp_path):
    """`ablate` on the real pair trains stage ar from the recipe's cached features: the backbone stays, the AR layer
    (re-initialised to zero) learns."""
    from types import SimpleNamespace

    from treeflash_hf.tools.ablate import cached_trainer, variant_drafter

    target, drafter, _ = tiny
    windows = torch.randint(3, target.config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(5)).numpy()
    create_store(tmp_path / "store", windows, np.ones_like(windows, dtype=np.uint8), list(drafter.config.target_layer_ids),
                 target.config.hidden_size, top_k=8, heldout=1)
    fill_store(target, tmp_path / "store", batch_size=4)
    train = cached_trainer(target, SimpleNamespace(store=tmp_path / "store", lr=1e-3, steps=2))
    variant = variant_drafter(drafter.float(), {"ar_type": "linear"})
    backbone = {k: v.clone() for k, v in variant.state_dict().items() if not k.startswith("ar_approximation.")}
    summary = train(variant, tmp_path / "run", seed=1, full_finetune=False)
    assert summary["steps"] == 2 and "eval_ar_kl" in summary["curve"][-1]
    state = variant.state_dict()
    assert all(torch.equal(state[k], v) for k, v in backbone.items())
    assert torch.count_nonzero(state["ar_approximation.d.weight"]) > 0


def test_a_store_grows_by_new_chat_windows_and_draws_the_chat_share(tiny, tmp_path):
    """`extend_store`: windows appended after the filled ones are filled next, the old outputs untouched; a
    `chat_fraction` store draws that share of its batches from chat windows (those with masked prompt positions)."""
    from treeflash_hf.training.features import extend_store

    target, drafter, _ = tiny
    generator = torch.Generator().manual_seed(3)
    code = torch.randint(3, target.config.vocab_size, (4, 33), generator=generator).numpy()
    layers, hidden = list(drafter.config.target_layer_ids), target.config.hidden_size
    create_store(tmp_path, code, np.ones_like(code, dtype=np.uint8), layers, hidden, top_k=4, heldout=1,
                 chat_chunks=["chunk-00000.json"])
    fill_store(target, tmp_path, batch_size=4)
    before = FeatureStore(tmp_path).rows(np.arange(4))
    chat = torch.randint(3, target.config.vocab_size, (3, 33), generator=generator).numpy()
    chat_mask = np.ones_like(chat, dtype=np.uint8)
    chat_mask[:, :5] = 0  # a prompt
    with pytest.raises(ValueError, match="tokens; the store's have 33"):
        extend_store(tmp_path, chat[:, :10], chat_mask[:, :10])
    assert extend_store(tmp_path, chat, chat_mask, chat_chunks=["chunk-00000.json", "chunk-00128.json"]) == 7
    meta = json.loads((tmp_path / "store.json").read_text())
    assert meta["done"] == 4 and meta["chat_chunks"][-1] == "chunk-00128.json"
    assert fill_store(target, tmp_path, batch_size=2) == 7
    store = FeatureStore(tmp_path, chat_fraction=0.75, seed=1)
    after = store.rows(np.arange(4))
    for old, new in zip(before[:3], after[:3]):
        assert torch.equal(old, new)
    ids, mask, context, _ = store.rows(np.arange(4, 7))
    assert torch.equal(ids, torch.from_numpy(chat).long()) and torch.count_nonzero(context) > 0
    assert store.is_chat.tolist() == [False] * 4 + [True] * 3
    drawn = np.concatenate([(store.batch(step, 8)[1] == 0).any(dim=1).numpy() for step in range(50)])
    assert 0.65 < drawn.mean() < 0.85  # 400 draws at 0.75
    assert (FeatureStore(tmp_path, seed=1).batch(0, 4)[0].shape == (4, 33))
    with pytest.raises(ValueError, match="chat_fraction must be within"):
        FeatureStore(tmp_path, chat_fraction=1.5)
    # a data-scaling point: only the first N chat windows are drawn, and the sizes say so
    two = FeatureStore(tmp_path, chat_fraction=0.75, seed=1, chat_windows=2)
    assert two.chat_window_count == 2 and store.chat_window_count == 3
    assert two.chat_answer_tokens == 2 * 28 and store.chat_answer_tokens == 3 * 28
    drawn_ids = np.concatenate([two.batch(step, 8)[0].numpy() for step in range(30)])
    drawn_chat = {tuple(row) for row in drawn_ids.tolist() if tuple(row) in {tuple(r) for r in chat.tolist()}}
    assert drawn_chat == {tuple(row) for row in chat[:2].tolist()}
    uniform = FeatureStore(tmp_path, seed=1, chat_windows=1)  # uniform over one chat window and the code ones
    drawn_ids = np.concatenate([uniform.batch(step, 8)[0].numpy() for step in range(30)])
    assert not any(tuple(row) in {tuple(r) for r in chat[1:].tolist()} for row in drawn_ids.tolist())
    with pytest.raises(ValueError, match="chat_windows must be at least 1"):
        FeatureStore(tmp_path, chat_windows=0)


def test_a_drafter_study_trains_each_variant_the_same_way_from_the_store(tiny, tmp_path):
    """`reference drafter-study`: each variant is a new drafter trained by the recipe's stages on the same store,
    differing by its one change (layers, initialisation, data size); its held-out metrics are recorded, tabled and
    plotted."""
    import argparse

    from treeflash_hf.recipes import drafter_study
    from treeflash_hf.recipes.tiny_suite import context_layer_ids

    from types import SimpleNamespace

    target, drafter, _ = tiny
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda token: 1)  # the mask token (the tiny one lacks SmolLM2's)
    generator = torch.Generator().manual_seed(7)
    windows = torch.randint(3, target.config.vocab_size, (8, 65), generator=generator).numpy()
    masks = np.ones_like(windows, dtype=np.uint8)
    masks[1::2, :9] = 0  # every other window is chat (a prompt)
    store_dir = tmp_path / "features"
    layers = context_layer_ids(target.config.num_hidden_layers, 1)  # the new drafters' (--context-layers 1)
    create_store(store_dir, windows, masks, layers, target.config.hidden_size, top_k=8, heldout=2)
    fill_store(target, store_dir, batch_size=4)
    parser = argparse.ArgumentParser()
    drafter_study.add_parser(parser.add_subparsers())
    args = parser.parse_args(["drafter-study", "--work", str(tmp_path), "--minutes", "0.01", "--ar-minutes", "0.01",
                              "--seq-len", "64", "--num-anchors", "2", "--batch-size", "2", "--context-layers", "1"])
    results = {}
    for name in ("baseline", "two_layers", "chat1"):
        variant = drafter_study.variant_args(args, name)
        results[name] = drafter_study.train_variant(target, tokenizer, store_dir, tmp_path / name, variant)
    assert args.drafter_layers == 1 and args.chat_windows is None  # variants are copies
    assert results["two_layers"]["drafter_layers"] == 2
    assert results["two_layers"]["parameters"] > results["baseline"]["parameters"]
    assert results["chat1"]["chat_windows"] == 1 and results["baseline"]["chat_windows"] == 3
    assert results["chat1"]["chat_answer_tokens"] == 56
    for result in results.values():
        for stage in ("backbone", "ar"):
            assert result[stage]["steps"] >= 1 and 0.0 <= result[stage]["accept_proxy"] <= 15
            assert result[stage]["curve"][-1]["kl"] == result[stage]["kl"]
    assert "| chat1 | 1 | random | 7 | 0 | all | 1 (56) | ar |" in drafter_study.table(results)
    assert drafter_study.sized_variant("vocab4096") == ("draft_vocab_size", 4096)
    assert drafter_study.sized_variant("chat0") is None and drafter_study.sized_variant("decay4") is None
    with pytest.raises(SystemExit, match="holds 0 tokens"):  # no draft vocabulary chosen in this work folder
        drafter_study.train_variant(target, tokenizer, store_dir, tmp_path / "v", drafter_study.variant_args(args, "vocab8"))
    ranked = list(range(target.config.vocab_size - 1, target.config.vocab_size - 17, -1))
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": ranked}))
    small = drafter_study.train_variant(target, tokenizer, store_dir, tmp_path / "v8",
                                        drafter_study.variant_args(args, "vocab8"))
    assert small["draft_vocab"] == 8 and small["backbone"]["steps"] >= 1
    drafter_study.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_online_features_are_the_rows_a_filled_store_reads(tiny, tmp_path):
    """`OnlineFeatures` (`--online-features`): the target runs over each drawn batch instead of the store's disk and
    gives exactly the rows a filled store reads (same rounding), on a store whose features were never built; the
    recipe's stages and the drafter study train from it."""
    import argparse

    from treeflash_hf.recipes import drafter_study
    from treeflash_hf.recipes.tiny_suite import context_layer_ids
    from treeflash_hf.training.features import OnlineFeatures

    from types import SimpleNamespace

    target, _, _ = tiny
    windows = torch.randint(3, target.config.vocab_size, (6, 65), generator=torch.Generator().manual_seed(9)).numpy()
    masks = np.ones_like(windows, dtype=np.uint8)
    masks[1::2, :9] = 0
    layers = context_layer_ids(target.config.num_hidden_layers, 1)
    for name, outputs in (("filled", True), ("features", False)):
        create_store(tmp_path / name, windows, masks, layers, target.config.hidden_size, top_k=8, heldout=2,
                     outputs=outputs)
    fill_store(target, tmp_path / "filled", batch_size=2)
    assert not (tmp_path / "features" / "features.bin").exists()  # nothing laid out on disk for online use
    stored, online = FeatureStore(tmp_path / "filled"), OnlineFeatures(tmp_path / "features", target)
    assert online.done == 6 and json.loads((tmp_path / "features" / "store.json").read_text())["done"] == 0
    for want, got in zip(stored.rows(np.arange(2, 4)), online.rows(np.arange(2, 4))):
        if hasattr(want, "log_probs"):
            assert torch.equal(want.log_probs, got.log_probs) and torch.equal(want.ids, got.ids)
        else:
            assert torch.equal(want, got)
    assert torch.equal(stored.batch(5, 3)[0], online.batch(5, 3)[0])  # the same windows drawn for a step
    assert len(online.heldout_batches(4)) == 1
    parser = argparse.ArgumentParser()
    drafter_study.add_parser(parser.add_subparsers())
    args = parser.parse_args(["drafter-study", "--work", str(tmp_path), "--minutes", "0.01", "--ar-minutes", "0.01",
                              "--seq-len", "64", "--num-anchors", "2", "--batch-size", "2", "--context-layers", "1",
                              "--online-features"])
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda token: 1)
    result = drafter_study.train_variant(target, tokenizer, tmp_path / "features", tmp_path / "run",
                                         drafter_study.variant_args(args, "baseline"))
    assert result["backbone"]["steps"] >= 1 and result["ar"]["steps"] >= 1 and result["chat_windows"] == 2
    assert fill_store(target, tmp_path / "features", batch_size=2) == 6  # a features stage later lays its files out
    assert torch.equal(FeatureStore(tmp_path / "features").rows(np.arange(2, 4))[2], stored.rows(np.arange(2, 4))[2])
