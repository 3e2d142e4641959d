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
    split_over_devices = len(set(getattr(target, "hf_device_map", {}).values())) > 1  # accelerate's device_map
    if target.device != drafter.device and not split_over_devices:
        raise TreeFlashInputError(
            f"Drafter is on {drafter.device} but the target is on {target.device}: put both on one device, "
            f"e.g. `drafter.to('{target.device}')`."
        )


def check_inputs(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config=None, streamer=None) -> None:
    """A left-padded batch of prompts the engine can decode, on the models' device."""
    batch_size, width = input_ids.shape
    if width == 0 or (attention_mask is not None and bool((attention_mask.sum(dim=-1) == 0).any())):
        raise TreeFlashInputError(
            "A prompt is empty: TreeFlash decoding starts from at least one token per row (the target must run on "
            "something to draft from). Give every row at least one token, e.g. a BOS token."
        )
    num_beams = getattr(generation_config, "num_beams", 1) or 1
    if num_beams > 1:
        raise TreeFlashInputError(
            f"Beam search (num_beams={num_beams}) cannot be combined with speculative decoding: TreeFlash emits "
            "the target's own greedy or sampled tokens. Use num_beams=1, or drop `assistant_model`."
        )
    if batch_size > 1 and streamer is not None:
        raise ValueError(  # the error transformers' own streamers give
            f"{type(streamer).__name__} only supports batch size 1 (got batch size {batch_size}): stream one prompt "
            "at a time, or drop `streamer`."
        )
    if batch_size > 1 and getattr(generation_config, "pad_token_id", None) is None:
        raise TreeFlashInputError(
            "A batch needs a pad token to fill the rows that finish first: pass `pad_token_id=` to generate() (e.g. "
            "`tokenizer.pad_token_id`, or the EOS id) or set `generation_config.pad_token_id`."
        )
    if attention_mask is not None and bool((attention_mask[:, -1] == 0).any()):
        raise TreeFlashInputError(
            "The batch is right-padded (a row's attention_mask ends in 0): decoder-only generation continues every "
            "row from its last column. Pad on the left: `tokenizer(..., padding=True, padding_side='left')`."
        )
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    max_length = getattr(generation_config, "max_length", None)
    if max_positions is not None and max_length is not None and max_length > max_positions:
        raise TreeFlashInputError(
            f"Prompt plus new tokens need {max_length} positions but the target holds at most {max_positions} "
            f"(max_position_embeddings): shorten the prompts (the padded width is {width}) or lower "
            "max_new_tokens."
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
