"""oneDNN's linear product with the weight packed once for a row count (the op torch's own compiler emits for frozen
CPU graphs): the primitives `integrations/cpu_linear.py` runs a model's linear layers through, and that
`draft.TargetHead` scores a draft vocabulary's head rows with when the target's head runs through them."""

from __future__ import annotations

import functools

import torch


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN multiplies here: float32, and bfloat16 / float16 where the CPU has their arithmetic."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return ()
    half = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    return (torch.float32, *(dtype for dtype, supported in half.items() if supported()))


def pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """`weight [out, in]` laid out by oneDNN for products of about `rows_hint` rows (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_product(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`input [..., in] @ weight.T + bias` through `pack_weight`'s copy of the weight (no backward)."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")
