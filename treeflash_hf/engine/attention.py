"""The verify step's attention on a CPU: grouped-query attention over a tree's nodes without copying the cache.

With a mask and several query heads per key/value head, transformers' `sdpa` attention repeats every cached key and
value once per query head (`repeat_kv`: a copy of the whole cache in every layer) and runs the kernel per query head.
A verify forward always has a mask (the tree's) and more than one query, so it pays that copy at every step. Here
the G query heads that share a key/value head are laid out as G*N query rows of that head instead
(`[R, H, N, d] -> [R, K, G*N, d]`, the mask repeated along the rows): the same kernel, the same products for every
query row, no copy of the cache. torch's CPU kernel computes each query row alone, through a product path chosen by
the number of rows: the layout is taken at the query counts where a one-time probe finds the outputs bit-identical to
the stock path (`grouped_layout_is_exact`; tests/test_tree_and_cache.py checks the logits in float32 and bfloat16).

`tree_attention(model)` switches a CPU `sdpa` model to it for the forwards inside the `with` (the engine's prefill,
verify and cost-curve forwards); outside, the model runs transformers' own `sdpa` (the stock path stays stock). The
switch goes through transformers' `AttentionInterface` and `AttentionMaskInterface` (`TREE_SDPA`: this function and
the `sdpa` masks) and the config's attention implementation, which every attention layer reads at each call. A
forward on another thread while the switch is on gets the same values: every call this function takes is
bit-identical to the stock one.

`R` rows, `H` query heads, `K` key/value heads (`G = H / K`), `N` queries, `L` keys, `d` head size.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

TREE_SDPA = "treeflash_tree_sdpa"


PROBED_PAST = (64, 600)  # cached tokens before the queries `grouped_layout_is_exact` probes (which product path a row
# takes follows the number of query rows, not of keys: measured over 20-1200 keys)


@functools.cache
def grouped_layout_is_exact(queries: int, groups: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                            threads: int) -> bool:
    """Whether torch's CPU kernel gives the grouped layout's outputs bit for bit for `queries` queries of `groups`
    query heads per key/value head, in `dtype` and in float32 (where rounding hides less). Not always: the kernel
    takes some rows through another product path by their count (in torch 2.13, 1-3 and 11 queries of 3 groups:
    3-9 and 33 rows against 1-3 and 11), so the layout is taken only at the query counts probed exact (random inputs,
    a random tree mask, once per shape and thread count)."""
    generator = torch.Generator().manual_seed(0)
    for probe_dtype in {dtype, torch.float32}:
        for keys in (past + queries for past in PROBED_PAST):
            shapes = ((1, kv_heads * groups, queries, head_dim), (1, kv_heads, keys, head_dim),
                      (1, kv_heads, keys, head_dim))
            query, key, value = (torch.randn(shape, generator=generator).to(probe_dtype) for shape in shapes)
            mask = torch.zeros(1, 1, queries, keys, dtype=probe_dtype)
            mask[..., -queries:] = torch.where(torch.rand(queries, queries, generator=generator) < 0.5, float("-inf"),
                                               0.0).fill_diagonal_(0.0).to(probe_dtype)
            stock = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                                   value.repeat_interleave(groups, 1), attn_mask=mask)
            grouped = F.scaled_dot_product_attention(
                query.reshape(1, kv_heads, groups * queries, head_dim), key, value,
                attn_mask=mask[:, :, None].expand(1, 1, groups, queries, keys).reshape(1, 1, groups * queries, keys))
            if not torch.equal(stock, grouped.view_as(stock)):
                return False
    return True


def grouped_query_rows_apply(module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float, kwargs: dict) -> bool:
    """Whether `tree_sdpa_attention` lays this call's query heads out as rows: a CPU call with several queries, a
    mask shared by the heads (`[R, 1, N, L]`, float or bool), several query heads per key/value head, and few
    enough queries that the mask repeated G times (`G*N*L` entries) is smaller than the repeated keys and values
    it saves (`2*H*L*d`): N up to 384 for SmolLM2 in bfloat16, every verify step; a long prefill keeps the stock
    layout; and only at query counts where the kernel gives the stock outputs bit for bit
    (`grouped_layout_is_exact`). Anything else (one query, no mask, per-head masks, position biases, dropout,
    soft-capping) goes to the stock function."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (query.device.type == "cpu" and query.shape[2] > 1 and groups > 1 and dropout == 0.0
            and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[2] == query.shape[2] and query.shape[1] == key.shape[1] * groups
            and query.shape[2] * attention_mask.element_size()
            <= 2 * key.shape[1] * key.shape[-1] * key.element_size()
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and grouped_layout_is_exact(query.shape[2], groups, key.shape[1], key.shape[-1], query.dtype,
                                        torch.get_num_threads()))


_LAST_CALL = threading.local()  # `.memo`: (what a call's layout depends on, its grouped mask or None)


def grouped_mask(module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float, kwargs: dict) -> torch.Tensor | None:
    """The mask of the grouped layout (`[R, 1, G*N, L]`) where `grouped_query_rows_apply`, else None. Every layer of
    a forward asks with the same mask and shapes: the answer is kept for the next call (in this thread) with that
    very mask, unchanged, and the same shapes, groups, dropout, extra arguments and thread count."""
    key_of_call = (attention_mask, None if attention_mask is None else attention_mask._version, query.shape,
                   query.device, query.dtype, key.shape, getattr(module, "num_key_value_groups", 1), dropout,
                   kwargs.get("position_bias") is None and kwargs.get("softcap") is None, torch.get_num_threads())
    memo = getattr(_LAST_CALL, "memo", None)
    if memo is not None and len(memo[0]) == len(key_of_call) and all(
            a is b or (type(a) is not torch.Tensor and a == b) for a, b in zip(memo[0], key_of_call)):
        return memo[1]
    mask = None
    if grouped_query_rows_apply(module, query, key, attention_mask, dropout, kwargs):
        rows, heads, queries, _ = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        mask = attention_mask[:, :, None].expand(rows, 1, groups, queries, keys).reshape(
            rows, 1, groups * queries, keys)
    _LAST_CALL.memo = (key_of_call, mask)
    return mask


def tree_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query [R, H, N, d]`, `key` / `value [R, K, L, d]`,
    `attention_mask [R, 1, N, L]` -> `([R, N, H, d], None)`, as `sdpa_attention_forward` returns it."""
    mask = grouped_mask(module, query, key, attention_mask, dropout, kwargs)
    if mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, queries, head_dim = query.shape
    grouped_query = query.reshape(rows, key.shape[1], -1, head_dim)  # head h = kv head h // G, group h % G
    out = F.scaled_dot_product_attention(grouped_query, key, value, attn_mask=mask, scale=scaling)
    return out.view(rows, heads, queries, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)  # the masks the model builds are the `sdpa` ones


def switchable_config(model):
    """The config whose attention implementation `tree_attention` switches (the text config, which the attention
    layers read), or None where it does not apply: only a CPU model running transformers' `sdpa` attention."""
    config = model.config.get_text_config()
    return config if getattr(config, "_attn_implementation", None) == "sdpa" and model.device.type == "cpu" else None


def tree_attention_applies(model) -> bool:
    """Whether `tree_attention` switches `model` (`switchable_config`)."""
    return switchable_config(model) is not None


@contextlib.contextmanager
def tree_attention(model):
    """Run `model`'s forwards inside the `with` on `tree_sdpa_attention` where `tree_attention_applies`; the
    implementation the model had comes back on leaving (an exception included)."""
    config = switchable_config(model)  # (once: this runs at every engine forward)
    if config is None:
        yield
        return
    config._attn_implementation = TREE_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
