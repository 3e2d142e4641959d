"""The TreeFlash decoding loop and its `generate()` integration.

Pipeline per step (one target forward each): draft -> build tree -> verify -> accept -> commit caches. A step may
skip the draft and verify the lookup branch or the root alone (`lookup.StepScheduler`); the drafter then receives
the skipped positions' context with its next draft.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation import GenerationMixin
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .accept import choose_token, walk_tree
from .cache import check_cache_supported, compact_cache
from .draft import TreeFlashCandidateGenerator
from .learned import learned_state
from .lookup import (
    MAX_NGRAM,
    MIN_PATH_PROB,
    expected_accepted,
    ngram_continuation,
    useful_length,
)
from .options import OPTION_NAMES, TreeOptions
from .tree import chain_tree, root_tree
from .validation import (
    TREE_MASK_BACKENDS,
    TreeFlashInputError,
    check_attention_backend,
    check_inputs,
    check_pair,
    is_treeflash_drafter,
)
from .verify import run_target, verify_tree

logger = logging.getLogger(__name__)


@dataclass
class TreeFlashStats:
    """Per verification step: `accepted_lengths` drafted tokens accepted (the bonus token not counted),
    `tree_sizes` nodes verified (root included), `expected_accepted_lengths` the drafter's own estimate,
    `step_kinds` what the step verified: `"draft"` (the drafter's tree), `"lookup"` (the lookup branch alone) or
    `"plain"` (the root alone); the last two skip the drafter."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    expected_accepted_lengths: list[float] = field(default_factory=list)
    step_kinds: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Block efficiency: tokens emitted per target forward (accepted + bonus), averaged over steps."""
        if not self.accepted_lengths:
            return float("nan")
        return 1.0 + sum(self.accepted_lengths) / len(self.accepted_lengths)


@dataclass
class TreeFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus per-step statistics: `accepted_lengths`, `tree_sizes`,
    `expected_accepted_lengths`, `step_kinds` (lists, one entry per verification step) and `tau`."""

    accepted_lengths: list[int] | None = None
    tree_sizes: list[int] | None = None
    expected_accepted_lengths: list[float] | None = None
    step_kinds: list[str] | None = None
    tau: float | None = None


@torch.no_grad()
def treeflash_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter=None,
    options: TreeOptions | None = None,
    streamer=None,
    candidate_generator: TreeFlashCandidateGenerator | None = None,
    **model_kwargs,
) -> torch.LongTensor | TreeFlashGenerateOutput:
    """TreeFlash speculative decoding of `input_ids [1, S]` with target `model`.

    Has the signature of a transformers decoding method, so `generate()` prepares everything (config, logits
    processors, stopping criteria, cache) and hands over. Stopping criteria are checked after every emitted
    token, so nothing is emitted past a stop. `candidate_generator` replaces the default drafting side (a
    `TreeFlashCandidateGenerator` subclass with other drafting or tree rules). Of `model_kwargs`, the
    target's `attention_mask` `[1, S]`, `position_ids` `[1, S]` and `cache` are used.
    """
    attention_mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    cache = model_kwargs.get("cache")
    target = model
    options = options or TreeOptions.resolve(drafter, {})
    check_inputs(target, input_ids)
    check_pair(target, drafter)
    check_attention_backend(target)
    cache = cache if cache is not None else DynamicCache(config=target.config)
    check_cache_supported(cache)
    if cache.get_seq_length() > 0:
        raise TreeFlashInputError("TreeFlash decoding starts from an empty cache: do not pass a pre-filled cache.")
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    generator = candidate_generator or TreeFlashCandidateGenerator(drafter, target, options)
    layer_ids = generator.target_layer_ids
    device = target.get_input_embeddings().weight.device  # where the target's inputs and outputs live

    # Padding (batch 1 with a mask that has zeros) is honoured through a key mask over the committed past.
    past_key_mask = None
    if attention_mask is not None and not bool(attention_mask.all()):
        past_key_mask = attention_mask[0].bool()
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]

    # Prefill: the target runs on the prompt; its next token is the first root.
    out = run_target(target, input_ids, position_ids, attention_mask, cache, layer_ids, logits_to_keep=1)
    # context features the drafter has not seen yet, oldest first (each [1, C_i, n*H]); joined at the next draft
    pending_context = [generator.context_features(out.hidden_states, slice(None))]
    raw = out.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone()) if len(logits_processor) else raw
    root_token = choose_token(processed, do_sample)
    root_position = int(position_ids[0, -1]) + 1

    sequence = input_ids
    scores, raw_logits = [], []
    stats = TreeFlashStats()
    learned = learned_state(drafter, target, options, generation_config)  # carried over from earlier calls
    auto_budget, lookup_rates, schedule = learned.auto_budget, learned.lookup_rates, learned.schedule

    def emit(token: int, token_scores: torch.Tensor, token_raw: torch.Tensor) -> bool:
        """Commit one token; True when generation must stop."""
        nonlocal sequence
        sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
        if keep_scores:
            scores.append(token_scores)
        if keep_logits:
            raw_logits.append(token_raw)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        return bool(stopping_criteria(sequence, token_scores).any())

    finished = emit(root_token, processed, raw)
    while not finished:
        remaining = generation_config.max_length - sequence.shape[1]  # tokens still allowed after the root
        past_len = cache.get_seq_length()
        drafting_started = time.perf_counter()
        budget = options.tree_budget if auto_budget is None else auto_budget.build_size()
        lookup_tokens, ngram, lookup_log_probs, branch_expected = [], 0, [], None
        # the budget counts the root; under "auto" a branch verified alone may be as long as auto allows
        lookup_cap = budget if auto_budget is None else auto_budget.max_size
        lookup_length = min(options.tree_lookup, remaining - 1, lookup_cap - 1)
        if lookup_length > 0:
            lookup_tokens, ngram = ngram_continuation(sequence[0], MAX_NGRAM, lookup_length)
        if lookup_tokens:
            lookup_log_probs = lookup_rates.log_probs(ngram, len(lookup_tokens))
            keep = useful_length(lookup_log_probs, MIN_PATH_PROB)
            lookup_tokens, lookup_log_probs = lookup_tokens[:keep], lookup_log_probs[:keep]
            branch_expected = expected_accepted(lookup_log_probs)
        # budget 1 is plain decoding asked for: nothing to draft, nothing for the scheduler to choose
        step_kind = "plain" if budget == 1 else schedule.choose(branch_expected)
        if step_kind == "plain":  # the root alone; the drafter catches up with the next draft
            tree = root_tree(root_token)
        elif step_kind == "lookup":  # the lookup branch alone; likewise
            tree = chain_tree(root_token, torch.tensor(lookup_tokens), torch.tensor(lookup_log_probs))
            if auto_budget is not None:
                tree = auto_budget.choose_lookup(tree)
        else:
            block = generator.draft(
                root_token, root_position, torch.cat(pending_context, dim=1), max_depth=min(remaining, budget) - 1,
                prev_token=int(sequence[0, -2]),
            )
            branch = (lookup_tokens[: budget - 1], lookup_log_probs[: budget - 1]) if lookup_tokens else None
            tree = generator.build_tree(block, budget, branch)
        drafted = step_kind == "draft"
        if auto_budget is not None and drafted:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            tree, predicted = auto_budget.choose(tree, time.perf_counter() - drafting_started)
        logits, hidden_states = verify_tree(target, tree, cache, past_len, root_position, past_key_mask, layer_ids)
        accepted = walk_tree(tree, logits, sequence, logits_processor, do_sample)
        if lookup_tokens:
            lookup_rates.observe(ngram, lookup_tokens, accepted.tokens)
        schedule.observe(step_kind, time.perf_counter() - drafting_started, len(accepted.path), branch_expected)
        if auto_budget is not None and drafted:
            auto_budget.observe(predicted, len(accepted.path))
        stats.accepted_lengths.append(len(accepted.path))
        stats.tree_sizes.append(tree.size)
        stats.expected_accepted_lengths.append(tree.expected_accepted_len)
        stats.step_kinds.append(step_kind)
        for token, token_scores, node in zip(accepted.tokens, accepted.scores, accepted.visited):
            finished = emit(token, token_scores, logits[node : node + 1])
            if finished:
                break
        if finished:
            break
        kept_nodes = torch.tensor([0] + accepted.path, dtype=torch.long, device=tree.tokens.device)
        compact_cache(cache, past_len, kept_nodes)
        kept_context = generator.context_features(hidden_states, kept_nodes.to(device))
        pending_context = [kept_context] if drafted else pending_context + [kept_context]
        if past_key_mask is not None:
            past_key_mask = torch.cat([past_key_mask, past_key_mask.new_ones(kept_nodes.shape[0])])
        root_position += kept_nodes.shape[0]
        root_token = accepted.tokens[-1]

    if streamer is not None:
        streamer.end()
    if not return_dict:
        return sequence
    return TreeFlashGenerateOutput(
        sequences=sequence,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
        cache=cache,
        accepted_lengths=stats.accepted_lengths,
        tree_sizes=stats.tree_sizes,
        expected_accepted_lengths=stats.expected_accepted_lengths,
        step_kinds=stats.step_kinds,
        tau=stats.tau,
    )


def treeflash_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 128,
    eos_token_id: int | list[int] | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    streamer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    candidate_generator: TreeFlashCandidateGenerator | None = None,
    **tree_options,
) -> TreeFlashGenerateOutput:
    """Plain-function API (no `generate()`): TreeFlash-decode `input_ids [1, S]`.

    `tree_options` are `tree_mode`, `tree_budget`, `tree_top_m`, `tree_top_k` (defaults from the drafter);
    `stopping_criteria` are checked after every token, like `generate()`'s.
    Returns a `TreeFlashGenerateOutput` with `sequences [1, S + new]` and the per-step statistics.
    """
    unknown = set(tree_options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"Unknown options {sorted(unknown)}; tree options are {OPTION_NAMES}.")
    processors = LogitsProcessorList()
    if do_sample:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    criteria = StoppingCriteriaList([MaxLengthCriteria(input_ids.shape[1] + max_new_tokens)])
    criteria.extend(stopping_criteria or [])
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id))
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}
    config = GenerationConfig(
        do_sample=do_sample, max_length=input_ids.shape[1] + max_new_tokens, return_dict_in_generate=True, **sampling
    )
    options = TreeOptions.resolve(drafter, tree_options)
    return treeflash_decode(
        target,
        input_ids,
        processors,
        criteria,
        config,
        drafter=drafter,
        options=options,
        streamer=streamer,
        candidate_generator=candidate_generator,
    )


@contextlib.contextmanager
def tree_attention_backend(target):
    """Switch a target whose attention backend cannot take tree masks (flash attention) to SDPA for the call."""
    original = target.config._attn_implementation
    if original in TREE_MASK_BACKENDS:
        yield
        return
    try:
        target.set_attn_implementation("sdpa")
    except Exception as err:  # the model has no SDPA path
        raise TreeFlashInputError(
            f"The target uses attn_implementation={original!r}, which cannot take a tree attention mask, and it "
            "cannot switch to 'sdpa'. Load it with attn_implementation='eager'."
        ) from err
    logger.warning("TreeFlash: attn_implementation=%r cannot take tree masks; using 'sdpa' for this call.", original)
    try:
        yield
    finally:
        target.set_attn_implementation(original)


_STOCK_GENERATE = GenerationMixin.generate


def _wants_stock_dflash(target, kwargs: dict) -> bool:
    if kwargs.get("speculation_type") is not None:
        return kwargs["speculation_type"] == "dflash"
    config = kwargs.get("generation_config") or target.generation_config
    return getattr(config, "speculation_type", None) == "dflash"


def route_generate(stock_generate, model, *args, assistant_model=None, **kwargs):
    """Run `stock_generate` (transformers' `generate`), handing decoding to TreeFlash when `assistant_model` is a
    TreeFlash drafter (unless `speculation_type="dflash"` asks for transformers' own linear DFlash loop).
    Extra keyword arguments `tree_mode`, `tree_budget`, `tree_top_m`, `tree_top_k` override the drafter's
    `generation_config`. Shared by the installed hook and the Hub repo's `custom_generate/generate.py`."""
    tree_overrides = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
    if not is_treeflash_drafter(assistant_model) or _wants_stock_dflash(model, kwargs):
        if tree_overrides:
            raise TypeError(
                f"{sorted(tree_overrides)} apply only to TreeFlash decoding: pass a TreeFlash drafter as "
                "`assistant_model` (and no `speculation_type='dflash'`)."
            )
        return stock_generate(model, *args, assistant_model=assistant_model, **kwargs)
    if kwargs.get("custom_generate") is not None:
        raise TypeError("`custom_generate` cannot be combined with a TreeFlash drafter as `assistant_model`.")
    kwargs.pop("custom_generate", None)
    options = TreeOptions.resolve(assistant_model, tree_overrides)
    check_pair(model, assistant_model)
    decoding = functools.partial(
        treeflash_decode, drafter=assistant_model, options=options, streamer=kwargs.get("streamer")
    )
    with tree_attention_backend(model):
        return stock_generate(model, *args, custom_generate=decoding, **kwargs)


@functools.wraps(_STOCK_GENERATE)
def generate(self, *args, assistant_model=None, **kwargs):
    """`GenerationMixin.generate`, routed to TreeFlash decoding when `assistant_model` is a TreeFlash drafter
    (see `route_generate`)."""
    return route_generate(_STOCK_GENERATE, self, *args, assistant_model=assistant_model, **kwargs)


def install_generate_hook() -> None:
    """Route `generate(assistant_model=<TreeFlash drafter>)` to TreeFlash decoding (idempotent)."""
    GenerationMixin.generate = generate
