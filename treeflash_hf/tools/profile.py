"""`treeflash-hf profile`: where the time of one decode step goes (target forward vs. drafting vs. tree
building vs. acceptance vs. cache work), on random-init models of a chosen size or on the bundled pair; and
(`--cost-table`) what verifying T tokens and one drafter forward cost relative to one target token, per model shape
and dtype, on this device: the measurements a reference pair's proportions are chosen from. No download."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..engine import decode, trace

from ..arguments import add_pair_argument, positive_int, tree_budget
from ..engine.budget import measure_verify_cost
from ..engine.draft import TreeDrafter
from ..engine.options import TreeOptions
from ..recipes.testing import matching_drafter, random_target

STAGES = {  # what each engine range is called in the report; nested ones are indented
    trace.DRAFT: "draft (drafter forward + marginals)",
    trace.DRAFTER_FORWARD: "  of which the drafter forward",
    trace.TREE: "tree (AR tables + best-first)",
    trace.VERIFY: "verify (masks, inputs, target forward)",
    trace.TARGET_FORWARD: "  of which the target forward",
    trace.ACCEPT: "accept",
    trace.COMMIT: "commit (cache compaction, context)",
}


def stage_seconds(events) -> dict[str, float]:
    """Seconds spent in each of the engine's ranges (`engine/trace.py`) among the profiler's `events`, the decode
    steps' only: a target forward inside the prefill counts as prefill."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name == trace.PREFILL or event.name in STAGES and not (
                event.cpu_parent is not None and event.cpu_parent.name == trace.PREFILL):
            totals[event.name] += event.cpu_time_total / 1e6
    return totals


@contextlib.contextmanager
def profiler_without_native_log(activities=None):
    """`torch.profiler.profile` (over the CPU unless `activities` says more), without the lines its native side
    writes to stderr at start and stop (torch 2.13 logs "USDT: ... profiler_start"); everything else written to
    stderr meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with torch.profiler.profile(activities=activities or [torch.profiler.ProfilerActivity.CPU]) as profiler:
                yield profiler
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def profile_budget(target, drafter, prompt, budget: int | str, mode: str, new_tokens: int
                   ) -> tuple[dict, int, float]:
    """Per-stage seconds of decoding `prompt` with the drafter alone (no lookup branch), the number of steps, and
    the decode loop's wall time (the prefill excluded), from the engine's profiler ranges."""
    with profiler_without_native_log() as profiler:
        start = time.perf_counter()
        out = decode.treeflash_generate(target, drafter, prompt, max_new_tokens=new_tokens, tree_mode=mode,
                                        tree_budget=budget, tree_lookup=0)  # the drafter pipeline only
        wall = time.perf_counter() - start
    totals = stage_seconds(profiler.events())
    return totals, len(out.tree_sizes), wall - totals.pop(trace.PREFILL, 0.0)


# calls whose result the host reads from the device: each one a synchronisation on an accelerator
HOST_READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
                        "masked_select", "unique", "unique_consecutive"})


def is_mask_index(index) -> bool:
    """A boolean-tensor index (a data-dependent shape), alone or in a tuple."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class HostReads(TorchFunctionMode):
    """Counts, while active, the torch calls that make the host read the device: `.tolist()`, `.item()`, `int()` /
    `bool()` / `float()` of a tensor, and data-dependent shapes (`nonzero`, boolean-mask indexing, `unique`). On a
    CPU they cost little; on an accelerator each one stops the host until the device catches up."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in ("__getitem__", "__setitem__") and len(args) > 1 and is_mask_index(args[1])):
            self.count += 1
        return func(*args, **(kwargs or {}))


def ancestors(event):
    while event.cpu_parent is not None:
        event = event.cpu_parent
        yield event


# aten operators that only make a new view of a tensor's storage or read its metadata: no kernel runs for them on an
# accelerator (they still cost the host a dispatch)
VIEW_OPS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "select", "slice", "narrow", "expand", "expand_as",
    "unsqueeze", "squeeze", "t", "transpose", "permute", "unbind", "split", "chunk", "alias", "detach", "view_as",
    "lift_fresh", "result_type", "size", "stride", "dim", "numel", "is_nonzero"))
# ... and these, when they call nothing below them (a `.to()` to the tensor's own device and dtype, a reshape of a
# contiguous tensor, an `.contiguous()` of a contiguous one)
VIEW_OPS_WHEN_ALONE = frozenset({"aten::to", "aten::reshape", "aten::contiguous", "aten::type_as"})


def launches_kernels(event) -> bool:
    """Whether an operator event does work on the device (not a view, not a no-op conversion)."""
    if event.name in VIEW_OPS:
        return False
    return not (event.name in VIEW_OPS_WHEN_ALONE and not event.cpu_children)


def step_counts(events) -> dict:
    """From the profiler's events of one decoding call: decode steps (verifications), the engine's operators (aten
    operators dispatched outside the target's and the drafter's forwards and outside the prefill, counted at the top
    level: an operator another one calls is part of it) that do work on the device (`engine_ops`; on an accelerator
    each is at least one kernel launch) and all of them (`engine_calls`, views included), the forwards' operators,
    and seconds per range."""
    counts = {"steps": 0, "engine_ops": 0, "engine_calls": 0, "forward_ops": 0, "seconds": defaultdict(float)}
    for event in events:
        if event.name.startswith("treeflash::"):
            inside_prefill = any(parent.name == trace.PREFILL for parent in ancestors(event))
            if not inside_prefill:
                counts["seconds"][event.name] += event.cpu_time_total / 1e6
                counts["steps"] += event.name == trace.VERIFY
            continue
        if not event.name.startswith("aten::") or (event.cpu_parent is not None and
                                                   event.cpu_parent.name.startswith("aten::")):
            continue
        names = {parent.name for parent in ancestors(event)}
        if trace.PREFILL in names:
            continue
        if names & set(trace.FORWARDS):
            counts["forward_ops"] += launches_kernels(event)
        else:
            counts["engine_calls"] += 1
            counts["engine_ops"] += launches_kernels(event)
    return counts


def ops_profile(target, drafter, prompt: torch.LongTensor, batch: int, budget: int | str, mode: str,
                new_tokens: int) -> dict:
    """Per decode step of greedy TreeFlash decoding (no lookup branch) of `batch` copies of `prompt [1, S]`: host
    reads, the engine's operators, the forwards' operators, and the engine's share of the step's time. Host reads of
    the prefill (a call that stops after its first token) are subtracted."""
    prompts = prompt.expand(batch, -1)

    def decode_prompts(max_new_tokens: int):
        reads = HostReads()
        with profiler_without_native_log() as profiler, reads:
            start = time.perf_counter()
            out = decode.treeflash_generate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                                   tree_mode=mode, tree_budget=budget, tree_lookup=0, pad_token_id=0)
            wall = time.perf_counter() - start
        return out, reads.count, profiler.events(), wall

    decode_prompts(8)  # warm-up (and, under "auto", the cost curve)
    _, prefill_reads, _, _ = decode_prompts(1)
    out, reads, events, wall = decode_prompts(new_tokens)
    counts = step_counts(events)
    steps = max(counts["steps"], 1)
    seconds = counts["seconds"]
    step_seconds = wall - seconds[trace.PREFILL]
    forward_seconds = seconds[trace.TARGET_FORWARD] + seconds[trace.DRAFTER_FORWARD]
    return {"batch": batch, "budget": budget, "steps": counts["steps"],
            "tau": float(out.tau), "host_reads": (reads - prefill_reads) / steps,
            "engine_ops": counts["engine_ops"] / steps, "engine_calls": counts["engine_calls"] / steps,
            "forward_ops": counts["forward_ops"] / steps,
            "step_ms": step_seconds / steps * 1e3, "engine_share": 1 - forward_seconds / step_seconds}


def run_ops(args: argparse.Namespace) -> int:
    target, drafter, prompt, description = profiled_pair(args)
    print(f"{description}; {args.threads} threads; mode {args.mode}; {args.new_tokens} new tokens")
    rows = []
    print("| batch | budget | steps | tau | host reads / step | engine ops / step | engine calls / step | "
          "forward ops / step | step ms | engine share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for batch, budget in zip(args.batches, args.budgets) if len(args.budgets) == len(args.batches) else (
                (b, g) for b in args.batches for g in args.budgets):
            row = ops_profile(target, drafter, prompt, batch, budget, args.mode, args.new_tokens)
            rows.append(row)
            print(f"| {batch} | {budget} | {row['steps']} | {row['tau']:.2f} | {row['host_reads']:.1f} | "
                  f"{row['engine_ops']:.0f} | {row['engine_calls']:.0f} | {row['forward_ops']:.0f} | {row['step_ms']:.1f} | "
                  f"{100 * row['engine_share']:.0f}% |", flush=True)
    print("(per decode step, the prefill excluded; host reads: .tolist()/.item()/int()/bool() of tensors and "
          "data-dependent shapes, each a sync on an accelerator; ops: aten operators dispatched at the top level "
          "that do work on the device (views and no-op conversions left out), the engine's outside the target's and "
          "the drafter's forwards; calls: the engine's operators, views included)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


@torch.no_grad()
def measure_drafter_forward(target, drafter, past_len: int = 300, new_context: int = 3, repeats: int = 15) -> float:
    """Median seconds of one drafter forward (block of `block_size`, `new_context` new context positions, on top of
    `past_len` cached ones): the drafter model alone, without the target's head."""
    generator = TreeDrafter(drafter, target, TreeOptions())
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    block = drafter.config.block_size
    embeds = generator.embed(torch.zeros(1, block, dtype=torch.long, device=drafter.device))
    position = past_len
    drafter(noise_embeds=embeds, context_hidden_states=torch.randn(1, past_len, width, dtype=drafter.dtype),
            position_ids=torch.arange(past_len + block)[None], cache=generator.cache)
    generator.cache.crop(-block)
    times = []
    for _ in range(repeats + 2):  # the first two warm up
        context = torch.randn(1, new_context, width, dtype=drafter.dtype)
        positions = torch.arange(position, position + new_context + block)[None]
        start = time.perf_counter()
        drafter(noise_embeds=embeds, context_hidden_states=context, position_ids=positions, cache=generator.cache)
        times.append(time.perf_counter() - start)
        generator.cache.crop(-block)
        position += new_context
    return statistics.median(times[2:])


def training_throughput(target, dtype: torch.dtype, batch: int = 8, seq_len: int = 512, steps: int = 3) -> float:
    """Tokens per second of causal-LM training steps (AdamW) of a copy of `target` in float32 under autocast in
    `dtype` (float32: no autocast), batch `[batch, seq_len]`."""
    import copy

    import torch.nn.functional as F

    model = copy.deepcopy(target).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq_len + 1))
    times = []
    for _ in range(steps + 1):  # the first warms up
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[:, :-1]).logits
        F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return batch * seq_len / statistics.median(times[1:])


def random_pair(layers: int, hidden: int, heads: int, dtype: torch.dtype, args: argparse.Namespace):
    """A random Qwen3 target of `layers` x `hidden` (intermediate 3H, half as many KV heads) and a matching drafter
    of `args.drafter_layers` layers and block `args.block_size`, both in `dtype`."""
    target = random_target("qwen3", vocab_size=args.vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                           num_kv_heads=max(1, heads // 2), intermediate_size=3 * hidden).to(dtype)
    drafter = matching_drafter(target, num_layers=args.drafter_layers, block_size=args.block_size).to(dtype)
    return target, drafter


def cost_row(layers: int, hidden: int, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """One line of the cost table: `random_pair` of `layers` x `hidden` (head dim 64) in `dtype`. Every ratio is
    measured here."""
    target, drafter = random_pair(layers, hidden, max(1, hidden // 64), dtype, args)
    sizes = sorted({1, *args.verify_sizes})
    costs = measure_verify_cost(target, sizes=sizes, past_len=args.prompt_len)
    drafter_seconds = measure_drafter_forward(target, drafter, past_len=args.prompt_len)
    row = {"layers": layers, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
           "params_m": sum(p.numel() for p in target.parameters()) / 1e6, "token_ms": costs[1] * 1e3,
           "verify_ratio": {n: costs[n] / costs[1] for n in sizes if n > 1},
           "drafter_ms": drafter_seconds * 1e3, "drafter_share": drafter_seconds / costs[1]}
    if args.train_throughput:
        row["train_tokens_per_s"] = training_throughput(target, dtype)
    return row


def print_cost_table(rows: list[dict]) -> None:
    sizes = list(rows[0]["verify_ratio"])
    header = ["target", "dtype", "params", "1 token"] + [f"{n} tokens" for n in sizes] + ["drafter fwd"]
    if "train_tokens_per_s" in rows[0]:
        header.append("train tok/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{row['layers']} x {row['hidden']}", row["dtype"], f"{row['params_m']:.1f}M",
                 f"{row['token_ms']:.2f} ms"] + [f"{row['verify_ratio'][n]:.2f}x" for n in sizes]
        cells.append(f"{row['drafter_ms']:.2f} ms ({100 * row['drafter_share']:.0f}%)")
        if "train_tokens_per_s" in row:
            cells.append(f"{row['train_tokens_per_s']:.0f}")
        print("| " + " | ".join(cells) + " |")
    print("(the cost of verifying T tokens and of one drafter forward, relative to one target token, on a cached "
          "context; each measured here: verification the fastest of several interleaved rounds, the drafter forward "
          "the median of several runs)")


def run_cost_table(args: argparse.Namespace) -> int:
    rows = []
    for shape in args.cost_table:
        layers, hidden = (int(part) for part in shape.lower().split("x"))
        for dtype_name in args.dtypes:
            rows.append(cost_row(layers, hidden, getattr(torch, dtype_name), args))
    print_cost_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def profiled_pair(args: argparse.Namespace):
    """(target, drafter, prompt `[1, S]`, a description): the bundled pair `--pair` on a held-out prompt with
    `--bundled`, else random-init models of the chosen size on a random prompt."""
    if args.bundled:
        from .. import reference
        from ..recipes.prompt_sets import load_prompts

        target, drafter, tokenizer = reference.load(args.pair, dtype=torch.float32 if args.ops else "auto")
        prompt_set = "packages-heldout" if args.pair == "tiny" else "instruct-heldout"
        text = load_prompts(prompt_set, 1, tokenizer)[0]
        prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        description = f"the {args.pair} pair"
    else:
        target, drafter = random_pair(args.layers, args.hidden, args.heads, getattr(torch, args.dtype), args)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, args.vocab - 1, (1, args.prompt_len), generator=generator)
        description = "random Qwen3"
    params = sum(p.numel() for p in target.parameters()) / 1e6
    return target, drafter, prompt, (
        f"target: {description}, {params:.1f}M parameters, {str(target.dtype).removeprefix('torch.')}; drafter: "
        f"{drafter.config.num_hidden_layers} layers, block {drafter.config.block_size}; prompt {prompt.shape[1]} "
        "tokens")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.cost_table:
        return run_cost_table(args)
    if args.ops:
        return run_ops(args)
    target, drafter, prompt, description = profiled_pair(args)
    print(description + f"; {args.threads} threads; mode {args.mode}")
    with torch.no_grad():
        profile_budget(target, drafter, prompt, args.budgets[0], args.mode, 8)  # warm-up
        start = time.perf_counter()
        target.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        plain_ms = (time.perf_counter() - start) / args.new_tokens * 1e3
    print(f"plain generate(): {plain_ms:.1f} ms per token")
    for budget in args.budgets:
        # a first call of the same length warms up: under "auto" it learns the widths, as repeated calls of a
        # user's do (the state is kept on the drafter), so the profiled call shows the steady step
        profile_budget(target, drafter, prompt, budget, args.mode, args.new_tokens)
        totals, steps, wall = profile_budget(target, drafter, prompt, budget, args.mode, args.new_tokens)
        step_ms = wall / max(steps, 1) * 1e3
        print(f"\nbudget {budget}: {steps} steps, {step_ms:.1f} ms per decode step (wall, prefill excluded)")
        for name, label in STAGES.items():
            print(f"  {label:40s} {totals[name] / steps * 1e3:7.2f} ms/step  {100 * totals[name] / wall:5.1f}%")
        staged = sum(totals[name] for name, label in STAGES.items() if not label.startswith(" "))  # (not nested)
        other = wall - staged
        print(f"  {'other (lookup, emission, Python glue)':40s} {other / steps * 1e3:7.2f} ms/step  "
              f"{100 * other / wall:5.1f}%")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("profile", help="Profile the decode step on random-init models.")
    parser.add_argument("--budgets", type=tree_budget, nargs="+", default=[16, 64])
    parser.add_argument("--bundled", action="store_true",
                        help="profile a reference pair (--pair, in its run dtype) on a held-out prompt")
    add_pair_argument(parser, " (with --bundled)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the random-init models")
    parser.add_argument("--mode", default="treeflash", choices=["chain", "marginal_tree", "treeflash"])
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--vocab", type=positive_int, default=8192)
    parser.add_argument("--drafter-layers", type=positive_int, default=2)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--prompt-len", type=positive_int, default=256)
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--cost-table", nargs="+", metavar="LAYERSxHIDDEN",
                        help="instead of a step profile: the cost table of these target shapes (e.g. 12x256 16x256)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--verify-sizes", type=positive_int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--train-throughput", action="store_true",
                        help="add causal-LM training tokens/s (autocast in the dtype) to the cost table")
    parser.add_argument("--ops", action="store_true",
                        help="instead of stage times: per decode step, host reads (syncs on an accelerator), the "
                             "engine's operators and its share of the step, at each of --batches (paired with "
                             "--budgets when both have as many values, else every combination)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--json", help="write the cost table (or the --ops table) as JSON")
    parser.set_defaults(func=run)
