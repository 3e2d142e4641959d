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
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_treeflash_drafter import TreeFlashDrafterConfig


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
    """Default RoPE. `forward(position_ids [B, S]) -> (cos, sin)`, each `[B, S, head_dim]`."""

    def __init__(self, config: TreeFlashDrafterConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        dim = self.head_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class TreeFlashAttention(nn.Module):
    """Queries from the block; keys/values from `[context ; block]` (context bypasses the input norm); no causal mask."""

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

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, Q, H], already input-normed
        context_hidden_states: torch.Tensor,  # [B, C, H], projected context (not normed by this layer)
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [B, C+Q, head_dim]
        attention_mask: torch.Tensor | None,  # additive [B, 1, Q or 1, past+C+Q] or None
        cache=None,
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

    def forward(self, hidden_states, context_hidden_states, cos_sin, attention_mask, cache=None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context_hidden_states, cos_sin, attention_mask, cache
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
        self.norm = TreeFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
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
        elif isinstance(module, TreeFlashRotaryEmbedding):  # a non-persistent buffer: recomputed on load
            init.copy_(module.inv_freq, module.compute_inv_freq())
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

        hidden_states = noise_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, cos_sin, additive_mask, cache)
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
