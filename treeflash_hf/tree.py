"""Stage 3 of the pipeline: build the draft tree from the drafter's tables.

A tree is flattened parents-before-children, node 0 is the root (the bonus token `b`, already committed).
`N` = number of nodes = the verification budget *including the root*.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A draft tree, flattened so that every parent precedes its children.

    tokens: `[N]` token ids (node 0 = root `b`); parents: `[N]` parent index (-1 for the root);
    depths: `[N]` depth (root 0); path_log_probs: `[N]` drafter log-probability of the root-to-node path.
    `expected_accepted_len` is the drafter's own estimate of accepted drafted tokens,
    `sum_{n != root} exp(path_log_prob[n])` (the OPT-Tree objective).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    path_log_probs: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expected_accepted_len(self) -> float:
        return float(self.path_log_probs[1:].exp().sum())

    def children(self) -> list[dict[int, int]]:
        """Per node, `{child token: child index}` (Python ints: the acceptance walk reads these)."""
        table: list[dict[int, int]] = [{} for _ in range(self.size)]
        for node, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if parent >= 0:
                table[parent][token] = node
        return table

    def ancestor_matrix(self) -> torch.BoolTensor:
        """`[N, N]`, entry `[i, j]` true when node j is node i or one of its ancestors.

        Pointer doubling over the parent relation: `log2(depth)` boolean matrix products, no loop over nodes.
        """
        n = self.size
        device = self.tokens.device
        reach = torch.eye(n, dtype=torch.float32, device=device)
        child_idx = torch.arange(1, n, device=device)
        reach[child_idx, self.parents[1:]] = 1.0  # reach = I + P
        max_depth = int(self.depths.max()) if n > 1 else 0
        covered = 1
        while covered < max_depth:
            reach = (reach @ reach).clamp_(max=1.0)
            covered *= 2
        return reach.bool()


def chain_tree(root_token: int, tokens: torch.LongTensor, log_probs: torch.Tensor) -> DraftTree:
    """A linear tree (DFlash): `tokens [D]` are the drafted tokens at depths 1..D, `log_probs [D]` theirs."""
    device = tokens.device
    depth = tokens.shape[0]
    all_tokens = torch.cat([torch.tensor([root_token], device=device), tokens])
    parents = torch.arange(-1, depth, device=device)
    depths = torch.arange(0, depth + 1, device=device)
    path = torch.cat([torch.zeros(1, device=device), log_probs.float().cumsum(0)])
    return DraftTree(all_tokens, parents, depths, path)


def best_first_tree(
    root_token: int,
    child_tokens: torch.LongTensor,
    child_log_probs: torch.Tensor,
    child_row: Callable[[int, int], int],
    budget: int,
    max_depth: int,
) -> DraftTree:
    """Best-first search for the `budget`-node tree maximising the sum of path probabilities.

    child_tokens / child_log_probs: `[R, K]` tables, each row sorted by decreasing log-prob: the top-K
    children of some (depth, previous token) context. `child_row(depth, token)` names the row holding the
    children of a node with `token` at `depth` (the root has depth 0), or -1 when the node is a leaf.

    Path scores only fall along a path, so the popped set is prefix-closed and is the optimal tree for the
    drafter's own estimate of expected accepted length. Each pop pushes at most two entries (the node's
    next sibling and its best child), so the loop runs `budget - 1` times.
    """
    tokens_table = child_tokens.tolist()
    logp_table = child_log_probs.float().tolist()
    num_children = len(tokens_table[0]) if tokens_table else 0
    node_tokens, node_parents, node_depths, node_scores = [root_token], [-1], [0], [0.0]
    heap: list[tuple[float, int, int, int]] = []  # (-score, parent node, row, rank in row)

    def push_first_child(node: int) -> None:
        depth = node_depths[node]
        if depth >= max_depth or num_children == 0:
            return
        row = child_row(depth, node_tokens[node])
        if row >= 0:
            heapq.heappush(heap, (-(node_scores[node] + logp_table[row][0]), node, row, 0))

    push_first_child(0)
    while heap and len(node_tokens) < budget:
        neg_score, parent, row, rank = heapq.heappop(heap)
        node_tokens.append(tokens_table[row][rank])
        node_parents.append(parent)
        node_depths.append(node_depths[parent] + 1)
        node_scores.append(-neg_score)
        if rank + 1 < num_children:
            heapq.heappush(heap, (-(node_scores[parent] + logp_table[row][rank + 1]), parent, row, rank + 1))
        push_first_child(len(node_tokens) - 1)

    device = child_tokens.device
    return DraftTree(
        tokens=torch.tensor(node_tokens, dtype=torch.long, device=device),
        parents=torch.tensor(node_parents, dtype=torch.long, device=device),
        depths=torch.tensor(node_depths, dtype=torch.long, device=device),
        path_log_probs=torch.tensor(node_scores, dtype=torch.float32, device=device),
    )
