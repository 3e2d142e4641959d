"""Stage 4 of the pipeline: one target forward over every row's tree, with a tree attention mask.

`R` rows, `N` nodes per row (padded), `P` slots already in the target cache, `V` vocabulary.
"""

from __future__ import annotations

import torch

from .tree import TreeBatch


def tree_attention_mask(trees: TreeBatch, key_valid: torch.BoolTensor | None, past_len: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask `[R, 1, N, P + N]`: every node sees its row's valid past slots, its ancestors and itself.

    key_valid: `[R, P]` true for cache slots that may be attended (not padding, not a dropped tree node), or None
    for all. A float mask (not bool) because eager attention adds the mask to the scores.
    """
    allowed_tree = trees.ancestor_matrix()  # [R, N, N]
    rows, n = trees.tokens.shape
    if key_valid is None:
        allowed_past = torch.ones(rows, n, past_len, dtype=torch.bool)
    else:
        allowed_past = key_valid.cpu()[:, None, :].expand(rows, n, past_len)
    allowed = torch.cat([allowed_past, allowed_tree], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


@torch.no_grad()
def verify_trees(
    target,
    trees: TreeBatch,
    cache,
    root_positions: torch.LongTensor,
    key_valid: torch.BoolTensor | None,
    target_layer_ids: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, tuple]:
    """Run the target once on every row's flattened tree; `root_positions [R]` are the rows' root positions (their
    own counts of real tokens). Returns logits `[R, N, V]` (float32, on `device`) and the hidden-states tuple
    (entries `i + 1` for `i` in `target_layer_ids` are `[R, N, H]`)."""
    tokens = trees.tokens.to(device)
    position_ids = (root_positions[:, None] + trees.depths).to(device)  # [R, N]
    if key_valid is None and trees.is_uniform_chain():
        mask = None  # the causal mask the model builds itself is this tree's mask (cheaper, and exact)
    else:
        mask = tree_attention_mask(trees, key_valid, cache.get_seq_length(), target.dtype).to(device)
    out = run_target(target, tokens, position_ids, mask, cache, target_layer_ids, logits_to_keep=0)
    return out.logits.float().to(device), out.hidden_states


def run_target(target, input_ids, position_ids, attention_mask, cache, target_layer_ids: list[int],
               logits_to_keep: int):
    """One cached target forward that also returns the context layers' hidden states (prefill and verify)."""
    return target(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        logits_to_keep=logits_to_keep,
    )
