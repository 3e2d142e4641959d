"""The tree step of the pipeline: build the draft tree from the drafter's tables (called by `draft.build_trees`).

A tree is flattened parents-before-children, node 0 is the root (the bonus token `b`, already committed).
`N` = number of nodes = the verification budget *including the root*. A batch verifies one tree per row:
`TreeBatch` packs `R` trees, padded to the largest.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

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
        if self.size == 1:  # the root alone (a plain step): skip three tensor ops
            return 0.0
        return float(self.path_log_probs[1:].exp().sum())

    def prefix(self, n: int) -> "DraftTree":
        """The first `n` nodes: a valid tree, since parents precede children."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.path_log_probs[:n])

    def is_chain(self) -> bool:
        """True when every node's parent is the node before it (a linear draft, or the root alone)."""
        # parents precede children, so a last node at depth N-1 has all N nodes on its path, in order
        return int(self.depths[-1]) == self.size - 1

    def children(self) -> list[dict[int, int]]:
        """Per node, `{child token: child index}` (Python ints: the acceptance walk reads these)."""
        table: list[dict[int, int]] = [{} for _ in range(self.size)]
        for node, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if parent >= 0:
                table[parent][token] = node
        return table

    def ancestor_matrix(self) -> torch.BoolTensor:
        """`[N, N]`, entry `[i, j]` true when node j is node i or one of its ancestors."""
        return TreeBatch.pack([self]).ancestor_matrix()[0]


@dataclass
class TreeBatch:
    """`R` rows' trees packed for one verification forward, padded to `N` = the largest tree's size.

    tokens: `[R, N]` (padding nodes carry their row's root token); parents: `[R, N]` parent index (-1 for roots
    and padding); depths: `[R, N]` (0 for padding); valid: `[R, N]` true for real nodes; trees: the row trees.
    A padding node attends only to itself and nothing accepts it.
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.BoolTensor
    trees: list[DraftTree]
    _ancestors: torch.BoolTensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def pack(cls, trees: list[DraftTree]) -> "TreeBatch":
        width = max(tree.size for tree in trees)
        rows = len(trees)
        tokens = torch.stack([tree.tokens[:1] for tree in trees]).expand(rows, width).clone()
        parents = torch.full((rows, width), -1, dtype=torch.long)
        depths = torch.zeros((rows, width), dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.bool)
        for row, tree in enumerate(trees):
            n = tree.size
            tokens[row, :n], parents[row, :n], depths[row, :n] = tree.tokens, tree.parents, tree.depths
            valid[row, :n] = True
        return cls(tokens, parents, depths, valid, trees)

    @classmethod
    def from_tensors(cls, tokens: torch.LongTensor, parents: torch.LongTensor, depths: torch.LongTensor,
                     path_log_probs: torch.Tensor) -> "TreeBatch":
        """Trees built as `[R, N]` tensors (`best_first_trees`); nodes scored -inf are padding (every row's real
        nodes come first). The row trees (`trees`) are their valid prefixes, on the CPU."""
        valid = path_log_probs > float("-inf")
        tokens = torch.where(valid, tokens, tokens[:, :1])
        parents = parents.masked_fill(~valid, -1)
        depths = depths.masked_fill(~valid, 0)
        sizes = valid.sum(dim=1).tolist()
        host = [t.cpu() for t in (tokens, parents, depths, path_log_probs.float())]
        trees = [DraftTree(*(t[row, :size] for t in host)) for row, size in enumerate(sizes)]
        width = max(sizes)
        return cls(tokens[:, :width], parents[:, :width], depths[:, :width], valid[:, :width], trees)

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def is_uniform_chain(self) -> bool:
        """True when every row's tree is a chain of the full width (a linear draft, or roots alone): then the
        model's own causal mask is the tree mask."""
        return bool(self.valid.all()) and all(tree.is_chain() for tree in self.trees)

    def ancestor_matrix(self) -> torch.BoolTensor:
        """`[R, N, N]`, entry `[r, i, j]` true when node j is node i or one of its ancestors in row r's tree
        (padding nodes: themselves only). Batched pointer doubling: `log2(depth)` matrix products; computed once."""
        if self._ancestors is not None:
            return self._ancestors
        rows, n = self.tokens.shape
        reach = torch.eye(n).expand(rows, n, n).clone()
        row_index, node_index = (self.parents >= 0).nonzero(as_tuple=True)
        reach[row_index, node_index, self.parents[row_index, node_index]] = 1.0
        max_depth = int(self.depths.max())
        covered = 1
        while covered < max_depth:
            reach = torch.bmm(reach, reach).clamp_(max=1.0)
            covered *= 2
        self._ancestors = reach.bool()
        return self._ancestors


def best_first_trees(root_tokens: torch.LongTensor, child_tokens: torch.LongTensor, child_log_probs: torch.Tensor,
                     parent_tokens: torch.LongTensor | None, budget: int, max_depth: int) -> TreeBatch:
    """`best_first_tree_tensors` packed as a `TreeBatch` (with each row's `DraftTree` for per-row consumers)."""
    return TreeBatch.from_tensors(*best_first_tree_tensors(root_tokens, child_tokens, child_log_probs, parent_tokens,
                                                           budget, max_depth))


def best_first_tree_tensors(
    root_tokens: torch.LongTensor,
    child_tokens: torch.LongTensor,
    child_log_probs: torch.Tensor,
    parent_tokens: torch.LongTensor | None,
    budget: int,
    max_depth: int,
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor, torch.Tensor]:
    """Every row's best-first tree at once, as tensor operations whose number does not grow with the rows:
    `(tokens, parents, depths, path_log_probs)`, each `[R, N]` (N <= budget; nodes scored -inf are padding).

    root_tokens: `[R]`; child_tokens / child_log_probs: `[R, D, P, K]`, entry `[r, d, p]` = the top-K children
    (depth d+1, log-probs sorted in decreasing order) of the p-th parent at depth d (the root: p = 0 at d = 0);
    parent_tokens: `[R, D, P]`, the token of the p-th parent at depth d >= 1 (a node at depth d whose token is not
    among them is a leaf), or None when children do not depend on the parent (entry `[r, d, 0]` for every node).

    The best-first search (`best_first_tree`) pops nodes in decreasing path log-probability, and a path's score
    only falls along it, so its `budget`-node tree is the root plus the `budget - 1` best nodes, in the order of the
    search's heap key: score (summed in float64, as the search sums), then rank among siblings, then the parent's
    place. Computed depth by depth: the children of the kept nodes of depth d, of which each row keeps its
    `budget - 1` best (a node among the `budget - 1` best overall is among the best of its depth, and its parent was
    kept), every kept node placed among all kept so far by that key. The trees are the search's, node for node,
    exactly equal scores included; a child of probability exactly 1 (the same score as its parent) is placed just
    below its parent's score, so that parents always precede children.
    """
    num_rows, depth_limit, _, top_k = child_tokens.shape
    device = child_log_probs.device
    keep = budget - 1
    child_tokens = child_tokens.to(device)
    child_log_probs = child_log_probs.to(device=device, dtype=torch.float64)
    parent_tokens = None if parent_tokens is None else parent_tokens.to(device)
    ranks = torch.arange(top_k, device=device)
    # the kept nodes of the current depth: tokens, scores and place in the pool (-1: the root, not pooled)
    frontier_tokens = root_tokens.to(device)[:, None]
    frontier_scores = torch.zeros(num_rows, 1, dtype=torch.float64, device=device)
    frontier_index = torch.full((num_rows, 1), -1, dtype=torch.long, device=device)
    pool: dict[str, list[torch.Tensor]] = {"tokens": [], "scores": [], "ranks": [], "depths": [], "parents": []}
    place = torch.zeros(num_rows, 0, dtype=torch.long, device=device)  # pool index -> its place in the heap order
    for depth in range(min(max_depth, depth_limit)):
        if keep <= 0:
            break
        if parent_tokens is None or depth == 0:
            slot = torch.zeros_like(frontier_tokens)
            expandable = torch.ones_like(frontier_tokens, dtype=torch.bool)
        else:
            match = frontier_tokens[:, :, None] == parent_tokens[:, depth, None, :]  # [R, F, P]
            slot, expandable = match.int().argmax(dim=-1), match.any(dim=-1)
        gather = slot[:, :, None].expand(-1, -1, top_k)
        tokens = child_tokens[:, depth].gather(1, gather)  # [R, F, K]
        parent_scores = frontier_scores[:, :, None]
        scores = torch.minimum(parent_scores + child_log_probs[:, depth].gather(1, gather),
                               parent_scores.nextafter(parent_scores.new_tensor(float("-inf"))))
        scores = scores.masked_fill(~expandable[:, :, None], float("-inf"))
        parent_place = (place.gather(1, frontier_index.clamp(min=0)) if depth else frontier_index)[:, :, None]
        width = frontier_tokens.shape[1]
        # this depth's best `keep` by the heap key: score, then rank, then the parent's place
        flat = lambda tensor: tensor.expand(num_rows, width, top_k).reshape(num_rows, -1)  # noqa: E731
        order = heap_order(flat(scores), flat(ranks[None, None, :]), flat(parent_place))[:, :keep]
        frontier_scores = flat(scores).gather(1, order)
        frontier_tokens = flat(tokens).gather(1, order)
        base = sum(len(t[0]) for t in pool["tokens"]) if pool["tokens"] else 0
        parents = flat(frontier_index[:, :, None]).gather(1, order)
        pool["tokens"].append(frontier_tokens)
        pool["scores"].append(frontier_scores)
        pool["ranks"].append(flat(ranks[None, None, :]).gather(1, order))
        pool["depths"].append(torch.full_like(order, depth + 1))
        pool["parents"].append(parents)
        frontier_index = base + torch.arange(order.shape[1], device=device).expand(num_rows, -1)
        # every kept node's place among all kept so far (an earlier node's relative place never changes)
        scores_so_far = torch.cat(pool["scores"], dim=1)
        parents_so_far = torch.cat(pool["parents"], dim=1)
        parent_places = torch.where(parents_so_far < 0, -1, torch.cat([place, place.new_zeros(num_rows, order.shape[1])],
                                                                       dim=1).gather(1, parents_so_far.clamp(min=0)))
        pooled_order = heap_order(scores_so_far, torch.cat(pool["ranks"], dim=1), parent_places)
        place = torch.empty_like(pooled_order).scatter_(
            1, pooled_order, torch.arange(pooled_order.shape[1], device=device).repeat(num_rows, 1))
    if not pool["tokens"]:
        zeros = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
        return root_tokens.to(device)[:, None], zeros - 1, zeros, torch.zeros(num_rows, 1, device=device)
    order = pooled_order[:, :keep]  # [R, B-1]: the tree's nodes below the root, in the search's order
    pool_parent = torch.cat(pool["parents"], dim=1).gather(1, order)
    parents = torch.where(pool_parent < 0, 0, place.gather(1, pool_parent.clamp(min=0)) + 1)
    root = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
    return (
        torch.cat([root_tokens.to(device)[:, None], torch.cat(pool["tokens"], dim=1).gather(1, order)], dim=1),
        torch.cat([root - 1, parents], dim=1),
        torch.cat([root, torch.cat(pool["depths"], dim=1).gather(1, order)], dim=1),
        torch.cat([torch.zeros(num_rows, 1, device=device), scores_so_far.gather(1, order).float()], dim=1),
    )


def heap_order(scores: torch.Tensor, ranks: torch.LongTensor, parent_places: torch.LongTensor) -> torch.LongTensor:
    """`[R, C]` -> the indices that order each row's candidates as the best-first search's heap pops them: by
    decreasing score, then increasing rank among siblings, then the parent's place (stable sorts, least significant
    key first)."""
    order = parent_places.argsort(dim=1, stable=True)
    order = order.gather(1, ranks.gather(1, order).argsort(dim=1, stable=True))
    return order.gather(1, scores.gather(1, order).argsort(dim=1, descending=True, stable=True))


def chain_tree(root_token: int, tokens: torch.LongTensor, log_probs: torch.Tensor) -> DraftTree:
    """A linear tree (DFlash): `tokens [D]` are the drafted tokens at depths 1..D, `log_probs [D]` theirs."""
    device = tokens.device
    depth = tokens.shape[0]
    all_tokens = torch.cat([torch.tensor([root_token], device=device), tokens])
    parents = torch.arange(-1, depth, device=device)
    depths = torch.arange(0, depth + 1, device=device)
    path = torch.cat([torch.zeros(1, device=device), log_probs.float().cumsum(0)])
    return DraftTree(all_tokens, parents, depths, path)


def root_tree(root_token: int) -> DraftTree:
    """The root alone (a plain decoding step)."""
    return DraftTree(torch.tensor([root_token]), _ROOT_PARENTS, _ROOT_DEPTHS, _ROOT_PATH_LOG_PROBS)


_ROOT_PARENTS, _ROOT_DEPTHS, _ROOT_PATH_LOG_PROBS = torch.tensor([-1]), torch.tensor([0]), torch.zeros(1)

ChildList = tuple[list[int], list[float]]  # (tokens, log-probs), sorted by decreasing log-prob


def best_first_tree(
    root_token: int,
    children_of: Callable[[int, int], ChildList | None],
    budget: int,
    max_depth: int,
    prefetch: Callable[[list[tuple[int, int]]], None] | None = None,
    prefetch_size: int = 0,
) -> DraftTree:
    """Best-first search for the `budget`-node tree maximising the sum of path probabilities.

    `children_of(depth, token)` gives the top-K children of a node carrying `token` at `depth` (the root has
    depth 0), or None for a leaf. Path scores only fall along a path, so the popped set is prefix-closed and is
    the optimal tree for the drafter's own estimate of expected accepted length. Each pop pushes at most two
    entries (the node's next sibling and its best child), so the loop runs `budget - 1` times.

    `prefetch(keys)` (optional) is told, before a node is expanded, the (depth, token) of that node and of the
    `prefetch_size` best candidates waiting in the heap, so that lazily computed children can be computed in
    batches.
    """
    node_tokens, node_parents, node_depths, node_scores = [root_token], [-1], [0], [0.0]
    heap: list[tuple[float, int, int, list[int], list[float]]] = []  # (-score, rank, parent, child list)

    def push_first_child(node: int) -> None:
        depth = node_depths[node]
        if depth >= max_depth:
            return
        if prefetch is not None:
            waiting = heapq.nsmallest(prefetch_size, heap) if prefetch_size else []
            keys = [(depth, node_tokens[node])]
            keys += [(node_depths[entry[2]] + 1, entry[3][entry[1]]) for entry in waiting
                     if node_depths[entry[2]] + 1 < max_depth]
            prefetch(keys)
        children = children_of(depth, node_tokens[node])
        if children is not None and children[0]:
            tokens, log_probs = children
            heapq.heappush(heap, (-(node_scores[node] + log_probs[0]), 0, node, tokens, log_probs))

    push_first_child(0)
    while heap and len(node_tokens) < budget:
        neg_score, rank, parent, tokens, log_probs = heapq.heappop(heap)
        node_tokens.append(tokens[rank])
        node_parents.append(parent)
        node_depths.append(node_depths[parent] + 1)
        node_scores.append(-neg_score)
        if rank + 1 < len(tokens):
            sibling_score = node_scores[parent] + log_probs[rank + 1]
            heapq.heappush(heap, (-sibling_score, rank + 1, parent, tokens, log_probs))
        push_first_child(len(node_tokens) - 1)

    return DraftTree(
        tokens=torch.tensor(node_tokens, dtype=torch.long),
        parents=torch.tensor(node_parents, dtype=torch.long),
        depths=torch.tensor(node_depths, dtype=torch.long),
        path_log_probs=torch.tensor(node_scores, dtype=torch.float32),
    )


def table_children(child_tokens: torch.LongTensor, child_log_probs: torch.Tensor, row_of: Callable[[int, int], int]):
    """`children_of` over precomputed `[R, K]` tables; `row_of(depth, token)` names a row or -1 (leaf)."""
    tokens_table, logp_table = child_tokens.tolist(), child_log_probs.float().tolist()

    def children_of(depth: int, token: int) -> ChildList | None:
        row = row_of(depth, token)
        return None if row < 0 else (tokens_table[row], logp_table[row])

    return children_of
