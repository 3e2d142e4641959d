"""The bundled reference suite: loads offline in seconds, fits together, decodes losslessly, publishes."""

import json
import time

import pytest
import torch

from treeflash_hf import reference
from treeflash_hf.hub.push import prepare_repo

from .test_hub import run_fresh


@pytest.fixture(scope="module")
def suite():
    start = time.perf_counter()
    target, drafter, tokenizer = reference.load("tiny", dtype=torch.float32)  # exact identity is checked in float32
    return target, drafter, tokenizer, time.perf_counter() - start


def test_loads_in_seconds_and_fits(suite):
    target, drafter, tokenizer, seconds = suite
    assert seconds < 30
    assert drafter.config.vocab_size == len(tokenizer) == target.config.vocab_size
    assert drafter.config.mask_token_id == tokenizer.mask_token_id
    assert target.dtype == drafter.dtype == torch.float32
    assert reference.load_draft_lm(dtype=torch.float32).config.vocab_size == len(tokenizer)


def test_greedy_treeflash_is_identical_and_accepts(suite):
    target, drafter, tokenizer, _ = suite
    prompt = tokenizer("import os\n\n\ndef read_lines(path):\n", return_tensors="pt")
    plain = target.generate(**prompt, max_new_tokens=48, do_sample=False)
    for mode in ("chain", "marginal_tree", "treeflash"):
        out = target.generate(**prompt, assistant_model=drafter, max_new_tokens=48, do_sample=False, tree_mode=mode,
                              tree_budget=16, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), mode
        assert out.tau > 1.2, (mode, out.tau)  # a trained drafter really is accepted


def test_target_folder_carries_its_tokenizer(suite):
    """`AutoTokenizer.from_pretrained(target_dir)` is the pair's tokenizer (a folder without tokenizer files would
    give one that encodes everything to [])."""
    from transformers import AutoTokenizer

    _, _, tokenizer, _ = suite
    own = AutoTokenizer.from_pretrained(reference.BUNDLED_DIR / "target")
    text = "def main():\n    return 0\n"
    ids = own(text)["input_ids"]
    assert ids and ids == tokenizer(text)["input_ids"]
    assert own.decode(ids) == text
    assert (own.pad_token_id, own.eos_token_id, own.mask_token_id) == (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id)


def test_reference_drafter_publishes_and_loads_without_the_package(suite, tmp_path):
    target, drafter, tokenizer, _ = suite
    folder = prepare_repo(reference.BUNDLED_DIR / "drafter", tmp_path / "repo", "local/treeflash-reference",
                          base_model="local/reference-target")
    prompt = tokenizer("def main():\n", return_tensors="pt")["input_ids"]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    result = run_fresh(f"""
        import json, sys, torch
        sys.modules["treeflash_hf"] = None
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(reference.BUNDLED_DIR / "target")!r}, dtype=torch.float32)
        drafter = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32)
        out = target.generate(torch.tensor({prompt.tolist()}), assistant_model=drafter, custom_generate={str(folder)!r},
                              trust_remote_code=True, max_new_tokens=24, do_sample=False, tree_budget=8,
                              return_dict_in_generate=True)
        print(json.dumps({{"out": out.sequences.tolist(), "tau": out.tau}}))
    """, tmp_path)
    assert result["out"] == expected.tolist()
    card = (folder / "README.md").read_text()
    assert "local/reference-target" in card and "stage `ar`" in card
    assert json.loads((folder / "config.json").read_text())["model_type"] == "treeflash_drafter"


HELD_OUT = ["def read_config(path):\n    with open(path) as handle:\n",
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
            "import os\n\n\ndef list_files(root):\n    \"\"\"Return every file below root.\"\"\"\n"]


def test_batched_rows_equal_single_row_decoding_exactly(suite):
    """float32, a left-padded batch of code prompts: every row equals that prompt decoded alone, token for token
    (no tie allowance on the bundled pair)."""
    target, drafter, tokenizer, _ = suite
    singles = [tokenizer(prompt, return_tensors="pt") for prompt in HELD_OUT]
    expected = [target.generate(**single, max_new_tokens=40, do_sample=False)[0, single["input_ids"].shape[1]:]
                for single in singles]
    tokenizer.padding_side = "left"
    batch = tokenizer(HELD_OUT, padding=True, return_tensors="pt")
    for budget in (4, "auto"):
        out = target.generate(**batch, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                              tree_budget=budget, return_dict_in_generate=True)
        width = batch["input_ids"].shape[1]
        for row, reference in enumerate(expected):
            assert out.sequences[row, width : width + len(reference)].tolist() == reference.tolist(), (budget, row)
        assert out.tau > 1.2


def test_run_dtype_divergences_are_near_ties():
    """In the pair's run dtype (bfloat16), rounding differs between verifying a tree and decoding one token, so a
    speculative output may leave plain decoding where the target's top two logits are within that dtype's
    rounding. Every divergence must be such a near-tie, never a real disagreement."""
    from treeflash_hf.tools.bench import Identity, compare

    target, drafter, tokenizer = reference.load("tiny")  # the stored dtype
    identity = Identity()
    for prompt in HELD_OUT:
        inputs = tokenizer(prompt, return_tensors="pt")
        width = inputs["input_ids"].shape[1]
        plain = target.generate(**inputs, max_new_tokens=40, do_sample=False)[0, width:].tolist()
        fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        compare(identity, target, inputs["input_ids"][0], plain, fast[0, width:].tolist())
    assert identity.other == 0, identity
    assert identity.identical + identity.near_ties == len(HELD_OUT)
