"""The accept step of the pipeline: walk the verified tree and decide what the target itself emits.

Greedy: at each node take the target's argmax; sampling: draw from the target's processed distribution.
Move to the child carrying that token, else stop: the token drawn at the last node is the bonus token.
Every emitted token is the target's own choice, so the output is exactly the target's (token-identical
under greedy, same distribution under sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree, TreeBatch


def choose_token(processed_logits: torch.Tensor, do_sample: bool) -> int:
    """The target's own next token from processed logits `[1, V]`: a sample, or the argmax."""
    if do_sample:
        return int(torch.multinomial(torch.softmax(processed_logits, dim=-1), 1))
    return int(processed_logits.argmax(dim=-1))


@dataclass
class Acceptance:
    """path: indices of the accepted nodes below the root, in order; tokens: the emitted tokens (the accepted
    nodes' tokens, then the bonus token); visited: the node at which each token was chosen (`[0] + path`);
    scores: per emitted token, the processed target logits `[1, V]` it was chosen from, or None when they are
    row `row` of the batch's `batch_scores [R, N, V]` (sliced only when asked: `token_scores`)."""

    path: list[int]
    tokens: list[int]
    visited: list[int]
    scores: list[torch.Tensor] | None = None
    batch_scores: torch.Tensor | None = None
    row: int = 0

    def token_scores(self, index: int) -> torch.Tensor:
        """The processed logits `[1, V]` the `index`-th emitted token was chosen from."""
        if self.scores is not None:
            return self.scores[index]
        node = self.visited[index]
        return self.batch_scores[self.row, node : node + 1]


def row_wise_processor_types() -> tuple[type, ...]:
    """transformers' logits processors whose output row depends on that row's scores alone (no per-row settings
    indexed by batch position, no sequence): sampling's temperature, top-k, top-p, min-p, typical, epsilon, eta."""
    from transformers.generation import logits_process as lp

    names = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
             "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper")
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


class RowProcessor:
    """`generate()`'s logits processors applied to one row of the original batch.

    transformers' processors are batch-aware: some hold per-row settings indexed by batch position (a repetition
    penalty's per-row prompt lengths, for one) and expect every row of the batch. Rows here advance at different
    speeds and leave the batch when they finish, so each row is processed at its own length, in a call shaped like
    the original batch whose other rows are copies of it; its own row of the result is kept. When every processor
    is row-wise (`row_wise_processor_types`: plain sampling settings) a row is processed alone, `[1, V]`: the same
    values without B copies of the vocabulary per node."""

    def __init__(self, logits_processor, batch_size: int):
        self.logits_processor = logits_processor
        self.batch_size = batch_size
        row_wise = row_wise_processor_types()
        self.row_wise = logits_processor is None or all(type(p) in row_wise for p in logits_processor)

    def __len__(self) -> int:
        return len(self.logits_processor) if self.logits_processor is not None else 0

    def __call__(self, row: int, sequence: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores `[1, V]` of original row `row`, whose tokens so far are `sequence [1, S]`."""
        if self.batch_size == 1 or self.row_wise:
            return self.logits_processor(sequence, scores)
        processed = self.logits_processor(sequence.expand(self.batch_size, -1),
                                          scores.expand(self.batch_size, -1).clone())
        return processed[row : row + 1]


def walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    committed_ids: torch.LongTensor,
    process,
    do_sample: bool,
) -> Acceptance:
    """logits: `[N, V]` target logits per node; committed_ids: `[1, S]` tokens up to and including the root;
    process: `process(sequence [1, S'], scores [1, V]) -> [1, V]` the logits processors, or None.

    Logits processors see, at each node, exactly the sequence the target would have generated there.
    """
    children = tree.children()
    has_processors = process is not None
    greedy_choice = None
    if not has_processors and not do_sample:
        # No processor depends on the path: every node's choice is its argmax, computed at once.
        greedy_choice = logits.argmax(dim=-1).tolist()
    node, path, tokens, visited, scores = 0, [], [], [], []
    sequence = committed_ids
    while True:
        node_logits = logits[node : node + 1]  # [1, V]
        if greedy_choice is not None:
            processed, token = node_logits, greedy_choice[node]
        else:
            processed = process(sequence, node_logits.clone()) if has_processors else node_logits
            token = choose_token(processed, do_sample)
        tokens.append(token)
        visited.append(node)
        scores.append(processed)
        child = children[node].get(token)
        if child is None:
            return Acceptance(path, tokens, visited, scores)
        path.append(child)
        node = child
        if has_processors:
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)


def greedy_accept(trees: TreeBatch, logits: torch.Tensor) -> list[Acceptance]:
    """Greedy acceptance of every row at once (no logits processors): the target's token at every node is its
    argmax. logits: `[R, N, V]`. Returns one `Acceptance` per row (scores are the raw node logits `[1, V]`)."""
    return accept_choices(trees, logits.argmax(dim=-1), logits)


def sampled_accept(trees: TreeBatch, logits: torch.Tensor, processor) -> list[Acceptance]:
    """Sampled acceptance of every row at once, for logits processors that read the scores alone (temperature,
    top-k, top-p, ...: `RowProcessor.row_wise`): the target's token is drawn at every node at once from its
    processed distribution, and the walk follows the draws. Each node's draw is independent of the others and
    used only where the walk reaches that node, so the emitted tokens are distributed exactly as drawing them one
    node after the other: the target's own distribution. logits: `[R, N, V]`; processor: the `LogitsProcessorList`
    (None or empty: plain softmax sampling)."""
    num_rows, width, vocab = logits.shape
    processed = logits
    if processor is not None and len(processor):
        flat = logits.reshape(num_rows * width, vocab).clone()
        processed = processor(flat.new_zeros(num_rows * width, 1, dtype=torch.long), flat).view(num_rows, width, vocab)
    probs = torch.softmax(processed.float(), dim=-1).view(num_rows * width, vocab)
    draws = torch.multinomial(probs, 1).view(num_rows, width)
    return accept_choices(trees, draws, processed)


def accept_choices(trees: TreeBatch, choice: torch.LongTensor, scores: torch.Tensor) -> list[Acceptance]:
    """Acceptance of every row given the target's token at every node, `choice [R, N]`: a node is accepted when
    its token is its parent's choice and its parent is accepted (siblings carry distinct tokens, so the accepted
    nodes of a row form one path, one node per depth); the choice at the last accepted node is the bonus token.
    scores: `[R, N, V]`, the logits each choice was made from. The host reads the step's outcome once."""
    num_rows, width = trees.tokens.shape
    choice = choice.to(trees.tokens.device)
    parent_choice = choice.gather(1, trees.parents.clamp(min=0))
    matches = trees.valid & (trees.parents >= 0) & (trees.tokens == parent_choice)  # [R, N]
    fails = ~(matches | (trees.parents < 0))  # the root never fails; a padding node always does
    accepted = matches & ~(trees.ancestor_matrix() & fails[:, None, :]).any(dim=-1)  # [R, N]
    accepted_len = accepted.sum(dim=1, keepdim=True)  # [R, 1]
    # visited[r, d]: the node chosen at depth d of the path (the root at 0); past the path, the root again
    nodes = torch.arange(width, device=choice.device).expand(num_rows, width)
    visited = torch.zeros(num_rows, width + 1, dtype=torch.long, device=choice.device)
    visited = visited.scatter(1, torch.where(accepted, trees.depths, width), nodes)[:, :width]
    emitted = choice.gather(1, visited)  # each path node's choice: the next node's token, then the bonus token
    outcome = torch.cat([accepted_len, visited, emitted], dim=1).tolist()  # [R, 1 + 2N]: the one read
    results = []
    for row, values in enumerate(outcome):
        count = values[0]
        visited_row = values[1 : count + 2]
        results.append(Acceptance(visited_row[1:], values[1 + width : count + 2 + width], visited_row,
                                  batch_scores=scores, row=row))
    return results
