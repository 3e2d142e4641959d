"""Random-init models of real architectures (Qwen3, Qwen3-MoE, Llama) and matching drafters, for tests and
profiling. No download: every model is built from a config."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

ARCHITECTURES = ("qwen3", "qwen3_moe", "llama")


def random_target(
    arch: str = "qwen3",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
):
    """A random-init causal LM of `arch` in eval mode, fp32, SDPA attention."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size, decoder_sparse_step=1)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **moe))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"unknown architecture {arch!r}; use one of {ARCHITECTURES}")
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model.eval()


def matching_drafter(target, num_layers: int = 2, block_size: int = 8, seed: int = 1, **config_kwargs):
    """A random-init TreeFlash drafter that fits `target` (its width, vocabulary and layers).

    The AR layer's down projection is zero-initialised like a fresh drafter; tests that need a working
    AR layer randomise it themselves.
    """
    torch.manual_seed(seed)
    target_config = target.config.get_text_config()
    config = TreeFlashDrafterConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=2 * target_config.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.hidden_size // target_config.num_attention_heads,
        rope_theta=target_config.rope_parameters.get("rope_theta", 10000.0),
        block_size=block_size,
        mask_token_id=target_config.vocab_size - 1,
        num_target_layers=target_config.num_hidden_layers,
        **config_kwargs,
    )
    return TreeFlashDrafterModel(config).eval()
