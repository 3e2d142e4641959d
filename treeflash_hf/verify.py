"""Stage 4 of the pipeline: one target forward over the whole tree with a tree attention mask.

`N` tree nodes, `P` committed positions already in the target cache, `V` vocabulary.
"""

from __future__ import annotations

import torch

from .tree import DraftTree


def tree_attention_mask(
    tree: DraftTree, past_key_mask: torch.BoolTensor | None, past_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive float mask `[1, 1, N, P + N]`: every node sees the allowed past, its ancestors and itself.

    past_key_mask: `[P]` true for past positions that may be attended (padding false), or None for all.
    A float mask (not bool) because eager attention adds the mask to the scores.
    """
    allowed_tree = tree.ancestor_matrix()  # [N, N]
    n = tree.size
    device = tree.tokens.device
    if past_key_mask is None:
        allowed_past = torch.ones(n, past_len, dtype=torch.bool, device=device)
    else:
        allowed_past = past_key_mask[None, :].expand(n, past_len)
    allowed = torch.cat([allowed_past, allowed_tree], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def verify_tree(
    target,
    tree: DraftTree,
    cache,
    past_len: int,
    root_position: int,
    past_key_mask: torch.BoolTensor | None,
    target_layer_ids: list[int],
) -> tuple[torch.Tensor, tuple]:
    """Run the target once on the flattened tree. Returns logits `[N, V]` (float32) and the hidden-states tuple
    (entries `i + 1` for `i` in `target_layer_ids` are `[1, N, H]`)."""
    device = target.get_input_embeddings().weight.device  # where inputs go (cheaper than `target.device`)
    tokens = tree.tokens.to(device)[None]  # [1, N]
    position_ids = (root_position + tree.depths.to(device))[None]  # [1, N]
    if past_key_mask is None and tree.is_chain():
        mask = None  # the causal mask the model builds itself is this tree's mask (cheaper, and exact)
    else:
        mask = tree_attention_mask(tree, past_key_mask, past_len, target.dtype).to(device)
    out = run_target(target, tokens, position_ids, mask, cache, target_layer_ids, logits_to_keep=0)
    return out.logits[0].float(), out.hidden_states


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
