"""Drafter training: stage `backbone` (DFlash marginals) and stage `ar` (the AR-approximation layer).

Per batch `[B, T + 1]`: the frozen target runs teacher-forced over the first `T` tokens, giving the context
features and its next-token distributions `p`. `A` anchors per sequence each make one block
`[x_a, MASK, ..., MASK]` (`Q` = block size) that sees context strictly before `a` and is bidirectional inside;
blocks don't see each other. Slot k (1..Q-1) of a block predicts the token at `a + k`; its loss is
`w_k * KL(p_{a+k} || q)` with `w_k = exp(-(k-1) / decay)`, where `q` is the marginal (stage backbone) or the
AR-corrected distribution given the true previous token (stage ar). A drafter with a draft vocabulary
(`draft_token_ids`, `V'` tokens) is trained as it drafts: `q` over those tokens only, `p` restricted to them (its
mass elsewhere dropped, like a top-K teacher's tail), which also makes the head's product `V / V'` times cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.validation import check_pair
from .loop import LossTerms, LoopConfig, Shard, ratios, train_loop


@dataclass
class DrafterLossConfig:
    """stage: "backbone" or "ar"; num_anchors: blocks per sequence; decay: slot-weight decay; ce_weight: mix of
    cross-entropy to the data token (0 = pure KL to the verifier)."""

    stage: str = "ar"
    num_anchors: int = 16
    decay: float = 7.0
    ce_weight: float = 0.0


def slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """`[Q - 1]` weights `exp(-(k - 1) / decay)` for slots k = 1..Q-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / decay)


def block_attention_mask(anchors: torch.LongTensor, context_len: int, block_size: int, dtype) -> torch.Tensor:
    """Additive mask `[B, 1, A*Q, T + A*Q]`: block i sees context positions < anchors[:, i] and its own slots."""
    batch, num_anchors = anchors.shape
    device = anchors.device
    query_block = torch.arange(num_anchors * block_size, device=device) // block_size  # [A*Q]
    context_ok = torch.arange(context_len, device=device)[None, None, :] < anchors[:, query_block, None]
    same_block = query_block[:, None] == query_block[None, :]  # [A*Q, A*Q]
    allowed = torch.cat([context_ok, same_block[None].expand(batch, -1, -1)], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def sample_anchors(batch: int, seq_len: int, block_size: int, num_anchors: int, generator,
                   loss_mask: torch.Tensor | None = None) -> torch.LongTensor:
    """`[B, A]` anchor positions in `[1, T - Q]`, so every block has context and its slots stay in the sequence.
    With `loss_mask [B, T + 1]`, a row's anchors are drawn among the positions whose first drafted token counts
    (e.g. in the response of a self-distilled sequence), so no block is spent where nothing is learned; a row
    without such a position draws from all of them."""
    high = seq_len - block_size + 1
    if high <= 1:
        raise ValueError(f"Sequences of {seq_len} tokens are too short for blocks of {block_size}.")
    if loss_mask is None:
        return torch.randint(1, high, (batch, num_anchors), generator=generator)
    useful = (loss_mask[:, 2 : high + 1] > 0).float()  # anchor a (1..high-1) predicts token a + 1 first
    useful[useful.sum(dim=1) == 0] = 1.0
    return 1 + torch.multinomial(useful, num_anchors, replacement=True, generator=generator)


def column_index(token_ids: torch.LongTensor, vocab_size: int, device: torch.device) -> torch.LongTensor:
    """`[V]`: each token's column in the draft vocabulary `token_ids [V']`, -1 for tokens outside it."""
    columns = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    columns[token_ids.to(device)] = torch.arange(len(token_ids), device=device)
    return columns


@dataclass
class Teacher:
    """The verifier's next-token log-probs at every context position: row j predicts token j + 1. log_probs:
    `[B, T, K]`; ids: `[B, T, K]` the vocabulary ids of those K entries (a cached top-K, sorted by descending
    log-prob), or None when `log_probs` covers the whole vocabulary (K = V)."""

    log_probs: torch.Tensor
    ids: torch.LongTensor | None = None

    def to(self, device: torch.device | str) -> "Teacher":
        return Teacher(self.log_probs.to(device), None if self.ids is None else self.ids.to(device))

    def at(self, positions: torch.LongTensor) -> "Teacher":
        """The rows predicting the tokens at `positions [B, P]` (rows `positions - 1`): `[B, P, K]`."""
        rows = (positions - 1)[..., None].expand(-1, -1, self.log_probs.shape[-1])
        return Teacher(self.log_probs.gather(1, rows), None if self.ids is None else self.ids.gather(1, rows))

    def argmax(self) -> torch.LongTensor:
        """The verifier's greedy token per row `[...]`."""
        best = self.log_probs.argmax(-1)
        return best if self.ids is None else self.ids.gather(-1, best[..., None])[..., 0]

    def kl(self, drafter_log_probs: torch.Tensor) -> torch.Tensor:
        """`KL(p || q)` per row for the drafter's log-probs `[..., V]`, over the teacher's entries (a top-K teacher
        drops the tail beyond its K tokens, whose mass it does not know; entries of log-prob -inf count nothing)."""
        q = drafter_log_probs if self.ids is None else drafter_log_probs.gather(-1, self.ids)
        difference = (self.log_probs - q).masked_fill(self.log_probs == -float("inf"), 0.0)  # (no inf * 0)
        return (self.log_probs.exp() * difference).sum(-1)

    def on_columns(self, token_ids: torch.LongTensor, vocab_size: int) -> "Teacher":
        """The teacher over a draft vocabulary `token_ids [V']`: entries indexed by columns of it (`ids [..., K]`
        always set), log-prob -inf for tokens outside it."""
        if self.ids is None:
            return Teacher(self.log_probs[..., token_ids.to(self.log_probs.device)], None)
        columns = column_index(token_ids, vocab_size, self.ids.device)[self.ids]
        return Teacher(self.log_probs.masked_fill(columns < 0, -float("inf")), columns.clamp(min=0))


def draft_head_log_probs(lm_head: torch.nn.Module, hidden: torch.Tensor,
                         token_ids: torch.LongTensor | None) -> torch.Tensor:
    """The drafter's log-probs `[..., V']` from the target's (frozen) head on `hidden [..., H]`: on the rows of the
    draft vocabulary `token_ids` only (a plain `nn.Linear` head is multiplied by those rows), `[..., V]` when
    None."""
    from ..engine.draft import full_tensor, is_plain_linear

    if token_ids is None:
        logits = lm_head(hidden)
    elif is_plain_linear(lm_head):
        weight = full_tensor(lm_head.weight)
        index = token_ids.to(weight.device)
        bias = None if lm_head.bias is None else full_tensor(lm_head.bias)[index]
        logits = torch.nn.functional.linear(hidden.to(weight.device), weight[index], bias).to(hidden.device)
    else:
        logits = lm_head(hidden)
        logits = logits.index_select(-1, token_ids.to(logits.device)).to(hidden.device)
    return torch.log_softmax(logits.float(), dim=-1)


def target_teacher(target, tokens: torch.LongTensor, layer_ids: list[int]) -> tuple[torch.Tensor, Teacher]:
    """The frozen target teacher-forced over `tokens [B, T]`: the context features `[B, T, n*H]` (outputs of
    `layer_ids`, concatenated) and its full next-token distributions."""
    with torch.no_grad():
        out = target(tokens, output_hidden_states=[i + 1 for i in layer_ids])
        context = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        return context, Teacher(torch.log_softmax(out.logits.float(), dim=-1))


def drafter_loss_terms(
    target,
    drafter,
    input_ids: torch.LongTensor,
    loss_config: DrafterLossConfig,
    anchors: torch.LongTensor,
    loss_mask: torch.Tensor | None = None,
    stage: str | None = None,
) -> LossTerms:
    """The loss of `drafter_loss` as sums: `loss_sum` = sum of slot-weighted losses, `weight` = sum of slot
    weights, metrics as (numerator, denominator), so that the shares of a batch computed on several processes
    add up to the loss and metrics of the whole batch. anchors: `[B, A]` block starts (`sample_anchors`)."""
    tokens = input_ids[:, :-1]  # [B, T]
    context, teacher = target_teacher(target, tokens, list(drafter.config.target_layer_ids))
    return block_loss_terms(drafter, target.get_input_embeddings(), target.get_output_embeddings(), input_ids,
                            context, teacher, loss_config, anchors, loss_mask, stage)


def block_loss_terms(
    drafter,
    embed: torch.nn.Module,
    lm_head: torch.nn.Module,
    input_ids: torch.LongTensor,
    context: torch.Tensor,
    teacher: Teacher,
    loss_config: DrafterLossConfig,
    anchors: torch.LongTensor,
    loss_mask: torch.Tensor | None = None,
    stage: str | None = None,
) -> LossTerms:
    """The drafter's blocks at `anchors [B, A]` over the context features `[B, T, n*H]` of `input_ids [B, T + 1]`
    (the last token only a label), scored against `teacher` (live from the target, or cached features); `embed` and
    `lm_head` are the target's (frozen)."""
    stage = stage or loss_config.stage
    config = drafter.config
    block = config.block_size
    tokens = input_ids[:, :-1]  # [B, T]
    batch, seq_len = tokens.shape
    device = drafter.device
    anchors = anchors.to(device)  # [B, A]
    num_anchors = anchors.shape[1]
    slot = torch.arange(block, device=device)
    block_positions = (anchors[:, :, None] + slot).reshape(batch, -1)  # [B, A*Q]
    block_ids = torch.full_like(block_positions, config.mask_token_id)
    block_ids.view(batch, num_anchors, block)[:, :, 0] = tokens.gather(1, anchors)
    with torch.no_grad():
        noise_embeds = embed(block_ids)
    position_ids = torch.cat([torch.arange(seq_len, device=device).expand(batch, -1), block_positions], dim=1)
    mask = block_attention_mask(anchors, seq_len, block, noise_embeds.dtype)
    hidden = drafter(noise_embeds=noise_embeds, context_hidden_states=context, attention_mask=mask,
                     position_ids=position_ids).pre_norm_hidden_state
    hidden = hidden.view(batch, num_anchors, block, -1)[:, :, 1:]  # slots 1..Q-1: [B, A, Q-1, H]

    predicted_pos = (anchors[:, :, None] + slot[1:]).reshape(batch, -1)  # [B, A*(Q-1)] positions a + k
    teacher = teacher.at(predicted_pos)  # [B, A*(Q-1), K]
    if stage == "backbone":
        final_hidden = drafter.norm(hidden)
    else:
        with torch.no_grad():
            prev_embeds = embed(tokens.gather(1, predicted_pos - 1)).view_as(hidden)
            prev2_embeds = None
            if config.ar_num_prev_tokens == 2:
                prev2_embeds = embed(tokens.gather(1, predicted_pos - 2)).view_as(hidden)
        final_hidden = drafter.ar_corrected_hidden_states(hidden, prev_embeds, prev2_embeds)
    token_ids = getattr(drafter, "draft_token_ids", None)  # [V'] the draft vocabulary, or None
    drafter_logp = draft_head_log_probs(lm_head, final_hidden, token_ids).view(batch, predicted_pos.shape[1], -1)
    target_tokens = teacher.argmax()  # [B, A*(Q-1)] the verifier's greedy tokens
    if token_ids is not None:
        teacher = teacher.on_columns(token_ids, config.vocab_size)

    kl = teacher.kl(drafter_logp)  # [B, A*(Q-1)]
    weights = slot_weights(block, loss_config.decay).to(device).repeat(num_anchors)[None].expand(batch, -1)
    if loss_mask is not None:
        weights = weights * loss_mask.to(device).gather(1, predicted_pos)
    per_slot = kl
    if loss_config.ce_weight:
        labels = input_ids.to(device).gather(1, predicted_pos)
        if token_ids is not None:  # as columns of the draft vocabulary; a label outside it gets no CE term
            labels = column_index(token_ids, config.vocab_size, device)[labels]
        ce = -drafter_logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        if token_ids is not None:
            ce = ce.masked_fill(labels < 0, 0.0)
        per_slot = (1 - loss_config.ce_weight) * kl + loss_config.ce_weight * ce
    with torch.no_grad():
        weight = weights.sum()
        drafted = drafter_logp.argmax(-1)
        drafted = drafted if token_ids is None else token_ids.to(device)[drafted]
        agree = (drafted == target_tokens.to(device)).float().view(batch, num_anchors, block - 1)
        blocks = batch * num_anchors
        metrics = {"kl": ((kl * weights).sum(), weight),
                   "top1_slot1": (agree[:, :, 0].sum(), blocks), "top1_mean": (agree.sum(), agree.numel()),
                   # greedy acceptance proxy: leading slots where the drafter's argmax is the verifier's
                   "accept_proxy": (agree.cumprod(-1).sum(), blocks)}
    return LossTerms((per_slot * weights).sum(), weight, metrics, tokens=input_ids.numel())


def drafter_loss(
    target,
    drafter,
    input_ids: torch.LongTensor,
    loss_config: DrafterLossConfig,
    generator: torch.Generator,
    loss_mask: torch.Tensor | None = None,
    stage: str | None = None,
) -> tuple[torch.Tensor, dict]:
    """Weighted KL to the verifier over all block slots, anchors drawn from `generator`. input_ids:
    `[B, T + 1]` (the last token is only a label); loss_mask: `[B, T + 1]`, 1 where a predicted token counts
    (e.g. the response). Returns the loss and metrics (`kl`, `top1` = how often the drafter's argmax is the
    verifier's, slot 1 and mean, `accept_proxy`)."""
    batch, seq_len = input_ids.shape[0], input_ids.shape[1] - 1
    anchors = sample_anchors(batch, seq_len, drafter.config.block_size, loss_config.num_anchors, generator,
                             loss_mask)
    terms = drafter_loss_terms(target, drafter, input_ids, loss_config, anchors, loss_mask, stage)
    loss = terms.loss_sum / terms.weight.clamp_min(1e-6)
    return loss, ratios({name: (float(num), float(den)) for name, (num, den) in terms.metrics.items()})


AR_PREFIX = "ar_approximation."  # the AR layer's parameter names


def freeze_for_stage(drafter, stage: str, full_finetune: bool = False) -> None:
    """Stage backbone trains everything but the AR layer; stage ar trains the AR layer only (or everything
    with `full_finetune`)."""
    for name, param in drafter.named_parameters():
        is_ar = name.startswith(AR_PREFIX)
        param.requires_grad = (not is_ar) if stage == "backbone" else (is_ar or full_finetune)


def train_drafter(target, drafter, train_data, heldout_batches: list, loss_config: DrafterLossConfig,
                  config: LoopConfig, full_finetune: bool = False) -> dict:
    """Train `drafter` for `target` (frozen). `train_data.batch(step, B)` gives `[B, T + 1]` ids or (ids, mask).

    Anchors are drawn for the whole global batch (seeded by the step) before each process takes its rows, so
    the data and the anchors of a step are the same whatever the number of processes."""
    check_pair(target, drafter)
    target.requires_grad_(False)
    target.eval()
    freeze_for_stage(drafter, loss_config.stage, full_finetune)
    block = drafter.config.block_size
    anchor_generator = torch.Generator()

    def unpack(item):
        return item if isinstance(item, tuple) else (item, None)

    def share(ids, mask, anchors, shard: Shard):
        rows = shard.rows(ids.shape[0])
        return ids[rows].to(target.device), anchors[rows], None if mask is None else mask[rows]

    def loss_fn(step: int, shard: Shard) -> LossTerms:
        ids, mask = unpack(train_data.batch(step, config.batch_size))
        anchor_generator.manual_seed(config.seed * 7919 + step)
        anchors = sample_anchors(ids.shape[0], ids.shape[1] - 1, block, loss_config.num_anchors, anchor_generator,
                                 mask)
        ids, anchors, mask = share(ids, mask, anchors, shard)
        return drafter_loss_terms(target, drafter, ids, loss_config, anchors, mask)

    def eval_fn(shard: Shard) -> dict[str, tuple]:
        totals: dict[str, tuple] = {}
        eval_generator = torch.Generator().manual_seed(12345)
        stages = ["backbone", "ar"] if loss_config.stage == "ar" else ["backbone"]
        for stage in stages:
            for item in heldout_batches:
                ids, mask = unpack(item)
                anchors = sample_anchors(ids.shape[0], ids.shape[1] - 1, block, loss_config.num_anchors,
                                         eval_generator, mask)
                ids, anchors, mask = share(ids, mask, anchors, shard)
                if len(ids) == 0:  # a held-out batch with fewer rows than processes
                    continue
                terms = drafter_loss_terms(target, drafter, ids, loss_config, anchors, mask, stage=stage)
                for key, (num, den) in terms.metrics.items():
                    total_num, total_den = totals.get(f"{stage}_{key}", (0.0, 0.0))
                    totals[f"{stage}_{key}"] = (total_num + float(num), total_den + float(den))
        return totals

    return train_loop(drafter, loss_fn, eval_fn, config, f"drafter-{loss_config.stage}")


__all__ = ["DrafterLossConfig", "Teacher", "block_loss_terms", "drafter_loss", "drafter_loss_terms", "target_teacher", "freeze_for_stage", "slot_weights",
           "train_drafter", "block_attention_mask", "sample_anchors"]


def new_drafter(target, num_layers: int, block_size: int, mask_token_id: int, target_layer_ids: list[int] | None = None,
                ar_intermediate_size: int | None = None, layer_init: str = "random"):
    """A fresh drafter shaped for `target` (its width, heads, vocabulary and RoPE base), `num_layers` decoder layers,
    drafting blocks of `block_size` with `mask_token_id` (a reserved token of the target's vocabulary).
    `layer_init="target"`: its decoder layers start as copies of the target's last `num_layers` ones
    (`copy_target_layers`)."""
    if layer_init not in ("random", "target"):
        raise ValueError(f"layer_init must be 'random' or 'target', got {layer_init!r}.")
    from ..modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
    from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

    text = target.config.get_text_config()
    # the target's RoPE, scaled ones included (YaRN, llama3, ...): the drafter's positions are the target's
    rope = {key: value for key, value in dict(getattr(text, "rope_parameters", None) or {}).items() if key != "type"}
    extra = {} if target_layer_ids is None else {"target_layer_ids": target_layer_ids}
    if rope.get("rope_type", "default") != "default":
        extra["rope_parameters"] = rope
    if ar_intermediate_size is not None:
        extra["ar_intermediate_size"] = ar_intermediate_size
    config = TreeFlashDrafterConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=getattr(text, "head_dim", None),
        rope_theta=rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)), block_size=block_size,
        mask_token_id=mask_token_id, num_target_layers=text.num_hidden_layers, **extra,
    )
    drafter = TreeFlashDrafterModel(config)
    if layer_init == "target":
        copy_target_layers(drafter, target)
    return drafter


def with_identity_layers(drafter, count: int):
    """`drafter` with `count` decoder layers appended whose output projections (`o_proj`, `down_proj`) are zero.
    Each new layer adds nothing to the residual stream, so the grown drafter drafts exactly what `drafter` drafts and
    training a deeper drafter goes on from a trained one instead of from scratch (progressive stacking)."""
    import copy

    if count <= 0:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers += count
    config.layer_types = list(config.layer_types) + ["full_attention"] * count
    grown = type(drafter)(config).to(drafter.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    new_layers = tuple(f"layers.{index}." for index in range(len(drafter.layers), len(grown.layers)))
    if unexpected or any(not name.startswith(new_layers) for name in missing):
        raise ValueError(f"could not grow the drafter: weights {sorted(unexpected) or sorted(missing)[:4]} do not fit")
    with torch.no_grad():
        for layer in grown.layers[len(drafter.layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def copy_target_layers(drafter, target) -> None:
    """Start the drafter's decoder layers as the target's last ones, in order (attention projections, MLP, norms),
    and its final norm as the target's: the drafter then begins where the target predicts the next token, and its
    hidden states already suit the target's head. Weights the target's layer lacks (a Llama layer has no q/k
    norms) keep their initialisation."""
    decoder = target.get_decoder()
    first = len(decoder.layers) - len(drafter.layers)
    if first < 0:
        raise ValueError(f"The drafter has {len(drafter.layers)} decoder layers and the target only "
                         f"{len(decoder.layers)}: use --layer-init random, or fewer --drafter-layers.")
    for layer, source in zip(drafter.layers, decoder.layers[first:]):
        own = layer.state_dict()
        weights = {name: value for name, value in source.state_dict().items() if name in own}
        wrong = [name for name, value in weights.items() if value.shape != own[name].shape]
        if wrong or not weights:
            what = ", ".join(wrong) or "no weight names in common"
            raise ValueError(f"The target's decoder layers do not fit the drafter's ({what}): use --layer-init "
                             "random.")
        layer.load_state_dict(weights, strict=False)
    drafter.norm.load_state_dict(decoder.norm.state_dict())
