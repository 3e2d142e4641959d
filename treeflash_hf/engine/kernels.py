"""The kernels the engine's own target forwards run on (its prefill, every verify step, `auto`'s cost curve) where
they are not the model's own, all switched on by one `with engine_kernels(model)`; outside it the model runs as
loaded (the stock path stays stock):
- `attention.tree_attention`: on a CPU `sdpa` model, the query heads of a key/value head as that head's query rows
  (no copy of the cache per query head);
- `onednn.fused_products`: layers with oneDNN-packed weights that read the same input (query/key/value, gate/up)
  multiplied as one product at a verify step's few rows;
- `lean_forward.lean_forward_on`: a Llama-layout decoder's forward as one flat loop over its modules' operations,
  without transformers' per-call machinery (its fused products read as views).
All are bit-identical to the stock computation (tests/test_tree_and_cache.py, tests/test_lean_forward.py)."""

from __future__ import annotations

import contextlib

from .attention import TREE_SDPA, tree_attention, tree_attention_applies
from .lean_forward import lean_forward_applies, lean_forward_on
from .onednn import fused_groups, fused_products

FUSED_PRODUCTS = "treeflash_fused_products"
LEAN_FORWARD = "treeflash_lean_forward"


@contextlib.contextmanager
def engine_kernels(model):
    """`model`'s forwards inside the `with` on the engine's kernels (those that apply to it)."""
    with tree_attention(model), fused_products(model), lean_forward_on(model):
        yield


def engine_kernel_names(model) -> list[str]:
    """The engine's kernels that apply to `model` (part of the cost curve's key: they change what a forward costs)."""
    names = [TREE_SDPA] if tree_attention_applies(model) else []
    if fused_groups(model):
        names.append(FUSED_PRODUCTS)
    with tree_attention(model), fused_products(model):  # (the lean forward is probed on the kernels it runs with)
        if lean_forward_applies(model):
            names.append(LEAN_FORWARD)
    return names
