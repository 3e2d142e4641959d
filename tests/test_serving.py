"""End to end: `transformers serve` on the bundled TreeFlash folder (fp32, CPU, loopback), queried with the `openai`
client. Every completion, streamed or not, one client or several at once, must be the text of offline greedy
generation by the plain target; bad requests get a 4xx with a message; the server stops cleanly."""

import concurrent.futures
import signal
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treeflash_hf.recipes import pairs
from treeflash_hf.tools.serve_bench import (
    closed_loop,
    format_load_table,
    format_table,
    merge_rounds,
    percentile,
    stream_completion,
    text_divergences,
    time_servers,
)
from treeflash_hf.tools.serving import running_server, stop_server

FOLDER = pairs.pair_dirs("tiny")[0]  # the tiny target as a TreeFlash folder (generated under the cache)
PROMPTS = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def expected():
    """Offline greedy continuation of every prompt by the plain target (fp32), as text."""
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    plain = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)
    texts = {}
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        new = plain.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        texts[prompt] = tokenizer.decode(new, skip_special_tokens=True)
    return texts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(FOLDER, trust_remote_code=True, dtype="float32", device="cpu", startup_timeout_s=180,
                        log_path=log_path) as running:
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def complete(server, prompt: str) -> str:
    response = client(server).completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0.0)
    return response.choices[0].text


def test_completions_are_offline_greedy_generation(server, expected):
    for prompt in PROMPTS:
        assert complete(server, prompt) == expected[prompt]


def test_streamed_completions_arrive_in_pieces_and_match(server, expected):
    for prompt in PROMPTS:
        stream = client(server).completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, stream=True)
        pieces = [chunk.choices[0].text for chunk in stream if chunk.choices and chunk.choices[0].text]
        assert len(pieces) > 1 and "".join(pieces) == expected[prompt]


def test_concurrent_clients(server, expected):
    requests = PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(complete, server, prompt) for prompt in requests]
        done, pending = concurrent.futures.wait(futures, timeout=len(requests) * REQUEST_TIMEOUT_S)
        assert not pending
    assert [future.result() for future in futures] == [expected[prompt] for prompt in requests]


def test_streamed_chat(server, expected):
    """The bundled chat template lays the messages out as plain text, so the assistant's reply continues the prompt.
    (transformers serve's Qwen3 reply parser also returns the prompt text in front of the reply.)"""
    stream = client(server).chat.completions.create(model=server.model, max_tokens=MAX_TOKENS, temperature=0.0,
                                                    messages=[{"role": "user", "content": PROMPTS[0]}], stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces).endswith(expected[PROMPTS[0]])


def test_bad_requests_get_a_client_error_with_a_message(server):
    with pytest.raises(openai.BadRequestError) as unknown:  # status 400, the message in the body
        client(server).completions.create(model="org/unknown-model", prompt="x", max_tokens=4)
    assert "pinned to" in unknown.value.body["detail"]
    with pytest.raises(openai.BadRequestError) as negative:
        client(server).completions.create(model=server.model, prompt="x", max_tokens=-1)
    assert "`max_new_tokens` must be greater than 0" in negative.value.body["detail"]
    with pytest.raises(openai.APIError) as streamed:  # the stream is already open: the error arrives in it
        list(client(server).completions.create(model=server.model, prompt="x", max_tokens=-1, stream=True))
    assert "max_new_tokens" in str(streamed.value.body)
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=b'{"model": "x", "prompt": ',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as malformed:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)
    assert malformed.value.code == 422 and "JSON decode error" in malformed.value.read().decode()


def test_serve_bench_measures_each_server(server, expected):
    report = time_servers({"plain": server, "treeflash": server}, PROMPTS[:1], MAX_TOKENS, repeats=1)
    for summary in report["servers"].values():
        assert summary["requests"] == 1 and summary["mean_tokens"] == MAX_TOKENS
        assert 0 < summary["first_token_ms"] and summary["tokens_per_s"] > 0
    assert report["identical_texts"]
    run = stream_completion(client(server), server.model, PROMPTS[1], MAX_TOKENS)
    assert run["text"] == expected[PROMPTS[1]] and run["first_token_s"] <= run["total_s"]


def test_the_load_test_runs_closed_loops_of_clients(server, expected):
    """Two clients share four requests: every text is the offline greedy one, latencies come as median and p90."""
    level = closed_loop(client(server), server.model, PROMPTS[:2], MAX_TOKENS, clients=2, requests=4)
    assert level["requests"] == 4 and level["tokens_per_s"] > 0
    assert 0 < level["first_token_ms_median"] <= level["first_token_ms_p90"]
    assert level["texts"] == {0: expected[PROMPTS[0]], 1: expected[PROMPTS[1]]}
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0, 3.0], 0.9) == 3.0
    report = {"prompts": 2, "max_tokens": MAX_TOKENS, "dtype": "float32", "concurrency": [1, 2],
              "treeflash_cb_warned_plain": True,
              "levels": {name: [{**level, "tokens_per_s": rate, "identical_texts": rate not in (3.0, 5.0),
                                 "divergences": [{"near_tie": rate == 5.0}] if rate in (3.0, 5.0) else []}
                                for rate in rates]
                         for name, rates in (("plain_cb", (2.0, 4.0)), ("treeflash_cb", (3.0, 5.0)))}}
    table = format_load_table(report)
    assert "1: 1.50x tokens/s, 1.00x TTFT, 2: 1.25x tokens/s" in table, table
    assert "3.0 (NOT identical: 1 beyond a near-tie)" in table and "5.0 (1 near-tie)" in table
    assert "runs plain: yes" in table


def test_load_rounds_merge_into_a_level_with_paired_ratios():
    """Rounds of a level: tokens/s is the median round's, latencies pool every request, and the table reports the
    round-by-round ratios of the two servers next to the ratio of the medians."""
    def round_of(rate, first):
        return {"clients": 2, "requests": len(first), "wall_s": 1.0, "tokens_per_s": rate, "first_token_ms": first,
                "first_token_ms_median": 0.0, "first_token_ms_p90": 0.0}

    plain = merge_rounds([round_of(10.0, [100.0, 300.0]), round_of(20.0, [200.0]), round_of(12.0, [400.0])])
    fast = merge_rounds([round_of(11.0, [50.0]), round_of(30.0, [60.0, 70.0]), round_of(18.0, [80.0])])
    assert plain["tokens_per_s"] == 12.0 and plain["requests"] == 4 and plain["rounds"] == 3
    assert plain["first_token_ms_median"] == 250.0 and plain["first_token_ms_p90"] == 400.0
    report = {"prompts": 2, "max_tokens": 8, "dtype": "float32", "concurrency": [2],
              "levels": {"plain_cb": [{**plain, "identical_texts": True}],
                         "treeflash_cb": [{**fast, "identical_texts": True}]}}
    table = format_load_table(report)  # ratios by round: 1.10, 1.50, 1.50
    assert "2: 1.50x tokens/s (rounds: median 1.50x, 1.10-1.50x), 0.26x TTFT" in table, table


def test_serve_bench_shows_where_texts_diverge(expected):
    """A text that leaves the plain server's is located and judged against the target's own top-2 gap there: a
    difference is never reported as a bare mismatch nor passed off as a tie."""
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    plain = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)
    text = expected[PROMPTS[0]]
    assert text_divergences(plain, tokenizer, PROMPTS[:1], [text], [text]) == []
    found = text_divergences(plain, tokenizer, PROMPTS[:1], [text], ["@@@" + text])
    assert len(found) == 1 and found[0]["prompt"] == 0
    assert not found[0]["near_tie"] and found[0]["gap"] > found[0]["tolerance"]  # float32: no real tie there
    servers = {name: {"first_token_ms": 1.0, "tokens_per_s": 1.0, "decode_tokens_per_s": 1.0, "mean_tokens": 1.0}
               for name in ("plain", "treeflash")}
    report = {"servers": servers, "speedup_tokens_per_s": 1.0, "first_token_ratio": 1.0, "identical_texts": False,
              "prompts": 1, "repeats": 1, "max_tokens": 16, "dtype": "float32", "device": "cpu", "divergences": found}
    assert "identical texts: NO; prompt 0: top-2 gap" in format_table(report)
    report["divergences"] = [{**found[0], "near_tie": True}]
    assert "identical texts: yes but 1 near-tie" in format_table(report)


def test_server_stops_cleanly(server):
    assert stop_server(server.process, grace_s=30) in (0, -signal.SIGTERM)  # not killed
    log = server.log_path.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log, log[-3000:]
