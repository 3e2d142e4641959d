"""The commit step of the pipeline: keep only each row's accepted path in a KV cache (the target's, and the drafter's
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


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends in place: its keys and values are prefix views of buffers with spare room, so a
    step writes only its own new slots instead of copying the whole cache (`torch.cat`) in every layer. Whenever
    `keys` stops being such a view (a row selection, a re-pack, a join: those make new tensors), the next update
    moves it into a new buffer. Values and semantics are a `DynamicLayer`'s."""

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def _is_prefix_of_buffer(self, extra: int) -> bool:
        buffer = self.key_buffer
        return (buffer is not None and self.keys.numel() > 0 and self.keys.data_ptr() == buffer.data_ptr()
                and self.keys.shape[:-2] == buffer.shape[:-2] and self.keys.stride() == buffer.stride()
                and self.values.data_ptr() == self.value_buffer.data_ptr()
                and self.keys.shape[-2] + extra <= buffer.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, extra = self.get_seq_length(), key_states.shape[-2]
        if not self._is_prefix_of_buffer(extra):
            capacity = max(2 * (length + extra), length + extra + 256)
            shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
            self.key_buffer = key_states.new_empty(shape)
            self.value_buffer = value_states.new_empty(shape)
            if length:
                self.key_buffer[..., :length, :] = self.keys
                self.value_buffer[..., :length, :] = self.values
        self.key_buffer[..., length : length + extra, :] = key_states
        self.value_buffer[..., length : length + extra, :] = value_states
        self.keys = self.key_buffer[..., : length + extra, :]
        self.values = self.value_buffer[..., : length + extra, :]
        return self.keys, self.values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


def growing_cache(cache: DynamicCache) -> DynamicCache:
    """`cache` (empty, full-attention dynamic layers) with `GrowingLayer`s instead, in place; returned."""
    if cache.get_seq_length() == 0 and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def drafter_cache(config) -> DynamicCache:
    """An empty growing cache for the drafter with a full-attention layer per drafter layer, whatever its
    `layer_types`: the drafter masks its sliding windows itself (by position), and the slot bookkeeping here
    (`key_valid`, re-packing, row selection) needs every layer to keep every slot."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def check_cache_supported(cache) -> None:
    """Tree verification appends a whole tree to the cache and then selects positions: that needs a plain
    dynamic cache (full-attention layers)."""
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"TreeFlash decoding needs a DynamicCache for the target, got {type(cache).__name__}. "
            "Drop `cache_implementation=...` / the pre-built cache from the generate() call."
        )
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or type(layer) not in (DynamicLayer, GrowingLayer):
            raise ValueError(
                f"TreeFlash decoding supports full-attention cache layers only, got {type(layer).__name__} "
                "(sliding-window or linear-attention targets are not supported yet)."
            )


def _slot_index(tensor: torch.Tensor, slots: torch.LongTensor) -> torch.LongTensor:
    """`slots [R, K]` as the index that gathers them from `tensor [R, heads, L, d]`: `[R, heads, K, d]`."""
    return slots.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])


def _gather_slots(tensor: torch.Tensor, slots: torch.LongTensor) -> torch.Tensor:
    """`tensor [R, heads, L, d]`, `slots [R, K]` -> `[R, heads, K, d]` (row r takes its slots `slots[r]`)."""
    return tensor.gather(2, _slot_index(tensor, slots))


def compact_cache(cache, past_len: int, kept_nodes: torch.LongTensor, contiguous: bool | None = None) -> None:
    """The cache holds `past_len` slots followed by each row's `N` tree nodes. Keep the past, then row r's nodes
    `kept_nodes[r]` (`[R, K]`, tree indices, root first; a row that keeps fewer repeats its last node, which the
    caller marks invalid), in that order; drop the rest. In place, exact: a node's K/V under the tree mask equal
    its K/V on the linear path. Each layer is compacted on its own device. `contiguous`: whether every row keeps
    nodes `0..K-1` (None: read from `kept_nodes`)."""
    num_kept = kept_nodes.shape[1]
    if contiguous is None:
        contiguous = bool((kept_nodes == torch.arange(num_kept)).all())
    if contiguous and cache.get_seq_length() == past_len + num_kept:
        return  # every row kept the whole verified chain (a plain step, or every drafted token accepted)
    indices: dict = {}  # per (device, shape): the gather index, made once for every layer alike
    for layer in cache.layers:
        if not contiguous:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                key = (tensor.device, tensor.shape[1], tensor.shape[3])
                if key not in indices:
                    indices[key] = _slot_index(tensor, kept_nodes)
                tensor[..., past_len : past_len + num_kept, :] = tensor[..., past_len:, :].gather(2, indices[key])
        layer.keys = layer.keys[..., : past_len + num_kept, :]
        layer.values = layer.values[..., : past_len + num_kept, :]


def select_rows(cache, rows: torch.LongTensor) -> None:
    """Keep only `rows` (batch indices) of every layer, in place (finished rows leave the batch)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            index = rows.to(layer.keys.device)
            layer.keys, layer.values = layer.keys[index], layer.values[index]


def valid_or_all(key_valid: torch.BoolTensor | None, rows: int, length: int) -> torch.BoolTensor:
    """`key_valid [R, L]`, or all-true `[rows, length]` where it is None (every slot valid)."""
    return key_valid if key_valid is not None else torch.ones(rows, length, dtype=torch.bool)


def append_rows(cache, key_valid: torch.BoolTensor | None, others: list[tuple]) -> torch.BoolTensor | None:
    """Append the rows of other caches (`others`: `(cache, key_valid)` pairs, the same layers) to `cache`, in place:
    every cache is padded with invalid slots to the longest, then the rows are concatenated, per layer on its own
    device. Returns the joined `key_valid [R_total, L]` (None when every slot is valid)."""
    groups = [(cache, key_valid)] + list(others)
    lengths = [group.get_seq_length() for group, _ in groups]
    length = max(lengths)
    valid = torch.cat([
        torch.nn.functional.pad(valid_or_all(group_valid, int(group.layers[0].keys.shape[0]), group_length),
                                (0, length - group_length), value=False)
        for (group, group_valid), group_length in zip(groups, lengths)
    ])
    for index, layer in enumerate(cache.layers):
        padded_keys, padded_values = [], []
        for (group, _), group_length in zip(groups, lengths):
            group_layer = group.layers[index]
            pad = (0, 0, 0, length - group_length)
            padded_keys.append(torch.nn.functional.pad(group_layer.keys, pad).to(layer.keys.device))
            padded_values.append(torch.nn.functional.pad(group_layer.values, pad).to(layer.values.device))
        layer.keys, layer.values = torch.cat(padded_keys), torch.cat(padded_values)
    return None if bool(valid.all()) else valid


def repack(cache, key_valid: torch.BoolTensor | None, max_invalid_fraction: float = 0.25,
           valid_counts: list[int] | None = None):
    """When moving each row's valid slots to the front (in their order) would cut the cache, now as long as its
    longest row's valid slots, by more than `max_invalid_fraction` of its length, do it. Returns the new
    `key_valid` (None when every slot is valid again). Invalid slots that re-packing cannot remove (the rows'
    lengths differ) do not trigger it: they would make every step pay a full-cache copy for nothing.
    `valid_counts`: each row's number of valid slots, when the caller keeps them on the host (None: read)."""
    if key_valid is None:
        return None
    length = key_valid.shape[1]
    new_length = max(valid_counts) if valid_counts else int(key_valid.sum(dim=1).max())
    if length - new_length <= max_invalid_fraction * length:
        return key_valid
    # stable order per row: valid slots first
    order = (~key_valid).to(torch.int8).argsort(dim=1, stable=True)  # [R, L]
    slots = order[:, :new_length]
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] == length:
            layer.keys, layer.values = _gather_slots(layer.keys, slots), _gather_slots(layer.values, slots)
    new_valid = key_valid.gather(1, slots)
    all_valid = min(valid_counts) == new_length if valid_counts else bool(new_valid.all())
    return None if all_valid else new_valid
