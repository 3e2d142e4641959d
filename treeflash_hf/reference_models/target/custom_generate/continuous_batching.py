"""TreeFlash and transformers' continuous batching (`cache_implementation="paged"`, `generate_batch`,
`continuous_batching_context_manager`, `init_continuous_batching`, `transformers serve --continuous-batching`).

TreeFlash does not decode inside continuous batching yet, and no path switches it off without a word: a TreeFlash
drafter given to continuous batching raises `TreeFlashInputError` naming what works; a TreeFlash model folder asked
for continuous batching logs one warning and decodes with the plain target. Every override of transformers'
continuous-batching entry points lives in this module.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

from .validation import TreeFlashInputError, is_treeflash_drafter

logger = logging.getLogger(__name__)

FOLDER_MARK = "_treeflash_folder_generate"  # on a TreeFlash folder's `generate` function
WARNED_ATTRIBUTE = "_treeflash_plain_cb_warned"  # on a folder model, once it has warned
GUARD_MARK = "_treeflash_guard"  # on ContinuousMixin's methods, once wrapped (by any copy of this module)


def refuse_drafter(entry: str) -> None:
    """Raise the error for a TreeFlash drafter given to continuous batching through `entry` (what the caller used)."""
    raise TreeFlashInputError(
        f"TreeFlash does not run inside continuous batching ({entry}) yet. To decode with TreeFlash, call "
        "`generate()` without cache_implementation='paged' on a static batch of left-padded prompts "
        "(`tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt')`); for plain continuous "
        "batching, drop `assistant_model`."
    )


def mark_folder_generate(generate: Callable) -> Callable:
    """Mark `generate` as a TreeFlash model folder's own `generate()` (see `is_treeflash_folder`)."""
    setattr(generate, FOLDER_MARK, True)
    return generate


def is_treeflash_folder(model) -> bool:
    """Whether `model` was loaded from a TreeFlash model folder with trust_remote_code: transformers then sets
    `model.generate = functools.partial(<the folder's generate>, model=model)`."""
    generate = model.__dict__.get("generate")
    return bool(getattr(getattr(generate, "func", None), FOLDER_MARK, False))


def warn_plain_continuous_batching(model) -> None:
    """Say once per model that continuous batching on this TreeFlash folder decodes with the plain target."""
    if model.__dict__.get(WARNED_ATTRIBUTE):
        return
    model.__dict__[WARNED_ATTRIBUTE] = True
    logger.warning(
        "TreeFlash is off for continuous batching (cache_implementation='paged', generate_batch, "
        "init_continuous_batching, `transformers serve --continuous-batching`): %s decodes with the plain target. "
        "For TreeFlash, call generate() without cache_implementation='paged' (or serve without "
        "--continuous-batching).", model.name_or_path)


def _guard(method: Callable, check: Callable) -> Callable:
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        check(self, kwargs)
        return method(self, *args, **kwargs)

    setattr(guarded, GUARD_MARK, True)
    return guarded


def _check_generate_batch(model, kwargs: dict) -> None:
    # stock generate_batch takes **kwargs and ignores all but max_new_tokens: a drafter would vanish there
    if is_treeflash_drafter(kwargs.get("assistant_model")):
        refuse_drafter("generate_batch")


def _check_init(model, kwargs: dict) -> None:
    if is_treeflash_folder(model):
        warn_plain_continuous_batching(model)


def install_continuous_batching_guards() -> None:
    """Wrap `ContinuousMixin.generate_batch` (a TreeFlash drafter raises) and `init_continuous_batching`, which the
    other entry points and `transformers serve --continuous-batching` go through (a TreeFlash folder warns once).
    The class is wrapped because transformers runs none of a folder's code with the model in hand when it loads it;
    other models take the stock path unchanged. Idempotent, also across copies of this module (a folder's
    `custom_generate/` and the installed package)."""
    for name, check in (("generate_batch", _check_generate_batch), ("init_continuous_batching", _check_init)):
        method = getattr(ContinuousMixin, name)
        if not getattr(method, GUARD_MARK, False):
            setattr(ContinuousMixin, name, _guard(method, check))
