"""Device-aware tree budget (`tree_budget="auto"`).

The target's verification cost `c(n)` (seconds for one forward over n tokens on top of a cached prefix) is
measured once per (model, dtype, device, threads) and cached on disk. Each step the tree is built at the
largest measured size; because best-first pops parents before children, every prefix of its node order is a
valid tree, and the drafter's own estimate of accepted tokens for prefix n is `E_n = sum of path probs of
nodes 1..n-1`. The step keeps the prefix that maximises expected tokens per second,
`(1 + calibration * E_n) / (c(n) + drafting time)`, where `calibration` (observed / predicted accepted
tokens, running) corrects the drafter's over- or under-confidence.
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

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def cache_dir() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash_hf"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_key(target) -> str:
    config = json.dumps(target.config.to_dict(), sort_keys=True, default=str)
    parts = [config, str(target.dtype), str(target.device), str(torch.get_num_threads()), torch.__version__]
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


def verify_cost_curve(target, refresh: bool = False) -> dict[int, float]:
    """`measure_verify_cost`, cached on disk per model, dtype, device and thread count."""
    path = cache_dir() / f"verify-cost-{model_key(target)}.json"
    if path.exists() and not refresh:
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    costs = measure_verify_cost(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(costs))
    os.replace(tmp, path)
    return costs


class AutoBudget:
    """Chooses, per step, how many nodes of the best-first order to verify."""

    def __init__(self, costs: dict[int, float], smoothing: float = 0.9, explore_every: int = 8):
        sizes = sorted(costs)
        self.max_size = sizes[-1]
        # cost of every n in 1..max_size, linear between measured sizes
        self.cost = torch.tensor([self._interpolate(costs, sizes, n) for n in range(1, self.max_size + 1)])
        self.calibration = 1.0
        self.smoothing = smoothing
        self.last_best = 16
        # Every `explore_every`-th step verifies the whole built tree, so that calibration also sees how the
        # drafter's estimate holds for bigger trees than the ones it currently picks (it would never learn that
        # an under-confident drafter deserves more nodes otherwise).
        self.explore_every = explore_every
        self.steps = 0
        self.predicted_total = 0.0
        self.observed_total = 0.0
        # Drafting time = fixed + per_node * nodes built (the tree stage grows with the size), fitted online by
        # least squares over exponentially weighted (built size, seconds) pairs.
        self.fit = torch.zeros(5, dtype=torch.float64)  # sums of w, x, y, x*x, x*y

    def drafting_cost(self, sizes: torch.Tensor) -> torch.Tensor:
        w, x, y, xx, xy = self.fit.tolist()
        if w == 0:
            return torch.zeros(sizes.shape)
        variance = xx / w - (x / w) ** 2
        slope = max(0.0, (xy / w - (x / w) * (y / w)) / variance) if variance > 1e-9 else 0.0
        intercept = y / w - slope * x / w
        return (intercept + slope * sizes.double()).float()

    @staticmethod
    def _interpolate(costs, sizes, n):
        lower = max(s for s in sizes if s <= n) if n >= sizes[0] else sizes[0]
        upper = min(s for s in sizes if s >= n) if n <= sizes[-1] else sizes[-1]
        if upper == lower:
            return costs[lower]
        weight = (n - lower) / (upper - lower)
        return costs[lower] * (1 - weight) + costs[upper] * weight

    def choose(self, tree: DraftTree, drafting_seconds: float) -> tuple[DraftTree, float]:
        """The best prefix of `tree` (in node order) and its predicted accepted tokens. `drafting_seconds` is what
        drafting this tree (of `tree.size` nodes) took; it feeds the drafting-cost model."""
        size = float(tree.size)
        self.fit.mul_(self.smoothing).add_(torch.tensor([1.0, size, drafting_seconds, size * size,
                                                         size * drafting_seconds], dtype=torch.float64))
        self.steps += 1
        if self.steps % self.explore_every == 0:
            n_max = min(tree.size, self.max_size)
            return tree.prefix(n_max), float(self.prefix_expected(tree, n_max)[-1])
        best, predicted = self.best_prefix(tree, self.calibration, self.drafting_cost)
        self.last_best = best
        return tree.prefix(best), predicted

    def choose_lookup(self, chain: DraftTree) -> DraftTree:
        """The best prefix of a lookup branch verified alone (no drafting cost; its probabilities are already
        calibrated by the lookup's own acceptance rates)."""
        return chain.prefix(self.best_prefix(chain, 1.0, torch.zeros_like)[0])

    @staticmethod
    def prefix_expected(tree: DraftTree, n_max: int) -> torch.Tensor:
        """`[n_max]`: E_n, the drafter's expected accepted tokens of the first n nodes, n = 1..n_max."""
        return torch.cat([torch.zeros(1), tree.path_log_probs[1:n_max].exp().cumsum(0)])

    def best_prefix(self, tree: DraftTree, calibration: float, extra_cost) -> tuple[int, float]:
        """(n, predicted accepted tokens) of the prefix maximising `(1 + calibration * E_n) / (c(n) + extra)`,
        where `extra_cost(sizes)` adds per-size seconds (e.g. drafting)."""
        n_max = min(tree.size, self.max_size)
        expected = self.prefix_expected(tree, n_max)
        sizes = torch.arange(1, n_max + 1)
        rate = (1 + calibration * expected) / (self.cost[:n_max] + extra_cost(sizes))
        best = int(rate.argmax()) + 1
        return best, float(expected[best - 1])

    def build_size(self) -> int:
        """How big a tree to build before choosing its prefix: room to grow past the last choice."""
        return min(self.max_size, max(4, self.last_best + max(2, self.last_best // 2)))

    def observe(self, predicted: float, accepted: int) -> None:
        self.predicted_total = self.smoothing * self.predicted_total + predicted
        self.observed_total = self.smoothing * self.observed_total + accepted
        if self.predicted_total > 1e-6:
            self.calibration = min(4.0, max(0.05, self.observed_total / self.predicted_total))
