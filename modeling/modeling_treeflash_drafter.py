# Copyright 2026 The treeflash-hf authors. Apache-2.0.
"""The TreeFlash drafter: a DFlash block drafter plus the AR-approximation layer.

This file travels to the Hub as remote code: it imports only torch and transformers.

Shapes: `B` batch, `C` new context positions, `Q` block length (`config.block_size`), `H` hidden size,
`n` number of target layers used as context (`len(config.target_layer_ids)`), `R` rows of AR evaluation.

Forward contract (the one transformers' `DFlashTokenCandidateGenerator` calls, so the same weights also run
under `generate(assistant_model=drafter, speculation_type="dflash")`):
`forward(noise_embeds [B, Q, H], context_hidden_states [B, C, n*H], position_ids [B, C+Q],
attention_mask [B, past+C+Q] or None, cache)` -> `last_hidden_state [B, Q, H]` (after the final norm, ready for
the target's `lm_head`). The context features of the `C` new positions are projected by `fc` + `hidden_norm`,
turned into K/V in every layer and appended to `cache`; the block's own K/V are appended too, so the caller crops
`Q` positions after each call (as the stock generator does).

Published drafters load as they are published (`TreeFlashDrafterModel.from_pretrained`): z-lab DFlash checkpoints
(and SpecForge / speculators exports in their layout) and the TreeFlash authors' release, config and weight names
mapped on load (see `configuration_treeflash_drafter.published_config_dict`). RoPE comes from the config through
transformers' own rotary functions (default, linear, dynamic, YaRN, llama3, longrope), and sliding-window layers
(`layer_types`, `sliding_window`) mask their keys by position as z-lab's DFlash does.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.utils import logging

from .configuration_treeflash_drafter import TreeFlashDrafterConfig, checkpoint_layout

logger = logging.get_logger(__name__)


class TreeFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32, one fused op (the drafter runs this ~10 times per decode step)
        normed = F.rms_norm(hidden_states.float(), hidden_states.shape[-1:], eps=self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TreeFlashRotaryEmbedding(nn.Module):
    """RoPE from the config. `forward(position_ids [B, S], dtype) -> (cos, sin)`, each `[B, S, head_dim]`.

    Plain RoPE (`rope_theta`) is computed here; a scaled one (`config.rope_parameters`: linear, dynamic, YaRN, llama3,
    longrope) takes its frequencies and attention scaling from transformers' own `ROPE_INIT_FUNCTIONS`, and the dynamic
    kinds update them per call through `dynamic_rope_update`, exactly as transformers' Qwen3 / Llama rotary embeddings
    (which z-lab's DFlash drafter uses) do."""

    def __init__(self, config: TreeFlashDrafterConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        self.attention_scaling = 1.0
        # read by `dynamic_rope_update`
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)
        if self.rope_type != "default":
            self.register_buffer("original_inv_freq", self.inv_freq.clone(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        if self.rope_type != "default":
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, None)
            return inv_freq.float()
        dim = self.head_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_type != "default":
            return self.scaled_forward(torch.empty(0, dtype=dtype, device=position_ids.device), position_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @dynamic_rope_update
    def scaled_forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` only carries the device and dtype (the signature `dynamic_rope_update` expects)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class KeyPositions:
    """Where the keys of one forward sit, for layers that mask by position (sliding-window or causal layers).

    The new keys (context, then block) carry `position_ids`; the cached keys before them are, per row, the valid
    (unmasked) slots holding the consecutive positions that end just before the earliest valid new key (the drafter
    sees every committed position once, in order; invalid slots are padding or dropped nodes and stay masked). A
    sliding cache layer returns only its last slots, so everything is read from the right.
    """

    def __init__(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 additive_mask: torch.Tensor | None, q_len: int):
        self.position_ids = position_ids  # [B, N] the new keys' positions (N = C + Q)
        self.q_len = q_len
        self.additive_mask = additive_mask if additive_mask is not None and additive_mask.dim() == 4 and (
            attention_mask is not None and attention_mask.dim() == 4) else None  # a caller's 4D mask, kept as a base
        if attention_mask is None:
            self.valid = None
        elif attention_mask.dim() == 2:
            self.valid = attention_mask.to(torch.bool)  # [B, L]
        else:  # an additive 4D mask: a key is valid when some query may see it
            keep = attention_mask > torch.finfo(attention_mask.dtype).min / 2 if attention_mask.is_floating_point() \
                else attention_mask.to(torch.bool)
            self.valid = keep.any(dim=-2)[:, 0]  # [B, L]
        self.masks: dict = {}

    def mask(self, kv_len: int, causal: bool, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive `[B, 1, Q, kv_len]`: a block query at position p sees the valid keys at positions k with
        `p - k < window` (and `k - p < window` unless causal), and only `k <= p` when causal."""
        key = (kv_len, causal, window, dtype)
        if key in self.masks:
            return self.masks[key]
        positions = self.position_ids
        batch, num_new = positions.shape
        past = kv_len - num_new
        valid = torch.ones(batch, kv_len, dtype=torch.bool, device=positions.device) if self.valid is None \
            else self.valid[:, -kv_len:].to(positions.device)
        if past > 0:
            first_new = torch.where(valid[:, past:], positions, torch.iinfo(positions.dtype).max).min(dim=1).values
            valid_after = valid[:, :past].flip(1).to(positions.dtype).cumsum(1).flip(1)  # valid cached slots >= j
            key_positions = torch.cat([first_new[:, None] - valid_after, positions], dim=1)
        else:
            key_positions = positions[:, -kv_len:]
        distance = positions[:, -self.q_len:, None] - key_positions[:, None, :]  # [B, Q, kv_len] query - key
        visible = valid[:, None, :].expand(-1, self.q_len, -1)
        if window is not None:
            visible = visible & (distance < window)
            if not causal:
                visible = visible & (distance > -window)
        if causal:
            visible = visible & (distance >= 0)
        visible = visible[:, None]  # [B, 1, Q, kv_len]
        if self.additive_mask is not None:  # [B, 1, Q or 1, kv_len]
            self.masks[key] = torch.where(visible, self.additive_mask[..., -kv_len:].to(dtype), torch.finfo(dtype).min)
        else:
            base = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
            self.masks[key] = base.masked_fill(~visible, torch.finfo(dtype).min)
        return self.masks[key]


class TreeFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[context ; block]` (context bypasses the input norm); no causal mask,
    except on the layers a published config makes causal or sliding (`config.layer_attention`)."""

    def __init__(self, config: TreeFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = TreeFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = TreeFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # causal inside the block, and the sliding window (None: every key), of this layer
        self.is_causal, self.sliding_window = config.layer_attention(layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, Q, H], already input-normed
        context_hidden_states: torch.Tensor,  # [B, C, H], projected context (not normed by this layer)
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [B, C+Q, head_dim]
        attention_mask: torch.Tensor | None,  # additive [B, 1, Q or 1, past+C+Q] or None
        cache=None,
        key_positions: KeyPositions | None = None,  # for a causal or sliding layer
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        kv_input = torch.cat([context_hidden_states, hidden_states], dim=1)  # [B, C+Q, H]
        kv_len = kv_input.shape[1]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = (t.unsqueeze(1) for t in cos_sin)  # [B, 1, C+Q, head_dim]
        query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
        key = key * cos + rotate_half(key) * sin
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # [B, kv_heads, past+C+Q, head_dim]
        if self.is_causal or self.sliding_window is not None:
            attention_mask = key_positions.mask(key.shape[-2], self.is_causal, self.sliding_window, query.dtype)

        attn = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, heads, Q, head_dim]
        return self.o_proj(attn.transpose(1, 2).reshape(batch, q_len, -1))


class TreeFlashMLP(nn.Module):
    def __init__(self, config: TreeFlashDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TreeFlashDecoderLayer(nn.Module):
    """Qwen3-style pre-norm layer whose attention also sees the context features."""

    def __init__(self, config: TreeFlashDrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TreeFlashAttention(config, layer_idx)
        self.mlp = TreeFlashMLP(config)
        self.input_layernorm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context_hidden_states, cos_sin, attention_mask, cache=None,
                key_positions=None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context_hidden_states, cos_sin, attention_mask, cache, key_positions
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TreeFlashARLayer(nn.Module):
    """The AR-approximation layer: `h' = h + d(silu(g) * u)`, `[u ; g] = ug([norm_e(e_prev) ; final_norm(h)])`.

    `d` is zero-initialised, so a fresh layer leaves the backbone unchanged. With `ar_num_prev_tokens == 2`
    the input is `[norm_e(e_prev2) ; norm_e(e_prev) ; final_norm(h)]`. With `ar_type == "linear"` the layer is
    `h + d(ug(...))` (no gate), for ablations.
    """

    def __init__(self, config: TreeFlashDrafterConfig):
        super().__init__()
        self.ar_type = config.ar_type
        self.num_prev_tokens = config.ar_num_prev_tokens
        inner = config.ar_intermediate_size
        in_features = (config.ar_num_prev_tokens + 1) * config.hidden_size
        out_features = 2 * inner if config.ar_type == "swiglu" else inner
        eps = getattr(config, "ar_rms_norm_eps", None)
        self.norm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps if eps is None else eps)
        self.ug = nn.Linear(in_features, out_features, bias=True)
        self.d = nn.Linear(inner, config.hidden_size, bias=False)
        self.d.zero_init = True  # read by `_init_weights`: a fresh AR layer is the identity

    def forward(
        self,
        hidden_states: torch.Tensor,  # [..., H] backbone output h (before the final norm)
        normed_hidden_states: torch.Tensor,  # [..., H] final_norm(h)
        prev_embeds: torch.Tensor,  # [..., H] target input embedding of the previous token
        prev2_embeds: torch.Tensor | None = None,  # [..., H] of the token before that (2-token variant)
    ) -> torch.Tensor:
        parts = [self.norm(prev_embeds), normed_hidden_states]
        if self.num_prev_tokens == 2:
            if prev2_embeds is None:
                raise ValueError("This drafter's AR layer conditions on two previous tokens: pass `prev2_embeds`.")
            parts.insert(0, self.norm(prev2_embeds))
        projected = self.ug(torch.cat(parts, dim=-1))
        if self.ar_type == "swiglu":
            up, gate = projected.chunk(2, dim=-1)
            projected = F.silu(gate) * up
        return hidden_states + self.d(projected)


AR_PREFIX = "ar_approximation."  # the AR layer's parameter names (the release's and ours)


@dataclass
class TreeFlashDrafterOutput(BaseModelOutputWithPast):
    """`last_hidden_state` [B, Q, H] after the final norm (the stock DFlash contract) and
    `pre_norm_hidden_state` [B, Q, H] before it (input of the AR layer)."""

    pre_norm_hidden_state: torch.FloatTensor | None = None


class TreeFlashDrafterPreTrainedModel(PreTrainedModel):
    config_class = TreeFlashDrafterConfig
    config: TreeFlashDrafterConfig
    base_model_prefix = "treeflash"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TreeFlashDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            init.zeros_(module.weight)
        elif isinstance(module, TreeFlashRotaryEmbedding):  # non-persistent buffers: recomputed on load
            init.copy_(module.inv_freq, module.compute_inv_freq())
            if hasattr(module, "original_inv_freq"):
                init.copy_(module.original_inv_freq, module.inv_freq)
        else:
            super()._init_weights(module)


class TreeFlashDrafterModel(TreeFlashDrafterPreTrainedModel):
    """DFlash backbone (`fc`, `hidden_norm`, `layers`, `norm`) plus `ar_approximation`.

    The drafter owns no embedding table and no `lm_head`: callers embed tokens with the target's input
    embeddings and score hidden states with the target's `lm_head`.
    """

    def __init__(self, config: TreeFlashDrafterConfig):
        super().__init__(config)
        n_context = len(config.target_layer_ids)
        self.fc = nn.Linear(n_context * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(TreeFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = TreeFlashRotaryEmbedding(config)
        self.ar_approximation = TreeFlashARLayer(config)
        if config.draft_vocab_size is not None:
            # `[draft_vocab_size]` target token ids the drafter drafts from (saved with the weights; set by
            # `set_draft_vocab` or loaded from a checkpoint)
            self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size), persistent=True)
        # Decoding knobs read by the TreeFlash engine (defaults from the config; per-call overrides win).
        self.generation_config = GenerationConfig(
            tree_mode=config.tree_mode,
            tree_budget=config.tree_budget,
            tree_top_m=config.tree_top_m,
            tree_top_k=config.tree_top_k,
            tree_lookup=config.tree_lookup,
        )
        self.post_init()

    # ---- loading published drafters ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""Loads our own folders as transformers does, and published drafters as they are published:

        - z-lab DFlash (and SpecForge / speculators exports in its layout): a Qwen3 config with `dflash_config`;
          weights named as ours, no AR layer: the drafter gets an identity AR layer (zero `d`) and drafts exactly
          what the DFlash checkpoint drafts.
        - the TreeFlash authors' release: `treeflash_config`; the backbone under `model.` (renamed on load through
          transformers' `key_mapping`), the AR layer as `ar_approximation.{ug, d, norm}`.

        Every weight of a published checkpoint must land in the drafter, and every drafter weight must come from it
        (the AR layer's only where the layout has none): otherwise a ValueError names the keys, e.g. a release folder
        whose config declares the AR layer but whose weights lack it. The loaded drafter saves in our layout.
        """
        layout = cls._published_layout(pretrained_model_name_or_path, kwargs)
        if layout is None:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        output_loading_info = kwargs.pop("output_loading_info", False)
        kwargs["key_mapping"] = {r"^model\.": "", **(kwargs.get("key_mapping") or {})}
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        model._weight_conversions = None  # save in our own layout, not back under `model.`
        model._check_published_weights(pretrained_model_name_or_path, kwargs.get("ignore_mismatched_sizes", False))
        return (model, loading_info) if output_loading_info else model

    @classmethod
    def _published_layout(cls, pretrained_model_name_or_path, kwargs: dict) -> str | None:
        """The published layout ("dflash", "treeflash-release") of what `from_pretrained` is asked to load, or None."""
        config = kwargs.get("config")
        if isinstance(config, PreTrainedConfig):
            return getattr(config, "_checkpoint_layout", None)
        if pretrained_model_name_or_path is None or config is not None:
            return None
        hub = {name: kwargs[name] for name in ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                                               "revision", "subfolder") if name in kwargs}
        raw, _ = PreTrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub)
        return checkpoint_layout(raw)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        if getattr(self.config, "_checkpoint_layout", None) is None:
            return
        # A published checkpoint is judged as a whole by `_check_published_weights`, which names what does not fit;
        # transformers' own report would call an absent AR layer "missing" where the layout has none.
        self._published_loading = {"missing": set(loading_info.missing_keys),
                                   "unexpected": set(loading_info.unexpected_keys),
                                   "mismatched": set(loading_info.mismatched_keys)}
        loading_info.missing_keys = set()
        loading_info.unexpected_keys = set()
        loading_info.mismatched_keys = set()

    def _check_published_weights(self, source, ignore_mismatched_sizes: bool = False) -> None:
        config = self.config
        layout, has_ar = config._checkpoint_layout, bool(config._checkpoint_has_ar)
        report = self.__dict__.pop("_published_loading", {"missing": set(), "unexpected": set(), "mismatched": set()})
        what = "TreeFlash release" if layout == "treeflash-release" else "DFlash"
        prefix = "model." if layout == "treeflash-release" else ""

        def named(keys):  # in the checkpoint's own names
            shown = sorted(key if key.startswith(AR_PREFIX) else prefix + key for key in keys)
            return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")

        ar_keys = {name for name in self.state_dict() if name.startswith(AR_PREFIX)}
        missing_ar = report["missing"] & ar_keys
        missing_backbone = report["missing"] - ar_keys
        if has_ar and missing_ar:
            raise ValueError(
                f"{source} is a {what} drafter whose config declares an AR layer (treeflash_config.ar_approximation="
                f"'swiglu'), but its weights lack {named(missing_ar)}: download the complete checkpoint, or set "
                "treeflash_config.ar_approximation to null to load it as a plain DFlash drafter.")
        if not has_ar and missing_ar != ar_keys:
            where = ("treeflash_config.ar_approximation is null" if layout == "treeflash-release"
                     else "a DFlash config declares none")
            raise ValueError(
                f"{source} holds AR-layer weights ({named(ar_keys - missing_ar)}) but {where}: set "
                "treeflash_config.ar_approximation to \"swiglu\" in its config.json to use them.")
        if missing_backbone:
            raise ValueError(f"{source} is a {what} drafter whose weights lack {named(missing_backbone)}: the "
                             "checkpoint is incomplete; download it again.")
        copies = {key for key in report["unexpected"] if key.split(".")[-2] in ("embed_tokens", "lm_head")}
        if copies:  # the drafter uses the target's embeddings and head, as DFlash does
            logger.warning(f"{source}: ignoring {sorted(copies)} (a drafter uses the target's embeddings and head).")
        unexpected = report["unexpected"] - copies
        if unexpected:
            raise ValueError(f"{source} holds weights the {what} drafter has no place for: {named(unexpected)}; it "
                             "is not a drafter this package can run as published.")
        if report["mismatched"] and not ignore_mismatched_sizes:
            shapes = ", ".join(f"{key} {tuple(saved)} (config: {tuple(expected)})"
                               for key, saved, expected in sorted(report["mismatched"])[:4])
            raise ValueError(f"{source}: weight shapes do not match its config: {shapes}.")
        if not has_ar:  # the identity AR layer: a fresh zero `d`, whatever initialised the rest
            with torch.no_grad():
                self.ar_approximation.d.weight.zero_()

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft from the target tokens `token_ids` `[Vd]` only (distinct ids of the target's vocabulary, most
        useful first), or from the whole vocabulary when None."""
        if token_ids is None:
            self.config.draft_vocab_size = None
            self._buffers.pop("draft_token_ids", None)
            return
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        in_range = bool(((token_ids >= 0) & (token_ids < self.config.vocab_size)).all())
        if token_ids.numel() == 0 or not in_range or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(f"A draft vocabulary must be distinct token ids in [0, {self.config.vocab_size}) "
                             f"(got {token_ids.numel()} ids).")
        self.config.draft_vocab_size = int(token_ids.numel())
        self.register_buffer("draft_token_ids", token_ids.to(self.fc.weight.device), persistent=True)

    def project_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """`[B, C, n*H]` concatenated target-layer outputs -> `[B, C, H]` context features."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> TreeFlashDrafterOutput:
        r"""
        noise_embeds (`[B, Q, H]`): target input embeddings of `[anchor, MASK, ..., MASK]`.
        context_hidden_states (`[B, C, n*H]`): target-layer outputs of the `C` positions not yet in `cache`.
        attention_mask (`[B, past+C+Q]` with 1 = attend, or an additive 4D mask): padding mask over all keys.
        position_ids (`[B, C+Q]`): positions of the new context positions followed by the block's.
        cache (a transformers `Cache`, optional): receives the K/V of the context *and* of the block.
        """
        if use_cache and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
        batch, q_len, _ = noise_embeds.shape
        context = self.project_context(context_hidden_states.to(noise_embeds.dtype))  # [B, C, H]
        new_len = context.shape[1] + q_len
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + new_len, device=noise_embeds.device).expand(batch, -1)
        cos_sin = self.rotary_emb(position_ids, noise_embeds.dtype)

        additive_mask = None
        if attention_mask is not None:
            if attention_mask.dim() == 2:  # [B, kv_len] of 0/1 -> [B, 1, 1, kv_len] additive
                keep = attention_mask[:, None, None, :].to(torch.bool)
                additive_mask = torch.zeros(keep.shape, dtype=noise_embeds.dtype, device=noise_embeds.device)
                additive_mask = additive_mask.masked_fill(~keep, torch.finfo(noise_embeds.dtype).min)
            else:
                additive_mask = attention_mask.to(noise_embeds.dtype)

        key_positions = None
        if any(layer.self_attn.is_causal or layer.self_attn.sliding_window is not None for layer in self.layers):
            positions = (position_ids if position_ids.dim() == 2 else position_ids[None]).expand(batch, -1)
            key_positions = KeyPositions(positions, attention_mask, additive_mask, q_len)
        hidden_states = noise_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, cos_sin, additive_mask, cache, key_positions)
        return TreeFlashDrafterOutput(
            last_hidden_state=self.norm(hidden_states), cache=cache, pre_norm_hidden_state=hidden_states
        )

    def ar_corrected_hidden_states(
        self,
        pre_norm_hidden_state: torch.Tensor,  # [..., H]
        prev_embeds: torch.Tensor,  # [..., H]
        prev2_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`norm(h + AR(e_prev, norm(h)))` `[..., H]`: score with the target's `lm_head` to get `q'_d(. | prev)`."""
        normed = self.norm(pre_norm_hidden_state)
        return self.norm(self.ar_approximation(pre_norm_hidden_state, normed, prev_embeds, prev2_embeds))


__all__ = ["TreeFlashDrafterModel", "TreeFlashDrafterPreTrainedModel", "TreeFlashDrafterOutput"]
