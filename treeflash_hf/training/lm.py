"""Causal-LM pre-training (the reference target and the small AR draft LM) on a token stream."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import TokenStream
from .loop import LossTerms, LoopConfig, Shard, train_loop


def lm_loss(model, batch: torch.LongTensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of `batch [B, T + 1]`: nats per token ("mean") or summed over the `B * T`
    predicted tokens ("sum")."""
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                           reduction=reduction)


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """Cross-entropy in nats per token -> bits per byte of the text (tokenizer-independent)."""
    return nats_per_token / math.log(2) / bytes_per_token


def train_lm(model, train: TokenStream, heldout: dict[str, tuple[TokenStream, float]], config: LoopConfig,
             description: str = "lm") -> dict:
    """Train `model` on `train`; evaluation reports, per held-out set `name -> (stream, bytes per token)`,
    cross-entropy (`<name>_ce_nats`) and bits per byte (`<name>_bits_per_byte`), both per token over all the
    set's evaluation windows."""
    eval_sets = {name: (stream.eval_batches(config.batch_size, num_batches=8), bytes_per_token)
                 for name, (stream, bytes_per_token) in heldout.items()}

    def loss_fn(step: int, shard: Shard) -> LossTerms:
        batch = train.batch(step, config.batch_size)[shard.rows(config.batch_size)].to(model.device)
        predicted = batch[:, 1:].numel()
        return LossTerms(lm_loss(model, batch, reduction="sum"), predicted, tokens=batch.numel())

    def eval_fn(shard: Shard) -> dict[str, tuple]:
        metrics = {}
        for name, (batches, bytes_per_token) in eval_sets.items():
            nats, predicted = 0.0, 0
            for batch in batches:
                rows = batch[shard.rows(len(batch))]
                if len(rows):
                    nats += lm_loss(model, rows.to(model.device), reduction="sum").item()
                    predicted += rows[:, 1:].numel()
            metrics[f"{name}_ce_nats"] = (nats, predicted)
            metrics[f"{name}_bits_per_byte"] = (bits_per_byte(nats, bytes_per_token), predicted)
        return metrics

    return train_loop(model, loss_fn, eval_fn, config, description)
