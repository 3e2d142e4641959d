"""Stage 6 of the pipeline: keep only the accepted path in the target's KV cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def check_cache_supported(cache) -> None:
    """Tree verification appends a whole tree to the cache and then selects positions: that needs a plain
    dynamic cache (full-attention layers)."""
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"TreeFlash decoding needs a DynamicCache for the target, got {type(cache).__name__}. "
            "Drop `cache_implementation=...` / the pre-built cache from the generate() call."
        )
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or type(layer) is not DynamicLayer:
            raise ValueError(
                f"TreeFlash decoding supports full-attention cache layers only, got {type(layer).__name__} "
                "(sliding-window or linear-attention targets are not supported yet)."
            )


def compact_cache(cache, past_len: int, accepted_nodes: torch.LongTensor) -> None:
    """The cache holds `past_len` committed positions followed by the `N` tree nodes. Keep the past, then the
    nodes `accepted_nodes [L]` (root first, tree indices), in that order; drop the rest. In place, exact: a node's
    K/V under the tree mask equal its K/V on the linear path."""
    new_len = past_len + accepted_nodes.shape[0]
    contiguous = accepted_nodes.tolist() == list(range(accepted_nodes.shape[0]))
    if contiguous and cache.get_seq_length() == new_len:
        return  # the whole verified chain was kept (a plain step, or every drafted token accepted)
    keep = accepted_nodes.to(cache.layers[0].keys.device) + past_len
    for layer in cache.layers:
        if not contiguous:
            layer.keys[..., past_len:new_len, :] = layer.keys[..., keep, :]
            layer.values[..., past_len:new_len, :] = layer.values[..., keep, :]
        layer.keys = layer.keys[..., :new_len, :]
        layer.values = layer.values[..., :new_len, :]
