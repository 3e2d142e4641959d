"""Stages 1-2 of the pipeline: one drafter forward, then the tables the tree is built from.

`Q` block size, `D` deepest drafted depth (<= Q-1), `V` vocabulary, `H` hidden size, `M` top-m, `K` top-k,
`n` number of context layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from .options import TreeOptions
from .tree import DraftTree, best_first_tree, chain_tree


@dataclass
class BlockDraft:
    """One drafter forward. anchor_token: `b`; prev_token: the committed token before `b` (or -1);
    pre_norm_hidden: `[D+1, H]` backbone outputs for slots 0..D; marginal_log_probs: `[D, V]` for depths 1..D."""

    anchor_token: int
    prev_token: int
    pre_norm_hidden: torch.Tensor
    marginal_log_probs: torch.Tensor

    @property
    def depth(self) -> int:
        return int(self.marginal_log_probs.shape[0])


class TreeFlashCandidateGenerator(CandidateGenerator):
    """The drafting side of TreeFlash: keeps the drafter's context cache, drafts a block, builds trees.

    Our verification loop calls `draft` -> `build_tree` -> (target verifies) -> `draft` again with the accepted
    positions' context features. `get_candidates` also implements transformers' `CandidateGenerator` protocol
    (chain mode, linear verification), so the same object runs inside stock assisted decoding.
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter,
        target,
        options: TreeOptions,
        do_sample: bool = False,
        max_length: int | None = None,
    ):
        self.drafter = drafter
        self.options = options
        self.input_embeddings = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        config = drafter.config
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.two_prev_tokens = config.ar_num_prev_tokens == 2
        self.cache = DynamicCache(config=config)
        self.do_sample = do_sample
        self.max_length = max_length
        # transformers' assisted loop merges this into the target's forward kwargs.
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.target_layer_ids]}
        self._stock_prefilled = False

    # ---- pipeline pieces -------------------------------------------------------------------------------
    def context_features(self, hidden_states: tuple, positions: torch.LongTensor | slice) -> torch.Tensor:
        """Concatenate the target-layer outputs at `positions` (sequence axis): `[1, C, n*H]`."""
        return torch.cat([hidden_states[i + 1][:, positions] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def draft(
        self,
        anchor_token: int,
        anchor_position: int,
        new_context: torch.Tensor,
        max_depth: int,
        prev_token: int = -1,
    ) -> BlockDraft:
        """Append `new_context [1, C, n*H]` (positions `anchor_position - C .. anchor_position - 1`) to the drafter
        cache and draft the block anchored at `anchor_token`. Only depths `1..max_depth` are scored."""
        device = self.drafter.device
        q_len = self.block_size
        noise_ids = torch.full((1, q_len), self.mask_token_id, dtype=torch.long, device=device)
        noise_ids[0, 0] = anchor_token
        num_context = new_context.shape[1]
        position_ids = torch.arange(anchor_position - num_context, anchor_position + q_len, device=device)[None]
        out = self.drafter(
            noise_embeds=self.input_embeddings(noise_ids),
            context_hidden_states=new_context.to(device),
            position_ids=position_ids,
            cache=self.cache,
        )
        self.cache.crop(-q_len)  # keep the context K/V, drop the block's
        depth = max(0, min(q_len - 1, max_depth))
        logits = self.lm_head(out.last_hidden_state[0, 1 : depth + 1])  # [D, V]
        return BlockDraft(
            anchor_token=anchor_token,
            prev_token=prev_token,
            pre_norm_hidden=out.pre_norm_hidden_state[0, : depth + 1],
            marginal_log_probs=torch.log_softmax(logits.float(), dim=-1),
        )

    @torch.no_grad()
    def ar_tables(self, block: BlockDraft) -> tuple[torch.LongTensor, torch.Tensor, list[dict[int, int]]]:
        """Stage 2: evaluate the AR layer for every (depth, previous token) of the top-M tree in one batch.

        Rows: row 0 = children of the root (depth 1, previous token `b`); then, for each depth d in 1..D-1 and
        each of the M tokens w of `S_d` (top-M of the marginal at depth d), the children of w at depth d+1.
        Returns `child_tokens [R, K]`, `child_log_probs [R, K]` and, per depth d = 1..D-1, `{w: row}`.
        """
        depth, top_m, top_k = block.depth, self.options.tree_top_m, self.options.tree_top_k
        device = block.pre_norm_hidden.device
        top_m = min(top_m, block.marginal_log_probs.shape[-1])
        top_tokens = block.marginal_log_probs[: depth - 1].topk(top_m, dim=-1).indices  # [D-1, M]: S_1..S_{D-1}
        hidden_rows = torch.cat(
            [block.pre_norm_hidden[1:2], block.pre_norm_hidden[2 : depth + 1].repeat_interleave(top_m, dim=0)]
        )  # [R, H]
        anchor = torch.tensor([block.anchor_token], device=device)
        prev_tokens = torch.cat([anchor, top_tokens.flatten()])  # [R]
        prev2_embeds = None
        if self.two_prev_tokens:
            # The token two back is known for rows 0 and 1..M; deeper rows use the top-1 marginal token of
            # depth d-1 as a stand-in (tables are per (depth, previous token), not per path).
            before_anchor = torch.tensor([max(block.prev_token, 0)], device=device)
            prev2 = torch.cat([before_anchor[None], anchor[None], top_tokens[: max(depth - 2, 0), :1]])[:, 0]
            prev2_tokens = torch.cat([prev2[:1], prev2[1:depth].repeat_interleave(top_m)])
            prev2_embeds = self.input_embeddings(prev2_tokens)
        corrected = self.drafter.ar_corrected_hidden_states(
            hidden_rows, self.input_embeddings(prev_tokens), prev2_embeds
        )
        log_probs = torch.log_softmax(self.lm_head(corrected).float(), dim=-1)  # [R, V]
        child = log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1)
        row_of = [
            {token: 1 + d * top_m + j for j, token in enumerate(tokens)} for d, tokens in enumerate(top_tokens.tolist())
        ]
        return child.indices, child.values, row_of

    def build_tree(self, block: BlockDraft, budget: int) -> DraftTree:
        """Stage 3: the tree of at most `budget` nodes (root included) for the configured mode."""
        max_depth = min(block.depth, budget - 1)
        mode = self.options.tree_mode
        if max_depth <= 0:
            no_tokens = block.marginal_log_probs.new_zeros(0, dtype=torch.long)
            return chain_tree(block.anchor_token, no_tokens, block.marginal_log_probs.new_zeros(0))
        if mode == "chain":
            best = block.marginal_log_probs[:max_depth].max(dim=-1)
            return chain_tree(block.anchor_token, best.indices, best.values)
        if mode == "marginal_tree":
            child = block.marginal_log_probs[:max_depth].topk(self.options.tree_top_k, dim=-1)

            def marginal_row(depth: int, token: int) -> int:
                return depth  # row d holds the children at depth d+1, whatever the parent

            return best_first_tree(block.anchor_token, child.indices, child.values, marginal_row, budget, max_depth)
        child_tokens, child_log_probs, row_of = self.ar_tables(block)

        def ar_row(depth: int, token: int) -> int:
            return 0 if depth == 0 else row_of[depth - 1].get(token, -1)

        return best_first_tree(block.anchor_token, child_tokens, child_log_probs, ar_row, budget, max_depth)

    # ---- transformers' CandidateGenerator protocol (chain mode, stock linear verification) ---------------
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
        new_context = self.context_features(model_outputs.hidden_states, slice(0, num_new))
        anchor_position = input_ids.shape[1] - 1
        block = self.draft(int(input_ids[0, -1]), anchor_position, new_context, depth)
        if self.do_sample:
            drafted = torch.multinomial(block.marginal_log_probs.exp(), 1)[:, 0]
        else:
            drafted = block.marginal_log_probs.argmax(dim=-1)
        return torch.cat([input_ids, drafted[None].to(input_ids.device)], dim=-1), block.marginal_log_probs[None]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        pass
