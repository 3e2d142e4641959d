"""What the decoding loop learns as it runs, kept across `generate()` calls for the same drafter and target.

The lookup branch's acceptance rates (`LookupRates`), each step kind's measured time and yield
(`StepScheduler`), how deep recent trees went (`ScoredDepth`) and, under `tree_budget="auto"`, the per-place
acceptance rates and step overhead (`AutoBudget`) are properties of the pair on this device under these decoding
settings, not of one prompt. A 100-token call has ~40 steps, too few to learn them afresh each time, so they carry over to the next call
(transformers' assisted generation likewise carries its assistant's `num_assistant_tokens` across calls). They
only decide what is verified, never what is emitted: the output stays the target's own either way.

The state is kept beside the drafter (`learned_states(drafter)`, a `LearnedStates`), per target and per (target and drafter dtype and device, torch thread
count, tree options, sampling settings, calling thread): concurrent `generate()` calls from several threads never
share it, so they cannot race on it. `forget_learned_state(drafter)` drops it.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .budget import AutoBudget, verify_cost_curve
from .lookup import LookupRates, StepScheduler
from .options import TreeOptions

class ScoredDepth:
    """How many depths a drafted step scores with the target's head before its trees are searched: one more than
    the deepest tree of the last `window` drafted steps (all of them before any step). Scoring a depth costs a
    `[rows, H] x [H, V]` product, and trees at budget 16 mostly stop 2-5 deep of the drafter's 15; a tree that
    reaches the scored depth has the rest scored and is searched again (`plan_step`), so the trees are those of
    scoring every depth, only cheaper. Learned from the trees alone: the same on every rank."""

    def __init__(self, window: int = 16):
        self.recent_depths: deque[int] = deque(maxlen=window)

    def depth(self, limit: int, longest_branch: int = 0) -> int:
        """Depths to score out of `limit`: past the recent trees' depth and below the end of the longest lookup
        branch (a branch reaching the scored depth would ask for the rest every time)."""
        if not self.recent_depths:
            return limit
        return min(limit, max(max(self.recent_depths), longest_branch) + 1)

    def observe(self, deepest: int) -> None:
        """A drafted step's deepest node over its trees as searched (before any cut to a verified width)."""
        self.recent_depths.append(deepest)


@dataclass
class LearnedState:
    """`lookup_rates`: the lookup branch's acceptance rates; `schedule`: which kind each step verifies;
    `auto_budget`: per-step prefix choice under `tree_budget="auto"` (None for a fixed budget); `scored_depth`:
    how many depths a drafted step scores up front."""

    lookup_rates: LookupRates
    schedule: StepScheduler
    auto_budget: AutoBudget | None
    scored_depth: ScoredDepth


class LearnedStates:
    """Everything decoding with one drafter has learned: for each target (held weakly: a freed target takes its
    states with it), a `LearnedState` per settings key. `learned_states(drafter)` is the drafter's own store."""

    def __init__(self):
        self.per_target: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def state(self, drafter, target, options: TreeOptions, generation_config: GenerationConfig,
              sync=None) -> LearnedState:
        """The state for decoding `target` with `drafter` under `options` and `generation_config`'s sampling
        settings, created on first use (`sync`: see `budget.verify_cost_curve`)."""
        sampling = (
            (generation_config.temperature, generation_config.top_k, generation_config.top_p)
            if generation_config.do_sample
            else None
        )
        devices = (str(target.dtype), str(target.device), str(drafter.dtype), str(drafter.device))
        key = (devices, torch.get_num_threads(), options, sampling, threading.get_ident())
        states = self.per_target.setdefault(target, {})
        if key not in states:
            auto = options.tree_budget == "auto"
            states[key] = LearnedState(
                lookup_rates=LookupRates(),
                schedule=StepScheduler(allow_plain=auto),
                auto_budget=AutoBudget(verify_cost_curve(target, sync=sync), max_depth=drafter.config.block_size - 1)
                if auto else None,
                scored_depth=ScoredDepth(),
            )
        return states[key]


# drafter -> its LearnedStates, beside the drafter (nothing is set on the user's module; a copy of the drafter,
# `copy.deepcopy` or a reload, starts afresh)
_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def learned_states(drafter) -> LearnedStates:
    """The store of what decoding with `drafter` has learned, made on first use."""
    store = _STORES.get(drafter)
    if store is None:
        store = _STORES[drafter] = LearnedStates()
    return store


def learned_state(drafter, target, options: TreeOptions, generation_config: GenerationConfig,
                  sync=None) -> LearnedState:
    """The drafter's learned state for this target and these settings (see `LearnedStates.state`)."""
    return learned_states(drafter).state(drafter, target, options, generation_config, sync)


def forget_learned_state(drafter) -> None:
    """Drop what decoding with `drafter` has learned (every target): the next call starts afresh."""
    _STORES.pop(drafter, None)
