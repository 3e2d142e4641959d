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


def test_auto_dtype_runs_half_precision_in_float32_where_the_cpu_has_no_arithmetic_for_it(monkeypatch, caplog):
    """`dtype="auto"` keeps the stored bfloat16 where the CPU multiplies it in hardware, and runs float32 (exactly
    the same weights) with a warning where torch would emulate it; an explicit dtype is always kept."""
    monkeypatch.setattr(reference, "cpu_has_native", lambda dtype: True)
    target, drafter, _ = reference.load("tiny")
    assert target.dtype == drafter.dtype == torch.bfloat16 and "running in float32" not in caplog.text
    monkeypatch.setattr(reference, "cpu_has_native", lambda dtype: False)
    target_32, drafter_32, _ = reference.load("tiny")
    assert target_32.dtype == drafter_32.dtype == torch.float32 and "running in float32" in caplog.text
    for model, model_32 in ((target, target_32), (drafter, drafter_32)):
        weights = dict(model.named_parameters())
        assert all(torch.equal(weights[name].float(), value) for name, value in model_32.named_parameters())
    assert reference.load("tiny", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_cpu_has_native_reads_the_cpu_features(monkeypatch):
    import platform

    from treeflash_hf.integrations import cpu_linear

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert cpu_linear.cpu_has_native(torch.float32)
    assert not cpu_linear.cpu_has_native(torch.bfloat16) and not cpu_linear.cpu_has_native(torch.float16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_linear.cpu_has_native(torch.bfloat16) and not cpu_linear.cpu_has_native(torch.float16)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_linear, "_arm_cpu_features", lambda: {"fp", "asimd", "bf16"})
    assert cpu_linear.cpu_has_native(torch.bfloat16) and not cpu_linear.cpu_has_native(torch.float16)
    monkeypatch.setattr(cpu_linear, "_arm_cpu_features", lambda: {"fp", "asimd", "asimdhp"})
    assert not cpu_linear.cpu_has_native(torch.bfloat16) and cpu_linear.cpu_has_native(torch.float16)


def test_run_dtype_divergences_are_near_ties():
    """In the pair's run dtype (bfloat16), rounding differs between verifying a tree and decoding one token, so a
    speculative output may leave plain decoding where the target's top two logits are within that dtype's
    rounding. Every divergence must be such a near-tie, never a real disagreement."""
    from treeflash_hf.tools.bench import Identity, compare

    target, drafter, tokenizer = reference.load("tiny", dtype=torch.bfloat16)  # the stored dtype
    identity = Identity()
    for prompt in HELD_OUT:
        inputs = tokenizer(prompt, return_tensors="pt")
        width = inputs["input_ids"].shape[1]
        plain = target.generate(**inputs, max_new_tokens=40, do_sample=False)[0, width:].tolist()
        fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        compare(identity, target, inputs["input_ids"][0], plain, fast[0, width:].tolist())
    assert identity.other == 0, identity
    assert identity.identical + identity.near_ties == len(HELD_OUT)


def test_doubling_fit_takes_the_last_point_of_each_amount_of_data():
    """The lineage fit: τ = a + b log2(tokens) over, for each amount of data, its last (longest-trained) point."""
    from treeflash_hf.tools.lineage import doubling_fit, predictions

    points = [{"chat_answer_tokens": 1000, "tau": 1.0}, {"chat_answer_tokens": 1000, "tau": 1.5},
              {"chat_answer_tokens": 2000, "tau": 1.6}, {"chat_answer_tokens": 8000, "tau": 1.8}]
    a, b = doubling_fit(points)
    assert b == pytest.approx(0.1) and a + b * 10 == pytest.approx(1.5, abs=0.01)
    assert predictions((a, b), taus=(2.0,))["tokens_for"]["2.0"] == pytest.approx(32000, rel=0.02)
    assert doubling_fit(points[:2]) is None


def test_drafter_tau_records_a_lineage_point_and_its_plot(suite, tmp_path):
    """`treeflash-hf drafter-tau`: τ per group of requests (their mean equals greedy τ's own count over each group),
    a point written and replaced by label, and a lineage measured another way refused."""
    from treeflash_hf.cli import main
    from treeflash_hf.recipes.pairs import pair_dirs
    from treeflash_hf.tools.ablate import greedy_tau
    from treeflash_hf.tools.lineage import group_taus

    target, drafter, tokenizer, _ = suite
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"][:, -64:] for text in ("def add(a, b):\n",
               "import os\n\ndef walk(path):\n", "class Stack:\n    def push(self, item):\n", "for i in range(")]
    taus = group_taus(target, drafter, prompts, 2, 8, 8)
    assert taus == [greedy_tau(target, drafter, prompts[:2], 8, 8), greedy_tau(target, drafter, prompts[2:], 8, 8)]
    assert all(tau >= 1 for tau in taus)

    lineage = tmp_path / "lineage.json"
    common = ["drafter-tau", "--pair", "tiny", "--drafters", str(pair_dirs("tiny")[1]), "--prompts",
              "stdlib-heldout", "--num-prompts", "4", "--groups", "2", "--max-new-tokens", "8",
              "--lineage", str(lineage)]
    assert main(common + ["--label", "a", "--answer-tokens", "1000", "--cpu-minutes", "1"]) == 0
    assert main(common + ["--label", "b", "--answer-tokens", "4000", "--cpu-minutes", "3"]) == 0
    assert main(common + ["--label", "a", "--answer-tokens", "2000", "--cpu-minutes", "2"]) == 0
    recorded = json.loads(lineage.read_text())
    assert [(p["label"], p["chat_answer_tokens"]) for p in recorded["points"]] == [("b", 4000), ("a", 2000)]
    assert recorded["points"][0]["tau"] == recorded["points"][1]["tau"]  # greedy and float32: the same drafter
    assert "fit" in recorded and lineage.with_suffix(".png").stat().st_size > 0
    assert main(common[:-2] + ["--budget", "4", "--lineage", str(lineage), "--label", "c", "--answer-tokens", "10",
                               "--cpu-minutes", "1"]) == 1  # another measure: refused, the file kept
    assert main(common + ["--tree-top-m", "2", "--label", "c", "--answer-tokens", "10", "--cpu-minutes", "1"]) == 1
    assert json.loads(lineage.read_text()) == recorded
