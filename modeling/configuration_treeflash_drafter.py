# Copyright 2026 The treeflash-hf authors. Apache-2.0.
"""Configuration of the TreeFlash drafter (a DFlash block drafter plus an AR-approximation layer).

This file travels to the Hub as remote code: it imports only torch and transformers.
"""

from transformers import PreTrainedConfig

TREE_MODES = ("chain", "marginal_tree", "treeflash")
AR_TYPES = ("swiglu", "linear")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule for the target layers whose outputs feed the drafter.

    One layer: the middle one. Otherwise `num_draft_layers` ids spread as
    `round(1 + i * (L - 4) / (n - 1))`, e.g. `[1, 9, 17, 25, 33]` for L=36, n=5 (targets too shallow for
    that rule get ids spread over all layers, `round(i * (L - 1) / (n - 1))`).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    if span < num_draft_layers - 1:  # too shallow for the rule: spread over all layers instead
        start, span = 0, num_target_layers - 1
    else:
        start = 1
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class TreeFlashDrafterConfig(PreTrainedConfig):
    r"""Configuration of a [`TreeFlashDrafterModel`].

    The drafter runs at the target's width and reuses the target's input embeddings and `lm_head`, so
    `hidden_size` and `vocab_size` are the target's.

    Args:
        vocab_size (`int`): the target's vocabulary size (rows of its embedding table and `lm_head`).
        hidden_size (`int`): the target's hidden size; the drafter's layers run at this width.
        intermediate_size (`int`): width of each drafter layer's SwiGLU MLP.
        num_hidden_layers (`int`): number of drafter decoder layers (DFlash uses 5).
        num_attention_heads (`int`), num_key_value_heads (`int`), head_dim (`int`): drafter attention shape.
        hidden_act (`str`): MLP activation (`"silu"`).
        max_position_embeddings (`int`): longest position the rotary embedding is meant for.
        rms_norm_eps (`float`): epsilon of every RMSNorm.
        rope_theta (`float`): RoPE base; should equal the target's.
        attention_bias (`bool`): bias on the q/k/v/o projections (False for Qwen3).
        attention_dropout (`float`): dropout on attention probabilities during training.
        initializer_range (`float`): std of the normal init of linear layers.
        block_size (`int`): γ, tokens per drafted block: the anchor (bonus) token plus `block_size - 1` masks.
        mask_token_id (`int`): id of the reserved mask token inside the target's embedding table.
        num_target_layers (`int`): number of decoder layers of the target.
        target_layer_ids (`list[int]`): 0-based target layers whose *outputs* (`hidden_states[id + 1]` in
            transformers) form the context features; defaults to DFlash's spread over `num_target_layers`.
        ar_type (`str`): the AR-approximation layer, `"swiglu"` (the paper's) or `"linear"` (ablation).
        ar_num_prev_tokens (`int`): previous tokens the AR layer conditions on, 1 (the paper's) or 2 (ablation).
        ar_intermediate_size (`int`): inner width of the AR layer; defaults to `intermediate_size`.
        tree_mode (`str`): default decoding mode: `"chain"` (DFlash), `"marginal_tree"` (DDTree) or
            `"treeflash"`.
        tree_budget (`int` or `"auto"`): default number of tokens the target verifies per step,
            **including the root** (so 16 means the root plus 15 drafted tokens).
        tree_top_m (`int`): M, tokens kept per depth in the stage-1 top tree (each gets an AR row).
        tree_top_k (`int`): K, children kept per (depth, previous token) in the stage-2 tables.
            (Named `tree_top_k`, not `top_k`, because `top_k` is a sampling setting of `GenerationConfig`.)
        tree_lookup (`int`): length of the lookup branch (the tokens that followed the last earlier occurrence of
            the sequence's ending) added to the tree; steps where it alone is worth verifying skip the drafter.
            0 turns it off. Tree modes only.
        draft_vocab_size (`int`, optional): how many tokens the drafter drafts from: the target's head scores
            drafts on these rows only (the model's `draft_token_ids` buffer, the most frequent tokens of the
            drafter's training data), which on a CPU makes the head's product several times cheaper for a small
            loss of acceptance. None: the whole vocabulary. Verification always uses the full head (lossless).
    """

    model_type = "treeflash_drafter"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 40960,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1_000_000.0,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        block_size: int = 16,
        mask_token_id: int = 151669,
        num_target_layers: int = 36,
        target_layer_ids: list[int] | None = None,
        ar_type: str = "swiglu",
        ar_num_prev_tokens: int = 1,
        ar_intermediate_size: int | None = None,
        tree_mode: str = "treeflash",
        tree_budget: int | str = 64,
        tree_top_m: int = 16,
        tree_top_k: int = 16,
        tree_lookup: int = 32,
        draft_vocab_size: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.num_target_layers = num_target_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        self.target_layer_ids = list(target_layer_ids)
        self.ar_type = ar_type
        self.ar_num_prev_tokens = ar_num_prev_tokens
        self.ar_intermediate_size = ar_intermediate_size if ar_intermediate_size is not None else intermediate_size
        self.tree_mode = tree_mode
        self.tree_budget = tree_budget
        self.tree_top_m = tree_top_m
        self.tree_top_k = tree_top_k
        self.tree_lookup = tree_lookup
        self.draft_vocab_size = draft_vocab_size
        # Read by transformers' cache classes (the drafter keeps a DFlash-style K/V cache).
        self.layer_types = ["full_attention"] * num_hidden_layers
        self.sliding_window = None
        kwargs.pop("layer_types", None)
        kwargs.pop("sliding_window", None)
        super().__init__(**kwargs)
        self._validate_treeflash()

    def _validate_treeflash(self) -> None:
        problems = []
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (got {self.block_size})")
        if not self.target_layer_ids:
            problems.append("target_layer_ids must name at least one target layer")
        elif min(self.target_layer_ids) < 0 or max(self.target_layer_ids) >= self.num_target_layers:
            problems.append(
                f"target_layer_ids {self.target_layer_ids} must lie in [0, num_target_layers={self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.ar_type not in AR_TYPES:
            problems.append(f"ar_type must be one of {AR_TYPES} (got {self.ar_type!r})")
        if self.ar_num_prev_tokens not in (1, 2):
            problems.append(f"ar_num_prev_tokens must be 1 or 2 (got {self.ar_num_prev_tokens})")
        if self.tree_mode not in TREE_MODES:
            problems.append(f"tree_mode must be one of {TREE_MODES} (got {self.tree_mode!r})")
        if not isinstance(self.tree_lookup, int) or self.tree_lookup < 0:
            problems.append(f"tree_lookup must be an integer >= 0 (got {self.tree_lookup!r})")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size must lie in [1, vocab_size={self.vocab_size}] or be None "
                            f"(got {self.draft_vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if problems:
            raise ValueError("Invalid TreeFlashDrafterConfig: " + "; ".join(problems) + ".")


__all__ = ["TreeFlashDrafterConfig", "default_target_layer_ids"]
