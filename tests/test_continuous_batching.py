"""TreeFlash inside transformers' continuous batching (`generate_batch`, `cache_implementation="paged"`,
`init_continuous_batching`, `transformers serve --continuous-batching`): every request's tokens are those of offline
greedy decoding of that request alone (float32), also when requests of different lengths join and leave mid-flight;
sampled requests keep the target's distribution; a cancelled request leaves both caches; where TreeFlash cannot run
(an untested transformers version), continuous batching says so and decodes plain."""

import logging
import os
import time

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from treeflash_hf.integrations import continuous_batching
from treeflash_hf import reference
from treeflash_hf.recipes import pairs
from treeflash_hf.integrations.continuous_batching import TreeFlashBatchProcessor, TreeFlashContinuousBatchingManager
from treeflash_hf.tools.serving import running_server
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.validation import TreeFlashInputError

from .conftest import randomise_ar_layer
from .test_lossless_sampling import TEMPERATURE, TOP_P, chi_square_p, exact_joint
from .test_serving import FOLDER, MAX_TOKENS, PROMPTS, complete, expected  # noqa: F401  (a fixture)
from .test_serving_chat import drafter_code_loaded

OFF_WARNING = "TreeFlash is off for continuous batching"
SMALL_CACHE = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256)  # stock CB: not 60% of free RAM
CODE_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):",
                "# sort a list\ndef sort(xs):", "for i in range(10):"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def plain():
    return AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter():
    return AutoModel.from_pretrained(reference.BUNDLED_DIR / "drafter", dtype=torch.float32)


def greedy(plain, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = plain.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    return out[0, len(prompt):].tolist()


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_generate_batch_with_a_drafter_decodes_like_offline_greedy(plain, drafter, tokenizer):
    prompts = [tokenizer(prompt)["input_ids"] for prompt in CODE_PROMPTS]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1)
    with plain.continuous_batching_context_manager(generation_config=config, assistant_model=drafter) as manager:
        assert isinstance(manager, TreeFlashContinuousBatchingManager)
        request_ids = manager.add_requests(prompts, max_new_tokens=40)
        results = {}
        while len(results) < len(prompts):
            result = manager.get_result(timeout=60)
            assert result is not None and result.error is None
            results[result.request_id] = result
        processor = manager.batch_processor
        assert processor.tau > 1.2, processor.tau  # TreeFlash ran: drafted tokens were accepted
    for request_id, prompt in zip(request_ids, prompts):
        assert results[request_id].generated_tokens == greedy(plain, prompt, 40)
    # generate_batch and generate(cache_implementation="paged") take the drafter too
    outputs = plain.generate_batch(prompts[:2], generation_config=config, assistant_model=drafter)
    assert [o.generated_tokens for o in outputs.values()] == [greedy(plain, p, 40) for p in prompts[:2]]
    paged = plain.generate(torch.tensor([prompts[0]]), assistant_model=drafter, max_new_tokens=12, do_sample=False,
                           eos_token_id=-1, cache_implementation="paged")
    assert paged.reshape(-1).tolist() == prompts[0] + greedy(plain, prompts[0], 12)


def test_requests_joining_and_leaving_mid_flight_and_cancelled(plain, drafter, tokenizer):
    prompts = [tokenizer(prompt)["input_ids"] for prompt in CODE_PROMPTS]
    lengths = [48, 9, 30, 17, 64]
    config = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=-1)
    manager = plain.init_continuous_batching(generation_config=config, assistant_model=drafter)
    manager.start()
    try:
        streamed = {}
        first = manager.add_request(prompts[0], max_new_tokens=lengths[0], streaming=True)
        doomed = manager.add_request(prompts[1], max_new_tokens=500, streaming=True)  # cancelled below

        def collect():
            while (result := manager.get_result(timeout=0.01)) is not None:
                streamed.setdefault(result.request_id, []).append(result)

        wait_for(lambda: collect() or len(streamed.get(first, [])) >= 3)  # `first` is decoding
        later = [manager.add_request(p, max_new_tokens=n, streaming=True) for p, n in zip(prompts[2:], lengths[2:])]
        processor: TreeFlashBatchProcessor = manager.batch_processor
        wait_for(lambda: collect() or len(processor.active) == 5)
        with manager.pause():  # the loop is parked between steps: its state can be read
            rows = len(processor.rows)
            assert rows == len(processor.active) == 5
            assert processor.cache.layers[0].keys.shape[0] == rows
            drafter_cache = processor.decoder.generator.cache
            assert drafter_cache.get_seq_length() == 0 or drafter_cache.layers[0].keys.shape[0] == rows
        manager.cancel_request(doomed)
        wait_for(lambda: collect() or doomed not in processor.active)
        with manager.pause():
            assert doomed not in processor.request_ids.values()
            if processor.rows is not None:
                rows = len(processor.rows)
                assert rows == len(processor.active) <= 4
                assert processor.cache.layers[0].keys.shape[0] == rows
                drafter_cache = processor.decoder.generator.cache
                assert drafter_cache.get_seq_length() == 0 or drafter_cache.layers[0].keys.shape[0] == rows
        wait_for(lambda: collect() or all(streamed.get(r) and streamed[r][-1].is_finished() for r in [first, *later]))
    finally:
        manager.stop(block=True, timeout=30)
    for request_id, prompt, length in zip([first, *later], [prompts[0], *prompts[2:]], [lengths[0], *lengths[2:]]):
        outputs = streamed[request_id]
        assert outputs[-1].status == RequestStatus.FINISHED
        assert outputs[-1].generated_tokens == greedy(plain, prompt, length)
        assert len(outputs) > 1  # streamed step by step
    assert not streamed.get(doomed) or not streamed[doomed][-1].is_finished()


def test_a_request_longer_than_the_model_allows_gets_a_clear_error(plain, drafter):
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    with plain.continuous_batching_context_manager(generation_config=config, assistant_model=drafter) as manager:
        manager.add_request([1, 2, 3], max_new_tokens=plain.config.max_position_embeddings)
        result = manager.get_result(timeout=60)
    assert result.status == RequestStatus.FAILED
    assert "positions" in result.error and "max_new_tokens" in result.error
    with pytest.raises(TreeFlashInputError, match="TreeFlash drafter"):
        plain.generate_batch([[1, 2, 3]], assistant_model=plain, max_new_tokens=4)
    with pytest.raises(TreeFlashInputError, match="log-probabilities"):
        plain.init_continuous_batching(generation_config=config, assistant_model=drafter,
                                       continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))


def test_sampled_requests_keep_the_targets_distribution():
    target = random_target("qwen3", vocab_size=6, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=21)
    with torch.no_grad():
        target.lm_head.weight.mul_(15.0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=22, block_size=4), std=0.5)
    drafter.config.tree_budget, drafter.config.tree_lookup = 4, 0
    prompt = torch.tensor([[1, 4, 2]])
    samples = 1500
    config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0, max_new_tokens=3,
                              eos_token_id=-1)
    torch.manual_seed(4321)
    with target.continuous_batching_context_manager(generation_config=config, assistant_model=drafter) as manager:
        manager.add_requests([prompt[0].tolist()] * samples, max_new_tokens=3)
        results = [manager.get_result(timeout=60) for _ in range(samples)]
        accepted = manager.batch_processor.accepted_tokens
    counts = {}
    for result in results:
        outcome = tuple(result.generated_tokens)
        counts[outcome] = counts.get(outcome, 0) + 1
    assert accepted > samples // 20, "drafts were almost never accepted: the test would not exercise them"
    assert chi_square_p(counts, exact_joint(target, prompt, TEMPERATURE), samples) > 1e-3
    assert chi_square_p(counts, exact_joint(target, prompt, TEMPERATURE * 1.5), samples) < 1e-3  # power


def test_a_folder_decodes_with_treeflash_under_continuous_batching(plain, tokenizer, caplog):
    fast = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True, dtype=torch.float32)
    prompts = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=-1)
    with caplog.at_level(logging.WARNING):
        manager = fast.init_continuous_batching(generation_config=config)
        assert isinstance(manager, TreeFlashContinuousBatchingManager)
        outputs = fast.generate_batch(prompts, generation_config=config)
        paged = fast.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, eos_token_id=-1,
                              cache_implementation="paged")
    assert not [r for r in caplog.records if OFF_WARNING in r.getMessage()]
    assert [o.generated_tokens for o in outputs.values()] == [greedy(plain, p, MAX_TOKENS) for p in prompts]
    assert paged.reshape(-1).tolist() == prompts[0] + greedy(plain, prompts[0], 6)
    plain_manager = plain.init_continuous_batching(generation_config=config, continuous_batching_config=SMALL_CACHE)
    assert type(plain_manager).__name__ == "ContinuousBatchingManager"  # not a TreeFlash model: stock, unchanged


def test_outside_the_tested_transformers_range_it_warns_and_decodes_plain(plain, drafter, tokenizer, caplog,
                                                                         monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(continuous_batching, "TESTED_TRANSFORMERS", (Version("4.0"), Version("4.1")))
    plain.__dict__.pop(continuous_batching.WARNED_ATTRIBUTE, None)
    prompt = tokenizer(CODE_PROMPTS[0])["input_ids"]
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    with caplog.at_level(logging.WARNING):
        outputs = plain.generate_batch([prompt], generation_config=config, assistant_model=drafter,
                                       continuous_batching_config=SMALL_CACHE)
    warnings = [r.getMessage() for r in caplog.records if OFF_WARNING in r.getMessage()]
    assert len(warnings) == 1 and "outside the range" in warnings[0]
    assert next(iter(outputs.values())).generated_tokens == greedy(plain, prompt, 8)
    plain.__dict__.pop(continuous_batching.WARNED_ATTRIBUTE, None)


def test_serve_with_continuous_batching_on_a_folder_runs_treeflash(tmp_path, expected):  # noqa: F811
    """Texts of offline greedy decoding, and TreeFlash decoded them: the drafter (remote code and all) is loaded by
    the first request, which only TreeFlash's continuous-batching manager does."""
    log_path, modules_cache = tmp_path / "serve.log", tmp_path / "hf_modules"
    env = {**os.environ, "HF_MODULES_CACHE": str(modules_cache)}
    with running_server(FOLDER, trust_remote_code=True, dtype="float32", device="cpu", startup_timeout_s=180,
                        log_path=log_path, env=env, extra_args=["--continuous-batching"]) as server:
        for prompt in PROMPTS:
            assert complete(server, prompt) == expected[prompt]
    assert OFF_WARNING not in log_path.read_text(), log_path.read_text()[-3000:]
    assert drafter_code_loaded(modules_cache, pairs.bundled_drafter("drafter")), log_path.read_text()[-3000:]
