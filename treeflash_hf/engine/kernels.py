"""The kernels the engine's own target forwards run on (its prefill, every verify step, `auto`'s cost curve) where
they are not the model's own, all switched on by one `with engine_kernels(model)`; outside it the model runs as
loaded (the stock path stays stock):
- `attention.tree_attention`: on a CPU `sdpa` model, the query heads of a key/value head as that head's query rows
  (no copy of the cache per query head);
- `onednn.fused_products`: layers with oneDNN-packed weights that read the same input (query/key/value, gate/up)
  multiplied as one product at a verify step's few rows.
Both are bit-identical to the stock computation (tests/test_tree_and_cache.py)."""

from __future__ import annotations

import contextlib

from .attention import TREE_SDPA, tree_attention, tree_attention_applies
from .onednn import fused_groups, fused_products

FUSED_PRODUCTS = "treeflash_fused_products"


@contextlib.contextmanager
def engine_kernels(model):
    """`model`'s forwards inside the `with` on the engine's kernels (those that apply to it)."""
    with tree_attention(model), fused_products(model):
        yield


def engine_kernel_names(model) -> list[str]:
    """The engine's kernels that apply to `model` (part of the cost curve's key: they change what a forward costs)."""
    names = [TREE_SDPA] if tree_attention_applies(model) else []
    if fused_groups(model):
        names.append(FUSED_PRODUCTS)
    return names
