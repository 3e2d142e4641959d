"""A test-only drafting side that knows the target's greedy continuation and puts it into the tree.

Random drafters accept almost nothing; this one makes deep acceptance, multi-step cache compaction and the
bonus-token bookkeeping happen. Per step it places the true token of each depth at a random rank among the
drafted candidates, and sometimes drops it at one depth (so acceptance stops part-way, on a branch).
"""

from __future__ import annotations

import random

import torch

from treeflash_hf.engine.draft import TreeDrafter


class OracleCandidateGenerator(TreeDrafter):
    def __init__(self, drafter, target, options, reference: list[int], seed: int = 0, max_rank: int = 2,
                 miss_prob: float = 0.3):
        super().__init__(drafter, target, options)
        self.reference = reference
        self.rng = random.Random(seed)
        self.max_rank = max_rank if options.tree_mode != "chain" else 0
        self.miss_prob = miss_prob
        self.truth: list[int] = []
        self.miss_depth = -1
        self.partly_scored_drafts = 0  # drafts that left depths unscored
        self.deepened_drafts = 0  # of them, those whose trees asked for the rest

    def _plan(self, anchor_position: int, depth: int) -> None:
        self.truth = self.reference[anchor_position + 1 : anchor_position + 1 + depth]
        self.ranks = [self.rng.randint(0, self.max_rank) for _ in range(depth)]
        self.miss_depth = self.rng.randint(1, max(depth, 1)) if self.rng.random() < self.miss_prob else -1

    def _place(self, values: torch.Tensor, token: int, rank: int) -> torch.Tensor:
        """Log-probs `[V]` rewritten to be peaked: `max_rank + 1` strong candidates, `token` at `rank` (0 = best)."""
        values = values.clone()
        others = values.clone()
        others[token] = -float("inf")
        decoys = others.topk(self.max_rank + 1).indices.tolist()
        strong = [d for d in decoys][: self.max_rank]
        strong.insert(rank, token)
        for position, candidate in enumerate(strong):
            values[candidate] = 8.0 - position
        return torch.log_softmax(values, dim=-1)

    def draft(self, anchor_tokens, anchor_positions, context, max_depth, prev_tokens=None, scored_depth=None):
        assert len(anchor_tokens) == 1, "the oracle knows one reference continuation (batch 1)"
        block = super().draft(anchor_tokens, anchor_positions, context, max_depth, prev_tokens, scored_depth)[0]
        unscored = 0 if block.unscored_hidden is None else block.unscored_hidden.shape[0]
        self.partly_scored_drafts += unscored > 0
        self._plan(int(anchor_positions[0]), block.depth + unscored)
        self._rewrite(block, 0)
        return [block]

    def score_deeper(self, blocks):
        scored = blocks[0].depth
        self.deepened_drafts += blocks[0].unscored_hidden is not None
        super().score_deeper(blocks)
        self._rewrite(blocks[0], scored)

    def _rewrite(self, block, start: int) -> None:
        """Rig the marginals of depths `start + 1..` of `block` (and their shortlists)."""
        log_probs = block.marginal_log_probs.clone()
        for d, token in enumerate(self.truth[start : block.depth], start=start):
            if d + 1 == self.miss_depth:
                log_probs[d, token] = -float("inf")
            else:
                log_probs[d] = self._place(log_probs[d], token, self.ranks[d])
        block.marginal_log_probs = log_probs
        shortlists = self.shortlists(log_probs[None])
        block.shortlist = None if shortlists is None else shortlists[0]

    def ar_table_tensors(self, blocks, max_depth):
        child_tokens, child_log_probs, top = super().ar_table_tensors(blocks, max_depth)
        child_tokens, child_log_probs = child_tokens.clone(), child_log_probs.clone()
        for row in range(len(blocks)):
            depths = torch.arange(max_depth)[:, None].expand_as(top[row]).reshape(-1)
            tokens, log_probs = self._rig(depths, top[row].reshape(-1), child_tokens[row].flatten(0, 1),
                                          child_log_probs[row].flatten(0, 1))
            child_tokens[row], child_log_probs[row] = tokens.view_as(child_tokens[row]), \
                log_probs.view_as(child_log_probs[row])
        return child_tokens, child_log_probs, top

    def ar_rows(self, inputs, row_index, parent_depths, parent_tokens):
        child_tokens, child_log_probs = super().ar_rows(inputs, row_index, parent_depths, parent_tokens)
        return self._rig(parent_depths, parent_tokens, child_tokens, child_log_probs)

    def _rig(self, parent_depths, parent_tokens, child_tokens, child_log_probs):
        child_tokens = child_tokens.clone()
        # Peaked, sorted children (a confident drafter), so that best-first goes deep rather than wide.
        steep = torch.log_softmax(-1.0 * torch.arange(child_tokens.shape[1], dtype=torch.float32), dim=-1)
        child_log_probs = steep.expand_as(child_log_probs).to(child_log_probs.device).clone()
        # Rows of nodes on the true path (the root, or a depth-d node carrying the true token) get the true
        # next token at the planned rank, or lose it at the planned miss depth.
        for row, (depth, token) in enumerate(zip(parent_depths.tolist(), parent_tokens.tolist())):
            on_true_path = depth == 0 or (depth <= len(self.truth) and token == self.truth[depth - 1])
            if not on_true_path or depth >= len(self.truth):
                continue
            true_next = self.truth[depth]
            present = (child_tokens[row] == true_next).nonzero()
            if depth + 1 == self.miss_depth:
                if len(present):
                    unused = next(t for t in range(self.drafter.config.vocab_size) if t not in child_tokens[row])
                    child_tokens[row, int(present[0])] = unused
                continue
            rank = min(self.ranks[depth], child_tokens.shape[1] - 1)
            if len(present):
                child_tokens[row, int(present[0])] = child_tokens[row, rank]
            child_tokens[row, rank] = true_next
        return child_tokens, child_log_probs
