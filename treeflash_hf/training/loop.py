"""One training loop for every stage: accelerate (one process or DDP over several), warmup + cosine schedule,
time budget, periodic evaluation, atomic checkpoints and bit-exact resume.

`batch_size` is the global batch. With `N` processes (`accelerate launch`, `torchrun`) process `i` computes its
`Shard` of every batch through the DDP-wrapped objective; a loss is a sum plus the count it is divided by
(`LossTerms`), both summed over the processes, so the gradient, the reported loss and the metrics are those of
the global-batch mean and `N` processes follow the one-process curve up to float summation order. Only the main
process writes checkpoints; they hold the plain model, optimizer, schedule and RNG state, so a run saved with
any number of processes resumes with any other.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state, with_own_draft_vocab


@dataclass
class LoopConfig:
    """run_dir: checkpoints and curve.jsonl; max_steps: schedule length; max_minutes: stop early (and save)
    when the wall-clock budget is spent; batch_size: rows per step over all processes together; eval_every /
    save_every: in steps; resume: continue from `latest`; mixed_precision: "no", "bf16" or "fp16"
    (accelerate's autocast around every loss and evaluation; the weights and optimizer state stay float32);
    cosine_steps: where the cosine reaches `min_lr_ratio` (default `max_steps`); steps past it stay at the floor,
    so a finished schedule can be continued by raising `max_steps` alone; replan: `max_steps` is only a first
    estimate of what fits `max_minutes`, re-estimated from this run's pace at every save so the cosine ends with
    the time (a pace probed on a loaded machine otherwise leaves the rest of the budget unused)."""

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
    mixed_precision: str = "no"
    cosine_steps: int | None = None
    replan: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Shard:
    """Process `index` of `count`: it takes the contiguous rows `[index * B // count, (index + 1) * B // count)`
    of every global batch of `B` rows (the same `batch(step, B)` on every process)."""

    index: int = 0
    count: int = 1

    def rows(self, batch_size: int) -> slice:
        return slice(self.index * batch_size // self.count, (self.index + 1) * batch_size // self.count)


@dataclass
class LossTerms:
    """One process's share of a loss over a global batch. The global loss is `sum(loss_sum) / sum(weight)`
    over the processes (e.g. summed token cross-entropy over the token count); each metric
    `name -> (numerator, denominator)` is likewise summed over the processes before dividing. tokens: input
    tokens in this share."""

    loss_sum: torch.Tensor  # scalar, carries the gradient
    weight: torch.Tensor | float
    metrics: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]] = field(default_factory=dict)
    tokens: int = 0


def lr_factor(step: int, config: LoopConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    cosine_steps = config.cosine_steps or config.max_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, cosine_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def replanned_steps(step: int, steps_this_run: int, elapsed: float, max_minutes: float) -> int:
    """The schedule length that spends what is left of `max_minutes` at the pace of this run so far
    (`steps_this_run` steps in `elapsed` seconds); never shorter than the next step."""
    pace = elapsed / max(1, steps_this_run)
    return max(step + 1, step + int((max_minutes * 60 - elapsed) / pace))


def ratios(totals: dict[str, tuple[float, float]]) -> dict[str, float]:
    """`name -> numerator / denominator` (a zero denominator, e.g. an all-masked batch, counts as 1e-6)."""
    return {name: num / max(den, 1e-6) for name, (num, den) in totals.items()}


class _Objective(torch.nn.Module):
    """A step's whole loss as the forward of one module, the one DDP wraps: every trainable parameter the loss
    reaches (the drafter's AR layer and final norm are called outside the drafter's own forward) belongs to
    `model`, so DDP averages all their gradients during backward."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[int, Shard], LossTerms], shard: Shard,
                 global_sums: Callable[[list], list[float]]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.shard = shard
        self.global_sums = global_sums

    def forward(self, step: int) -> tuple[torch.Tensor, dict[str, float], int]:
        """Returns this process's loss to backpropagate, the global-batch loss and metrics, the global tokens."""
        terms = self.loss_fn(step, self.shard)
        names = list(terms.metrics)
        totals = self.global_sums([terms.loss_sum.detach(), terms.weight, terms.tokens]
                                  + [value for name in names for value in terms.metrics[name]])
        loss_total, weight_total, tokens = totals[0], max(totals[1], 1e-6), totals[2]
        # DDP averages the processes' gradients: scale by the process count so that the average is the
        # gradient of sum(loss_sum) / sum(weight), the global-batch loss.
        loss = terms.loss_sum / (weight_total / self.shard.count)
        metrics = ratios({name: (totals[3 + 2 * i], totals[4 + 2 * i]) for i, name in enumerate(names)})
        return loss, {"loss": loss_total / weight_total, **metrics}, int(tokens)


def new_accelerator(on_cpu: bool, mixed_precision: str):
    """An `Accelerator` for one training. accelerate keeps one state per Python process and refuses a second
    `Accelerator` with another mixed precision; in a single-process run (several trainings in one process:
    ablations, recalibrations, tests) that state is started afresh instead. Launched processes keep theirs."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    earlier = AcceleratorState._shared_state.get("_mixed_precision")
    if earlier not in (None, mixed_precision) and PartialState().num_processes == 1:
        AcceleratorState._reset_state()
    return Accelerator(cpu=on_cpu, mixed_precision=mixed_precision)


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[int, Shard], LossTerms],
    eval_fn: Callable[[Shard], dict[str, tuple]] | None,
    config: LoopConfig,
    description: str = "train",
) -> dict:
    """Train the parameters of `model` that require grad. `loss_fn(step, shard)` returns the `LossTerms` of this
    process's rows of global batch `step`; `eval_fn(shard)` returns held-out metrics `name -> (numerator,
    denominator)` over this process's rows. Returns a summary with the curve (global-batch values)."""
    from accelerate.utils import DistributedType, gather_object

    config = replace(config)  # (a replan changes its max_steps: the caller's config stays as given)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    on_cpu = next(model.parameters()).device.type == "cpu"
    accelerator = new_accelerator(on_cpu, config.mixed_precision)
    unsupported = {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}
    if accelerator.distributed_type in unsupported:
        raise ValueError(
            f"Training runs in one process or with DDP over several (`accelerate launch --multi_gpu`, `torchrun`); "
            f"{accelerator.distributed_type} is not supported: checkpoints hold the full, unsharded model and "
            "optimizer state. Launch without an FSDP/DeepSpeed accelerate config.")
    shard = Shard(accelerator.process_index, accelerator.num_processes)
    if config.batch_size < shard.count:
        raise ValueError(f"batch_size {config.batch_size} is the global batch: it needs at least one row for each "
                         f"of the {shard.count} processes.")
    if shard.count > 1:
        accelerator.print(f"{description}: {shard.count} processes ({accelerator.distributed_type}), global batch "
                          f"{config.batch_size} rows")

    def global_sums(values: list) -> list[float]:
        local = torch.tensor([float(value) for value in values], dtype=torch.float64, device=accelerator.device)
        return (accelerator.reduce(local, reduction="sum") if shard.count > 1 else local).tolist()

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    objective, optimizer = accelerator.prepare(_Objective(model, loss_fn, shard, global_sums), optimizer)

    start_step, curve, runs = 0, [], []  # runs: steps, tokens and minutes of each earlier run of this schedule
    if config.resume and (checkpoint := latest_checkpoint(run_dir)) is not None:
        state = load_checkpoint(checkpoint)
        model.load_state_dict(with_own_draft_vocab(model, state["model"]))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_step, curve, runs = state["step"], state.get("curve", []), state.get("runs", [])
        if config.replan and "max_steps" in state:  # the last plan, until this run has a pace of its own
            config.max_steps = state["max_steps"]
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")

    def this_run() -> dict:
        return {"from_step": start_step, "to_step": step, "tokens": tokens_seen,
                "minutes": (time.time() - started) / 60}

    def save(step: int) -> None:
        """The main process writes; the others wait until the checkpoint is complete."""
        if accelerator.is_main_process:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "curve": curve, "runs": runs + [this_run()],
                     "max_steps": config.max_steps}
            meta = {"config": asdict(config), "description": description, "num_processes": shard.count}
            save_checkpoint(run_dir, step, state, meta)
            (run_dir / "curve.jsonl").write_text("".join(json.dumps(row) + "\n" for row in curve))
        accelerator.wait_for_everyone()

    def evaluate() -> dict[str, float]:
        objective.eval()
        with torch.no_grad(), accelerator.autocast():
            local = eval_fn(shard)
        objective.train()
        names = list(local)
        if shard.count > 1:  # a process whose share of every held-out batch is empty has no names
            names = list(dict.fromkeys(name for process_names in gather_object([names]) for name in process_names))
        local = {name: local.get(name, (0.0, 0.0)) for name in names}
        totals = global_sums([value for name in names for value in local[name]])
        return ratios({name: (totals[2 * i], totals[2 * i + 1]) for i, name in enumerate(names)})

    started = time.time()
    tokens_seen, step = 0, start_step
    bar = tqdm(total=config.max_steps, initial=start_step, desc=description, disable=not accelerator.is_main_process)
    objective.train()
    while step < config.max_steps:
        with accelerator.autocast():
            loss, metrics, tokens = objective(step)
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
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
        row = {"step": step, "loss": metrics.pop("loss"), "lr": scheduler.get_last_lr()[0], **metrics}
        out_of_time = config.max_minutes is not None and elapsed > config.max_minutes * 60
        if config.max_minutes is not None and shard.count > 1:  # every process stops at the same step
            out_of_time = global_sums([out_of_time])[0] > 0
        if eval_fn is not None and (step % config.eval_every == 0 or step == config.max_steps or out_of_time):
            row.update({f"eval_{k}": v for k, v in evaluate().items()})
            accelerator.print(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items()
                                                           if k.startswith("eval_")))
        curve.append(row)
        if step % config.save_every == 0 or step == config.max_steps or out_of_time:
            if config.replan and config.max_minutes is not None and not out_of_time and step < config.max_steps:
                planned = replanned_steps(step, step - start_step, elapsed, config.max_minutes)
                if shard.count > 1:  # the main process's plan, on every process
                    planned = int(global_sums([planned if accelerator.is_main_process else 0])[0])
                config.max_steps = bar.total = planned
            save(step)
        if out_of_time:
            accelerator.print(f"time budget of {config.max_minutes} min spent at step {step}")
            break
    bar.close()
    model.eval()
    all_runs = runs + [this_run()]  # a resumed schedule reports the totals of all its runs
    return {"steps": step, "minutes": sum(run["minutes"] for run in all_runs),
            "tokens": sum(run["tokens"] for run in all_runs), "runs": all_runs, "curve": curve}
