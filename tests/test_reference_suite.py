"""The bundled reference suite: loads offline in seconds, fits together, decodes losslessly, publishes."""

import json
import time

import pytest
import torch

from treeflash_hf import reference
from treeflash_hf.hub import prepare_repo

from .test_hub import run_fresh


@pytest.fixture(scope="module")
def suite():
    start = time.perf_counter()
    target, drafter, tokenizer = reference.load(dtype=torch.float32)  # exact identity is checked in float32
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


def test_bundled_remote_code_is_the_package_source():
    """save_pretrained copied the model files next to the bundled weights; they must not drift from modeling/."""
    from pathlib import Path

    import treeflash_hf.modeling.modeling_treeflash_drafter as source

    source_dir = Path(source.__file__).parent
    for name in ("modeling_treeflash_drafter.py", "configuration_treeflash_drafter.py"):
        bundled = reference.BUNDLED_DIR / "drafter" / name
        assert bundled.read_text() == (source_dir / name).read_text(), f"re-save the bundled drafter: {name} drifted"
