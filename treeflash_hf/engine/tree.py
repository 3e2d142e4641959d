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
    and padding); depths: `[R, N]` (0 for padding); valid: `[R, N]` true for real nodes (each row's come first);
    path_log_probs: `[R, N]` float32 (-inf for padding). A padding node attends only to itself and nothing accepts
    it. uniform_chain: known, without reading the device, that every row is a chain of the full width (its
    builder says so): the model's own causal mask is then the tree mask. `trees` gives each row's `DraftTree` for
    per-row consumers (the slow paths; it reads the tree sizes once).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.BoolTensor
    path_log_probs: torch.Tensor
    uniform_chain: bool = False
    _trees: list[DraftTree] | None = field(default=None, repr=False)
    _sizes: list[int] | None = field(default=None, repr=False)
    _ancestors: torch.BoolTensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def pack(cls, trees: list[DraftTree], chains: bool = False) -> "TreeBatch":
        """Per-row trees packed (the per-row paths: lookup branches, lazily built AR trees); `chains`: the caller
        built every tree as a chain (`chain_tree`, `root_tree`)."""
        sizes = [tree.size for tree in trees]
        width, rows = max(sizes), len(trees)
        tokens = torch.stack([tree.tokens[:1] for tree in trees]).expand(rows, width).clone()
        parents = torch.full((rows, width), -1, dtype=torch.long)
        depths = torch.zeros((rows, width), dtype=torch.long)
        path_log_probs = torch.full((rows, width), float("-inf"))
        for row, (tree, n) in enumerate(zip(trees, sizes)):
            tokens[row, :n], parents[row, :n], depths[row, :n] = tree.tokens, tree.parents, tree.depths
            path_log_probs[row, :n] = tree.path_log_probs
        valid = path_log_probs > float("-inf")
        return cls(tokens, parents, depths, valid, path_log_probs, chains and min(sizes) == width, list(trees), sizes)

    @classmethod
    def roots(cls, root_tokens: torch.LongTensor) -> "TreeBatch":
        """Every row's root alone, `root_tokens [R]` (a plain decoding step)."""
        column = root_tokens[:, None]
        zeros = torch.zeros_like(column)
        return cls(column, zeros - 1, zeros, torch.ones_like(column, dtype=torch.bool),
                   torch.zeros(column.shape, device=column.device), uniform_chain=True)

    @classmethod
    def from_tensors(cls, tokens: torch.LongTensor, parents: torch.LongTensor, depths: torch.LongTensor,
                     path_log_probs: torch.Tensor) -> "TreeBatch":
        """Trees built as `[R, N]` tensors (`best_first_tree_tensors`); nodes scored -inf are padding (every row's
        real nodes come first). Nothing is read from the device."""
        valid = path_log_probs > float("-inf")
        return cls(torch.where(valid, tokens, tokens[:, :1]), parents.masked_fill(~valid, -1),
                   depths.masked_fill(~valid, 0), valid, path_log_probs.float())

    @property
    def trees(self) -> list[DraftTree]:
        """Each row's `DraftTree`, on the CPU (one read of the batch; made once)."""
        if self._trees is None:
            host = [t.cpu() for t in (self.tokens, self.parents, self.depths, self.path_log_probs)]
            self._trees = [DraftTree(*(t[row, :size] for t in host)) for row, size in enumerate(self.size_list())]
        return self._trees

    def size_list(self) -> list[int]:
        """Each row's number of nodes on the host (one read, made once)."""
        if self._sizes is None:
            self._sizes = self.valid.sum(dim=1).tolist()
        return self._sizes

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def sizes(self) -> torch.LongTensor:
        """`[R]` each row's number of nodes (root included)."""
        return self.valid.sum(dim=1)

    def prefix(self, width: int) -> "TreeBatch":
        """Every row cut to its first `width` nodes (a valid tree: parents precede children)."""
        if width >= self.width:
            return self
        cut = TreeBatch(self.tokens[:, :width], self.parents[:, :width], self.depths[:, :width],
                        self.valid[:, :width], self.path_log_probs[:, :width], self.uniform_chain)
        if self._trees is not None:
            cut._trees = [tree.prefix(min(width, tree.size)) for tree in self._trees]
        if self._sizes is not None:
            cut._sizes = [min(width, size) for size in self._sizes]
        return cut

    def is_uniform_chain(self) -> bool:
        """True when every row's tree is a chain of the full width (a linear draft, or roots alone): then the
        model's own causal mask is the tree mask."""
        return self.uniform_chain

    def ancestor_matrix(self) -> torch.BoolTensor:
        """`[R, N, N]`, entry `[r, i, j]` true when node j is node i or one of its ancestors in row r's tree
        (padding nodes: themselves only). Pointer doubling, `ceil(log2(N - 1))` rounds whatever the trees (no
        read of their depths); computed once."""
        if self._ancestors is not None:
            return self._ancestors
        rows, n = self.tokens.shape
        nodes = torch.arange(n, device=self.tokens.device)
        pointer = torch.where(self.parents >= 0, self.parents, nodes)  # [R, N]: the parent, or the node itself
        reach = (nodes[:, None] == nodes) | (pointer[:, :, None] == nodes)  # [R, N, N]: within 1 step
        span = 1
        while span < n - 1:  # reach: ancestors within `span` steps; pointer: the ancestor `span` steps up
            reach = reach | reach.gather(1, pointer[:, :, None].expand(rows, n, n))
            pointer = pointer.gather(1, pointer)
            span *= 2
        self._ancestors = reach
        return self._ancestors


def best_first_trees(root_tokens: torch.LongTensor, child_tokens: torch.LongTensor, child_log_probs: torch.Tensor,
                     parent_tokens: torch.LongTensor | None, budget: int, max_depth: int) -> TreeBatch:
    """`best_first_tree_tensors` as a `TreeBatch`."""
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
    place. Computed depth by depth:
    - select: the children of the kept nodes of depth d, of which each row keeps its `budget - 1` best (a node
      among the `budget - 1` best overall is among the best of its depth, and its parent was kept). Within one
      depth the parents' places are in the order the previous depth was kept in, so laying the candidates out
      rank-major, parent-minor makes one stable sort by score the heap's order;
    - place: the kept nodes join all kept so far, ordered by the heap key with every parent's current place (an
      earlier node's relative place never changes).
    The trees are the search's, node for node, exactly equal scores included; a child of probability exactly 1
    (the same score as its parent) is placed just below its parent's score, so that parents always precede
    children.
    """
    num_rows, depth_limit, num_parents, top_k = child_tokens.shape
    device = child_log_probs.device
    keep = budget - 1
    depths = min(max_depth, depth_limit) if keep > 0 else 0
    root_tokens = root_tokens.to(device)
    if depths <= 0:
        zeros = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
        return root_tokens[:, None], zeros - 1, zeros, torch.zeros(num_rows, 1, device=device)
    child_tokens = child_tokens.to(device)
    log_probs = child_log_probs.to(device=device, dtype=torch.float64)
    # A node is carried as one code, token * (P + 1) + slot: slot 1 + p when it is the p-th parent of its depth
    # (its children are row p of the next table), 0 for a leaf. Every child's slot is found once, for all depths.
    stride = num_parents + 1
    if parent_tokens is None:
        slots = torch.ones_like(child_tokens)
    else:
        next_parents = parent_tokens.to(device)[:, 1:depth_limit, None, None, :]  # [R, D-1, 1, 1, P]
        match = child_tokens[:, : depth_limit - 1, :, :, None] == next_parents  # [R, D-1, P, K, P]
        slots = torch.where(match.any(dim=-1), match.int().argmax(dim=-1) + 1, 0)
        slots = torch.cat([slots, torch.zeros_like(child_tokens[:, :1])], dim=1)  # the deepest children: leaves
    codes = child_tokens * stride + slots  # [R, D, P, K]
    neg_inf = log_probs.new_tensor(float("-inf"))
    pool_size = sum(min(keep, top_k * min(keep, top_k ** d)) for d in range(depths))  # (an upper bound)
    positions = torch.arange(pool_size + 1, device=device)
    # the kept nodes of the current depth, in the heap's order: codes, scores, pool index (-1: the root)
    frontier_codes = root_tokens[:, None] * stride + 1
    frontier_scores = torch.zeros(num_rows, 1, dtype=torch.float64, device=device)
    frontier_index = torch.full((num_rows, 1), -1, dtype=torch.long, device=device)
    # every kept node, in the order kept (depth after depth): code, score, rank among siblings, parent's pool
    # index + 1 (0: the root), depth; `place_of`: column 1 + i holds pool node i's place in the heap's order, and
    # column 0 the root's, -1
    pool_codes = pool_scores = pool_ranks = pool_parents = pool_depths = None
    place_of = torch.full((num_rows, 1), -1, dtype=torch.long, device=device)
    for depth in range(depths):
        width = frontier_codes.shape[1]
        slot = frontier_codes % stride
        rows_of = (slot - 1).clamp(min=0)[:, :, None].expand(-1, -1, top_k)
        parent_scores = frontier_scores.masked_fill(slot == 0, float("-inf"))[:, :, None]
        scores = torch.minimum(parent_scores + log_probs[:, depth].gather(1, rows_of),
                               parent_scores.nextafter(neg_inf))  # [R, F, K]
        # rank-major, parent-minor: a stable sort by score is the heap's order among this depth's candidates
        scores = scores.transpose(1, 2).reshape(num_rows, -1)
        candidates = codes[:, depth].gather(1, rows_of).transpose(1, 2).reshape(num_rows, -1)
        order = scores.argsort(dim=1, descending=True, stable=True)[:, :keep]
        count = order.shape[1]
        frontier_scores = scores.gather(1, order)
        frontier_codes = candidates.gather(1, order)
        ranks = order.div(width, rounding_mode="floor")
        parents = frontier_index.gather(1, order - ranks * width) + 1
        base = 0 if pool_codes is None else pool_codes.shape[1]
        frontier_index = positions[base : base + count].expand(num_rows, -1)
        if pool_codes is None:  # the first depth: its order is the heap's
            pool_codes, pool_scores, pool_ranks, pool_parents = frontier_codes, frontier_scores, ranks, parents
            pool_depths = torch.ones_like(order)
            place_of = torch.cat([place_of, frontier_index], dim=1)
            continue
        pool_codes = torch.cat([pool_codes, frontier_codes], dim=1)
        pool_scores = torch.cat([pool_scores, frontier_scores], dim=1)
        pool_ranks = torch.cat([pool_ranks, ranks], dim=1)
        pool_parents = torch.cat([pool_parents, parents], dim=1)
        pool_depths = torch.cat([pool_depths, torch.full_like(order, depth + 1)], dim=1)
        # the heap key: score (descending), then rank, then the parent's place (stable sorts, least significant first)
        tie_key = pool_ranks * (pool_size + 2) + place_of.gather(1, pool_parents)
        by_tie = tie_key.argsort(dim=1, stable=True)
        heap_order = by_tie.gather(1, pool_scores.gather(1, by_tie).argsort(dim=1, descending=True, stable=True))
        place_of = torch.cat([place_of[:, :1], torch.empty_like(heap_order).scatter_(
            1, heap_order, positions[: heap_order.shape[1]].expand(num_rows, -1))], dim=1)
    if depths == 1:
        heap_order = positions[: pool_codes.shape[1]].expand(num_rows, -1)
    chosen = heap_order[:, :keep]  # [R, B-1]: the tree's nodes below the root, in the search's order
    root = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
    return (
        torch.cat([root_tokens[:, None], pool_codes.gather(1, chosen).div(stride, rounding_mode="floor")], dim=1),
        torch.cat([root - 1, place_of.gather(1, pool_parents.gather(1, chosen)) + 1], dim=1),
        torch.cat([root, pool_depths.gather(1, chosen)], dim=1),
        torch.cat([torch.zeros(num_rows, 1, device=device), pool_scores.gather(1, chosen).float()], dim=1),
    )


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
) -> DraftTree:
    """Best-first search for the `budget`-node tree maximising the sum of path probabilities.

    `children_of(depth, token)` gives the top-K children of a node carrying `token` at `depth` (the root has
    depth 0), or None for a leaf. Path scores only fall along a path, so the popped set is prefix-closed and is
    the optimal tree for the drafter's own estimate of expected accepted length. Each pop pushes at most two
    entries (the node's next sibling and its best child), so the loop runs `budget - 1` times.
    """
    node_tokens, node_parents, node_depths, node_scores = [root_token], [-1], [0], [0.0]
    heap: list[tuple[float, int, int, list[int], list[float]]] = []  # (-score, rank, parent, child list)

    def push_first_child(node: int) -> None:
        depth = node_depths[node]
        if depth >= max_depth:
            return
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
