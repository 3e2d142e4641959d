"""Clear errors for inputs the engine cannot take (raised before any forward runs)."""

from __future__ import annotations

import torch

TREE_MASK_BACKENDS = ("sdpa", "eager", "flex_attention")


class TreeFlashInputError(ValueError):
    """An input the TreeFlash engine cannot take; the message names the problem and the fix."""


def is_treeflash_drafter(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "treeflash_drafter" and hasattr(model, "ar_corrected_hidden_states")


def check_pair(target, drafter) -> None:
    """The drafter must have been made for this target: layers, width, vocabulary, dtype and device."""
    target_config = target.config.get_text_config()
    config = drafter.config
    num_layers = target_config.num_hidden_layers
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad_ids:
        raise TreeFlashInputError(
            f"The drafter reads target layers {config.target_layer_ids} but the target has only {num_layers} "
            f"layers (ids {bad_ids} do not exist): this drafter was trained for another target. Load the drafter "
            "that matches this target."
        )
    if config.num_target_layers != num_layers:
        raise TreeFlashInputError(
            f"The drafter was made for a target with {config.num_target_layers} layers, this target has "
            f"{num_layers}: load the drafter that matches this target."
        )
    if config.hidden_size != target_config.hidden_size:
        raise TreeFlashInputError(
            f"Drafter hidden_size {config.hidden_size} != target hidden_size {target_config.hidden_size}: the "
            "drafter runs at its target's width. Load the drafter that matches this target."
        )
    embed_rows = target.get_input_embeddings().weight.shape[0]
    if config.vocab_size != embed_rows:
        raise TreeFlashInputError(
            f"Drafter vocab_size {config.vocab_size} != the target's embedding rows {embed_rows}: drafter and "
            "target must share one tokenizer and vocabulary."
        )
    if target.dtype != drafter.dtype:
        raise TreeFlashInputError(
            f"Drafter dtype {drafter.dtype} != target dtype {target.dtype}: load both in one dtype, "
            f"e.g. `drafter.to({target.dtype})`."
        )
    if target.device != drafter.device:
        raise TreeFlashInputError(
            f"Drafter is on {drafter.device} but the target is on {target.device}: put both on one device, "
            f"e.g. `drafter.to('{target.device}')`."
        )


def check_inputs(target, input_ids: torch.Tensor) -> None:
    if input_ids.shape[0] != 1:
        raise TreeFlashInputError(
            f"TreeFlash decoding takes one sequence at a time (batch size 1), got batch size {input_ids.shape[0]}. "
            "Batched tree decoding is not implemented yet: loop over the prompts."
        )
    if input_ids.device.type != target.device.type:
        raise TreeFlashInputError(
            f"input_ids are on {input_ids.device} but the models are on {target.device}: move the inputs, "
            f"e.g. `inputs.to('{target.device}')`."
        )


def check_attention_backend(target) -> None:
    implementation = target.config._attn_implementation
    if implementation not in TREE_MASK_BACKENDS:
        raise TreeFlashInputError(
            f"The target uses attn_implementation={implementation!r}, which cannot take a tree attention mask. "
            "Load it with `attn_implementation='sdpa'` (or call `target.set_attn_implementation('sdpa')`)."
        )
