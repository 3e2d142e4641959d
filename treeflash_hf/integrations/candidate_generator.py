"""transformers' `CandidateGenerator` protocol over TreeFlash's drafting side: chain mode (the top-1 of each marginal),
verified linearly by stock assisted decoding, batch 1. The tree loop itself (`engine/decode.py`) uses `TreeDrafter`
directly; this adapter lets the same drafter run inside transformers' own loop."""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..engine.draft import DraftContext, TreeDrafter
from ..engine.options import TreeOptions


class TreeFlashCandidateGenerator(TreeDrafter, CandidateGenerator):
    """A `TreeDrafter` that is also a transformers `CandidateGenerator` (`get_candidates`: `input_ids [1, S]` ->
    the drafted chain appended). `do_sample`: draw the chain from the marginals instead of taking their top-1;
    `max_length`: the call's length limit (None: a whole block)."""

    requires_model_outputs = True

    def __init__(self, drafter, target, options: TreeOptions, do_sample: bool = False, max_length: int | None = None,
                 ar_evaluation: str | None = None):
        super().__init__(drafter, target, options, ar_evaluation=ar_evaluation)
        self.do_sample = do_sample
        self.max_length = max_length
        self._stock_prefilled = False  # the prompt's context was drafted from (the first call takes it all)

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Stock protocol: `input_ids [1, S]` -> (`[1, S + D]` with the chain appended, logits `[1, D, V]`)."""
        if is_first_iteration or model_outputs is None:
            return input_ids, None  # the target must run first: its hidden states are the context
        max_length = self.max_length if self.max_length is not None else input_ids.shape[1] + self.block_size
        depth = min(self.block_size - 1, max_length - input_ids.shape[1] - 1)
        if depth <= 0:
            return input_ids, None
        num_new = n_last_matches + 1 if self._stock_prefilled else input_ids.shape[1] - 1
        self._stock_prefilled = True
        features = self.context_features(model_outputs.hidden_states, slice(0, num_new))
        anchor_position = input_ids.shape[1] - 1
        context = DraftContext(features, torch.arange(anchor_position - num_new, anchor_position)[None])
        block = self.draft([int(input_ids[0, -1])], torch.tensor([anchor_position]), context, depth)[0]
        if self.do_sample:
            drafted = torch.multinomial(block.marginal_log_probs.exp(), 1)[:, 0]
        else:
            drafted = block.marginal_log_probs.argmax(dim=-1)
        drafted = self.column_tokens(drafted)
        candidate_log_probs = self.full_vocabulary(block.marginal_log_probs)[None]  # stock code indexes by token
        return torch.cat([input_ids, drafted[None].to(input_ids.device)], dim=-1), candidate_log_probs

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        pass
