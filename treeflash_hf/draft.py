"""Stages 1-2 of the pipeline: one drafter forward, then the tables the tree is built from.

`Q` block size, `D` deepest drafted depth (<= Q-1), `V` vocabulary, `H` hidden size, `M` top-m, `K` top-k,
`n` number of context layers, `C` shortlist size of stage 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from .lookup import with_lookup_branch
from .options import TreeOptions
from .tree import ChildList, DraftTree, best_first_tree, chain_tree, table_children


@dataclass
class Shortlist:
    """Per depth d = 1..D, the `C` most likely tokens of the marginal, the `lm_head` rows that score them and the
    marginal's log-mass on them. Stage 2 scores AR rows on these tokens only (`C*H` instead of `V*H` per row)
    and gives the shortlist the marginal's mass: with a zero AR layer that reproduces the marginal exactly.

    tokens: `[D, C]` sorted by decreasing marginal probability; weight: `[H, D*C]` (depth-major columns);
    bias: `[D, C]` or None; log_mass: `[D]`."""

    tokens: torch.LongTensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    log_mass: torch.Tensor


@dataclass
class BlockDraft:
    """One drafter forward. anchor_token: `b`; prev_token: the committed token before `b` (or -1);
    pre_norm_hidden: `[D+1, H]` backbone outputs for slots 0..D; marginal_log_probs: `[D, V]` for depths 1..D;
    shortlist: the stage-2 vocabulary per depth, or None for the full vocabulary."""

    anchor_token: int
    prev_token: int
    pre_norm_hidden: torch.Tensor
    marginal_log_probs: torch.Tensor
    shortlist: Shortlist | None = None

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
        ar_evaluation: str | None = None,
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
        # How stage 2 runs (the same tree either way): "batched" evaluates every (depth, top-M token) row in one
        # call (about M*Q rows); "lazy" evaluates only the rows of nodes the best-first search expands (at most
        # budget - 1), with `ar_prefetch` likely-next rows per call. "auto" picks lazy when its calls cost less
        # than the batched rows, counting one call as `call_cost_in_rows` rows: on a CPU a call's fixed cost
        # (~0.3 ms, the work of ~3e7 multiply-adds there) over one row's AR-layer multiply-adds; effectively
        # infinite on a GPU, where one big batch is nearly free.
        self.ar_evaluation = ar_evaluation or "auto"
        self.ar_prefetch = 4
        ar_layer = drafter.ar_approximation
        row_macs = ar_layer.ug.weight.numel() + ar_layer.d.weight.numel()
        self.call_cost_in_rows = 3e7 / row_macs if drafter.device.type == "cpu" else float("inf")
        # Stage-2 vocabulary: on a CPU a full-vocabulary row costs a V*H product (the whole lm_head read per call),
        # so AR rows are scored on the marginal's top `ar_shortlist` tokens of their depth (see `Shortlist`);
        # None scores the full vocabulary (the default on accelerators, where a big product is nearly free).
        self.ar_shortlist: int | None = 64 if drafter.device.type == "cpu" else None
        self.device = drafter.device  # read once: a model's `device` property walks its parameters
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
        device = self.device
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
        marginal_log_probs = torch.log_softmax(logits.float(), dim=-1)
        return BlockDraft(
            anchor_token=anchor_token,
            prev_token=prev_token,
            pre_norm_hidden=out.pre_norm_hidden_state[0, : depth + 1],
            marginal_log_probs=marginal_log_probs,
            shortlist=self.shortlist(marginal_log_probs) if self.options.tree_mode == "treeflash" else None,
        )

    def shortlist(self, marginal_log_probs: torch.Tensor) -> Shortlist | None:
        """The stage-2 `Shortlist` of marginals `[D, V]`, or None when rows score the full vocabulary."""
        size = self.ar_shortlist
        if size is None or size >= marginal_log_probs.shape[-1] or marginal_log_probs.shape[0] == 0:
            return None
        top = marginal_log_probs.topk(size, dim=-1)  # [D, C], sorted
        bias = self.lm_head.bias
        return Shortlist(
            tokens=top.indices,
            weight=self.lm_head.weight[top.indices.flatten()].T,  # [H, D*C]
            bias=None if bias is None else bias[top.indices],
            log_mass=torch.logsumexp(top.values, dim=-1),
        )

    @torch.no_grad()
    def ar_children(
        self, block: BlockDraft, parent_depths: torch.LongTensor, parent_tokens: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Stage 2, for `R` rows at once: the top-K children (depth d+1) of a node carrying `parent_tokens[r]`
        at depth `d = parent_depths[r]`, from the AR-corrected distribution `q'_{d+1}(. | parent token)`.
        Returns `child_tokens [R, K]` and `child_log_probs [R, K]`, sorted by decreasing log-prob."""
        device = block.pre_norm_hidden.device
        parent_depths, parent_tokens = parent_depths.to(device), parent_tokens.to(device)
        hidden_rows = block.pre_norm_hidden[parent_depths + 1]  # [R, H]
        prev2_embeds = None
        if self.two_prev_tokens:
            # Token two back: known for depth 0 (the committed token before b) and depth 1 (b); deeper rows
            # use the top-1 marginal token of depth d-1 as a stand-in (rows are per (depth, token), not per path).
            top1 = block.marginal_log_probs.argmax(dim=-1)  # [D]: depth 1..D
            known = torch.tensor([max(block.prev_token, 0), block.anchor_token], device=device)
            lookup = torch.cat([known, top1])  # index d -> token two back of a depth-d parent
            prev2_embeds = self.input_embeddings(lookup[parent_depths])
        corrected = self.drafter.ar_corrected_hidden_states(
            hidden_rows, self.input_embeddings(parent_tokens), prev2_embeds
        )  # [R, H]
        shortlist = block.shortlist
        if shortlist is None:
            log_probs = torch.log_softmax(self.lm_head(corrected).float(), dim=-1)  # [R, V]
            child = log_probs.topk(min(self.options.tree_top_k, log_probs.shape[-1]), dim=-1)
            return child.indices, child.values
        # Row r scores the shortlist of its children's depth d+1 (index d of the `[D, ...]` tables). One product
        # against every depth's shortlist, then each row keeps its own depth's block: no per-row weight copies.
        num_depths, size = shortlist.tokens.shape
        rows = torch.arange(len(parent_depths), device=device)
        logits = (corrected @ shortlist.weight).view(-1, num_depths, size)[rows, parent_depths]  # [R, C]
        if shortlist.bias is not None:
            logits = logits + shortlist.bias[parent_depths]
        log_probs = torch.log_softmax(logits.float(), dim=-1) + shortlist.log_mass[parent_depths, None]
        child = log_probs.topk(min(self.options.tree_top_k, size), dim=-1)
        return shortlist.tokens[parent_depths].gather(1, child.indices), child.values

    def top_tokens(self, block: BlockDraft) -> torch.LongTensor:
        """Stage 1: `S_d`, the top-M tokens of each marginal, `[D, M]` for depths 1..D."""
        top_m = min(self.options.tree_top_m, block.marginal_log_probs.shape[-1])
        if block.shortlist is not None and block.shortlist.tokens.shape[-1] >= top_m:
            return block.shortlist.tokens[:, :top_m]
        return block.marginal_log_probs.topk(top_m, dim=-1).indices

    def ar_tables(self, block: BlockDraft) -> tuple[torch.LongTensor, torch.Tensor, list[dict[int, int]]]:
        """Stage 2 for the whole top tree in one batch: row 0 = children of the root (previous token `b`), then
        for each depth d in 1..D-1 and each w in `S_d`, the children of w. Returns `child_tokens [R, K]`,
        `child_log_probs [R, K]` and, per depth d = 1..D-1, `{w: row}`."""
        depth = block.depth
        top = self.top_tokens(block)[: depth - 1]  # [D-1, M]
        top_m = top.shape[-1]
        parent_depths = torch.cat([torch.zeros(1, dtype=torch.long),
                                   torch.arange(1, depth).repeat_interleave(top_m)])
        parent_tokens = torch.cat([torch.tensor([block.anchor_token]), top.flatten().cpu()])
        child_tokens, child_log_probs = self.ar_children(block, parent_depths, parent_tokens)
        row_of = [{token: 1 + d * top_m + j for j, token in enumerate(row)} for d, row in enumerate(top.tolist())]
        return child_tokens, child_log_probs, row_of

    def build_tree(
        self, block: BlockDraft, budget: int, lookup: tuple[list[int], list[float]] | None = None
    ) -> DraftTree:
        """Stage 3: the tree of at most `budget` nodes (root included) for the configured mode. `lookup` =
        (tokens, conditional log-prob of each) adds a lookup branch below the root (tree modes; `lookup.py`)."""
        max_depth = min(block.depth, budget - 1)
        mode = self.options.tree_mode
        if max_depth <= 0 or mode == "chain":
            best = block.marginal_log_probs[:max(max_depth, 0)].max(dim=-1)
            return chain_tree(block.anchor_token, best.indices.cpu(), best.values.cpu())

        def search(children_of, prefetch=None, prefetch_size: int = 0) -> DraftTree:
            if lookup is not None and lookup[0]:
                children_of = with_lookup_branch(children_of, *lookup)
            return best_first_tree(block.anchor_token, children_of, budget, max_depth, prefetch, prefetch_size)

        if mode == "marginal_tree":
            child = block.marginal_log_probs[:max_depth].topk(self.options.tree_top_k, dim=-1)
            # row d holds the children at depth d+1, whatever the parent
            return search(table_children(child.indices, child.values, lambda depth, token: depth))
        batched_rows = 1 + (max_depth - 1) * self.options.tree_top_m
        lazy_cost = (budget - 1) * self.call_cost_in_rows
        if self.ar_evaluation == "batched" or (self.ar_evaluation == "auto" and lazy_cost >= batched_rows):
            child_tokens, child_log_probs, row_of = self.ar_tables(block)
            return search(table_children(
                child_tokens, child_log_probs, lambda d, token: 0 if d == 0 else row_of[d - 1].get(token, -1)
            ))
        lazy = LazyARChildren(self, block)
        # Guess which nodes the search will expand by running it on the marginals (a stand-in for the AR rows,
        # cheap), compute those rows in one call, then search for real; rows it missed are computed on demand.
        marginal = block.marginal_log_probs[:max_depth].topk(self.options.tree_top_k, dim=-1)
        stand_in = table_children(marginal.indices, marginal.values,
                                  lambda depth, token: depth if lazy.has_children(depth, token) else -1)
        guess = best_first_tree(block.anchor_token, stand_in, budget, max_depth)
        lazy.prefetch(list(zip(guess.depths.tolist(), guess.tokens.tolist())))
        return search(lazy.children_of, lazy.prefetch, self.ar_prefetch)

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


class LazyARChildren:
    """Stage-2 rows on demand: the AR children of (depth, token) are computed the first time the best-first
    search expands such a node (batched with the prefetched candidates) and memoised."""

    def __init__(self, generator: TreeFlashCandidateGenerator, block: BlockDraft):
        self.generator = generator
        self.block = block
        top = generator.top_tokens(block).tolist()
        self.expandable = [set(row) for row in top]  # S_d for depth d = 1..D
        self.rows: dict[tuple[int, int], ChildList] = {}

    def has_children(self, depth: int, token: int) -> bool:
        if depth == 0:
            return True
        return depth < self.block.depth and token in self.expandable[depth - 1]

    def prefetch(self, keys: list[tuple[int, int]]) -> None:
        missing = list(dict.fromkeys(k for k in keys if k not in self.rows and self.has_children(*k)))
        if not missing:
            return
        depths = torch.tensor([d for d, _ in missing], dtype=torch.long)
        tokens = torch.tensor([t for _, t in missing], dtype=torch.long)
        child_tokens, child_log_probs = self.generator.ar_children(self.block, depths, tokens)
        for key, row_tokens, row_log_probs in zip(missing, child_tokens.tolist(), child_log_probs.tolist()):
            self.rows[key] = (row_tokens, row_log_probs)

    def children_of(self, depth: int, token: int) -> ChildList | None:
        if not self.has_children(depth, token):
            return None
        if (depth, token) not in self.rows:
            self.prefetch([(depth, token)])
        return self.rows[(depth, token)]
