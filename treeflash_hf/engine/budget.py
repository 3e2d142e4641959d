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
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .cache import growing_cache
from .kernels import engine_kernel_names, engine_kernels
from .tree import DraftTree
from .verify import NOT_QUANTIZED, quantization_backend

# every size up to 8 and every other to 16: a single row's widths live there, and a CPU's curve is flat up to a
# kernel's tile and then bends, which linear interpolation between powers of two smears over the widths around it
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
INCONSISTENT = 1.05  # a size measured this much slower than a larger one is measured again
COST_METHOD = "steady sizes on the engine's cache"  # in the curve's key: curves measured otherwise are measured again


def cache_dir() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash_hf"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_key(target) -> str:
    """The cost curve's cache key: model, dtype, device, threads, what quantizes the target (a backend applied
    without transformers, e.g. `torchao.quantize_` or HQQ, leaves its config as the dense model's), and the kernels
    a module names in its `cost_key` (e.g. linear layers through oneDNN's packed weights from some row count on), and
    the engine's kernels where they are not the model's own (`kernels.engine_kernel_names`)."""
    config = json.dumps(target.config.to_dict(), sort_keys=True, default=str)
    parts = [config, str(target.dtype), str(target.device), str(torch.get_num_threads()), torch.__version__,
             str(DEFAULT_SIZES), COST_METHOD]
    backend = quantization_backend(target)
    if backend != NOT_QUANTIZED:  # only then, so that dense targets keep their keys and cached curves
        parts.append(backend)
    kernels = sorted({key for module in target.modules() if (key := getattr(module, "cost_key", None))})
    if kernels:  # likewise only when some module runs other kernels
        parts.extend(kernels)
    parts.extend(engine_kernel_names(target))  # (none on most targets: their keys and cached curves stay)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def measure_verify_cost(target, sizes=DEFAULT_SIZES, past_len: int = 256, repeats: int = 3, block: int = 2,
                        max_seconds: float = 20.0, sync=None) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after `past_len` cached ones, for each n, measured as the
    verify step runs them: on the engine's cache (`cache.growing_cache`) and kernels, each size in its steady state.
    A round visits every size (ascending, then descending the next round) and times `block` forwards of it back to
    back after an untimed one; a size's cost is its fastest. Other work on the machine only adds time, and the
    untimed forward takes what a change of size costs once (the allocator and the kernels settling to new shapes;
    docs/design.md, "auto"), which a decoding loop, whose widths change little, does not pay at every step. Past
    `max_seconds` no round starts after the second: every first call (the demo's included) waits for the curve. With
    a `sync` every rank stops where rank 0 does (the forwards are collectives)."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    prefix = torch.randint(0, vocab, (1, past_len), device=device)
    cache = growing_cache(DynamicCache(config=target.config))
    target(prefix, cache=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}

    def measure(n: int) -> None:
        tokens = torch.randint(0, vocab, (1, n), device=device)
        positions = torch.arange(past_len, past_len + n, device=device)[None]
        for timed in range(block + 1):
            _synchronize(device)
            start = time.perf_counter()
            with engine_kernels(target):  # (as the verify step runs it)
                target(tokens, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=0)
            _synchronize(device)
            if timed:
                times[n].append(time.perf_counter() - start)
            cache.crop(-n)  # back to the prefix

    started = time.perf_counter()
    for round_index in range(repeats):
        if round_index >= 2:
            stop = int(time.perf_counter() - started > max_seconds)
            if (stop if sync is None else sync.share_int(stop)):
                break
        for n in (sizes if round_index % 2 == 0 else sizes[::-1]):
            measure(n)
    # A size timed slower than a larger one was timed in a slow moment (noise only adds): measured again, once
    costs = {n: min(measured) for n, measured in times.items()}
    ordered = sorted(costs)
    suspect = [int(i + 1 < len(ordered) and costs[n] > INCONSISTENT * min(costs[m] for m in ordered[i + 1:]))
               for i, n in enumerate(ordered)]
    for n, again in zip(ordered, suspect if sync is None else sync.share_ints(suspect)):
        if again:
            measure(n)
    return {n: min(measured) for n, measured in times.items()}


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
        costs = measure_verify_cost(target, sync=sync)
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
    """Chooses, per step, the width (nodes per row) of the best-first order every row verifies: the width with the
    most expected tokens per second, `tokens(n) / (overhead + scale * c(rows * n))`.

    - `tokens(n) = 1 + rate[1:n].sum()`: best-first order puts parents before children, so one verified step shows
      for every n up to its width what n nodes would have yielded (node p adds a token exactly when it is on the
      accepted path; exact for greedy, an estimate under sampling). `rate[p]` is the decayed acceptance count of
      place p over the steps that verified it, shrunk toward the drafter's own probability of that place's path
      over the same steps where few did (places past the width are verified only on exploring steps).
    - `c` is the target's measured verification cost curve, `scale` what verifying at this number of rows measured
      against it, `overhead` the measured rest of a drafted step, adjusted by `depth_cost` seconds per drafted
      depth and row (fitted on how the rest of a step moves with its depth, over the steps that scored their depths
      once: `observe`).
    - The width is settled before the step (`plan`), kept unless another beats it by `switch_margin`, and now and
      then a step explores a quarter wider so the places past it stay measured; a settled width doubles the wait
      between explorations (up to `max_explore_every`).
    The rationale and the measurements behind each rule: docs/design.md ("auto")."""

    def __init__(self, costs: dict[int, float], smoothing: float = 0.99, explore_every: int = 4,
                 max_explore_every: int = 32, first_width: int = 16, prior_weight: float = 4.0,
                 switch_margin: float = 0.01, warmup_steps: int = 8, max_depth: int | None = None):
        sizes = sorted(costs)
        self.max_size = sizes[-1]  # largest measured forward, in total tokens
        # cost of every t in 1..max_size, linear between measured sizes, made non-decreasing (a measured bump, e.g.
        # 2 tokens timed slower than 4, is noise; left in, it would make widths just before it look cheap)
        cost = torch.tensor([self._interpolate(costs, sizes, n) for n in range(1, self.max_size + 1)],
                            dtype=torch.float64)
        self.cost = cost.flip(0).cummin(0).values.flip(0)
        self.cost_list = self.cost.tolist()  # the same, for single lookups without tensor overhead
        self.per_token_beyond = (costs[sizes[-1]] - costs[sizes[-2]]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 \
            else costs[sizes[-1]]
        self.smoothing = smoothing
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        # A place seen on few steps (only the exploring ones verify past the current width) is shrunk toward the
        # drafter's own probability of its path (calibrated: docs/design.md, "auto") by `prior_weight`
        # pseudo-verifications; toward "never accepted", those places read a third of their rate and the width
        # settled too narrow. The width changes only for one whose expected rate beats the last choice's by
        # `switch_margin`: on a flat stretch of the cost curve many widths are within noise of each other, and the
        # noise of a few places would otherwise move the width back and forth.
        self.prior_weight = prior_weight
        self.switch_margin = switch_margin
        self.last_best = first_width  # the last width chosen on trees not cut short
        self.planned = first_width  # this step's width, settled by `plan`
        self.built = 0  # the tree size `plan` last asked for
        self.exploring = True  # whether this step verifies the whole wider tree it built
        self.explore_wait = explore_every  # draft steps from one exploration to the next
        self.until_explore = 0  # draft steps left before the next exploration
        self.just_explored = False
        self.warmup_steps = warmup_steps  # the first steps explore around `first_width`
        self.observed_steps = 0
        # per place p = 0..max_size-1 in the best-first order: decayed count of acceptances and of verifications
        self.accepted_sums = torch.zeros(self.max_size, dtype=torch.float64)
        self.verified_sums = torch.zeros(self.max_size, dtype=torch.float64)
        self.predicted_sums = torch.zeros(self.max_size, dtype=torch.float64)  # of the drafter's path probability
        self.verified_extent = 0  # places 0..verified_extent-1 have been verified on some step
        self.overhead: dict[int, float] = {}  # rows -> recent seconds of a drafted step besides the verification
        self.verify_scale: dict[int, float] = {}  # rows -> recent measured verification seconds / c(rows * width)
        self.drafted_depth: dict[int, float] = {}  # rows -> recent drafted depth of the steps behind `overhead`
        # decayed sums over the fitted steps (`observe`), of (depth - its rows' recent depth)^2 and of that times
        # (per-row rest - its rows' recent per-row rest), both recent figures those of fitted steps alone: their
        # ratio is `depth_cost`
        self.depth_moments = [0.0, 0.0]
        self.fitted_depth: dict[int, float] = {}  # rows -> recent drafted depth of the fitted steps
        self.fitted_rest: dict[int, float] = {}  # rows -> their recent rest per row
        self.max_depth = max_depth  # the drafter's deepest draft (its block size - 1); None: no limit
        self.depth_cap: int | None = None  # the depths a drafted step scores at most (`plan`'s); None: no cap
        self.overhead_smoothing = 0.8  # a step's time varies little: follow it closely

    def verify_cost(self, total_tokens: int) -> float:
        """Seconds of one forward over `total_tokens` (>= 1) tokens, extrapolated linearly past the largest
        measured size."""
        inside = self.cost_list[min(total_tokens, self.max_size) - 1]
        return inside + max(0, total_tokens - self.max_size) * self.per_token_beyond

    def verify_costs(self, rows: int, width: int) -> torch.Tensor:
        """`[width]`: seconds of one forward over `rows * n` tokens for n = 1..width (`rows * width` within the
        largest measured size)."""
        return self.cost[rows - 1 : rows * width : rows]

    @staticmethod
    def _interpolate(costs, sizes, n):
        lower = max(s for s in sizes if s <= n) if n >= sizes[0] else sizes[0]
        upper = min(s for s in sizes if s >= n) if n <= sizes[-1] else sizes[-1]
        if upper == lower:
            return costs[lower]
        weight = (n - lower) / (upper - lower)
        return costs[lower] * (1 - weight) + costs[upper] * weight

    def expected_tokens(self, width: int) -> list[float]:
        """Expected tokens per row when verifying the first n = 1..width nodes (places never verified count as
        never accepted). Plain floats: this runs every step, and a few dozen additions cost less than the
        tensor calls would."""
        accepted = self.accepted_sums[:width].tolist()
        verified = self.verified_sums[:width].tolist()
        predicted = self.predicted_sums[:width].tolist()
        tokens, expected, weight = 1.0, [], self.prior_weight
        for accepted_at, verified_at, predicted_at in zip(accepted, verified, predicted):
            # place 0, the root, is on no accepted path (paths list drafted nodes), so its rate is 0: tokens(1) = 1
            prior = predicted_at / verified_at if verified_at > 0 else 0.0
            tokens += (accepted_at + weight * prior) / (verified_at + weight) if verified_at + weight > 0 else 0.0
            expected.append(tokens)
        return expected

    def widest(self, sizes: list[int]) -> int:
        """The widest width rows with trees of `sizes` nodes can verify: their largest tree, within the largest
        measured forward."""
        return min(max(sizes), max(1, self.max_size // len(sizes)))

    @property
    def depth_cost(self) -> float:
        """Seconds a drafted step's rest grows by per drafted position and row (0 until steps of one batch size
        have drafted different depths)."""
        spread, covariance = self.depth_moments
        return max(0.0, covariance / spread) if spread >= 1.0 else 0.0

    def overheads(self, rows: int, width: int) -> list[float] | None:
        """`[width]`: the rest of a drafted step of `rows` rows verifying n = 1..width nodes per row (see the
        class): from this number of rows' measured figures, else the nearest measured number's, in proportion to
        the rows (drafting is mostly per-row work; the first step at a new batch size then measures it). None
        before any drafted step."""
        if not self.overhead:
            return None
        nearest = self.nearest_measured(rows)
        base, depth, per_position = self.overhead[nearest] * rows / nearest, self.drafted_depth[nearest], \
            rows * self.depth_cost
        return [max(0.0, base + per_position * (self.drafted_depth_of(n) - depth)) for n in range(1, width + 1)]

    def drafted_depth_of(self, width: int) -> int:
        """Depths a drafted step of `width` nodes per row scores (a tree of the root alone still drafts one)."""
        depth = max(2, width) - 1
        for cap in (self.max_depth, self.depth_cap):
            depth = depth if cap is None else min(depth, cap)
        return depth

    def nearest_measured(self, rows: int) -> int:
        """The number of rows closest to `rows` (the smaller on a tie) that some drafted step has measured."""
        return rows if rows in self.overhead else min(self.overhead, key=lambda measured: (abs(measured - rows),
                                                                                          measured))

    def plan(self, rows: int = 1, share=None, may_explore: bool = True, depth_cap: int | None = None) -> int:
        """Before a drafted step of `rows` rows: settle the width every row verifies (`planned`) and whether the step
        explores; returns how big a tree to build per row (the width itself, or a quarter more, at least 4 nodes,
        when exploring). `share(width) -> width` (tensor parallelism: rank 0's width on every rank) settles the
        width; the rest follows from what every rank has seen alike. `may_explore=False` (the step scheduler is
        itself trying the drafted kind, which must be judged at the width it would use) postpones a due
        exploration to a later step; the first steps (`warmup_steps`) explore regardless. `depth_cap`: the most
        depths the step will score (`learned.ScoredDepth`), whatever the width; None: as many as the width."""
        self.depth_cap = depth_cap
        cap = max(1, self.max_size // rows)
        measured = min(cap, self.verified_extent)  # widths whose every place was verified
        warming_up = self.observed_steps < self.warmup_steps  # a few steps' paths say little: keep the width
        self.exploring = warming_up or not self.overhead or measured < 2 or (may_explore and self.until_explore <= 0)
        width = min(self.last_best, cap)
        if not warming_up and self.overhead:  # (then some step was observed: measured >= 1)
            scale = self.verify_scale[self.nearest_measured(rows)]
            rate = [tokens / (overhead + scale * self.cost_list[rows * n - 1])  # tokens per second at width n
                    for n, (tokens, overhead) in enumerate(zip(self.expected_tokens(measured),
                                                               self.overheads(rows, measured)), start=1)]
            best = rate.index(max(rate)) + 1
            last = min(self.last_best, measured)
            width = last if rate[last - 1] >= (1 - self.switch_margin) * rate[best - 1] else best
        self.planned = width if share is None else share(width)
        grown = max(8, self.planned + max(4, self.planned // 4))
        # (at least 2: a tree of the root alone would ask for plain decoding, which the step scheduler decides)
        self.built = min(cap, grown if self.exploring else max(2, self.planned))
        return self.built

    def choose(self, sizes: list[int]) -> int:
        """The width every row of this drafted step verifies (each row keeps the first `width` nodes of its tree;
        `sizes`: the built trees' nodes): the planned width, or on an exploring step the whole built tree."""
        largest = self.widest(sizes)
        if self.exploring:
            self.until_explore = self.explore_wait - 1  # the explore_wait-th step from here explores again
            self.just_explored = True
            return largest
        width = min(self.planned, largest)
        self.until_explore -= 1
        if largest >= self.built:  # not a width forced by trees cut short
            if width != self.last_best:
                self.explore_wait = self.explore_every
            elif self.just_explored:
                self.explore_wait = min(self.max_explore_every, 2 * self.explore_wait)
            self.just_explored = False
            self.last_best = width
        return width

    def observe(self, sizes: list[int], paths: list[list[int]], seconds: float,
                verify_seconds: float | None = None, drafted_depth: int | None = None,
                deepened: bool = False, path_probs: torch.Tensor | None = None) -> None:
        """One verified drafted step: the rows' verified trees' nodes, each row's accepted path (node numbers), the
        step's wall time from drafting to acceptance and, of it, the verification's (the target's forward and the
        acceptance; None: not measured apart, taken as the cost curve's figure), the depths the drafter scored
        (None: those of the widest verified tree), whether its trees asked for the depths left unscored (then
        searched again), and `path_probs [R, >= width]`: the drafter's probability of each verified node's path (0
        past a row's tree; None: none known, the places shrink toward "never accepted").

        `depth_cost` is fitted on steps that scored their depths once, after the warm-up: a deepened step scores
        the whole block and searches twice, and the first steps of a first call pay one-time work; both would be
        read as a cost per depth and make narrow widths look cheaper than they run (docs/design.md, "auto")."""
        rows = len(sizes)
        width = max(sizes)
        sizes = torch.tensor(sizes)
        on_paths = torch.tensor([node for path in paths for node in path], dtype=torch.long)
        accepted = torch.bincount(on_paths, minlength=width)  # rows whose accepted path holds each place
        verified = torch.bincount(sizes - 1, minlength=width).flip(0).cumsum(0).flip(0)  # rows that verified it
        self.accepted_sums[:width].mul_(self.smoothing).add_(accepted, alpha=1 / rows)
        self.verified_sums[:width].mul_(self.smoothing).add_(verified, alpha=1 / rows)
        self.predicted_sums[:width].mul_(self.smoothing)
        if path_probs is not None:
            path_sums = path_probs[:, :width].sum(0, dtype=torch.float64)
            path_sums[0] = 0.0  # (the root is on no accepted path)
            self.predicted_sums[:width].add_(path_sums, alpha=1 / rows)
        self.verified_extent = max(self.verified_extent, width)
        self.observed_steps += 1
        predicted = self.verify_cost(rows * width)
        verify_seconds = predicted if verify_seconds is None else verify_seconds
        rest = max(0.0, seconds - verify_seconds)
        drafted = self.drafted_depth_of(width) if drafted_depth is None else drafted_depth
        # the depth fit reads steps that scored their depths once, after the warm-up (see above)
        fitted = not deepened and self.observed_steps > self.warmup_steps
        if fitted and rows in self.fitted_depth:
            depth_gap, rest_gap = drafted - self.fitted_depth[rows], rest / rows - self.fitted_rest[rows]
            self.depth_moments = [self.smoothing * self.depth_moments[0] + depth_gap ** 2,
                                  self.smoothing * self.depth_moments[1] + depth_gap * rest_gap]
        for figures, value in ((self.overhead, rest), (self.verify_scale, verify_seconds / max(predicted, 1e-9)),
                               (self.drafted_depth, drafted), (self.fitted_depth, drafted if fitted else None),
                               (self.fitted_rest, rest / rows if fitted else None)):
            old = figures.get(rows)
            if value is not None:
                figures[rows] = value if old is None else \
                    self.overhead_smoothing * old + (1 - self.overhead_smoothing) * value

    def choose_lookup(self, chains: list[DraftTree], share=None) -> int:
        """The width of lookup branches verified alone: their path probabilities come from the lookup's own
        learned acceptance rates, so the width maximising `sum_rows (1 + E_n) / c(rows * n)` is used, where
        `E_n` is a row's expected accepted tokens of its first n nodes."""
        rows = len(chains)
        width = self.widest([chain.size for chain in chains])
        expected = torch.zeros(width, dtype=torch.float64)
        for chain in chains:
            sums = chain.path_log_probs[1:width].double().exp().cumsum(0)
            expected[1 : 1 + sums.shape[0]] += sums
            expected[1 + sums.shape[0] :] += sums[-1] if sums.shape[0] else 0.0
        best = int(((rows + expected) / self.verify_costs(rows, width)).argmax()) + 1
        return best if share is None else share(best)
