"""Stage 6 of the pipeline: keep only each row's accepted path in a KV cache (the target's, and the drafter's
context cache), drop finished rows, and re-pack rows whose dropped slots pile up.

A cache holds `[R, kv_heads, L, head_dim]` per layer. Rows keep different numbers of slots per step, so a slot
may be invalid for its row (left padding of the prompt, or a tree node that row did not accept); `key_valid
[R, L]` says which slots a row may attend, or is None when every slot is valid. Slot order does not matter
(positions are applied before caching), so compaction never moves a row's past.
"""

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


def _gather_slots(tensor: torch.Tensor, slots: torch.LongTensor) -> torch.Tensor:
    """`tensor [R, heads, L, d]`, `slots [R, K]` -> `[R, heads, K, d]` (row r takes its slots `slots[r]`)."""
    index = slots.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return tensor.gather(2, index)


def compact_cache(cache, past_len: int, kept_nodes: torch.LongTensor) -> None:
    """The cache holds `past_len` slots followed by each row's `N` tree nodes. Keep the past, then row r's nodes
    `kept_nodes[r]` (`[R, K]`, tree indices, root first; a row that keeps fewer repeats its last node, which the
    caller marks invalid), in that order; drop the rest. In place, exact: a node's K/V under the tree mask equal
    its K/V on the linear path. Each layer is compacted on its own device."""
    num_kept = kept_nodes.shape[1]
    contiguous = bool((kept_nodes == torch.arange(num_kept)).all())
    if contiguous and cache.get_seq_length() == past_len + num_kept:
        return  # every row kept the whole verified chain (a plain step, or every drafted token accepted)
    for layer in cache.layers:
        if not contiguous:
            layer.keys[..., past_len : past_len + num_kept, :] = _gather_slots(layer.keys[..., past_len:, :],
                                                                               kept_nodes)
            layer.values[..., past_len : past_len + num_kept, :] = _gather_slots(layer.values[..., past_len:, :],
                                                                                 kept_nodes)
        layer.keys = layer.keys[..., : past_len + num_kept, :]
        layer.values = layer.values[..., : past_len + num_kept, :]


def select_rows(cache, rows: torch.LongTensor) -> None:
    """Keep only `rows` (batch indices) of every layer, in place (finished rows leave the batch)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            index = rows.to(layer.keys.device)
            layer.keys, layer.values = layer.keys[index], layer.values[index]


def repack(cache, key_valid: torch.BoolTensor | None, max_invalid_fraction: float = 0.25):
    """When moving each row's valid slots to the front (in their order) would cut the cache, now as long as its
    longest row's valid slots, by more than `max_invalid_fraction` of its length, do it. Returns the new
    `key_valid` (None when every slot is valid again). Invalid slots that re-packing cannot remove (the rows'
    lengths differ) do not trigger it: they would make every step pay a full-cache copy for nothing."""
    if key_valid is None:
        return None
    length = key_valid.shape[1]
    new_length = int(key_valid.sum(dim=1).max())
    if length - new_length <= max_invalid_fraction * length:
        return key_valid
    # stable order per row: valid slots first
    order = (~key_valid).to(torch.int8).argsort(dim=1, stable=True)  # [R, L]
    slots = order[:, :new_length]
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] == length:
            layer.keys, layer.values = _gather_slots(layer.keys, slots), _gather_slots(layer.values, slots)
    new_valid = key_valid.gather(1, slots)
    return None if bool(new_valid.all()) else new_valid
