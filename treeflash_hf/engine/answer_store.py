"""An answer store for the lookup branch (`tree_lookup`): the target's own earlier answers, searched for the text
that followed the sequence's last few tokens.

A model answers alike what users ask alike: the same openings, the same code idioms, the same worked-answer
phrasing, often whole answers to a common request. The in-sequence lookup (`lookup.ngram_continuation`) only sees
the current request; the store sees every answer it holds (for the reference pair: the committed corpus, the
target's greedy answers to ~50K requests). As vLLM's suffix decoding and REST do, a match of the sequence's last
`n` tokens (n = 8 down to 1, the longest first) proposes the continuation most of its occurrences share, and the
branch is verified like any other: the output stays the target's own.

Layout: `tokens [T]` (the answers one after another, each followed by `SEPARATOR`) and an index `order [T]` of the
positions sorted by the `KEY_TOKENS` tokens that start there (packed into one integer, `key`). A pattern of at
most `KEY_TOKENS` tokens is a range of the sorted keys; a longer one is the range of its first `KEY_TOKENS` tokens,
filtered on the rest.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STORE_FILE = "answer_store.npz"  # in a drafter's folder: used by its lookup branch
SEPARATOR = -1  # after each answer: no match runs across it (a pattern holds real tokens only)
UINT16_SEPARATOR = 2**16 - 1  # the separator in a file of two-byte tokens
MAX_ORDER = 8  # longest match tried (tokens)
MAX_VOTERS = 256  # occurrences sampled (evenly over the match range) to choose a continuation
MIN_SHARE = 0.3  # a continuation token fewer than this share of the voters agree on ends the branch
BUILD_COMMAND = "treeflash-hf reference corpus answer-store --folder <corpus> --out <drafter folder>"


class AnswerStoreError(ValueError):
    """An answer store that cannot be read or built; the message names the fix."""


@dataclass(frozen=True)
class StoreMatch:
    """A continuation from the store: `tokens`, the share of the voting occurrences that agreed on each, and the
    matched order `n` (0: nothing matched)."""

    tokens: list[int]
    shares: list[float]
    order: int


class AnswerStore:
    """The index over `tokens [T]` (int32, answers separated by `SEPARATOR`); built once, read-only. Memory: 16
    bytes a token (the tokens, their positions and the sorted keys): ~185 MB for the reference pair's 11.6M."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, metadata: dict | None = None):
        if vocab_size >= 2**31 - 1:
            raise AnswerStoreError(f"A vocabulary of {vocab_size} tokens does not fit an answer store (int32 ids).")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise AnswerStoreError(f"An answer store's tokens must be one flat array (got shape {tokens.shape}).")
        if tokens.size and (tokens.max() >= vocab_size or tokens.min() < SEPARATOR):
            raise AnswerStoreError(f"The answer store holds token ids outside the vocabulary (0..{vocab_size - 1}): "
                                   "was it built for another tokenizer? Rebuild it from this target's answers.")
        tokens = tokens.astype(np.int32)
        self.tokens, self.vocab_size, self.metadata = tokens, vocab_size, metadata or {}
        self.bits = int(vocab_size + 1).bit_length()  # a token is stored as id + 1 (the separator: 0)
        self.key_tokens = max(1, min(MAX_ORDER, 63 // self.bits))
        keys = self.packed_keys(np.arange(tokens.size))
        self.order = np.argsort(keys, kind="stable").astype(np.int64 if tokens.size >= 2**31 else np.int32)
        self.sorted_keys = keys[self.order]

    def __len__(self) -> int:
        return int(self.tokens.size)

    def packed_keys(self, positions: np.ndarray) -> np.ndarray:
        """The `key_tokens` tokens starting at each of `positions`, packed big-end first (past the end: 0)."""
        keys = np.zeros(positions.shape, dtype=np.uint64)
        for offset in range(self.key_tokens):
            at = positions + offset
            values = np.where(at < self.tokens.size, self.tokens[np.minimum(at, self.tokens.size - 1)] + 1, 0)
            keys = (keys << np.uint64(self.bits)) | values.astype(np.uint64)
        return keys

    def occurrences(self, pattern: list[int], at_most: int | None = None) -> np.ndarray:
        """Positions where `pattern` (real tokens, at most `MAX_ORDER`) starts, in index order; `at_most`: no more
        than that many, evenly spaced over them (sampled before they are copied where no tail filter runs)."""
        head, tail = pattern[: self.key_tokens], pattern[self.key_tokens :]
        low = 0
        for token in head:
            low = (low << self.bits) | (token + 1)
        shift = self.bits * (self.key_tokens - len(head))
        low <<= shift
        high = low + (1 << shift)  # every key that starts with `head`
        start = int(np.searchsorted(self.sorted_keys, np.uint64(low), side="left"))
        end = int(np.searchsorted(self.sorted_keys, np.uint64(high - 1), side="right"))
        if not tail and at_most is not None and end - start > at_most:
            return self.order[start + evenly_spaced(end - start, at_most)].astype(np.int64)
        positions = self.order[start:end].astype(np.int64)
        for offset, token in enumerate(tail, start=self.key_tokens):
            at = positions + offset
            inside = at < self.tokens.size
            positions = positions[inside & (self.tokens[np.minimum(at, self.tokens.size - 1)] == token)]
        if at_most is not None and positions.size > at_most:
            positions = positions[evenly_spaced(positions.size, at_most)]
        return positions

    def continuation(self, sequence: list[int], length: int) -> StoreMatch:
        """The continuation of `sequence`'s last n tokens (n = `MAX_ORDER` down to 1, the longest that occurs):
        at each depth the token most of the matching occurrences continue with (up to `MAX_VOTERS` of them, evenly
        sampled), then only the occurrences that agreed vote on the next. Ends at `length` tokens, at the end of an
        answer, or where fewer than `MIN_SHARE` of the voters agree."""
        starts, order = self.longest_match(sequence)
        if not order:
            return StoreMatch([], [], 0)
        positions = starts + order
        tokens, shares = [], []
        while len(tokens) < length:
            positions = positions[positions < self.tokens.size]
            if not positions.size:
                break
            if positions.size == 1:  # one occurrence left: the rest of its answer, as far as asked
                start = int(positions[0])
                rest = self.tokens[start : start + length - len(tokens)]
                ends = np.flatnonzero(rest == SEPARATOR)
                rest = rest[: ends[0]] if ends.size else rest
                tokens += rest.tolist()
                shares += [1.0] * rest.size
                break
            following = self.tokens[positions]
            agreed = following == following[0]
            if agreed.all():  # (the common case: no count needed)
                token, share = int(following[0]), 1.0
            else:
                values, counts = np.unique(following, return_counts=True)
                best = int(counts.argmax())
                token, share = int(values[best]), float(counts[best]) / following.size
                agreed = following == token
            if token == SEPARATOR or share < MIN_SHARE:
                break
            tokens.append(token)
            shares.append(share)
            positions = positions[agreed] + 1
        return StoreMatch(tokens, shares, order)

    def longest_match(self, sequence: list[int]) -> tuple[np.ndarray, int]:
        """The starts of the longest of `sequence`'s last n tokens (n = `MAX_ORDER` down to 1) that occurs, in index
        order (at most `MAX_VOTERS`, evenly spaced), and n (0: none). A match of n >= `key_tokens` tokens ends with
        the last `key_tokens`: their occurrences (one key, so in position order) are found once and filtered on one
        more token before them per order, instead of a search per order (each a walk of the sorted keys, missing the
        CPU's caches after a target forward)."""
        head = self.key_tokens
        if len(sequence) >= head:
            last = self.occurrences(sequence[-head:])  # where the last `head` tokens start
            order, found = (head, last) if last.size else (0, last)
            for extra in range(1, min(MAX_ORDER, len(sequence)) - head + 1):
                before = last - extra  # (the token `extra` places before them must be the sequence's too)
                last = last[(before >= 0) & (self.tokens[np.maximum(before, 0)] == sequence[-head - extra])]
                if not last.size:
                    break
                order, found = head + extra, last
            if order:
                starts = found - (order - head)
                return (starts[evenly_spaced(starts.size, MAX_VOTERS)] if starts.size > MAX_VOTERS else starts), order
        for order in range(min(head - 1, len(sequence)), 0, -1):  # shorter than a key: a range of keys each
            starts = self.occurrences(sequence[-order:], at_most=MAX_VOTERS)
            if starts.size:
                return starts, order
        return np.zeros(0, dtype=np.int64), 0

    @classmethod
    def from_answers(cls, answers, vocab_size: int, metadata: dict | None = None) -> "AnswerStore":
        """A store over `answers` (sequences of token ids)."""
        parts = []
        for answer in answers:
            parts.extend((np.asarray(answer, dtype=np.int64), np.array([SEPARATOR])))
        return cls(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32), vocab_size, metadata)

    def save(self, path: str | Path) -> None:
        """Write the answers (not the index: rebuilt on load) to `path` atomically."""
        path = Path(path)
        scratch = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        if self.vocab_size < UINT16_SEPARATOR:  # two bytes a token
            stored = np.where(self.tokens == SEPARATOR, UINT16_SEPARATOR, self.tokens).astype(np.uint16)
        else:
            stored = self.tokens
        with open(scratch, "wb") as handle:
            np.savez(handle, tokens=stored, vocab_size=np.int64(self.vocab_size),
                     metadata=np.array(json.dumps(self.metadata)))
        os.replace(scratch, path)

    @classmethod
    def load(cls, path: str | Path) -> "AnswerStore":
        """Read a store `save` wrote (and index it: a few seconds for ten million tokens)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                stored, vocab_size = data["tokens"], int(data["vocab_size"])
                metadata = json.loads(str(data["metadata"]))
        except (OSError, KeyError, ValueError) as err:
            raise AnswerStoreError(f"Cannot read the answer store {path} ({type(err).__name__}: {err}): rebuild it "
                                   f"with `{BUILD_COMMAND}`.") from None
        tokens = stored.astype(np.int32)
        if stored.dtype == np.uint16:  # (the separator stored as the largest value)
            tokens[stored == UINT16_SEPARATOR] = SEPARATOR
        return cls(tokens, vocab_size, metadata)


def evenly_spaced(count: int, size: int) -> np.ndarray:
    """`size` indices evenly spaced over 0..count-1."""
    return np.linspace(0, count - 1, size).astype(np.int64)


def npz_metadata(path: str | Path) -> dict:
    """The JSON `metadata` member of an `.npz` file (corpus shards, answer stores), read without the arrays."""
    with np.load(path, allow_pickle=False) as data:
        return json.loads(str(data["metadata"]))


_LOADED: dict[str, tuple[float, AnswerStore]] = {}  # path -> (its modification time, the store)
_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # drafter -> store or None


def attach_answer_store(drafter, store: "AnswerStore | str | Path | None") -> None:
    """Give `drafter`'s lookup branch this answer store (a store, or the path of a store file; None: none, not even
    the one in its folder)."""
    if isinstance(store, (str, Path)):
        store = load_store_file(Path(store))
    _ATTACHED[drafter] = store


def load_store_file(path: Path) -> AnswerStore:
    """The store at `path`, read once per process (again when the file changed)."""
    if not path.is_file():
        raise AnswerStoreError(f"No answer store at {path}: build one with `{BUILD_COMMAND}`.")
    stamp = path.stat().st_mtime
    kept = _LOADED.get(str(path))
    if kept is None or kept[0] != stamp:
        kept = (stamp, AnswerStore.load(path))
        _LOADED[str(path)] = kept
    return kept[1]


def answer_store_of(drafter) -> AnswerStore | None:
    """The answer store `drafter`'s lookup branch reads: the one attached (`attach_answer_store`), else the
    `answer_store.npz` in the folder the drafter was loaded from, else None."""
    if drafter in _ATTACHED:
        return _ATTACHED[drafter]
    folder = getattr(drafter, "name_or_path", "") or getattr(drafter.config, "_name_or_path", "")
    path = Path(folder) / STORE_FILE if folder else None
    store = load_store_file(path) if path is not None and path.is_file() else None
    _ATTACHED[drafter] = store
    return store
