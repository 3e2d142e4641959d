"""The decode step's stages as named `torch.profiler` ranges, so that `treeflash-hf profile` (or any torch profiler)
sees where a step's time goes without patching the engine. Outside a profiler a range costs about a microsecond."""

from __future__ import annotations

import functools

from torch.profiler import record_function

PREFILL = "treeflash::prefill"  # the target over the prompts (not part of a decode step)
DRAFT = "treeflash::draft"  # drafter forward and marginals
TREE = "treeflash::tree"  # AR tables and the best-first trees
VERIFY = "treeflash::verify"  # masks, inputs and the target's forward over the trees
TARGET_FORWARD = "treeflash::target_forward"  # the target's forward alone (inside VERIFY or PREFILL)
DRAFTER_FORWARD = "treeflash::drafter_forward"  # the drafter model's forward alone (inside DRAFT)
ACCEPT = "treeflash::accept"  # the walk down each tree
COMMIT = "treeflash::commit"  # cache compaction and the drafter's new context
STAGES = (DRAFT, DRAFTER_FORWARD, TREE, VERIFY, TARGET_FORWARD, ACCEPT, COMMIT)
FORWARDS = (TARGET_FORWARD, DRAFTER_FORWARD)  # the models' own work; everything else in a step is the engine's


def traced(name: str):
    """Decorate a function so that each call is one `name` range (a fresh range per call: thread-safe)."""
    def decorate(function):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            with record_function(name):
                return function(*args, **kwargs)

        return wrapped

    return decorate
