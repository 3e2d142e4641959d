"""The verify step of the pipeline: one target forward over every row's tree, with a tree attention mask.

`R` rows, `N` nodes per row (padded), `P` slots already in the target cache, `V` vocabulary.
"""

from __future__ import annotations

import logging
import weakref

import torch
from transformers import DynamicCache

from .kernels import engine_kernels
from .trace import TARGET_FORWARD, VERIFY, traced
from .tree import DraftTree, TreeBatch, root_tree

logger = logging.getLogger(__name__)
NOT_QUANTIZED = "none found"  # what `quantization_backend` says of a dense target


def tree_attention_mask(trees: TreeBatch, key_valid: torch.BoolTensor | None, past_len: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask `[R, 1, N, P + N]`: every node sees its row's valid past slots, its ancestors and itself.

    key_valid: `[R, P]` true for cache slots that may be attended (not padding, not a dropped tree node), or None
    for all. A float mask (not bool) because eager attention adds the mask to the scores.
    """
    allowed_tree = trees.ancestor_matrix()  # [R, N, N]
    rows, n = trees.tokens.shape
    device = allowed_tree.device
    if key_valid is None:
        allowed_past = torch.ones(rows, n, past_len, dtype=torch.bool, device=device)
    else:
        allowed_past = key_valid.to(device)[:, None, :].expand(rows, n, past_len)
    allowed = torch.cat([allowed_past, allowed_tree], dim=-1)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


@torch.no_grad()
@traced(VERIFY)
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
    position_ids = root_positions.to(device)[:, None] + trees.depths.to(device)  # [R, N]
    if key_valid is None and trees.is_uniform_chain():
        mask = None  # the causal mask the model builds itself is this tree's mask (cheaper, and exact)
    else:
        mask = tree_attention_mask(trees, key_valid, cache.get_seq_length(), target.dtype).to(device)
    out = run_target(target, tokens, position_ids, mask, cache, target_layer_ids, logits_to_keep=0)
    return out.logits.float().to(device), out.hidden_states


@traced(TARGET_FORWARD)
def run_target(target, input_ids, position_ids, attention_mask, cache, target_layer_ids: list[int],
               logits_to_keep: int):
    """One cached target forward that also returns the context layers' hidden states (prefill and verify), run on
    the engine's kernels where they apply (`kernels.engine_kernels`)."""
    with engine_kernels(target):
        return target(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=[i + 1 for i in target_layer_ids],
            logits_to_keep=logits_to_keep,
        )


def same_logits(first: torch.Tensor, second: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether logits `[..., V]` agree up to rounding for a model computing in `dtype`: within 1e-4 (float32), or
    8 epsilons of a narrower dtype, of the larger of 1 and the largest logit."""
    scale = max(1.0, float(second.float().abs().max()))
    return float((first.float() - second.float()).abs().max()) <= max(1e-4, 8 * torch.finfo(dtype).eps) * scale


@torch.no_grad()
def logits_alone_and_in_tree(target, tokens: torch.LongTensor, target_layer_ids: list[int], device: torch.device,
                             tree_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits `[S, V]` for the chain `tokens [S]` (from position 0, S < tree_size) twice: decoded one
    token per forward, the way plain decoding runs, and all in one forward of a `tree_size`-node tree made of the
    chain (rooted at its first token) and branches hanging off it (tokens spread over the vocabulary). Equal for a
    model whose logits for a token do not depend on the other tokens of the forward."""
    alone, cache = [], DynamicCache(config=target.config)
    for position, token in enumerate(tokens.tolist()):
        logits, _ = verify_trees(target, TreeBatch.pack([root_tree(token)]), cache, torch.tensor([position]), None,
                                 target_layer_ids, device)
        alone.append(logits[0, 0])
    chain, branches = len(tokens), tree_size - len(tokens)
    vocab_size = target.config.get_text_config().vocab_size
    parents = [-1] + list(range(chain - 1)) + [branch % chain for branch in range(branches)]
    tree = DraftTree(torch.cat([tokens.cpu(), torch.arange(branches) * (vocab_size // branches)]),
                     torch.tensor(parents), torch.tensor(list(range(chain)) + [p + 1 for p in parents[chain:]]),
                     torch.zeros(tree_size))
    in_tree, _ = verify_trees(target, TreeBatch.pack([tree]), DynamicCache(config=target.config),
                              torch.tensor([0]), None, target_layer_ids, device)
    return torch.stack(alone), in_tree[0, :chain]


def forward_shape_difference(target, prompt: torch.LongTensor, target_layer_ids: list[int], device: torch.device
                             ) -> tuple[bool, float]:
    """Whether the last (at most 4) tokens of `prompt [S]` get the same logits alone as inside a tree
    (`logits_alone_and_in_tree`, up to the rounding of the target's dtype), and the largest difference."""
    alone, in_tree = logits_alone_and_in_tree(target, prompt[-4:], target_layer_ids, device)
    return same_logits(in_tree, alone, target.dtype), float((in_tree - alone).abs().max())


_CHECKED_TARGETS: weakref.WeakSet = weakref.WeakSet()


def check_forward_shapes(target, prompt: torch.LongTensor, target_layer_ids: list[int], device: torch.device) -> None:
    """Once per target (its first TreeFlash call): warn when a token's logits depend on the other tokens of the
    forward, as some quantized kernels make them (activation quantization, outlier handling, repacked low-precision
    matmuls). Tree verification then cannot always reproduce the model's own one-token decoding. Costs five small
    forwards on the last (at most 4) tokens of `prompt [S]`."""
    if target in _CHECKED_TARGETS:
        return
    _CHECKED_TARGETS.add(target)
    stable, difference = forward_shape_difference(target, prompt, target_layer_ids, device)
    if not stable:
        logger.warning(
            "TreeFlash: this target (quantization: %s) gives a token different logits alone than inside a tree "
            "(by up to %.3g): outputs may differ from this model's own one-token decoding at near-ties; this "
            "backend's kernels make a token's logits depend on the other tokens in the forward. Weight-only "
            "quantization (e.g. torchao Int8WeightOnlyConfig, optimum-quanto, HQQ) does not.",
            quantization_backend(target), difference,
        )


def quantization_backend(target) -> str:
    """What quantizes `target`, for messages: its `quantization_config` (method and kind), else the classes of its
    quantized modules and weights (quantized without transformers, e.g. `torchao.quantize_` or HQQ directly)."""
    config = getattr(target.config, "quantization_config", None)
    if isinstance(config, dict):
        return str(config.get("quant_method", "unknown"))
    if config is not None:
        method = getattr(config.quant_method, "value", config.quant_method)
        kind = getattr(config, "quant_type", None) or getattr(config, "weights", None)
        if hasattr(config, "quantization_method"):  # bitsandbytes: "llm_int8", "nf4" or "fp4"
            kind = config.quantization_method()
        kind = kind if kind is None or isinstance(kind, str) else type(kind).__name__
        return f"{method} {kind}" if kind else str(method)
    plain = (torch.Tensor, torch.nn.Parameter)
    found = {type(module) for module in target.modules()
             if "Linear" in type(module).__name__ and type(module) is not torch.nn.Linear}
    found |= {type(module.weight) for module in target.modules()
              if isinstance(getattr(module, "weight", None), torch.Tensor) and type(module.weight) not in plain}
    names = sorted(f"{cls.__module__.split('.')[0]}.{cls.__name__}" for cls in found)
    return ", ".join(names) if names else NOT_QUANTIZED
