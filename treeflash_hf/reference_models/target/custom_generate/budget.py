"""Device-aware tree budget (`tree_budget="auto"`).

The target's verification cost `c(t)` (seconds for one forward over t tokens on top of a cached prefix) is
measured once per (model, dtype, device, threads) and cached on disk; a batch of R rows verifying n nodes each
costs about `c(R * n)` (the same matrix products), so trees shrink as the batch grows. Each step every row's
tree is built; because best-first pops parents before children, every prefix of a row's node order is a valid
tree, and the drafter's own estimate of accepted tokens for prefix n is `E_n = sum of path probs of nodes
1..n-1`. One forward verifies all rows at one width (a narrower row would be padded anyway), so the step keeps
the width n that maximises expected tokens per second, `sum_rows (1 + calibration * E_n) / (c(R * n) + drafting
time)`, where `calibration` (observed / predicted accepted tokens, running) corrects the drafter's over- or
under-confidence.
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
    """Chooses, per step, the width (nodes per row) of the best-first order every row verifies."""

    def __init__(self, costs: dict[int, float], smoothing: float = 0.9, explore_every: int = 8):
        sizes = sorted(costs)
        self.max_size = sizes[-1]  # largest measured forward, in total tokens
        # cost of every t in 1..max_size, linear between measured sizes
        self.cost = torch.tensor([self._interpolate(costs, sizes, n) for n in range(1, self.max_size + 1)])
        self.per_token_beyond = (costs[sizes[-1]] - costs[sizes[-2]]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 \
            else costs[sizes[-1]]
        self.calibration = 1.0
        self.smoothing = smoothing
        self.last_best = 16
        # Every `explore_every`-th step verifies the whole built trees, so that calibration also sees how the
        # drafter's estimate holds for bigger trees than the ones it currently picks (it would never learn that
        # an under-confident drafter deserves more nodes otherwise).
        self.explore_every = explore_every
        self.steps = 0
        self.predicted_total = 0.0
        self.observed_total = 0.0
        # Drafting time = fixed + per_node * nodes built (the tree stage grows with the size), fitted online by
        # least squares over exponentially weighted (nodes built over all rows, seconds) pairs.
        self.fit = torch.zeros(5, dtype=torch.float64)  # sums of w, x, y, x*x, x*y

    def verify_cost(self, total_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of one forward over `total_tokens` (any shape of ints >= 1), extrapolated linearly past the
        largest measured size."""
        inside = self.cost[(total_tokens.clamp(max=self.max_size) - 1).long()]
        return inside + (total_tokens - self.max_size).clamp(min=0) * self.per_token_beyond

    def drafting_cost(self, nodes: torch.Tensor) -> torch.Tensor:
        w, x, y, xx, xy = self.fit.tolist()
        if w == 0:
            return torch.zeros(nodes.shape)
        variance = xx / w - (x / w) ** 2
        slope = max(0.0, (xy / w - (x / w) * (y / w)) / variance) if variance > 1e-9 else 0.0
        intercept = y / w - slope * x / w
        return (intercept + slope * nodes.double()).float()

    @staticmethod
    def _interpolate(costs, sizes, n):
        lower = max(s for s in sizes if s <= n) if n >= sizes[0] else sizes[0]
        upper = min(s for s in sizes if s >= n) if n <= sizes[-1] else sizes[-1]
        if upper == lower:
            return costs[lower]
        weight = (n - lower) / (upper - lower)
        return costs[lower] * (1 - weight) + costs[upper] * weight

    def choose(self, trees: list[DraftTree], drafting_seconds: float, share=None) -> tuple[int, float]:
        """The width every row verifies (each row keeps the first `width` nodes of its tree) and the predicted
        accepted tokens over all rows. `drafting_seconds` is what drafting these trees took; it feeds the
        drafting-cost model. `share(width) -> width` (tensor parallelism: rank 0's width on every rank) settles
        the width before it is recorded."""
        built = float(sum(tree.size for tree in trees))
        self.fit.mul_(self.smoothing).add_(torch.tensor([1.0, built, drafting_seconds, built * built,
                                                         built * drafting_seconds], dtype=torch.float64))
        self.steps += 1
        exploring = self.steps % self.explore_every == 0
        if exploring:
            width = max(tree.size for tree in trees)
        else:
            width = self.best_width(trees, self.calibration, self.drafting_cost)
        width = width if share is None else share(width)
        if not exploring:
            self.last_best = width
        return width, float(self.prefix_expected(trees, width)[:, -1].sum())

    def choose_lookup(self, chains: list[DraftTree], share=None) -> int:
        """The width of lookup branches verified alone (no drafting cost; their probabilities are already
        calibrated by the lookup's own acceptance rates)."""
        width = self.best_width(chains, 1.0, torch.zeros_like)
        return width if share is None else share(width)

    @staticmethod
    def prefix_expected(trees: list[DraftTree], width: int) -> torch.Tensor:
        """`[R, width]`: E_n per row, the drafter's expected accepted tokens of the first n nodes, n = 1..width
        (constant past a row's own size)."""
        rows = torch.zeros(len(trees), width)
        for row, tree in enumerate(trees):
            sums = tree.path_log_probs[1:width].exp().cumsum(0)
            rows[row, 1 : 1 + sums.shape[0]] = sums
            if sums.shape[0] + 1 < width:
                rows[row, sums.shape[0] + 1 :] = rows[row, sums.shape[0]]
        return rows

    def best_width(self, trees: list[DraftTree], calibration: float, extra_cost) -> int:
        """The width n maximising `sum_rows (1 + calibration * E_n) / (c(R * n) + extra)`, where
        `extra_cost(nodes)` adds seconds for the nodes of all rows (e.g. drafting)."""
        rows = len(trees)
        width = min(max(tree.size for tree in trees), max(1, self.max_size // rows))
        expected = self.prefix_expected(trees, width).sum(dim=0)  # [width]
        sizes = torch.arange(1, width + 1)
        rate = (rows + calibration * expected) / (self.verify_cost(rows * sizes) + extra_cost(rows * sizes))
        return int(rate.argmax()) + 1

    def build_size(self, rows: int = 1) -> int:
        """How big a tree to build per row before choosing the width: room to grow past the last choice."""
        return min(max(1, self.max_size // rows), max(4, self.last_best + max(2, self.last_best // 2)))

    def observe(self, predicted: float, accepted: int) -> None:
        """The predicted and the observed accepted tokens of one step (over all rows)."""
        self.predicted_total = self.smoothing * self.predicted_total + predicted
        self.observed_total = self.smoothing * self.observed_total + accepted
        if self.predicted_total > 1e-6:
            self.calibration = min(4.0, max(0.05, self.observed_total / self.predicted_total))
