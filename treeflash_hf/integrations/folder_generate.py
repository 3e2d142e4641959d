"""`custom_generate/generate.py` of a TreeFlash model folder: the target's own `generate()`, decoding with TreeFlash.

A TreeFlash model folder is a target's folder (weights, config, generation config, tokenizer) plus `treeflash.json`,
which records the folder's drafter (a path relative to the folder, or a Hub id), and `custom_generate/` (this file
and the engine modules it imports). Loaded with `trust_remote_code=True`, transformers replaces `model.generate` with
`generate` below, so every caller of `generate()` (a script, `pipeline("text-generation")`, `transformers serve`)
decodes with TreeFlash:

    model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)
    out = model.generate(**inputs, max_new_tokens=256)   # the folder's drafter is loaded once, kept on `model`

Loaded without `trust_remote_code`, the folder is the plain target. `treeflash-hf bundle` writes the folder, copying
this file and the engine modules byte for byte, so treeflash-hf need not be installed where the folder is used.
"""

import copy
import json
import os
import threading

from transformers import AutoModel
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import cached_file

from .continuous_batching import install_continuous_batching_guards, mark_folder_generate
from .generate_hook import route_generate

BUNDLE_FILE = "treeflash.json"
DRAFTER_ATTRIBUTE = "_treeflash_drafter"
TREEFLASH_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
_LOADING = threading.Lock()
install_continuous_batching_guards()  # so that continuous batching on this folder decodes with TreeFlash

try:  # installed with `transformers[serving]`
    from starlette.exceptions import HTTPException as _HTTPException
except ImportError:
    _HTTPException = None


class InvalidGenerateArguments(ValueError, *((_HTTPException,) if _HTTPException else ())):
    """`generate()` arguments its generation config rejects (e.g. `max_new_tokens=-1`). Where starlette is installed
    it is also starlette's `HTTPException` (status 400), so `transformers serve`, which runs `generate()` for a
    request, answers a bad request with a client error and this message instead of a bare 500."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.status_code, self.detail, self.headers = 400, message, None

    def __str__(self) -> str:
        return self.detail


def generate(*args, model, assistant_model=None, **kwargs):
    """`model.generate(...)` of a TreeFlash folder (transformers passes `model` by keyword); every argument keeps its
    meaning. Greedy search and sampling run TreeFlash with the folder's drafter, also under continuous batching
    (`cache_implementation="paged"`, `generate_batch`, `init_continuous_batching`). A caller's own
    `assistant_model` or `custom_generate`, and modes TreeFlash does not decode (beam search, contrastive search,
    DoLa, prompt lookup), run exactly as they would on the plain target."""
    config = requested_config(model, kwargs)
    treeflash = config.get_generation_mode() in TREEFLASH_MODES
    if assistant_model is None and kwargs.get("custom_generate") is None and treeflash:
        assistant_model = folder_drafter(model)
    return route_generate(GenerationMixin.generate, model, *args, assistant_model=assistant_model, **kwargs)


def requested_config(model, kwargs: dict):
    """The call's generation config: `generation_config` (or the model's) with the call's settings applied, validated
    as `generate()` validates it, before anything loads; a rejected setting raises `InvalidGenerateArguments`."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    for name, value in kwargs.items():
        if hasattr(config, name):
            setattr(config, name, value)
    try:
        config.validate(user_set_attributes=set())  # only errors: the warnings are generate()'s to give
    except ValueError as err:
        raise InvalidGenerateArguments(str(err)) from err
    return config


def folder_drafter(model):
    """The drafter recorded in the folder `model` was loaded from: loaded on first use, then kept on `model` (outside
    its modules, so it is neither in `state_dict()` nor saved with it) and matched to its dtype and device."""
    with _LOADING:
        drafter = model.__dict__.get(DRAFTER_ATTRIBUTE)
        if drafter is None:
            reference = drafter_reference(str(model.name_or_path))
            drafter = AutoModel.from_pretrained(reference, dtype=model.dtype, trust_remote_code=True).eval()
            model.__dict__[DRAFTER_ATTRIBUTE] = drafter
        if drafter.dtype != model.dtype or drafter.device != model.device:
            drafter.to(device=model.device, dtype=model.dtype)
    return drafter


def drafter_reference(folder: str) -> str:
    """Where the drafter of `folder` (a local folder or a Hub id) lives: a local path, or a Hub id."""
    record = cached_file(folder, BUNDLE_FILE, _raise_exceptions_for_missing_entries=False)
    if record is None:
        raise OSError(f"{folder} is not a TreeFlash model folder: it has no {BUNDLE_FILE}. Write one with "
                      f"`treeflash-hf bundle --target TARGET --drafter DRAFTER --out DIR`.")
    with open(record, encoding="utf-8") as handle:
        reference = json.load(handle)["drafter"]
    if not os.path.isdir(folder):  # a Hub repo records its drafter's Hub id
        return reference
    local = os.path.normpath(os.path.join(folder, reference))
    if os.path.isdir(local):
        return local
    if reference.startswith((".", "/", "~")) or os.path.isabs(reference):
        raise OSError(f"The drafter recorded in {os.path.join(folder, BUNDLE_FILE)}, {reference!r}, is not a folder "
                      f"(looked for {local}): re-run `treeflash-hf bundle` with the drafter's path or Hub id.")
    return reference  # a Hub id


mark_folder_generate(generate, folder_drafter)  # continuous batching on this folder finds its drafter through it
