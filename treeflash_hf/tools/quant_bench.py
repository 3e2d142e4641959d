"""`treeflash-hf bench-quant`: the support matrix of quantized targets, measured in one run.

For every `--specs` backend (`quantize.py`) the pair's target (float32 compute) is quantized afresh and measured on
the same prompts as the dense target: whether a token's logits depend on the other tokens of a forward (the check
TreeFlash runs once per target), plain `generate()` tokens/s, then τ, speedup over that quantized target's own plain
`generate()`, and identity with its greedy output for each method, with the original drafter and, where
`--recalibrated SPEC=DIR` names one, a drafter recalibrated for that backend. τ is also given relative to the dense
target's τ of the same method. Writes the matrix as JSON and a plot of τ by backend.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import warnings
from pathlib import Path

import torch

from ..arguments import add_pair_argument, positive_int
from ..optional import pyplot
from .bench import Method, parse_methods, run_bench, with_drafter

RECALIBRATED = "recalibrated"


def shape_stability(target, drafter, tokenizer, prompt: str) -> tuple[bool, float]:
    """TreeFlash's once-per-target check (`verify.forward_shape_difference`) on the last tokens of `prompt`."""
    from ..engine.verify import forward_shape_difference

    tokens = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return forward_shape_difference(target, tokens, list(drafter.config.target_layer_ids), target.device)


def lossless_verdict(stable: bool, difference: float, rows: list[dict]) -> str:
    """The matrix's "lossless" cell: yes only when the logits do not depend on the forward's shape and every row of
    every method equals the quantized target's own greedy output."""
    diverged = sum(r.get("near_tie_rows", 0) + r.get("divergent_rows", 0) for r in rows)
    if stable and diverged == 0:
        return "yes"
    reasons = []
    if not stable:
        reasons.append(f"a token's logits depend on the forward (up to {difference:.3g})")
    if diverged:
        reasons.append(f"{diverged} rows differ from its own generate()")
    return "no: " + "; ".join(reasons)


def measure_spec(base, spec: str, drafter, recalibrated, tokenizer, prompts: list[str], methods: list[Method],
                 args: argparse.Namespace) -> dict:
    """One matrix row: `base` quantized by `spec`, measured (see the module docstring)."""
    from ..integrations.quantize import describe, quantize_target

    target = quantize_target(copy.deepcopy(base), spec)  # a copy: HQQ quantizes in place
    stable, difference = shape_stability(target, drafter, tokenizer, prompts[0])
    spec_methods, drafters = list(methods), {}
    if recalibrated is not None:
        spec_methods, drafters = with_drafter(methods, RECALIBRATED), {RECALIBRATED: recalibrated}
    report = run_bench(target, drafter, None, tokenizer, prompts, spec_methods, args.max_new_tokens, 0.0,
                       args.repeats, progress=False, drafters=drafters, measure_shape_noise=False)
    results = report["results"]
    del target
    gc.collect()
    return {"spec": spec, "backend": describe(spec), "logits_stable": stable, "logit_difference": difference,
            "lossless": lossless_verdict(stable, difference, list(results.values())),
            "plain_tokens_per_s": results["autoregressive"]["tokens_per_s"], "methods": results}


def print_matrix(matrix: list[dict]) -> None:
    dense = next((row for row in matrix if row["spec"] == "none"), None)
    print(f"\n{'spec':13s} {'plain tok/s':>11s}  {'method':30s} {'tau':>5s} {'vs dense':>8s} {'speedup':>8s}  lossless")
    for row in matrix:
        for label, result in row["methods"].items():
            if label == "autoregressive":
                continue
            base = dense["methods"].get(label.split("[")[0]) if dense else None
            ratio = f"{result['tau'] / base['tau']:.3f}" if base else "-"
            print(f"{row['spec']:13s} {row['plain_tokens_per_s']:11.1f}  {label:30s} {result['tau']:5.2f} {ratio:>8s} "
                  f"{result['speedup']:7.2f}x  {row['lossless']}")
        print(f"{'':13s} ({row['backend']})")


def plot_matrix(matrix: list[dict], out_dir: Path) -> Path:
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [label for label in matrix[0]["methods"] if label != "autoregressive"]
    labels += sorted({label for row in matrix for label in row["methods"] if label not in labels
                      and label != "autoregressive"})
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(matrix)), 4))
    for index, label in enumerate(labels):
        points = [(i, row["methods"][label]["tau"]) for i, row in enumerate(matrix) if label in row["methods"]]
        ax.bar([i + (index - (len(labels) - 1) / 2) * width for i, _ in points], [tau for _, tau in points], width,
               label=label)
    ax.set_xticks(range(len(matrix)), [row["spec"] for row in matrix], rotation=30, ha="right")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("τ by target quantization")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "tau_by_quantization.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_recalibrated(values: list[str]) -> dict[str, str]:
    from ..integrations.quantize import QUANT_SPECS

    pairs = {}
    for value in values:
        spec, sep, folder = value.partition("=")
        if not sep or spec not in QUANT_SPECS or not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"error: --recalibrated {value}: expected SPEC=DIR with SPEC one of "
                             f"{', '.join(QUANT_SPECS)} and DIR a drafter folder")
        pairs[spec] = folder
    return pairs


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModel

    import treeflash_hf  # noqa: F401

    from .. import reference
    from ..recipes.prompt_sets import PromptFileError, load_prompts

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="MatMul8bitLt")  # bitsandbytes on every 8-bit matmul; the matrix says it
    recalibrated_dirs = parse_recalibrated(args.recalibrated)
    base, drafter, tokenizer = reference.load(args.pair, dtype=torch.float32)
    try:
        prompts = load_prompts(args.prompts, args.num_prompts, tokenizer)
    except PromptFileError as err:
        raise SystemExit(f"error: {err}") from None
    methods = parse_methods(args.modes, args.budgets)
    matrix = []
    for spec in args.specs:
        recalibrated = None
        if spec in recalibrated_dirs:
            recalibrated = AutoModel.from_pretrained(recalibrated_dirs[spec], dtype=torch.float32).eval()
        print(f"{spec}: measuring", flush=True)
        matrix.append(measure_spec(base, spec, drafter, recalibrated, tokenizer, prompts, methods, args))
        print_matrix(matrix[-1:])
    print_matrix(matrix)
    report = {"pair": args.pair, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
              "compute_dtype": "float32", "matrix": matrix}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        print(f"wrote {plot_matrix(matrix, Path(args.plot))}")
    return 0


def add_parser(subparsers) -> None:
    from ..integrations.quantize import QUANT_SPECS

    parser = subparsers.add_parser("bench-quant", help="the quantized-target support matrix: lossless, τ, speedup")
    add_pair_argument(parser)
    parser.add_argument("--specs", nargs="+", choices=QUANT_SPECS, default=list(QUANT_SPECS), metavar="SPEC",
                        help=f"backends to measure (default all: {', '.join(QUANT_SPECS)})")
    parser.add_argument("--recalibrated", nargs="*", default=[], metavar="SPEC=DIR",
                        help="a drafter recalibrated for SPEC (`reference train-drafter --target-quant SPEC`)")
    parser.add_argument("--prompts", default="instruct-heldout")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--modes", nargs="+", default=["treeflash", "auto+lookup"])
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=positive_int, default=1)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.set_defaults(func=run)
