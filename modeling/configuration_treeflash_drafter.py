# Copyright 2026 The treeflash-hf authors. Apache-2.0.
"""Configuration of the TreeFlash drafter (a DFlash block drafter plus an AR-approximation layer).

This file travels to the Hub as remote code: it imports only torch and transformers.
"""

from transformers import PreTrainedConfig

TREE_MODES = ("chain", "marginal_tree", "treeflash")
AR_TYPES = ("swiglu", "linear")
# RoPE variants the drafter computes through transformers' own functions (`ROPE_INIT_FUNCTIONS`, `dynamic_rope_update`)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
        rope_parameters (`dict`, optional): a scaled RoPE in transformers' format (`rope_type` one of `"linear"`,
            `"dynamic"`, `"yarn"`, `"llama3"`, `"longrope"`, plus that type's keys, e.g. `factor` and
            `original_max_position_embeddings` for YaRN); its frequencies and attention scaling come from transformers'
            own `ROPE_INIT_FUNCTIONS`. None (or `rope_type: "default"`): plain RoPE with `rope_theta`. The legacy
            `rope_scaling` key is read the same way.
        layer_types (`list[str]`, optional): per drafter layer, `"full_attention"` (default) or `"sliding_attention"`.
        sliding_window (`int`, optional): the window of the sliding layers: a block query at position `p` sees only the
            keys at positions `p - sliding_window < k` (context and block alike), as z-lab's DFlash computes it.
        is_causal (`bool`, optional): whether block queries also see only the block keys at or before their own
            position. None: z-lab's rule, causal exactly on the sliding layers; False: bidirectional inside the block
            everywhere (our drafters' default); True: causal everywhere.
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
        ar_rms_norm_eps (`float`, optional): epsilon of the AR layer's own norm; defaults to `rms_norm_eps` (the
            TreeFlash authors' release fixes it at 1e-6).
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
        rope_parameters: dict | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        is_causal: bool | None = None,
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
        ar_rms_norm_eps: float | None = None,
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
        # A scaled RoPE is kept as transformers' `rope_parameters` (standardized by `PreTrainedConfig.__init__`); plain
        # RoPE stays the single `rope_theta` our own folders have always carried.
        rope = dict(rope_parameters or kwargs.pop("rope_scaling", None) or {})
        kwargs.pop("rope_scaling", None)
        if "type" in rope:  # the legacy spelling of `rope_type`
            rope.setdefault("rope_type", rope.pop("type"))
        self.rope_theta = rope.setdefault("rope_theta", rope_theta)
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            self.rope_parameters = rope
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
        self.ar_rms_norm_eps = ar_rms_norm_eps
        self.tree_mode = tree_mode
        self.tree_budget = tree_budget
        self.tree_top_m = tree_top_m
        self.tree_top_k = tree_top_k
        self.tree_lookup = tree_lookup
        self.draft_vocab_size = draft_vocab_size
        # Also read by transformers' cache classes (a sliding layer gets a sliding cache layer there; the TreeFlash
        # engine keeps every slot in every layer and the drafter masks its windows itself).
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.sliding_window = sliding_window
        self.is_causal = is_causal
        # Which published layout this config was read from ("dflash", "treeflash-release"; None: ours) and whether
        # that layout declares an AR layer. Never saved: a converted folder is in our layout.
        self._checkpoint_layout = kwargs.pop("_checkpoint_layout", None)
        self._checkpoint_has_ar = kwargs.pop("_checkpoint_has_ar", None)
        try:
            super().__init__(**kwargs)
        except KeyError as err:  # transformers' RoPE validation names the missing keys of a scaled RoPE
            raise ValueError(f"Invalid TreeFlashDrafterConfig: rope_parameters {rope}: {err}.") from err
        self._validate_treeflash()

    def to_dict(self) -> dict:
        output = super().to_dict()
        output.pop("_checkpoint_layout", None)
        output.pop("_checkpoint_has_ar", None)
        return output

    def layer_attention(self, layer_idx: int) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of drafter layer `layer_idx`."""
        sliding = self.layer_types[layer_idx] == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also reads the published layouts (z-lab DFlash, the TreeFlash authors' release; see
        `published_config_dict`)."""
        if checkpoint_layout(config_dict) is not None:
            config_dict = published_config_dict(config_dict)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """The config dict of a folder or Hub repo, a published layout already mapped to ours (so transformers' own
        loading, `from_pretrained` included, sees a TreeFlash drafter config)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if checkpoint_layout(config_dict) is not None:
            config_dict = published_config_dict(config_dict)
        return config_dict, kwargs

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
        problems += self._rope_problems()
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            problems.append(f"layer_types must give one of {LAYER_TYPES} per layer ({self.num_hidden_layers} layers; "
                            f"got {self.layer_types})")
        elif "sliding_attention" in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            problems.append(f"sliding_attention layers need sliding_window, an integer >= 1 (got {self.sliding_window!r})")
        if self.is_causal not in (None, True, False):
            problems.append(f"is_causal must be true, false or null (got {self.is_causal!r})")
        if problems:
            raise ValueError("Invalid TreeFlashDrafterConfig: " + "; ".join(problems) + ".")

    def _rope_problems(self) -> list[str]:
        rope = getattr(self, "rope_parameters", None)
        if not rope:
            return []
        if any(isinstance(value, dict) for value in rope.values()):
            return [f"per-layer-type rope_parameters {rope} are not supported (one RoPE for every layer)"]
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            return [f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"]
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return [f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported (the drafter rotates the "
                    "whole head)"]
        try:
            self.validate_rope()
        except (KeyError, ValueError) as err:
            return [f"rope_parameters {rope}: {err}"]
        return []


# ---- published layouts ---------------------------------------------------------------------------------------------
# z-lab DFlash (`dflash/model.py`; also SpecForge and speculators exports in its layout): a Qwen3 config (the drafter
# builds its rotary embedding and per-layer attention from it) plus `block_size`, `num_target_layers` and
# `dflash_config.{mask_token_id, target_layer_ids}` (each also read at the top level); weights without prefix, no AR
# layer. The TreeFlash authors' release (ETH-DISCO/TreeFlash `tree_flash.py`): the same config plus
# `treeflash_config.{ar_approximation, candidate_tokens}` with top-level fallbacks, `ar_approximation` "swiglu" or null
# (null: a plain DFlash drafter); backbone weights under `model.`, the AR layer as `ar_approximation.{ug, d, norm}`
# with its inner width the config's `intermediate_size` and its norm's epsilon fixed at 1e-6.

# Decoding defaults of a loaded published drafter: the publisher's, not ours (our lookup branch and budget "auto" are
# a choice to make per call or in the drafter's generation_config). The release drafts a best-first tree of
# `candidate_tokens` nodes counting the root (its `spec_generate(tree_size=None)` default; its README runs
# tree_size=64), from the top 16 tokens per depth (`m_initial_token_embds`) and the top 16 children per AR row
# (`topk_candidates`); with a null AR layer that is a tree on the marginals. z-lab's checkpoints get the same tree on
# their marginals (the DDTree reading of DFlash; `tree_mode="chain"` is DFlash's own linear verification).
RELEASE_TREE_SIZE = 64  # the release README's `tree_size`, used when the config names no `candidate_tokens`
PUBLISHED_TOP_M = 16
PUBLISHED_TOP_K = 16

# dflash_config keys that do not change what the drafter computes (training settings) ...
DFLASH_TRAINING_KEYS = ("num_anchors", "loss_decay_gamma", "num_target_layers")
# ... and keys z-lab reads that do, accepted only at their no-op value.
DFLASH_NO_OP_VALUES = {"input_embedding_scale": (1, 1.0), "output_multiplier": (1, 1.0),
                       "final_logit_softcapping": (None, 0, 0.0), "attention_sink_bias": (None, False),
                       "use_swa": (None, False)}
QWEN3_ONLY_KEYS = ("dflash_config", "treeflash_config", "auto_map", "architectures", "model_type", "ar_approximation",
                   "candidate_tokens", "transformers_version", "dtype", "torch_dtype")


def checkpoint_layout(config_dict: dict) -> str | None:
    """The published layout of a config dict: "treeflash-release", "dflash", or None (ours, or not a drafter)."""
    if config_dict.get("model_type") == TreeFlashDrafterConfig.model_type:
        return None
    architectures = config_dict.get("architectures") or []
    if any(key in config_dict for key in ("treeflash_config", "ar_approximation", "candidate_tokens")) or any(
            name in ("TreeFlashDraftModel", "TreeFlash") for name in architectures):
        return "treeflash-release"
    if "dflash_config" in config_dict or any("DFlash" in name for name in architectures):
        return "dflash"
    return None


def _published_value(source: dict, nested: str, name: str, default=None):
    """`source[nested][name]`, else `source[name]`, else `default` (how z-lab and the release read their keys)."""
    inner = source.get(nested) or {}
    return inner[name] if name in inner else source.get(name, default)


def published_config_dict(source: dict) -> dict:
    """Our config dict for a published drafter config (z-lab DFlash or the TreeFlash release), read the way their own
    code reads it. Anything the drafter cannot compute the same way is refused with a ValueError naming it."""
    from transformers import Qwen3Config

    layout = checkpoint_layout(source)
    if layout is None:
        raise ValueError("Not a DFlash or TreeFlash drafter config: it has no dflash_config or treeflash_config.")
    name = f"this {'TreeFlash release' if layout == 'treeflash-release' else 'DFlash'} drafter config"
    dflash = dict(source.get("dflash_config") or {})
    architectures = source.get("architectures") or []
    if "DFlash2DraftModel" in architectures or {"conv_kernel_size", "selector_rank"} & set(dflash):
        raise ValueError(f"{name} is a DFlash2 drafter (grouped dynamic convolutions and a candidate selector), which "
                         "the TreeFlash drafter does not implement.")
    refused = []
    for key, value in dflash.items():
        if key in ("mask_token_id", "target_layer_ids", "block_size") or key in DFLASH_TRAINING_KEYS:
            continue
        if key not in DFLASH_NO_OP_VALUES or value not in DFLASH_NO_OP_VALUES[key]:
            refused.append(f"dflash_config.{key}={value!r}")
    for key, no_op in DFLASH_NO_OP_VALUES.items():
        if key in source and source[key] not in no_op:
            refused.append(f"{key}={source[key]!r}")
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if key not in source]
    mask_token_id = _published_value(source, "dflash_config", "mask_token_id")
    if mask_token_id is None:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise ValueError(f"{name} lacks {missing}.")

    # The drafter's attention and RoPE as z-lab's model builds them: from a Qwen3Config of this dict
    qwen = Qwen3Config(**{key: value for key, value in source.items() if key not in QWEN3_ONLY_KEYS})
    rope = {key: value for key, value in dict(qwen.rope_parameters or {}).items() if key != "type"}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        # Qwen3's default rotary embedding rotates the whole head with `rope_theta`, whatever else the dict holds
        # (a `partial_rotary_factor` or an M-RoPE section is not read there), so neither is it here.
        rope_parameters = None
    else:
        rope_parameters = rope
    layer_types = list(qwen.layer_types)
    if "sliding_attention" in layer_types and qwen.sliding_window is None:
        refused.append("layer_types with sliding_attention layers but no sliding window (use_sliding_window is false: "
                       "z-lab's model runs those layers causal without a window)")
    if refused:
        raise ValueError(f"{name} sets {', '.join(refused)}: the TreeFlash drafter cannot compute that, so it does not "
                         "load it.")

    target_layer_ids = _published_value(source, "dflash_config", "target_layer_ids")
    num_target_layers = _published_value(source, "dflash_config", "num_target_layers")
    if num_target_layers is None:
        if target_layer_ids is None:
            raise ValueError(f"{name} lacks both dflash_config.target_layer_ids and num_target_layers.")
        num_target_layers = max(target_layer_ids) + 1  # only bounds the ids; the drafter reads the ids
    config = {
        "vocab_size": qwen.vocab_size, "hidden_size": qwen.hidden_size, "intermediate_size": qwen.intermediate_size,
        "num_hidden_layers": qwen.num_hidden_layers, "num_attention_heads": qwen.num_attention_heads,
        "num_key_value_heads": qwen.num_key_value_heads, "head_dim": qwen.head_dim, "hidden_act": qwen.hidden_act,
        "max_position_embeddings": qwen.max_position_embeddings, "rms_norm_eps": qwen.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", 10_000.0), "rope_parameters": rope_parameters,
        "layer_types": layer_types, "sliding_window": qwen.sliding_window,
        "is_causal": source.get("is_causal"), "attention_bias": qwen.attention_bias,
        "attention_dropout": qwen.attention_dropout, "initializer_range": qwen.initializer_range,
        "block_size": int(_published_value(source, "dflash_config", "block_size", 16)),
        "mask_token_id": mask_token_id, "num_target_layers": num_target_layers, "target_layer_ids": target_layer_ids,
        "tree_top_m": PUBLISHED_TOP_M, "tree_top_k": PUBLISHED_TOP_K, "tree_lookup": 0,
        "_checkpoint_layout": layout,
    }
    if layout == "treeflash-release":
        ar = _published_value(source, "treeflash_config", "ar_approximation")
        if ar not in ("swiglu", None):
            raise ValueError(f"{name} sets treeflash_config.ar_approximation={ar!r}: the release defines only "
                             "\"swiglu\" or null.")
        config.update(ar_type="swiglu", ar_intermediate_size=qwen.intermediate_size, ar_rms_norm_eps=1e-6,
                      tree_mode="treeflash" if ar == "swiglu" else "marginal_tree",
                      tree_budget=int(_published_value(source, "treeflash_config", "candidate_tokens",
                                                       RELEASE_TREE_SIZE)))
        config["_checkpoint_has_ar"] = ar is not None
    else:
        config.update(tree_mode="marginal_tree", tree_budget=RELEASE_TREE_SIZE, _checkpoint_has_ar=False)
    return config


__all__ = ["TreeFlashDrafterConfig", "checkpoint_layout", "default_target_layer_ids", "published_config_dict"]
