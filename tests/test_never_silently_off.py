"""TreeFlash is never switched off without a word: continuous batching (`cache_implementation="paged"`,
`generate_batch`, `transformers serve --continuous-batching`) cannot run TreeFlash yet, so a TreeFlash drafter given
to it raises a clear error and a TreeFlash model folder asked for it warns once and decodes with the plain target."""

import logging

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from treeflash_hf import reference
from treeflash_hf.serving import running_server
from treeflash_hf.validation import TreeFlashInputError

from .test_serving import FOLDER, MAX_TOKENS, PROMPTS, complete, expected  # noqa: F401  (a fixture)

WARNING = "TreeFlash is off for continuous batching"
SMALL_CACHE = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256)  # not the default 60% of free RAM


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def plain():
    return AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)


def warnings_in(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if WARNING in record.getMessage()]


def test_a_treeflash_drafter_with_continuous_batching_raises(plain, tokenizer):
    drafter = AutoModel.from_pretrained(reference.BUNDLED_DIR / "drafter", dtype=torch.float32)
    inputs = tokenizer(PROMPTS[0], return_tensors="pt")
    paged_config = GenerationConfig(cache_implementation="paged", max_new_tokens=4)
    for paged in ({"cache_implementation": "paged", "max_new_tokens": 4}, {"generation_config": paged_config}):
        with pytest.raises(TreeFlashInputError, match="does not run inside continuous batching") as error:
            plain.generate(**inputs, assistant_model=drafter, return_dict_in_generate=True, **paged)
        assert "without cache_implementation='paged'" in str(error.value)
        assert "padding_side='left'" in str(error.value) and "drop `assistant_model`" in str(error.value)
    with pytest.raises(TreeFlashInputError, match=r"continuous batching \(generate_batch\)"):
        plain.generate_batch([inputs["input_ids"][0].tolist()], assistant_model=drafter, max_new_tokens=4)


def test_continuous_batching_on_a_folder_warns_once_and_decodes_plain(plain, tokenizer, caplog):
    fast = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True, dtype=torch.float32)
    prompts = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=-1)
    with caplog.at_level(logging.WARNING):
        outputs = fast.generate_batch(prompts, generation_config=config, continuous_batching_config=SMALL_CACHE)
        assert len(warnings_in(caplog)) == 1 and str(FOLDER) in warnings_in(caplog)[0]
        inputs = tokenizer(PROMPTS[0], return_tensors="pt")
        fast.generate(**inputs, max_new_tokens=4, do_sample=False, cache_implementation="paged",
                      continuous_batching_config=SMALL_CACHE)
        assert len(warnings_in(caplog)) == 1  # once per model
    for prompt, output in zip(prompts, outputs.values()):
        greedy = plain.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=-1)
        assert output.generated_tokens == greedy[0, len(prompt):].tolist()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plain.generate_batch(prompts[:1], generation_config=config, continuous_batching_config=SMALL_CACHE)
    assert not warnings_in(caplog)  # not a TreeFlash folder: the stock path, unchanged


def test_serve_with_continuous_batching_on_a_folder_warns_once(tmp_path, expected):  # noqa: F811
    log_path = tmp_path / "serve.log"
    cb_flags = ["--continuous-batching", "--cb-num-blocks", "8", "--cb-max-batch-tokens", "256"]
    with running_server(FOLDER, trust_remote_code=True, dtype="float32", device="cpu", startup_timeout_s=180,
                        log_path=log_path, extra_args=cb_flags) as server:
        for prompt in PROMPTS:
            assert complete(server, prompt) == expected[prompt]
    assert log_path.read_text().count(WARNING) == 1, log_path.read_text()[-3000:]
