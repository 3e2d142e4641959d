"""Device-aware tree budget (`tree_budget="auto"`).

The target's verification cost `c(t)` (seconds for one forward over t tokens on top of a cached prefix) is
measured once per (model, dtype, device, threads) and cached on disk; a batch of R rows verifying n nodes each
costs about `c(R * n)` (the same matrix products), so trees shrink as the batch grows. Each step every row's
tree is built best-first, and one forward verifies the first n nodes of every row (a narrower row would be padded
anyway). `AutoBudget` picks n from what it has measured: how often the node at each place of the best-first order
is accepted, and what the rest of a drafted step costs.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .tree import DraftTree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def cache_dir() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash_hf"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_key(target) -> str:
    config = json.dumps(target.config.to_dict(), sort_keys=True, default=str)
    parts = [config, str(target.dtype), str(target.device), str(torch.get_num_threads()), torch.__version__,
             str(DEFAULT_SIZES)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def measure_verify_cost(target, sizes=DEFAULT_SIZES, past_len: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after `past_len` cached ones, for each n."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    prefix = torch.randint(0, vocab, (1, past_len), device=device)
    cache = DynamicCache(config=target.config)
    target(prefix, cache=cache, use_cache=True)
    costs = {}
    for n in sizes:
        tokens = torch.randint(0, vocab, (1, n), device=device)
        positions = torch.arange(past_len, past_len + n, device=device)[None]
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            _synchronize(device)
            start = time.perf_counter()
            target(tokens, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=0)
            _synchronize(device)
            times.append(time.perf_counter() - start)
            cache.crop(-n)  # back to the prefix
        costs[n] = statistics.median(times[1:])
    return costs


def verify_cost_curve(target, refresh: bool = False, sync=None) -> dict[int, float]:
    """`measure_verify_cost`, cached on disk per model, dtype, device and thread count. With a `sync`
    (`sync.DecisionSync`) every rank of a tensor-parallel target measures together (the forwards are collectives)
    and then uses rank 0's curve."""
    path = cache_dir() / f"verify-cost-{model_key(target)}.json"
    cached = path.exists() and not refresh
    if sync is not None:
        cached = bool(sync.share_ints([int(cached)])[0])
    if cached and path.exists():
        costs = {int(k): v for k, v in json.loads(path.read_text()).items()}
    elif cached:  # another rank has it cached; its figures arrive below
        costs = {n: 0.0 for n in DEFAULT_SIZES}
    else:
        costs = measure_verify_cost(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs))
        os.replace(tmp, path)
    if sync is not None:
        sizes = sync.share_ints(sorted(costs))
        values = sync.share_floats([costs.get(n, 0.0) for n in sizes])
        costs = dict(zip(sizes, values))
    return costs


class AutoBudget:
    """Chooses, per step, the width (nodes per row) of the best-first order every row verifies, by measured tokens
    per second.

    Best-first order puts parents before children, so every prefix of a row's node order is a tree, and a row's
    accepted path within the first n nodes is its accepted path cut at the first node numbered >= n (exact for
    greedy acceptance; an estimate under sampling, where the walk also depends on siblings). So one verified step
    shows, for every n up to its width, what verifying n nodes would have yielded: node p (p >= 1) adds a token
    exactly when it is on the accepted path. Per place p in the order, the acceptance rate `accepted_sums[p] /
    verified_sums[p]` (decayed counts over the steps that verified p, shrunk toward 0 where few steps did) gives
    the expected tokens per row of width n, `tokens(n) = 1 + rate[1:n].sum()`. The step verifies the width
    maximising expected tokens per second, `tokens(n) / (overhead + c(rows * n))`: `c` is the measured
    verification cost curve, `overhead` the measured rest of a drafted step (drafting, tree, acceptance) at this
    number of rows.

    Widths are learned, not predicted from the drafter's own probabilities (a drafter's confidence is a poor
    guide to the value of its deeper nodes). Every `explore_every`-th step verifies the whole built tree, built
    twice as large as the last choice, so the rates of places past the current width stay measured and the width
    can grow.
    """

    def __init__(self, costs: dict[int, float], smoothing: float = 0.99, explore_every: int = 4,
                 first_width: int = 16, prior_misses: float = 1.0, narrower_within: float = 0.01):
        sizes = sorted(costs)
        self.max_size = sizes[-1]  # largest measured forward, in total tokens
        # cost of every t in 1..max_size, linear between measured sizes, made non-decreasing (a measured bump, e.g.
        # 2 tokens timed slower than 4, is noise; left in, it would make widths just before it look cheap)
        cost = torch.tensor([self._interpolate(costs, sizes, n) for n in range(1, self.max_size + 1)],
                            dtype=torch.float64)
        self.cost = cost.flip(0).cummin(0).values.flip(0)
        self.per_token_beyond = (costs[sizes[-1]] - costs[sizes[-2]]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 \
            else costs[sizes[-1]]
        self.smoothing = smoothing
        self.explore_every = explore_every
        # A place seen on few steps (only the exploring ones verify past the current width) is shrunk toward "never
        # accepted" by `prior_misses` pseudo-verifications, and among widths whose rate is within `narrower_within`
        # of the best the narrowest wins: on a flat cost curve the noise of rarely verified places would otherwise
        # decide the width.
        self.prior_misses = prior_misses
        self.narrower_within = narrower_within
        self.last_best = first_width
        self.steps = 0
        # per place p = 0..max_size-1 in the best-first order: decayed count of acceptances and of verifications
        self.accepted_sums = torch.zeros(self.max_size, dtype=torch.float64)
        self.verified_sums = torch.zeros(self.max_size, dtype=torch.float64)
        self.overhead: dict[int, float] = {}  # rows -> recent seconds of a drafted step besides the verification
        self.overhead_smoothing = 0.8  # a step's time varies little: follow it closely

    def verify_cost(self, total_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of one forward over `total_tokens` (any shape of ints >= 1), extrapolated linearly past the
        largest measured size."""
        inside = self.cost[(total_tokens.clamp(max=self.max_size) - 1).long()]
        return inside + (total_tokens - self.max_size).clamp(min=0) * self.per_token_beyond

    @staticmethod
    def _interpolate(costs, sizes, n):
        lower = max(s for s in sizes if s <= n) if n >= sizes[0] else sizes[0]
        upper = min(s for s in sizes if s >= n) if n <= sizes[-1] else sizes[-1]
        if upper == lower:
            return costs[lower]
        weight = (n - lower) / (upper - lower)
        return costs[lower] * (1 - weight) + costs[upper] * weight

    def expected_tokens(self, width: int) -> torch.Tensor:
        """`[width]`: expected tokens per row when verifying the first n = 1..width nodes (places never verified
        count as never accepted)."""
        # place 0, the root, is on no accepted path (paths list drafted nodes), so its rate is 0: tokens(1) = 1
        rates = self.accepted_sums[:width] / (self.verified_sums[:width] + self.prior_misses)
        return 1.0 + rates.cumsum(0)

    def widest(self, trees: list[DraftTree]) -> int:
        """The widest width these rows can verify: their largest tree, within the largest measured forward."""
        return min(max(tree.size for tree in trees), max(1, self.max_size // len(trees)))

    def choose(self, trees: list[DraftTree], share=None) -> int:
        """The width every row verifies (each row keeps the first `width` nodes of its tree). `share(width) ->
        width` (tensor parallelism: rank 0's width on every rank) settles the width before it is recorded."""
        self.steps += 1
        rows = len(trees)
        largest = self.widest(trees)
        measured = int((self.verified_sums[1:largest] > 0).sum()) + 1  # widths whose every place was verified
        exploring = rows not in self.overhead or measured < 2 or self.steps % self.explore_every == 0
        if exploring:
            width = largest
        else:
            sizes = torch.arange(1, measured + 1)
            rate = self.expected_tokens(measured) / (self.overhead[rows] + self.verify_cost(rows * sizes))
            width = int((rate >= (1 - self.narrower_within) * rate.max()).nonzero()[0]) + 1
        width = width if share is None else share(width)
        if not exploring:
            self.last_best = width
        return width

    def observe(self, trees: list[DraftTree], paths: list[list[int]], seconds: float) -> None:
        """One verified drafted step: the rows' verified trees, each row's accepted path (node numbers) and the
        step's wall time from drafting to acceptance."""
        rows = len(trees)
        width = max(tree.size for tree in trees)
        accepted = torch.zeros(width, dtype=torch.float64)
        verified = torch.zeros(width, dtype=torch.float64)
        for tree, path in zip(trees, paths):
            verified[: tree.size] += 1
            accepted[path] += 1
        self.accepted_sums[:width] = self.smoothing * self.accepted_sums[:width] + accepted / rows
        self.verified_sums[:width] = self.smoothing * self.verified_sums[:width] + verified / rows
        rest = max(0.0, seconds - float(self.verify_cost(torch.tensor(rows * width))))
        old = self.overhead.get(rows)
        self.overhead[rows] = rest if old is None else \
            self.overhead_smoothing * old + (1 - self.overhead_smoothing) * rest

    def choose_lookup(self, chains: list[DraftTree], share=None) -> int:
        """The width of lookup branches verified alone: their path probabilities come from the lookup's own
        learned acceptance rates, so the width maximising `sum_rows (1 + E_n) / c(rows * n)` is used, where
        `E_n` is a row's expected accepted tokens of its first n nodes."""
        rows = len(chains)
        width = self.widest(chains)
        expected = torch.zeros(width, dtype=torch.float64)
        for chain in chains:
            sums = chain.path_log_probs[1:width].double().exp().cumsum(0)
            expected[1 : 1 + sums.shape[0]] += sums
            expected[1 + sums.shape[0] :] += sums[-1] if sums.shape[0] else 0.0
        sizes = torch.arange(1, width + 1)
        best = int(((rows + expected) / self.verify_cost(rows * sizes)).argmax()) + 1
        return best if share is None else share(best)

    def build_size(self, rows: int = 1) -> int:
        """How big a tree to build per row before choosing the width: room to grow past the last choice (twice
        the last choice on an exploring step)."""
        exploring = (self.steps + 1) % self.explore_every == 0
        size = max(8, 2 * self.last_best) if exploring else max(4, self.last_best + max(2, self.last_best // 2))
        return min(max(1, self.max_size // rows), size)


