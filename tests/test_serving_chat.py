"""End to end on the real pair: `transformers serve` on the SmolLM2 TreeFlash folder (fp32, CPU, loopback), streamed
chat completions through the `openai` client. Every reply must be the text of offline greedy generation by the plain
target on the prompt serve renders (the folder's chat template with the generation prompt), and the server must have
decoded it with TreeFlash; served with `generate()` per request and with `--continuous-batching`.

How serve answers a chat (transformers/cli/serving/chat_completion.py): each message's content is collapsed to one
string, the processor loaded with `AutoProcessor.from_pretrained(folder)` (here the tokenizer) renders them with
`apply_chat_template(messages, add_generation_prompt=True, tools=None, return_tensors="pt", return_dict=True,
tokenize=True)`, generation runs with a copy of the model's generation config (`max_tokens` -> `max_new_tokens`,
`temperature=0` -> `do_sample=False`), and the stream is decoded token by token with `skip_special_tokens=True` (no
reply parser for `llama`). The offline reference below makes the same calls.

TreeFlash is seen from outside through transformers' dynamic-module cache (`HF_MODULES_CACHE`, a fresh folder for
this server): the folder's `generate()` loads its drafter, remote code and all, on the first request that decodes
with TreeFlash, so the drafter's modeling code appears there then and not before."""

import os
from pathlib import Path
from typing import Iterator

import pytest
import torch
from openai.types.chat import ChatCompletionChunk
from transformers import AutoModelForCausalLM, AutoTokenizer

from treeflash_hf.recipes import pairs
from treeflash_hf.tools.serving import ServerProcess, running_server

from .test_serving import client

PAIR = "smollm2-135m"
CHATS = [
    [{"role": "user", "content": "How do I keep basil fresh?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "Seven is a prime number."},
     {"role": "user", "content": "Write a Python function that returns the largest of three numbers."}],
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path, Path]:
    """(target folder, drafter folder, tokenizer folder) of the real pair (SmolLM2 converted on first use)."""
    return pairs.pair_dirs(PAIR)


@pytest.fixture(scope="module")
def expected(pair) -> list[dict]:
    """Per chat, offline greedy decoding by the plain target (fp32) of the prompt serve renders: the reply's text,
    and the prompt's and the reply's lengths in tokens."""
    target_dir, _, tokenizer_dir = pair
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    replies = []
    for messages in CHATS:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        prompt_len = inputs["input_ids"].shape[1]
        new = plain.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, prompt_len:]
        replies.append({"text": tokenizer.decode(new, skip_special_tokens=True), "prompt_tokens": prompt_len,
                        "completion_tokens": len(new)})
    return replies


@pytest.fixture(scope="module", params=["generate", "continuous-batching"])
def serving_mode(request) -> str:
    """How the server decodes: `generate()` on one inference thread, or `--continuous-batching` (TreeFlash's
    continuous-batching manager)."""
    return request.param


@pytest.fixture(scope="module")
def modules_cache(tmp_path_factory, serving_mode) -> Path:
    """The server's own dynamic-module cache (`HF_MODULES_CACHE`), empty at startup."""
    return tmp_path_factory.mktemp(f"hf_modules_{serving_mode}")


@pytest.fixture(scope="module")
def server(pair, modules_cache, serving_mode, tmp_path_factory) -> Iterator[ServerProcess]:
    """The pair's TreeFlash folder served in fp32 with its remote code, its log kept for the assertions."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_MODULES_CACHE": str(modules_cache)}
    extra = ["--continuous-batching"] if serving_mode == "continuous-batching" else []
    with running_server(pair[0], trust_remote_code=True, dtype="float32", device="cpu", startup_timeout_s=180,
                        env=env, log_path=log_path, extra_args=extra) as running:
        yield running


def drafter_code_loaded(modules_cache: Path, drafter_dir: Path) -> bool:
    """Whether the server has imported the drafter's remote code (transformers copies a local folder's code into
    `transformers_modules/<folder name>/<hash>/` when it loads it)."""
    return any((modules_cache / "transformers_modules" / drafter_dir.name).glob("*/modeling_treeflash_drafter.py"))


def stream_chat(server: ServerProcess, messages: list[dict]) -> tuple[list[str], ChatCompletionChunk]:
    """The streamed reply to `messages` (greedy, `MAX_TOKENS`): its content pieces, and the last chunk."""
    stream = client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)
    chunks = list(stream)
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    return pieces, chunks[-1]


def test_streamed_chats_are_offline_greedy_replies_decoded_by_treeflash(server, expected, pair, modules_cache):
    drafter_dir = pair[1]
    assert not drafter_code_loaded(modules_cache, drafter_dir)  # loaded lazily, by the first TreeFlash request
    for messages, reply in zip(CHATS, expected):
        pieces, last = stream_chat(server, messages)
        assert len(pieces) > 1 and "".join(pieces) == reply["text"]
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (reply["prompt_tokens"],
                                                                            reply["completion_tokens"])
        assert last.choices[0].finish_reason == ("length" if reply["completion_tokens"] == MAX_TOKENS else "stop")
    assert drafter_code_loaded(modules_cache, drafter_dir), server.log_tail()
    log = server.log_path.read_text()
    assert "Traceback" not in log and "TreeFlash is off" not in log, server.log_tail()
