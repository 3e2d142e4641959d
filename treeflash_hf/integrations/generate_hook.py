"""The `generate()` hook: `target.generate(**inputs, assistant_model=drafter)` decodes with TreeFlash.

`install_generate_hook` (run by `import treeflash_hf`) replaces `GenerationMixin.generate` with `generate` below,
which hands decoding to `engine.decode.treeflash_decode` when `assistant_model` is a TreeFlash drafter and runs
transformers' own `generate` otherwise. `route_generate` is shared with the `custom_generate/generate.py` files of
TreeFlash model folders and Hub repos.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

from transformers.generation import GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from ..engine.decode import treeflash_decode
from ..engine.options import OPTION_NAMES, TreeOptions
from ..engine.validation import (
    TREE_MASK_BACKENDS,
    TreeFlashInputError,
    check_inputs,
    check_pair,
    is_treeflash_drafter,
)
from .continuous_batching import install_continuous_batching_guards, paged_generate

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def tree_attention_backend(target):
    """Switch a target whose attention backend cannot take tree masks (flash attention) to SDPA for the call."""
    original = target.config._attn_implementation
    if original in TREE_MASK_BACKENDS:
        yield
        return
    try:
        target.set_attn_implementation("sdpa")
    except Exception as err:  # the model has no SDPA path
        raise TreeFlashInputError(
            f"The target uses attn_implementation={original!r}, which cannot take a tree attention mask, and it "
            "cannot switch to 'sdpa'. Load it with attn_implementation='eager'."
        ) from err
    logger.warning("TreeFlash: attn_implementation=%r cannot take tree masks; using 'sdpa' for this call.", original)
    try:
        yield
    finally:
        target.set_attn_implementation(original)


_STOCK_GENERATE = GenerationMixin.generate


def _wants_stock_dflash(target, kwargs: dict) -> bool:
    if kwargs.get("speculation_type") is not None:
        return kwargs["speculation_type"] == "dflash"
    config = kwargs.get("generation_config") or target.generation_config
    return getattr(config, "speculation_type", None) == "dflash"


def route_generate(stock_generate, model, *args, assistant_model=None, **kwargs):
    """Run `stock_generate` (transformers' `generate`), handing decoding to TreeFlash when `assistant_model` is a
    TreeFlash drafter (unless `speculation_type="dflash"` asks for transformers' own linear DFlash loop).
    Extra keyword arguments `tree_mode`, `tree_budget`, `tree_top_m`, `tree_top_k` override the drafter's
    `generation_config`. With `cache_implementation="paged"` (an argument or the generation config's) it runs
    transformers' continuous batching with TreeFlash's manager (`continuous_batching.paged_generate`). Shared by the
    installed hook and the Hub repo's `custom_generate/generate.py`."""
    tree_overrides = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
    if not is_treeflash_drafter(assistant_model) or _wants_stock_dflash(model, kwargs):
        if tree_overrides:
            raise TypeError(
                f"{sorted(tree_overrides)} apply only to TreeFlash decoding: pass a TreeFlash drafter as "
                "`assistant_model` (and no `speculation_type='dflash'`)."
            )
        return stock_generate(model, *args, assistant_model=assistant_model, **kwargs)
    config = kwargs.get("generation_config") or model.generation_config
    if (kwargs.get("cache_implementation") or config.cache_implementation) == "paged":
        if tree_overrides:
            raise TypeError(f"{sorted(tree_overrides)} do not apply to continuous batching "
                            "(cache_implementation='paged'): it decodes with the drafter's own tree options.")
        return paged_generate(stock_generate, model, args, kwargs, assistant_model)
    if kwargs.get("custom_generate") is not None:
        raise TypeError("`custom_generate` cannot be combined with a TreeFlash drafter as `assistant_model`.")
    kwargs.pop("custom_generate", None)
    move_stop_strings_to_criteria(model, kwargs)
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if kwargs.get("streamer") is not None and inputs is not None and inputs.dim() == 2 and inputs.shape[0] > 1:
        check_inputs(model, inputs, streamer=kwargs["streamer"])  # before generate() streams the prompt
    options = TreeOptions.resolve(assistant_model, tree_overrides)
    check_pair(model, assistant_model)
    decoding = functools.partial(
        treeflash_decode, drafter=assistant_model, options=options, streamer=kwargs.get("streamer")
    )
    with tree_attention_backend(model):
        return stock_generate(model, *args, custom_generate=decoding, **kwargs)


def move_stop_strings_to_criteria(model, kwargs: dict) -> None:
    """Turn `stop_strings` (an argument or the generation config's) into a `StopStringCriteria` in
    `kwargs["stopping_criteria"]`, in place. `generate()` drops `tokenizer` when decoding runs through a callable
    `custom_generate` (it keeps only the callable's own extra parameters), and then fails to build that criterion
    itself; building it here, from the `tokenizer` the caller gave, keeps `stop_strings` working."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if not stop_strings:
        return
    if tokenizer is None:
        raise TreeFlashInputError(
            "There are stop strings (an argument of generate() or in the generation config) but no tokenizer: pass "
            "the model's tokenizer as `tokenizer=` to generate()."
        )
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    # already a criterion: generate() must not build it again
    if "stop_strings" in kwargs or kwargs.get("generation_config") is None:
        kwargs["stop_strings"] = None
    else:
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].stop_strings = None


@functools.wraps(_STOCK_GENERATE)
def generate(self, *args, assistant_model=None, **kwargs):
    """`GenerationMixin.generate`, routed to TreeFlash decoding when `assistant_model` is a TreeFlash drafter
    (see `route_generate`)."""
    return route_generate(_STOCK_GENERATE, self, *args, assistant_model=assistant_model, **kwargs)


def install_generate_hook() -> None:
    """Route `generate(assistant_model=<TreeFlash drafter>)` to TreeFlash decoding, and refuse a TreeFlash drafter
    where continuous batching would drop it (idempotent)."""
    GenerationMixin.generate = generate
    install_continuous_batching_guards()
