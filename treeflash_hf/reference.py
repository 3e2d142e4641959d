"""The reference pairs, loaded: `(target, drafter, tokenizer)` of `smollm2-135m` (the main pair: SmolLM2-135M-Instruct
from the package index and the drafter this project trained for it), `tiny` (the small pair trained here, for fast
tests), or a folder `treeflash-hf reference build` wrote.

    target, drafter, tokenizer = treeflash_hf.reference.load()
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .integrations.cpu_linear import cpu_has_native
from .recipes.corpus import ensure_answer_store, repository_corpus
from .recipes.pairs import BUNDLED_DIR, DEFAULT_PAIR, PAIRS, pair_dirs

logger = logging.getLogger(__name__)


def run_in_fast_dtype(*models):
    """`dtype="auto"`'s rule on a CPU: models stored in a half precision this CPU has no arithmetic for run in float32
    (exact: every bfloat16 or float16 value is a float32 one; faster than torch's emulation), and a warning says so.
    Returns the models, in the order given."""
    stored = models[0].dtype
    if models[0].device.type != "cpu" or cpu_has_native(stored):
        return models
    name = str(stored).removeprefix("torch.")
    logger.warning(f"running in float32: the weights are {name}, which this CPU has no arithmetic for (emulated, "
                   f"{name} runs slower than float32 here); --dtype {name} forces it")
    return tuple(model.to(torch.float32) for model in models)


def run_fast_on_cpu(*models):
    """`dtype="auto"`'s rules on a CPU, for models loaded together: `run_in_fast_dtype`, then the linear layers through
    oneDNN's packed weights where that is timed faster on these models' shapes, dtype and row counts
    (`integrations/cpu_linear.py`; a model run this way rounds a little differently from a stock one in the same
    dtype, like another kernel would).
    Returns the models, in the order given."""
    from .integrations.cpu_linear import pack_where_faster

    models = run_in_fast_dtype(*models)
    if models[0].device.type == "cpu":
        pack_where_faster(*models)
    return models


def load(pair: str | Path | None = None, dtype: torch.dtype | str = "auto"):
    """`(target, drafter, tokenizer)` of a reference pair: a name (`"smollm2-135m"`, the default: SmolLM2-135M-Instruct
    and its bundled drafter; `"tiny"`: the small pair trained here) or a folder `reference build` wrote, in `dtype`
    ("auto": the dtype the weights are stored in, the pair's run dtype; float32 where that is a half precision this
    CPU has no arithmetic for, and the linear layers through oneDNN where that is faster: `run_fast_on_cpu`)."""
    pair = DEFAULT_PAIR if pair is None else pair
    if isinstance(pair, str) and pair in PAIRS:
        target_dir, drafter_dir, tokenizer_dir = pair_dirs(pair)
        if pair == "smollm2-135m":  # its lookup branch also reads the target's answers in the committed corpus
            ensure_answer_store(drafter_dir, repository_corpus())
    else:
        root = Path(pair)
        if not (root / "target").exists():
            raise FileNotFoundError(
                f"No reference models in {root}: pass a pair name ({', '.join(PAIRS)}) or run "
                f"`treeflash-hf reference build --out {root}` first.")
        target_dir, drafter_dir, tokenizer_dir = root / "target", root / "drafter", root / "tokenizer"
    return load_folders(target_dir, drafter_dir, tokenizer_dir, dtype)


def load_folders(target_dir: str | Path, drafter_dir: str | Path, tokenizer_dir: str | Path,
                 dtype: torch.dtype | str = "auto"):
    """`(target, drafter, tokenizer)` from three model folders (or Hub ids): the target in `dtype` with SDPA
    attention, the drafter in the target's dtype ("auto": as `load`)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import treeflash_hf  # noqa: F401  (registers the drafter class)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").eval()
    drafter = AutoModel.from_pretrained(drafter_dir, dtype=target.dtype).eval()
    if dtype == "auto":
        target, drafter = run_fast_on_cpu(target, drafter)
    return target, drafter, tokenizer


def load_draft_lm(path: str | Path | None = None, dtype: torch.dtype | str = "auto"):
    """The small autoregressive draft LM (the baseline stock assisted generation needs)."""
    from transformers import AutoModelForCausalLM

    root = Path(path) if path is not None else BUNDLED_DIR
    return AutoModelForCausalLM.from_pretrained(root / "draft_lm", dtype=dtype).eval()
