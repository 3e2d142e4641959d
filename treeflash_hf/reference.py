"""The reference pairs, loaded: `(target, drafter, tokenizer)` of `smollm2-135m` (the main pair: SmolLM2-135M-Instruct
from the package index and the drafter this project trained for it), `tiny` (the small pair trained here, for fast
tests), or a folder `treeflash-hf reference build` wrote.

    target, drafter, tokenizer = treeflash_hf.reference.load()
"""

from __future__ import annotations

from pathlib import Path

import torch

from .recipes.pairs import BUNDLED_DIR, DEFAULT_PAIR, PAIRS, pair_dirs


def load(pair: str | Path | None = None, dtype: torch.dtype | str = "auto"):
    """`(target, drafter, tokenizer)` of a reference pair: a name (`"smollm2-135m"`, the default: SmolLM2-135M-Instruct
    and its bundled drafter; `"tiny"`: the small pair trained here) or a folder `reference build` wrote, in `dtype`
    ("auto": the dtype the weights are stored in, the pair's run dtype)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import treeflash_hf  # noqa: F401  (registers the drafter class)

    pair = DEFAULT_PAIR if pair is None else pair
    if isinstance(pair, str) and pair in PAIRS:
        target_dir, drafter_dir, tokenizer_dir = pair_dirs(pair)
    else:
        root = Path(pair)
        if not (root / "target").exists():
            raise FileNotFoundError(
                f"No reference models in {root}: pass a pair name ({', '.join(PAIRS)}) or run "
                f"`treeflash-hf reference build --out {root}` first.")
        target_dir, drafter_dir, tokenizer_dir = root / "target", root / "drafter", root / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").eval()
    drafter = AutoModel.from_pretrained(drafter_dir, dtype=target.dtype).eval()
    return target, drafter, tokenizer


def load_draft_lm(path: str | Path | None = None, dtype: torch.dtype | str = "auto"):
    """The small autoregressive draft LM (the baseline stock assisted generation needs)."""
    from transformers import AutoModelForCausalLM

    root = Path(path) if path is not None else BUNDLED_DIR
    return AutoModelForCausalLM.from_pretrained(root / "draft_lm", dtype=dtype).eval()
