"""A lookup branch for the draft tree (`tree_lookup`), and the scheduler that decides what each step verifies.

Code and chat repeat themselves (identifiers, call patterns, quoted text). The most recent earlier occurrence of
the sequence's last n tokens proposes the tokens that followed it (`ngram_continuation`), as one more branch of
the drafter's tree; the best-first search weighs it against the drafter's own nodes (`with_lookup_branch`). Each
proposed token carries `P(accepted | parent accepted)`, learned online per n-gram length and depth
(`LookupRates`). `StepScheduler` decides, per step and by measured tokens per second, whether to draft, to verify
the branch alone, or (auto budget) to verify the root alone. Verification is unchanged, so the output stays the
target's own.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from .tree import ChildList

MAX_NGRAM = 3  # longest n-gram matched first (then shorter ones)
# Where a branch came from: ("sequence", n) a match of the last n tokens in the row's own text, ("store", n) in the
# answer store (`answer_store.py`); each learns its own acceptance rates.
LookupSource = tuple[str, int]
NO_SOURCE: LookupSource = ("none", 0)
# A proposed token whose path probability falls below this is the branch's last (see `useful_length`).
MIN_PATH_PROB = 0.05


def ngram_continuation(sequence: torch.LongTensor | list[int], max_ngram: int, length: int) -> tuple[list[int], int]:
    """The `length` tokens that followed the most recent earlier occurrence of the last n tokens of `sequence
    [S]`, the longest n up to `max_ngram` that occurs. Returns (continuation, n), or ([], 0) when nothing matches.

    A match that ends `p` tokens before the sequence does is a copy at distance `p`; where the copied text runs
    into the end of the sequence, the copy continues over its own output (as in LZ77), so text repeating with
    period `p` yields a continuation of any length, not just `p` tokens. (One pass over the host's list, most recent
    first: a few hundred tokens cost less than the tensor calls of a windowed comparison per n.)"""
    tokens = sequence.tolist() if isinstance(sequence, torch.Tensor) else list(sequence)
    total = len(tokens)
    best_n, best_end = 0, -1
    for end in range(total - 2, -1, -1):  # where an earlier occurrence ends (it has a next token)
        if tokens[end] != tokens[-1]:
            continue
        n = 1
        while n < max_ngram and end - n >= 0 and tokens[end - n] == tokens[total - 1 - n]:
            n += 1
        if n > best_n:  # (the most recent occurrence of each length is met first)
            best_n, best_end = n, end
            if n == max_ngram:
                break
    if not best_n:
        return [], 0
    period = tokens[best_end + 1 :]
    return (period * (length // len(period) + 1))[:length], best_n


def depth_bucket(depth: int) -> int:
    """Depth 1, 2, 3-4, 5-8, 9-16, 17+ -> 0..5: a token deep in a matching run is likelier to match too."""
    return min(5, (depth - 1).bit_length())


@dataclass
class LookupRates:
    """Per (branch source, depth bucket), the running probability that a proposed token is accepted when its
    parent was (a source: `LookupSource`, where the branch came from and the length of its match): a Beta prior of
    `prior_count` pseudo-trials at `priors[bucket]`, then exponentially weighted counts. Deep buckets start
    optimistic (repeated text tends to keep repeating) and learn from every token proposed there."""

    priors: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)
    prior_count: float = 2.0
    decay: float = 0.98
    successes: dict[tuple[LookupSource, int], float] = field(default_factory=dict)
    trials: dict[tuple[LookupSource, int], float] = field(default_factory=dict)

    def rate(self, source: LookupSource, depth: int = 1) -> float:
        key = (source, depth_bucket(depth))
        successes = self.successes.get(key, 0.0) + self.priors[key[1]] * self.prior_count
        return successes / (self.trials.get(key, 0.0) + self.prior_count)

    def log_probs(self, source: LookupSource, length: int) -> list[float]:
        """Conditional log-probability of each proposed token at depths 1..length."""
        return [math.log(self.rate(source, depth)) for depth in range(1, length + 1)]

    def observe(self, source: LookupSource, proposed: list[int], target_tokens: list[int]) -> None:
        """`target_tokens`: the target's own tokens at depths 1, 2, ... (as far as verification reached). Each
        proposed token whose predecessors all matched is one trial at its depth."""
        for key in [k for k in self.trials if k[0] == source]:
            self.successes[key] *= self.decay
            self.trials[key] *= self.decay
        for depth, (proposed_token, target_token) in enumerate(zip(proposed, target_tokens), start=1):
            key = (source, depth_bucket(depth))
            self.trials[key] = self.trials.get(key, 0.0) + 1
            self.successes.setdefault(key, 0.0)
            if proposed_token != target_token:
                break
            self.successes[key] += 1


def useful_length(log_probs: list[float], min_path_prob: float) -> int:
    """How many tokens of a branch with conditional `log_probs` to keep: up to the first whose path probability
    falls below `min_path_prob`, that one included (so deeper rates keep being tried)."""
    for depth, path in enumerate(itertools.accumulate(log_probs), start=1):
        if path < math.log(min_path_prob):
            return depth
    return len(log_probs)


def expected_accepted(log_probs: list[float]) -> float:
    """Expected accepted tokens of a chain with conditional `log_probs`: the sum of its path probabilities."""
    return sum(math.exp(path) for path in itertools.accumulate(log_probs))


def with_lookup_branch(children_of, lookup_tokens: list[int], log_probs: list[float]):
    """Wrap a best-first `children_of(depth, token)` so that the lookup branch root -> lookup_tokens[0] -> ... is
    offered too: the node at depth i carrying `lookup_tokens[i-1]` (the root at depth 0) gets child
    `lookup_tokens[i]` with log-prob at least `log_probs[i]`. Children stay sorted by decreasing log-prob."""

    def children(depth: int, token: int) -> ChildList | None:
        base = children_of(depth, token)
        on_branch = depth < len(lookup_tokens) and (depth == 0 or lookup_tokens[depth - 1] == token)
        if not on_branch:
            return base
        proposed, log_prob = lookup_tokens[depth], log_probs[depth]
        tokens, values = (list(base[0]), list(base[1])) if base is not None else ([], [])
        if proposed in tokens:
            at = tokens.index(proposed)
            if values[at] >= log_prob:
                return base
            del tokens[at], values[at]
        at = next((i for i, value in enumerate(values) if value < log_prob), len(values))
        tokens.insert(at, proposed)
        values.insert(at, log_prob)
        return tokens, values

    return children


@dataclass
class StepScheduler:
    """What each decode step verifies, chosen by expected tokens per second. One target forward serves every row
    of the batch, so the choice is the batch's:

    - `"draft"`: the drafter's trees, each with its row's lookup branch in it when there is one;
    - `"lookup"`: each row's lookup branch alone (the root alone for a row without one), skipping the drafter;
    - `"plain"`: the roots alone (one token per row, skipping the drafter); only when `allow_plain`
      (`tree_budget="auto"`, where 1 is a budget like any other).

    Tokens of a step are summed over the rows. A row yields, on a draft step, `1 + E_L + gain` with a branch
    (`E_L`: the branch's expected accepted tokens, `expected_accepted`; `gain`: what the drafter added on top of
    the branch on recent draft steps), else `draft_tokens`, the recent mean; on a lookup step `1 + E_L` (1
    without a branch); on a plain step 1. Seconds: each kind's recent step time at this number of rows (a
    forward over more rows costs more). Each kind is tried once per batch size before it is judged. A kind that
    loses is still taken once it has waited `explore_every` steps, so that its figures stay current (one unlucky
    measurement cannot exclude it for good); each such try that does not change the verdict doubles that kind's
    wait (up to `max_explore_every`), and winning resets it. A kind with a known lower bound on its time (plain
    steps: the target's forward alone) is not tried while it would lose even at that bound. Skipping the drafter
    loses nothing: it receives the skipped positions' context with its next draft (a longer drafter forward,
    measured like any other draft).
    """

    allow_plain: bool = False
    explore_every: int = 4
    max_explore_every: int = 64
    smoothing: float = 0.8  # step times
    yield_smoothing: float = 0.95  # tokens per draft step: one step's yield varies far more than its time
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, rows) -> recent step time
    draft_tokens: float | None = None
    drafter_gain: float | None = None
    waited: dict[str, int] = field(default_factory=dict)  # per kind, steps since it was last taken
    wait_limit: dict[str, int] = field(default_factory=dict)  # per kind, its current exploration wait
    explored: bool = False  # whether the last choice was a try (an untried or a losing kind), not the best kind

    def expected_tokens(self, branch_expected: list[float | None],
                        in_tree: list[float | None] | None = None) -> dict[str, float | None]:
        """Per step kind, the tokens the batch is expected to emit (None: not yet known). `in_tree`: per row, what
        its branch is expected to yield inside a drafted tree, which holds fewer of a long branch's tokens than a
        step verifying the branch alone (None: as much)."""
        in_tree = branch_expected if in_tree is None else in_tree
        with_branch = [(e, t) for e, t in zip(branch_expected, in_tree) if e is not None]
        without_branch = len(branch_expected) - len(with_branch)
        draft = 0.0
        if with_branch:
            draft = None if self.drafter_gain is None else sum(1 + t + self.drafter_gain for _, t in with_branch)
        if without_branch and draft is not None:
            draft = None if self.draft_tokens is None else draft + without_branch * self.draft_tokens
        tokens = {"draft": draft}
        if with_branch:
            tokens["lookup"] = without_branch + sum(1 + e for e, _ in with_branch)
        if self.allow_plain:
            tokens["plain"] = float(len(branch_expected))
        return tokens

    def choose(self, branch_expected: list[float | None], share=None,
               lower_bounds: dict[str, float] | None = None, in_tree: list[float | None] | None = None) -> str:
        """The kind of the next step, given each row's lookup-branch expected accepted tokens (None: no branch;
        `in_tree`: inside a drafted tree, see `expected_tokens`).
        `share(kind) -> kind` (tensor parallelism: rank 0's choice on every rank) settles the choice before this
        scheduler records it. `lower_bounds`: per kind, a known lower bound of its step time at this number of
        rows (a plain step costs at least the target's forward over one token per row): such a kind is judged at
        its bound until measured, and is explored only while it would win at its bound."""
        rows = len(branch_expected)
        bounds = lower_bounds or {}
        tokens = self.expected_tokens(branch_expected, in_tree)
        for kind in tokens:
            self.waited[kind] = self.waited.get(kind, 0) + 1
        seconds = {kind: self.seconds.get((kind, rows), bounds.get(kind)) for kind in tokens}
        untried = [kind for kind in tokens if seconds[kind] is None or tokens[kind] is None]
        best = None
        if untried:
            chosen = untried[0]  # learn what each kind yields first (a draft step first of all)
        else:
            rate = {kind: tokens[kind] / seconds[kind] for kind in tokens}
            best = max(tokens, key=rate.get)
            stale = [kind for kind in tokens if kind != best
                     and self.waited[kind] >= self.wait_limit.get(kind, self.explore_every)
                     and (kind not in bounds or tokens[kind] / bounds[kind] > rate[best])]
            chosen = stale[0] if stale else best
            if chosen == best:
                self.wait_limit[best] = self.explore_every
            else:
                self.wait_limit[chosen] = min(self.max_explore_every,
                                              2 * self.wait_limit.get(chosen, self.explore_every))
        if share is not None:
            chosen = share(chosen)
        self.waited[chosen] = 0
        self.explored = chosen != best
        return chosen

    def observe(self, kind: str, seconds: float, accepted: list[int], branch_expected: list[float | None]) -> None:
        """One verified step: its kind, wall time (drafting to acceptance), and per row the accepted drafted tokens
        and the lookup branch's expected accepted tokens (None: no branch)."""
        def ema(old: float | None, new: float, smoothing: float) -> float:
            return new if old is None else smoothing * old + (1 - smoothing) * new

        key = (kind, len(accepted))
        self.seconds[key] = ema(self.seconds.get(key), seconds, self.smoothing)
        if kind != "draft":
            return
        for row_accepted, expected in zip(accepted, branch_expected):
            if expected is None:
                self.draft_tokens = ema(self.draft_tokens, 1 + row_accepted, self.yield_smoothing)
            else:
                self.drafter_gain = ema(self.drafter_gain, row_accepted - expected, self.yield_smoothing)
