"""Atomic, resumable training checkpoints.

A checkpoint is a folder `step-XXXXXXXX/` holding `state.pt` (model, optimizer and scheduler state, step,
every RNG state) and `meta.json`. It is written to a temporary folder and renamed into place, so a crash
never leaves a half-written checkpoint; `latest` names the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict, meta: dict, keep: int = 2) -> Path:
    """Write `state` (tensors, optimizer state...) for `step` atomically; keep the newest `keep` checkpoints."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=run_dir))
    try:
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = run_dir / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, run_dir / "latest")
    for old in sorted(run_dir.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


DRAFT_VOCAB_KEY = "draft_token_ids"  # a drafter's draft vocabulary: a decoding choice saved with it, not a weight


def with_own_draft_vocab(model: torch.nn.Module, weights: dict) -> dict:
    """`weights` (a checkpoint's state dict) for loading into `model`, with `model`'s own draft vocabulary (or none
    when it has none) in place of the checkpoint's: a run resumed or continued after a drafter was given a draft
    vocabulary, or had it removed, loads its weights as they are."""
    weights = {name: value for name, value in weights.items() if name != DRAFT_VOCAB_KEY}
    own = getattr(model, DRAFT_VOCAB_KEY, None)
    return weights if own is None else {**weights, DRAFT_VOCAB_KEY: own}


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = Path(run_dir) / pointer.read_text().strip()
    return path if path.exists() else None


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint folder (or its `state.pt`); a damaged file gives a `CheckpointError`."""
    path = Path(path)
    state_file = path / "state.pt" if path.is_dir() else path
    if not state_file.exists():
        raise CheckpointError(f"No checkpoint at {state_file}: pass a run folder written by `treeflash-hf train`.")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(
            f"Checkpoint {state_file} is corrupt or truncated ({type(err).__name__}: {err}). Delete that step "
            "folder (training resumes from the previous one) or start without --resume."
        ) from err
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{state_file} is not a treeflash-hf training checkpoint (no model state or step).")
    return state
