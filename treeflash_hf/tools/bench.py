"""`treeflash-hf bench`: τ and wall-clock speedup of every method, measured side by side in one run.

Methods run on the same target, prompts and token budget, interleaved per prompt (prompt -> repeat -> method),
so machine drift hits every method alike. τ is measured the same way for every method: tokens emitted per
target forward after the prefill, `(new_tokens - 1) / (target_forwards - 1)`.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import math
import hashlib
import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation import GenerationMixin

from ..arguments import add_pair_argument, add_target_quant_argument, positive_int
from ..engine.answer_store import answer_store_of, attach_answer_store
from ..engine.kernels import engine_kernel_names, engine_kernels
from ..integrations.cpu_linear import is_packed, kernels_note, stock_kernels
from ..optional import pyplot
from ..recipes.prompt_sets import PromptFileError, load_prompts

TREE_MODES = ("chain", "marginal_tree", "treeflash")
BASELINES = ("autoregressive", "stock_kernels", "engine_kernels", "compiled", "hf_assisted", "prompt_lookup",
             "hf_dflash")
# `stock_kernels`: plain decoding on torch's stock linear products, where `dtype="auto"` packed the layers for oneDNN
# (`integrations/cpu_linear.py`): what `from_pretrained` alone runs; every other method uses the packed layers
# `engine_kernels`: plain decoding inside the kernels the engine's own forwards run on (`engine/kernels.py`): what of
# a TreeFlash speedup the kernels alone would give plain decoding (left out where none applies to the target)
# `compiled`: plain decoding with a static cache and torch.compile, what a user who wants speed does first; the cache
# is sized once for every call (prompts are cut to 384 tokens), so one compiled decode graph serves every prompt
COMPILED_CACHE_LEN = 1024
# "<mode>+lookup": the same mode with the lookup branch (`tree_lookup=LOOKUP_LENGTH`, see lookup.py).
LOOKUP_SUFFIX, LOOKUP_LENGTH = "+lookup", 32
NO_STORE = "no answer store"  # the drafter key of `--without-answer-store`
LOOKUP_MODES = ("treeflash+lookup", "auto+lookup")
BASELINE_STYLES = {"autoregressive": ("black", ":"), "stock_kernels": ("tab:gray", ":"),
                   "engine_kernels": ("black", "-."), "hf_assisted": ("tab:purple", "--"),
                   "prompt_lookup": ("tab:brown", "--"), "hf_dflash": ("tab:gray", "-."), "auto": ("tab:red", "-"),
                   "auto+lookup": ("tab:orange", "-")}


@dataclass
class Method:
    name: str
    budget: int | str | None = None
    drafter: str = ""  # a key of run_bench's `drafters` (e.g. "recalibrated"); "" is the run's own drafter

    @property
    def label(self) -> str:
        label = self.name if self.budget is None else f"{self.name}@{self.budget}"
        return f"{label}[{self.drafter}]" if self.drafter else label


@dataclass
class Measurement:
    """One method over the prompts of one repeat. `row_steps`: verification steps summed over rows (a batch's
    forward is one step for each of its rows), so `(new_tokens - rows) / row_steps` is τ at any batch size."""

    seconds: float = 0.0
    new_tokens: int = 0
    row_steps: int = 0
    num_prompts: int = 0
    accepted: Counter = field(default_factory=Counter)


@dataclass
class Identity:
    """Rows compared with the target's own batch-1 greedy output: identical ones, ones that first differ at a
    near-tie of the target (top-2 logit gap within `tie_tolerance` of the run's dtype; `tie_gaps` lists those
    gaps), and ones that differ elsewhere (a lossless method has none; `other_gaps` lists (gap, tolerance) there)."""

    identical: int = 0
    near_ties: int = 0
    other: int = 0
    tie_gaps: list[float] = field(default_factory=list)
    other_gaps: list[tuple[float, float]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.other:
            return "NO"
        return "yes" if not self.near_ties else f"yes, {self.near_ties} near-tie"


def tie_tolerance(dtype: torch.dtype, magnitude: float) -> float:
    """How close two logits of about `magnitude` must be to count as a tie under `dtype`'s rounding: two units in
    the last place of the dtype there (at least 1e-5, the float32 test threshold)."""
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), 1e-30)))
    return max(1e-5, 2 * ulp)


def first_divergence_gap(target, prompt_ids: torch.LongTensor, expected: list[int], got: list[int],
                         logits_processor=None) -> tuple[float, float]:
    """(gap, tolerance) at the first new token where `got` leaves `expected`: the target's top-2 score gap there,
    computed as plain decoding does (batch 1, the same dtype, then `logits_processor` if decoding used one, e.g. a
    repetition penalty), and the tie tolerance of that dtype.

    Outside float32 the same position's logits round differently for different forward shapes (on SmolLM2 in
    bfloat16 a gap of 0.19 in a forward over the prefix was 0.03 in one over the whole reference), so a gap
    measured in one shape can hide a tie: there the gap is also taken from a forward over the whole reference
    (`expected`), and the smaller counts. In float32 the two agree, and the prefix forward alone is run."""
    index = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    prefix = torch.cat([prompt_ids, prompt_ids.new_tensor(expected[:index])])[None]
    shapes = [prefix]
    if target.dtype != torch.float32 and len(expected) > index:
        shapes.append(torch.cat([prompt_ids, prompt_ids.new_tensor(expected)])[None])
    measured = []
    with torch.no_grad():
        for ids in shapes:
            scores = target(ids).logits[:, prefix.shape[1] - 1].float()
            if logits_processor is not None:
                scores = logits_processor(prefix, scores)
            top2 = scores[0].topk(2).values
            measured.append((float(top2[0] - top2[1]), tie_tolerance(target.dtype, float(top2[0]))))
    return min(measured, key=lambda pair: pair[0] - pair[1])


def shape_noise(target, singles: list[dict], references: list[list[int]], common: dict, eos_ids: set[int],
                split: int = 16) -> Identity:
    """How plain greedy decoding itself reacts to another forward shape: each prompt's reference continuation is
    decoded again after one prefill of the prompt plus its first `split` tokens (instead of one token per forward
    there), and compared with the rest of the reference. In float32 nothing moves; in bfloat16 the rows that leave
    the reference, with their top-2 gaps, are the noise floor a speculative method's divergences are judged against."""
    identity = Identity()
    with torch.no_grad():
        for single, expected in zip(singles, references):
            if len(expected) <= split + 1:
                continue
            prompt = torch.cat([single["input_ids"][0], single["input_ids"].new_tensor(expected[:split])])
            out = target.generate(prompt[None], **{**common, "max_new_tokens": len(expected) - split})
            got = new_tokens_per_row(out, prompt.shape[0], eos_ids)[0]
            compare(identity, target, prompt, expected[split:], got)
    return identity


@contextmanager
def count_forwards(model):
    calls = [0]
    handle = model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


@contextmanager
def record_stock_acceptance(accepted: list[int]):
    """Record `n_matches` of every step of transformers' assisted loop (its candidate generators report it)."""
    original = GenerationMixin._get_candidate_generator

    def wrapped(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        update = generator.update_candidate_strategy

        def recording(input_ids, scores, num_matches):
            accepted.append(int(num_matches))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = recording
        return generator

    GenerationMixin._get_candidate_generator = wrapped
    try:
        yield
    finally:
        GenerationMixin._get_candidate_generator = original


def compiled_config():
    """transformers' compile settings for plain decoding on any device: it compiles the decode step by itself on
    accelerators only (`_compile_all_devices` is its documented switch for other devices), and CUDA graphs
    ("reduce-overhead") need a GPU."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default" if not torch.cuda.is_available() else "reduce-overhead")
    config._compile_all_devices = True
    return config


def generate_kwargs(method: Method, drafter, draft_lm) -> dict:
    if method.name in ("autoregressive", "stock_kernels", "engine_kernels"):
        return {}
    if method.name == "compiled":
        return {"cache_implementation": "static", "max_cache_len": COMPILED_CACHE_LEN,
                "compile_config": compiled_config()}
    if method.name == "hf_assisted":
        return {"assistant_model": draft_lm}
    if method.name == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 10}
    if method.name == "hf_dflash":
        return {"assistant_model": drafter, "speculation_type": "dflash"}
    mode = method.name.removesuffix(LOOKUP_SUFFIX)
    lookup = LOOKUP_LENGTH if method.name.endswith(LOOKUP_SUFFIX) else 0
    return {"assistant_model": drafter, "tree_mode": mode if mode != "auto" else "treeflash",
            "tree_budget": method.budget, "tree_lookup": lookup, "return_dict_in_generate": True}


def run_method(target, inputs, method: Method, drafter, draft_lm, common: dict):
    """Returns (sequences, seconds, target forwards, accepted drafted tokens per row-step, row-steps or None)."""
    accepted: list[int] = []
    kwargs = generate_kwargs(method, drafter, draft_lm)
    kernels = (stock_kernels(target) if method.name == "stock_kernels" else engine_kernels(target)
               if method.name == "engine_kernels" else nullcontext())
    with count_forwards(target) as calls, record_stock_acceptance(accepted), torch.no_grad(), kernels:
        start = time.perf_counter()
        out = target.generate(**inputs, **common, **kwargs)
        seconds = time.perf_counter() - start
    row_steps = None
    if not isinstance(out, torch.Tensor):
        accepted = list(out.accepted_lengths)
        row_steps = len(accepted)
        out = out.sequences
    return out, seconds, calls[0], accepted, row_steps


def new_tokens_per_row(sequences: torch.LongTensor, width: int, eos_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens, up to and including its first EOS (the padding after it dropped)."""
    rows = []
    for row in sequences[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def summarize(per_repeat: list[Measurement], reference: list[Measurement] | None, identity: Identity | None) -> dict:
    rates = [m.new_tokens / m.seconds for m in per_repeat]
    taus = [(m.new_tokens - m.num_prompts) / max(1, m.row_steps) for m in per_repeat]
    row = {
        "tau": statistics.median(taus),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "new_tokens": per_repeat[0].new_tokens,
        "n_prompts": per_repeat[0].num_prompts,
        "accepted_len_histogram": {str(k): v for k, v in sorted(per_repeat[0].accepted.items())},
    }
    if reference is not None:
        speedups = [r / (ref.new_tokens / ref.seconds) for r, ref in zip(rates, reference)]
        row.update(speedup=statistics.median(speedups), speedup_min=min(speedups), speedup_max=max(speedups))
    if identity is not None:
        row.update(identical_to_autoregressive=identity.verdict, identical_rows=identity.identical,
                   near_tie_rows=identity.near_ties, divergent_rows=identity.other, tie_gaps=identity.tie_gaps,
                   divergent_gaps=identity.other_gaps)
    return row


# transformers' assisted generation (and so these stock baselines) decodes one sequence at a time
BATCH_ONE_ONLY = ("hf_assisted", "prompt_lookup", "hf_dflash")


def encode_batches(tokenizer, prompts: list[str], batch_size: int, max_prompt_tokens: int, device) -> list[dict]:
    """Prompts in groups of `batch_size`, each group left-padded (batch 1: the bare prompt, no mask)."""
    batches = []
    for start in range(0, len(prompts), batch_size):
        rows = [tokenizer(p, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
                for p in prompts[start : start + batch_size]]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        batch = {"input_ids": ids}
        if batch_size > 1:
            batch["attention_mask"] = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows],
                                                   device=device)
        batches.append(batch)
    return batches


def run_bench(target, drafter, draft_lm, tokenizer, prompts: list[str], methods: list[Method], max_new_tokens: int,
              temperature: float, repeats: int, max_prompt_tokens: int = 384, progress: bool = True,
              batch_size: int = 1, drafters: dict | None = None, measure_shape_noise: bool = True) -> dict:
    """Every method on the same prompts, interleaved per batch (batch -> repeat -> method). Greedy runs compare
    every row with the target's own batch-1 output for that prompt (`Identity`). `drafters`: other drafters for
    the methods that name one (`Method.drafter`)."""
    drafters = {"": drafter, **(drafters or {})}
    from tqdm.auto import tqdm

    greedy = temperature == 0
    common = {"max_new_tokens": max_new_tokens, "do_sample": not greedy, "pad_token_id": tokenizer.pad_token_id}
    if not greedy:
        common["temperature"] = temperature
    if batch_size > 1 and (skipped := [m.label for m in methods if m.name in BATCH_ONE_ONLY]):
        print(f"batch size {batch_size}: skipping {skipped} (transformers' assisted generation takes batch size 1)")
        methods = [m for m in methods if m.name not in BATCH_ONE_ONLY]
    if not is_packed(target) and any(m.name == "stock_kernels" for m in methods):
        print("skipping stock_kernels: the target's linear layers run torch's stock kernels already "
              "(packed for oneDNN only under --dtype auto, where timed faster)")
        methods = [m for m in methods if m.name != "stock_kernels"]
    if not engine_kernel_names(target) and any(m.name == "engine_kernels" for m in methods):
        print("skipping engine_kernels: none of the engine's kernels applies to this target (its forwards run the "
              "model's own)")
        methods = [m for m in methods if m.name != "engine_kernels"]
    eos_ids = set(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, list)
                  else [target.generation_config.eos_token_id])
    batches = encode_batches(tokenizer, prompts, batch_size, max_prompt_tokens, target.device)
    singles = encode_batches(tokenizer, prompts, 1, max_prompt_tokens, target.device)
    # the target's own batch-1 greedy output per prompt: what every method must reproduce. At batch size 1 the
    # `autoregressive` method's first run is that very call: it runs first on each prompt and its rows are kept.
    from_plain_method = greedy and batch_size == 1 and any(m.name == "autoregressive" for m in methods)
    if from_plain_method:
        methods = sorted(methods, key=lambda m: m.name != "autoregressive")
    references: list[list[int] | None] = [None] * len(singles)
    if greedy and not from_plain_method:
        with torch.no_grad():
            for index, single in enumerate(singles):
                out = target.generate(**single, **common)
                references[index] = new_tokens_per_row(out, single["input_ids"].shape[1], eos_ids)[0]
    results = {m.label: [Measurement() for _ in range(repeats)] for m in methods}
    identity = {m.label: Identity() for m in methods}
    for method in methods:  # warm-up: first calls pay one-time costs (compilation; "auto" measures its cost curve)
        run_method(target, batches[0], method, drafters[method.drafter], draft_lm, {**common, "max_new_tokens": 8})
    bar = tqdm(total=len(batches) * repeats * len(methods), desc="bench", disable=not progress)
    for batch_index, inputs in enumerate(batches):
        width = inputs["input_ids"].shape[1]
        for repeat in range(repeats):
            for method in methods:
                out, seconds, forwards, accepted, row_steps = run_method(target, inputs, method,
                                                                         drafters[method.drafter], draft_lm, common)
                rows = new_tokens_per_row(out, width, eos_ids)
                measurement = results[method.label][repeat]
                measurement.seconds += seconds
                measurement.new_tokens += sum(len(row) for row in rows)
                measurement.num_prompts += len(rows)
                if row_steps is None:  # a stock loop: one row, one verification per forward after the prefill
                    plain = len(rows) > 1 or method.name == "compiled"  # (a compiled step may bypass forward hooks)
                    row_steps = sum(len(row) - 1 for row in rows) if plain else max(0, forwards - 1)
                measurement.row_steps += row_steps
                if repeat == 0:
                    measurement.accepted.update(accepted)
                if from_plain_method and repeat == 0 and method.name == "autoregressive":
                    references[batch_index] = rows[0]
                if greedy and repeat == 0:
                    for offset, row in enumerate(rows):
                        prompt_index = batch_index * batch_size + offset
                        compare(identity[method.label], target, singles[prompt_index]["input_ids"][0],
                                references[prompt_index], row)
                bar.update(1)
    bar.close()
    reference = results.get("autoregressive")
    noise = None
    if measure_shape_noise and greedy and batch_size == 1:
        noise = shape_noise(target, singles, references, common, eos_ids)
    table = {}
    for method in methods:
        table[method.label] = {"method": method.name, "budget": method.budget, "drafter": method.drafter, **summarize(
            results[method.label], reference, identity[method.label] if greedy else None)}
    shape = None if noise is None else {"identical_rows": noise.identical, "near_tie_rows": noise.near_ties,
                                        "divergent_rows": noise.other, "tie_gaps": noise.tie_gaps,
                                        "divergent_gaps": noise.other_gaps}
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "repeats": repeats,
            "plain_under_another_forward_shape": shape,
            "batch_size": batch_size, "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
            "packed_linear": is_packed(target),
            "threads": torch.get_num_threads(), "results": table}


def compare(identity: Identity, target, prompt_ids: torch.LongTensor, expected: list[int], got: list[int]) -> None:
    """Count one row into `identity`: identical, diverging at a near-tie of the target, or diverging elsewhere."""
    if got == expected:
        identity.identical += 1
        return
    gap, tolerance = first_divergence_gap(target, prompt_ids, expected, got)
    if gap <= tolerance:
        identity.near_ties += 1
        identity.tie_gaps.append(gap)
    else:
        identity.other += 1
        identity.other_gaps.append((gap, tolerance))


def print_table(report: dict) -> None:
    print(f"\n{'method':24s} {'budget':>6s} {'tau':>6s} {'tok/s':>8s} {'(min-max)':>15s} {'speedup':>8s} identical")
    for label, row in report["results"].items():
        spread = f"{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}"
        same = row.get("identical_to_autoregressive")
        print(f"{row['method']:24s} {str(row['budget'] or '-'):>6s} {row['tau']:6.2f} {row['tokens_per_s']:8.1f} "
              f"{spread:>15s} {row.get('speedup', float('nan')):7.2f}x {'' if same is None else same}")
    kernels = kernels_note(bool(report.get("packed_linear")))
    print(f"(batch size {report.get('batch_size', 1)}, {report.get('dtype', '')}{kernels}, target quantization "
          f"{report.get('target_quant', 'none')}; identical: every row equals the "
          "target's own batch-1 greedy output; a near-tie is a first difference where the target's top-2 logits are "
          "within its dtype's rounding)")
    if store := report.get("answer_store"):
        compared = any(row.get("drafter") == NO_STORE for row in report["results"].values())
        print(f"+lookup modes: the branch also comes from the drafter's answer store ({store.get('answers', '?')} "
              f"answers, {store['tokens']} tokens)" + (f"; [{NO_STORE}]: the same without it" if compared else ""))
    if noise := report.get("plain_under_another_forward_shape"):
        gaps = ", ".join(f"{g:.3g}" for g in noise["tie_gaps"] + [g for g, _ in noise["divergent_gaps"]]) or "-"
        print(f"plain decoding under another forward shape (prompt + first 16 tokens as one prefill): "
              f"{noise['identical_rows']} rows identical, {noise['near_tie_rows']} near-ties, "
              f"{noise['divergent_rows']} other divergences (top-2 gaps at first divergence: {gaps})")


def plot(report: dict, out_dir: Path) -> list[Path]:
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["results"].values()
    written = []
    for key, ylabel, name in (("tau", "τ (tokens per target forward)", "tau_vs_budget.png"),
                              ("speedup", "speedup vs autoregressive", "speedup_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in TREE_MODES + LOOKUP_MODES:
            points = sorted((r["budget"], r[key]) for r in rows
                            if r["method"] == mode and isinstance(r["budget"], int) and not r.get("drafter"))
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        for r in rows:
            if r["method"] in BASELINE_STYLES and key in r and not r.get("drafter"):
                color, style = BASELINE_STYLES[r["method"]]
                ax.axhline(r[key], linestyle=style, linewidth=1.2, label=r["method"], color=color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (tokens verified per step, root included)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def uses_drafter(name: str) -> bool:
    """Whether method `name` drafts with the TreeFlash drafter."""
    base = name.removesuffix(LOOKUP_SUFFIX)
    return base in TREE_MODES or base == "auto" or name == "hf_dflash"


def with_drafter(methods: list[Method], key: str) -> list[Method]:
    """`methods`, then again every one that drafts (`uses_drafter`) with the drafter `key` of run_bench's
    `drafters`."""
    return methods + [Method(m.name, m.budget, key) for m in methods if uses_drafter(m.name)]


def parse_methods(modes: list[str], budgets: list[int]) -> list[Method]:
    methods = []
    for mode in modes:
        base = mode.removesuffix(LOOKUP_SUFFIX)
        with_lookup = base != mode
        if base in TREE_MODES and not (with_lookup and base == "chain"):  # a chain has no branch to add to
            methods.extend(Method(mode, budget) for budget in budgets)
        elif base == "auto":
            methods.append(Method(mode, "auto"))
        elif mode in BASELINES:
            methods.append(Method(mode))
        else:
            raise SystemExit(f"Unknown method {mode!r}: use {BASELINES + TREE_MODES + ('auto',) + LOOKUP_MODES}.")
    if not any(m.name == "autoregressive" for m in methods):
        methods.insert(0, Method("autoregressive"))
    return methods


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import treeflash_hf  # noqa: F401

    from .. import reference
    from ..integrations.quantize import describe, quantize_target

    torch.set_num_threads(args.threads)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    if dtype == "auto" and args.target_quant != "none":
        dtype = torch.float32  # the quantized kernels compute in float32 here unless --dtype asks for bfloat16
    if args.target:
        if not args.drafter:
            raise SystemExit("error: --target needs --drafter (a drafter trained for that target).")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        if dtype == "auto":
            (target,) = reference.run_fast_on_cpu(target)
    else:  # the pair's target, and its drafter unless --drafter names another one trained for it
        target, drafter, tokenizer = reference.load(args.pair, dtype=dtype)
    if args.drafter:
        drafter = AutoModel.from_pretrained(args.drafter, dtype=target.dtype).eval()
        if dtype == "auto":
            (drafter,) = reference.run_fast_on_cpu(drafter)
    try:
        target = quantize_target(target, args.target_quant, compute_dtype=target.dtype)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        prompts = load_prompts(args.prompts, args.num_prompts, tokenizer)
    except PromptFileError as err:
        raise SystemExit(f"error: {err}") from None
    methods = parse_methods(args.modes, args.budgets)
    drafters = {}
    if args.recalibrated:  # the same drafter-based methods again with the recalibrated drafter, side by side
        drafters["recalibrated"] = AutoModel.from_pretrained(args.recalibrated, dtype=target.dtype).eval()
        methods = with_drafter(methods, "recalibrated")
    if args.without_answer_store:  # the lookup modes again, their branch from each row's own text alone
        drafters[NO_STORE] = copy.copy(drafter)  # (the same weights; its own learned state and attachments)
        attach_answer_store(drafters[NO_STORE], None)
        methods = methods + [Method(m.name, m.budget, NO_STORE) for m in methods if m.name in LOOKUP_MODES]
    draft_lm = None
    if any(m.name == "hf_assisted" for m in methods) and args.batch_size == 1:
        if args.draft_lm:
            draft_lm = AutoModelForCausalLM.from_pretrained(args.draft_lm, dtype=target.dtype).eval()
        elif args.pair == "tiny" and not args.target:
            draft_lm = reference.load_draft_lm(dtype=target.dtype)
        else:  # SmolLM2-135M is its family's smallest model: no AR draft model shares its vocabulary here
            print("hf_assisted skipped: it needs an AR draft model with the target's vocabulary (--draft-lm DIR)")
            methods = [m for m in methods if m.name != "hf_assisted"]
    report = run_bench(target, drafter, draft_lm, tokenizer, prompts, methods, args.max_new_tokens,
                       args.temperature, args.repeats, batch_size=args.batch_size, drafters=drafters)
    report["prompts"] = args.prompts
    store = answer_store_of(drafter) if isinstance(drafter, torch.nn.Module) else None
    report["answer_store"] = None if store is None else {"tokens": len(store), **store.metadata}
    report["target_quant"], report["target_quant_backend"] = args.target_quant, describe(args.target_quant)
    print_table(report)
    write_report(report, args.json, args.plot, plot)
    return 0


def write_report(report: dict, json_path: str | None, plot_dir: str | None, plot_fn) -> None:
    """Write the JSON report and the PNG plots where asked."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2))
    if plot_dir:
        for path in plot_fn(report, Path(plot_dir)):
            print(f"wrote {path}")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="τ and speedup of every method, side by side.")
    parser.add_argument("--target", help="a target folder (with --drafter) instead of a --pair")
    parser.add_argument("--drafter", help="a drafter folder for the target (default: the pair's own), e.g. one "
                                          "recalibrated by `reference train-drafter --target-quant`")
    parser.add_argument("--tokenizer")
    parser.add_argument("--draft-lm", help="AR draft LM for hf_assisted (default: the bundled one)")
    add_pair_argument(parser, " (unless --target and --drafter are given)")
    parser.add_argument("--prompts", default="instruct-heldout",
                        help="instruct-heldout (chat requests: code, arithmetic, everyday questions), humaneval, "
                             "packages-heldout (code of the reserved evaluation packages), stdlib-heldout, or a "
                             "JSONL file of {\"prompt\": ...} or {\"messages\": [...]} lines")
    parser.add_argument("--modes", nargs="+", default=list(BASELINES + TREE_MODES + ("auto",) + LOOKUP_MODES),
                        help="methods; a tree mode or auto with the suffix +lookup adds the lookup branch")
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="prompts per generate() call, left-padded; autoregressive is transformers' batched "
                             "plain generate() on the same batches")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="run dtype (auto: the weights' own, bfloat16 for the bundled pair, float32 on a CPU "
                             "without arithmetic for the weights' half precision, with the linear layers through "
                             "oneDNN's packed weights where that is timed faster (an explicit dtype keeps the stock "
                             "kernels); float32 with --target-quant, where bfloat16 computes the torchao specs in "
                             "bfloat16)")
    add_target_quant_argument(parser)
    parser.add_argument("--without-answer-store", action="store_true",
                        help="run the +lookup modes a second time with the drafter's answer store detached (their "
                             "branch from each row's own text alone), side by side")
    parser.add_argument("--recalibrated", metavar="DIR",
                        help="a drafter recalibrated for --target-quant (`reference train-drafter --target-quant`): "
                             "its tree methods run next to the original drafter's")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.set_defaults(func=run)
