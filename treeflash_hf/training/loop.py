"""One training loop for every stage: accelerate, warmup + cosine schedule, time budget, periodic evaluation,
atomic checkpoints and bit-exact resume."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state


@dataclass
class LoopConfig:
    """run_dir: checkpoints and curve.jsonl; max_steps: schedule length; max_minutes: stop early (and save)
    when the wall-clock budget is spent; eval_every / save_every: in steps; resume: continue from `latest`."""

    run_dir: str
    max_steps: int = 1000
    max_minutes: float | None = None
    batch_size: int = 8
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    resume: bool = False
    extra: dict = field(default_factory=dict)


def lr_factor(step: int, config: LoopConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[int], tuple[torch.Tensor, dict, int]],
    eval_fn: Callable[[], dict] | None,
    config: LoopConfig,
    description: str = "train",
) -> dict:
    """Train the parameters of `model` that require grad. `loss_fn(step)` returns (loss, metrics, tokens seen);
    `eval_fn()` returns held-out metrics. Returns a summary with the curve."""
    from accelerate import Accelerator

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    model, optimizer = accelerator.prepare(model, optimizer)

    start_step, curve = 0, []
    if config.resume and (checkpoint := latest_checkpoint(run_dir)) is not None:
        state = load_checkpoint(checkpoint)
        accelerator.unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_step, curve = state["step"], state.get("curve", [])
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")

    def save(step: int) -> None:
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            state = {"model": unwrapped.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "curve": curve}
            save_checkpoint(run_dir, step, state, {"config": asdict(config), "description": description})
            (run_dir / "curve.jsonl").write_text("".join(json.dumps(row) + "\n" for row in curve))

    started = time.time()
    tokens_seen, step = 0, start_step
    bar = tqdm(total=config.max_steps, initial=start_step, desc=description, disable=not accelerator.is_main_process)
    model.train()
    while step < config.max_steps:
        loss, metrics, tokens = loss_fn(step)
        accelerator.backward(loss)
        if config.grad_clip:
            accelerator.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens
        elapsed = time.time() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
        row = {"step": step, "loss": loss.item(), "lr": scheduler.get_last_lr()[0], **metrics}
        out_of_time = config.max_minutes is not None and elapsed > config.max_minutes * 60
        if eval_fn is not None and (step % config.eval_every == 0 or step == config.max_steps or out_of_time):
            model.eval()
            with torch.no_grad():
                row.update({f"eval_{k}": v for k, v in eval_fn().items()})
            model.train()
            accelerator.print(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items()
                                                           if k.startswith("eval_")))
        curve.append(row)
        if step % config.save_every == 0 or step == config.max_steps or out_of_time:
            save(step)
        if out_of_time:
            accelerator.print(f"time budget of {config.max_minutes} min spent at step {step}")
            break
    bar.close()
    model.eval()
    return {"steps": step, "minutes": (time.time() - started) / 60, "tokens": tokens_seen, "curve": curve}
