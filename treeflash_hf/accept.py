"""Stage 5 of the pipeline: walk the verified tree and decide what the target itself emits.

Greedy: at each node take the target's argmax; sampling: draw from the target's processed distribution.
Move to the child carrying that token, else stop: the token drawn at the last node is the bonus token.
Every emitted token is the target's own choice, so the output is exactly the target's (token-identical
under greedy, same distribution under sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


def choose_token(processed_logits: torch.Tensor, do_sample: bool) -> int:
    """The target's own next token from processed logits `[1, V]`: a sample, or the argmax."""
    if do_sample:
        return int(torch.multinomial(torch.softmax(processed_logits, dim=-1), 1))
    return int(processed_logits.argmax(dim=-1))


@dataclass
class Acceptance:
    """path: indices of the accepted nodes below the root, in order; tokens: the emitted tokens (the accepted
    nodes' tokens, then the bonus token); visited: the node at which each token was chosen (`[0] + path`);
    scores: per emitted token, the processed target logits `[1, V]` it was chosen from."""

    path: list[int]
    tokens: list[int]
    visited: list[int]
    scores: list[torch.Tensor]


def walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    committed_ids: torch.LongTensor,
    logits_processor,
    do_sample: bool,
) -> Acceptance:
    """logits: `[N, V]` target logits per node; committed_ids: `[1, S]` tokens up to and including the root.

    Logits processors see, at each node, exactly the sequence the target would have generated there.
    """
    children = tree.children()
    has_processors = logits_processor is not None and len(logits_processor) > 0
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
            processed = logits_processor(sequence, node_logits.clone()) if has_processors else node_logits
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
