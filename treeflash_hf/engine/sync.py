"""Decisions shared across the ranks of a tensor-parallel target.

Under tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun) every rank runs the same decoding
loop and every target forward is a collective: the ranks must verify the same trees in the same steps, or they
diverge or hang. What the loop computes from tensors alone (drafts, trees, greedy acceptance) is already the same
on every rank, since the target's outputs are. What depends on measured times (the step kind, the `"auto"` width,
the verification cost curve) or on random draws (sampled tokens) is decided on rank 0 and broadcast.
Single-process runs share nothing and pay nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STEP_KINDS = ("draft", "lookup", "plain")  # see `lookup.StepScheduler`


def is_tensor_parallel(target) -> bool:
    """True when `target`'s weights are sharded over a process group (DTensor parameters)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(hasattr(param, "device_mesh") for param in target.parameters())


class DecisionSync:
    """`share(...)` returns rank 0's values on every rank (a no-op outside tensor parallelism)."""

    def __init__(self, target):
        self.active = is_tensor_parallel(target)
        self.device = torch.device("cpu")
        if self.active and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _broadcast(self, values: list, dtype: torch.dtype) -> list:
        if not self.active:
            return values
        tensor = torch.tensor(values, dtype=dtype, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    def share_ints(self, values: list[int]) -> list[int]:
        return self._broadcast(values, torch.long)

    def share_floats(self, values: list[float]) -> list[float]:
        return self._broadcast(values, torch.float64)

    def share_int(self, value: int) -> int:
        return self.share_ints([value])[0]

    def share_step_kind(self, kind: str) -> str:
        return STEP_KINDS[self.share_int(STEP_KINDS.index(kind))]

    def share_token_lists(self, rows: list[list[int]]) -> list[list[int]]:
        """Rank 0's lists of ints, one per row (lengths may differ)."""
        if not self.active:
            return rows
        lengths = self.share_ints([len(row) for row in rows])
        width = max(lengths, default=0)
        packed = torch.zeros(len(rows), width, dtype=torch.long)
        if dist.get_rank() == 0:
            for i, row in enumerate(rows):
                packed[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        packed = packed.to(self.device)
        dist.broadcast(packed, src=0)
        return [row[:length] for row, length in zip(packed.tolist(), lengths)]
