"""Causal-LM pre-training (the reference target and the small AR draft LM) on a token stream."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import TokenStream
from .loop import LoopConfig, train_loop


def lm_loss(model, batch: torch.LongTensor) -> torch.Tensor:
    """Next-token cross-entropy (nats per token) of `batch [B, T + 1]`."""
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_lm(model, train: TokenStream, heldout: TokenStream, config: LoopConfig, bytes_per_token: float,
             description: str = "lm") -> dict:
    """Train `model` on `train`; evaluation reports held-out cross-entropy and bits per byte."""
    eval_batches = heldout.eval_batches(config.batch_size, num_batches=8)

    def loss_fn(step: int):
        batch = train.batch(step, config.batch_size).to(model.device)
        loss = lm_loss(model, batch)
        return loss, {}, batch.numel()

    def eval_fn():
        losses = [lm_loss(model, b.to(model.device)).item() for b in eval_batches]
        nats = sum(losses) / len(losses)
        return {"ce_nats": nats, "bits_per_byte": nats / math.log(2) / bytes_per_token}

    return train_loop(model, loss_fn, eval_fn, config, description)
