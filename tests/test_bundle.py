"""TreeFlash model folders (`treeflash-hf bundle`): the bundled reference target is one; loaded with
trust_remote_code it generates with TreeFlash (every generate() argument honoured, the target's own output), without
it it is the plain target; `bundle` is idempotent and refuses what would not work; `push` publishes one."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, pipeline

from treeflash_hf import reference
from treeflash_hf.hub.bundle import BundleError, write_bundle
from treeflash_hf.integrations.folder_generate import BUNDLE_FILE, DRAFTER_ATTRIBUTE
from treeflash_hf.hub.folders import custom_generate_files, missing_relative_imports
from treeflash_hf.integrations import folder_generate
from treeflash_hf.recipes import pairs
from treeflash_hf.hub.push import PublishError, check_publishable, prepare_bundle_repo
from treeflash_hf.recipes.testing import matching_drafter, random_target

from .test_hub import run_fresh

FOLDER = pairs.pair_dirs("tiny")[0]  # the tiny target as a TreeFlash folder, generated under the cache
PROMPT = "import os\n\n\ndef read_lines(path):\n"


@pytest.fixture(scope="module")
def models():
    """(TreeFlash folder model, plain target, tokenizer), both fp32, from the bundled folder."""
    fast = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)
    return fast, plain, AutoTokenizer.from_pretrained(FOLDER)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_target_folder_is_generated_from_the_package_engine():
    """The tiny target's TreeFlash folder: links to the bundled files, and custom_generate/ written from the package's
    modules (flattened: no import reaches outside the folder), rewritten when it no longer matches them."""
    assert json.loads((FOLDER / BUNDLE_FILE).read_text()) == {"drafter": str(pairs.bundled_drafter("drafter"))}
    assert (FOLDER / "model.safetensors").resolve() == (reference.BUNDLED_DIR / "target" / "model.safetensors").resolve()
    copies = FOLDER / "custom_generate"
    files = custom_generate_files("folder_generate")
    assert files["generate.py"].startswith(Path(folder_generate.__file__).read_text()[:200])
    assert not missing_relative_imports(copies)
    assert all("from .." not in text for text in files.values())
    assert {p.name for p in copies.glob("*.py")} == set(files)
    (copies / "tree.py").write_text("stale = True\n")  # a package edit since the folder was written
    (copies / "dropped_module.py").write_text("stale = True\n")
    assert pairs.pair_dirs("tiny")[0] == FOLDER
    assert (copies / "tree.py").read_text() == files["tree.py"] and not (copies / "dropped_module.py").exists()


@pytest.mark.parametrize("drafter", ["drafter", "smollm2_drafter"])
def test_bundled_drafters_get_the_package_model_code(drafter):
    """A bundled drafter's remote code (loaded with trust_remote_code, published with it) is written from `modeling/`;
    the package keeps only its weights and configs."""
    import treeflash_hf.modeling

    modeling = Path(treeflash_hf.modeling.__file__).parent
    folder = pairs.bundled_drafter(drafter)
    for name in ("configuration_treeflash_drafter.py", "modeling_treeflash_drafter.py"):
        assert not (reference.BUNDLED_DIR / drafter / name).exists(), f"{name} is generated: do not commit it"
        assert (folder / name).read_text() == (modeling / name).read_text()


def stop_string_inside(plain, tokenizer, inputs) -> str:
    """Four characters from the middle of the plain target's 64-token greedy continuation: a stop string that is
    sure to stop it early, whatever the bundled target writes."""
    continuation = plain.generate(**inputs, max_new_tokens=64, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    text = tokenizer.decode(continuation)
    return text[len(text) // 2 : len(text) // 2 + 4]


def test_only_trust_remote_code_turns_treeflash_on(models):
    fast, plain, _ = models
    assert "generate" in fast.__dict__  # custom_generate/generate.py replaced model.generate
    assert "generate" not in plain.__dict__  # transformers loads custom_generate/ only with trust_remote_code=True


def test_greedy_is_the_targets_own_output_with_tau_and_one_drafter(models):
    fast, plain, tokenizer = models
    inputs = tokenizer(PROMPT, return_tensors="pt")
    expected = plain.generate(**inputs, max_new_tokens=40, do_sample=False)
    out = fast.generate(**inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.tau > 1.2 and len(out.accepted_lengths) < 40  # the folder's drafter did draft and was accepted
    drafter = fast.__dict__[DRAFTER_ATTRIBUTE]
    prompt_length = inputs["input_ids"].shape[1]
    assert torch.equal(fast.generate(inputs["input_ids"], max_new_tokens=8), expected[:, : prompt_length + 8])
    assert fast.__dict__[DRAFTER_ATTRIBUTE] is drafter  # loaded once, kept on the model
    assert drafter.dtype == torch.float32
    assert not any("drafter" in key for key in fast.state_dict())  # not a submodule: never saved with the target


def test_streamer_stop_strings_and_sampling_are_honoured(models):
    fast, plain, tokenizer = models
    inputs = tokenizer(PROMPT, return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = fast.generate(**inputs, max_new_tokens=32, do_sample=False, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    stop = stop_string_inside(plain, tokenizer, inputs)
    stopped = fast.generate(**inputs, max_new_tokens=64, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(stopped, plain.generate(**inputs, max_new_tokens=64, do_sample=False, stop_strings=[stop],
                                               tokenizer=tokenizer))
    assert stopped.shape[1] < inputs["input_ids"].shape[1] + 64  # the stop string did stop it
    assert stop in tokenizer.decode(stopped[0, inputs["input_ids"].shape[1]:])
    torch.manual_seed(0)
    sampled = fast.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, top_k=50,
                            return_dict_in_generate=True)
    assert sampled.sequences.shape[1] <= inputs["input_ids"].shape[1] + 16 and sampled.tau >= 1.0


def test_other_modes_and_a_callers_assistant_run_as_on_the_plain_target(models):
    fast, plain, tokenizer = models
    inputs = tokenizer(PROMPT, return_tensors="pt")
    beams = fast.generate(**inputs, max_new_tokens=12, num_beams=2, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(beams.sequences, plain.generate(**inputs, max_new_tokens=12, num_beams=2, do_sample=False))
    assert not hasattr(beams, "tau")  # not TreeFlash
    fresh = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True, dtype=torch.float32)
    draft_lm = reference.load_draft_lm(dtype=torch.float32)
    assisted = fresh.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=draft_lm)
    assert torch.equal(assisted, plain.generate(**inputs, max_new_tokens=16, do_sample=False))
    assert DRAFTER_ATTRIBUTE not in fresh.__dict__  # the caller's assistant was used, the folder's never loaded
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast.generate(**inputs, max_new_tokens=-1)


def test_pipeline(models):
    _, plain, tokenizer = models
    generator = pipeline("text-generation", model=str(FOLDER), trust_remote_code=True, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")

    def plain_text(**kwargs) -> str:
        return tokenizer.decode(plain.generate(**inputs, do_sample=False, **kwargs)[0, inputs["input_ids"].shape[1]:])

    out = generator(PROMPT, max_new_tokens=24, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"] == plain_text(max_new_tokens=24)
    assert DRAFTER_ATTRIBUTE in generator.model.__dict__  # it ran TreeFlash
    stop = stop_string_inside(plain, tokenizer, inputs)
    stopped = generator(PROMPT, max_new_tokens=64, do_sample=False, return_full_text=False, stop_sequence=stop)
    expected = plain_text(max_new_tokens=64, stop_strings=[stop], tokenizer=tokenizer)
    assert stopped[0]["generated_text"] == expected and stop in expected
    assert len(expected) < len(plain_text(max_new_tokens=64))


def test_package_blocked_from_import_still_decodes_with_treeflash(models, tmp_path):
    _, plain, tokenizer = models
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = plain.generate(ids, max_new_tokens=24, do_sample=False)
    result = run_fresh(f"""
        import json, sys, torch
        sys.modules["treeflash_hf"] = None  # transformers alone
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(FOLDER)!r}, trust_remote_code=True, dtype=torch.float32)
        out = model.generate(torch.tensor({ids.tolist()}), max_new_tokens=24, do_sample=False,
                             return_dict_in_generate=True)
        print(json.dumps({{"out": out.sequences.tolist(), "tau": out.tau, "cls": type(out).__module__}}))
    """, tmp_path)
    assert result["out"] == expected.tolist()
    assert result["tau"] > 1.0 and "treeflash_hf" not in result["cls"]


def copy_suite(tmp_path):
    """The bundled target, drafter and tokenizer copied side by side, as in the package."""
    for name in ("target", "drafter", "tokenizer"):
        shutil.copytree(reference.BUNDLED_DIR / name, tmp_path / name)
    return tmp_path


def test_bundle_in_place_is_idempotent_and_keeps_the_weights(tmp_path):
    root = copy_suite(tmp_path)
    weights = sha256(root / "target" / "model.safetensors")
    (root / "target" / "custom_generate").mkdir()
    (root / "target" / "custom_generate" / "dropped_module.py").write_text("stale = True\n")
    (root / "target" / BUNDLE_FILE).write_text(json.dumps({"drafter": "org/old-drafter"}))
    for _ in range(2):
        write_bundle(root / "target", root / "drafter", root / "target")
        assert json.loads((root / "target" / BUNDLE_FILE).read_text()) == {"drafter": "../drafter"}
        assert not (root / "target" / "custom_generate" / "dropped_module.py").exists()
        assert sha256(root / "target" / "model.safetensors") == weights
    out = write_bundle(root / "target", root / "drafter", tmp_path / "elsewhere" / "folder", drafter_ref="org/drafter")
    assert json.loads((out / BUNDLE_FILE).read_text()) == {"drafter": "org/drafter"}
    assert sha256(out / "model.safetensors") == weights and not (out / "README.md").exists()


def test_bundle_refuses_what_would_not_work(tmp_path):
    root = copy_suite(tmp_path)
    other = random_target("qwen3", vocab_size=8192, seed=0)
    matching_drafter(other).save_pretrained(tmp_path / "other_drafter")
    with pytest.raises(BundleError, match="does not fit the target"):
        write_bundle(root / "target", tmp_path / "other_drafter", tmp_path / "a")
    with pytest.raises(BundleError, match="not a TreeFlash drafter"):
        write_bundle(root / "target", reference.BUNDLED_DIR / "draft_lm", tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (root / "target" / name).unlink()
    with pytest.raises(BundleError, match="pass --tokenizer"):
        write_bundle(root / "target", root / "drafter", tmp_path / "c")
    with pytest.raises(BundleError, match="not the drafter"):
        write_bundle(root / "target", root / "drafter", tmp_path / "d", tokenizer=root / "tokenizer",
                     drafter_ref=str(reference.BUNDLED_DIR / "draft_lm"))
    weights = root / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(BundleError, match="truncated or corrupt"):
        write_bundle(root / "target", root / "drafter", tmp_path / "e", tokenizer=root / "tokenizer")


def test_push_dry_run_of_a_treeflash_folder(tmp_path):
    with pytest.raises(PublishError, match="local path .*drafter'.*--drafter-ref"):
        prepare_bundle_repo(FOLDER, tmp_path / "no", "org/treeflash-target")
    repo = prepare_bundle_repo(FOLDER, tmp_path / "repo", "org/treeflash-target", base_model="org/target",
                               drafter_ref="org/treeflash-drafter")
    assert json.loads((repo / BUNDLE_FILE).read_text()) == {"drafter": "org/treeflash-drafter"}
    assert sha256(repo / "model.safetensors") == sha256(FOLDER / "model.safetensors")
    card = (repo / "README.md").read_text()
    assert "accelerated with [TreeFlash]" in card and "trust_remote_code=True" in card
    assert "org/treeflash-drafter" in card and "base_model: org/target" in card
    check_publishable(repo)
    config = json.loads((repo / "config.json").read_text())
    config["hidden_size"] *= 2
    (repo / "config.json").write_text(json.dumps(config))
    with pytest.raises(PublishError, match="do not match its config"):
        check_publishable(repo)
