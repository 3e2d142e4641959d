"""`treeflash-hf drafter-tau`: drafters' greedy τ on held-out requests, and a drafter lineage as a data-scaling curve.

τ is measured one way for every drafter, so figures from different sessions compare: the pair's target in float32,
`treeflash` with the drafter alone (no prompt lookup), one tree budget, greedy, on the first `--num-prompts` requests
of a prompt set (SmolLM2: `instruct-heldout`, which no drafter trains on). The requests are split into `--groups`
equal groups in order; the figure is the mean of the groups' τ, and the groups' spread says how much a difference
between two drafters means. The tree's `tree_top_m` and `tree_top_k` are each drafter's own unless `--tree-top-m` /
`--tree-top-k` fix them (then the measure names them): a lineage fixes them, so that its points differ only in the
drafters. τ does not depend on timing, so it can be measured beside other jobs.

With `--lineage FILE --label NAME`, the measured drafter becomes the point NAME of a lineage (replacing a point of
that name): the chat answer tokens it was trained on and the CPU minutes of training behind it, cumulative over the
drafters it continued. The points are kept in FILE (JSON) and plotted as τ against answer tokens beside it
(`FILE` with `.png`), with the log-linear fit `τ = a + b log2(tokens)` over, for each amount of data, its last
point (the longest-trained one): `b` is what each doubling of the data has bought so far.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from datetime import date
from pathlib import Path

import torch

from ..arguments import add_pair_argument, positive_int
from ..optional import pyplot


def host() -> str:
    """This machine in a few words (the CPU's model name and core count), for the record of a measurement."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{os.cpu_count()} cores, {names[0] if names else platform.processor() or platform.machine()}"


def group_taus(target, drafter, prompts_ids: list[torch.LongTensor], groups: int, budget: int,
               max_new_tokens: int, tree_options: dict | None = None) -> list[float]:
    """τ of each of `groups` equal, consecutive groups of `prompts_ids` (`[1, S]` each); a remainder is dropped.
    `tree_options` override the drafter's tree defaults (`greedy_tau`)."""
    from .ablate import greedy_tau

    size = len(prompts_ids) // groups
    return [greedy_tau(target, drafter, prompts_ids[g * size:(g + 1) * size], budget, max_new_tokens, tree_options)
            for g in range(groups)]


def doubling_fit(points: list[dict]) -> tuple[float, float] | None:
    """`(a, b)` of `τ = a + b log2(answer_tokens)` by least squares over, for each amount of data, its last point in
    the list; None with fewer than two amounts."""
    last = {point["chat_answer_tokens"]: point["tau"] for point in points}
    if len(last) < 2:
        return None
    xs = [math.log2(tokens) for tokens in last]
    ys = list(last.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def predictions(fit: tuple[float, float], taus: tuple[float, ...] = (2.5, 3.0),
                tokens: tuple[int, ...] = (3_000_000,)) -> dict:
    """What the fit predicts: τ at the given answer tokens, and the answer tokens a τ needs (None: the fit does not
    grow with data)."""
    a, b = fit
    return {"tau_at": {str(n): round(a + b * math.log2(n), 3) for n in tokens},
            "tokens_for": {str(t): (round(2 ** ((t - a) / b)) if b > 0 else None) for t in taus}}


def plot_lineage(lineage: dict, path: Path) -> None:
    """τ against chat answer tokens (log scale), each point labelled, with the fit."""
    plt = pyplot()

    points = lineage["points"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot([p["chat_answer_tokens"] for p in points], [p["tau"] for p in points], "o-", color="tab:blue")
    for point in points:
        ax.annotate(f"{point['label']} ({point['training_cpu_minutes']:.0f} min)",
                    (point["chat_answer_tokens"], point["tau"]), textcoords="offset points", xytext=(5, -12),
                    fontsize=8)
    if (fit := doubling_fit(points)) is not None:
        a, b = fit
        low = min(p["chat_answer_tokens"] for p in points)
        xs = [low * 2 ** (i / 4) for i in range(0, 4 * 7)]
        ax.plot(xs, [a + b * math.log2(x) for x in xs], ":", color="gray",
                label=f"log-linear fit: +{b:.3f} τ per doubling")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xscale("log")
    ax.set_xlabel("chat answer tokens trained on")
    ax.set_ylabel("τ")
    ax.set_title(lineage.get("measure", "")[:90], fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_measure(path: Path, measure: str) -> None:
    """A lineage file's points must all be measured one way: refuse another before anything runs."""
    recorded = json.loads(path.read_text()).get("measure") if path.exists() else measure
    if recorded != measure:
        raise ValueError(f"{path} holds points measured as {recorded!r}, not {measure!r}: measure the same way "
                         "(the same --prompts, --num-prompts, --groups, --budget, --max-new-tokens, --tree-top-m, "
                         "--tree-top-k), or start another lineage file.")


def record_point(path: Path, measure: str, point: dict) -> dict:
    """Write `point` into the lineage file at `path` (replacing the point of its label), the fit and its predictions,
    and draw the plot beside it. Returns the lineage."""
    check_measure(path, measure)
    lineage = json.loads(path.read_text()) if path.exists() else {"measure": measure, "points": []}
    points = [p for p in lineage["points"] if p["label"] != point["label"]] + [point]
    lineage["points"] = points
    if (fit := doubling_fit(points)) is not None:
        lineage["fit"] = {"tau": f"{fit[0]:.4f} + {fit[1]:.4f} * log2(chat_answer_tokens)",
                          "tau_per_doubling": round(fit[1], 4), **predictions(fit)}
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".partial")
    scratch.write_text(json.dumps(lineage, indent=2) + "\n")
    scratch.replace(path)
    plot_lineage(lineage, path.with_suffix(".png"))
    return lineage


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModel, AutoTokenizer

    from .. import reference
    from ..recipes.pairs import pair_dirs
    from ..recipes.prompt_sets import load_prompts

    if args.lineage and (args.label is None or args.answer_tokens is None or args.cpu_minutes is None
                         or len(args.drafters) != 1):
        raise ValueError("--lineage records one drafter as one point: pass a single --drafters folder with --label, "
                         "--answer-tokens and --cpu-minutes.")
    tokenizer_dir = pair_dirs(args.pair)[2]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, -256:]
               for text in load_prompts(args.prompts, args.num_prompts, tokenizer)]
    if len(prompts) < args.groups:
        raise ValueError(f"{len(prompts)} prompts cannot make {args.groups} groups: lower --groups or raise "
                         "--num-prompts.")
    labels = {"tree_top_m": "top-M", "tree_top_k": "top-K"}  # the options that fix the tree, as the measure names them
    tree_options = {name: getattr(args, name) for name in labels if getattr(args, name) is not None}
    shape = "".join(f", {labels[name]} {value}" for name, value in tree_options.items())
    measure = (f"float32 greedy tau@{args.budget} (treeflash, no lookup{shape}), "
               f"{len(prompts)} {args.prompts} requests, "
               f"{args.max_new_tokens} new tokens, mean of {args.groups} groups")
    if args.lineage:
        check_measure(Path(args.lineage), measure)
    torch.set_num_threads(args.threads)
    target, _, _ = reference.load(args.pair, dtype=torch.float32)
    for folder in args.drafters:
        drafter = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        taus = group_taus(target, drafter, prompts, args.groups, args.budget, args.max_new_tokens, tree_options)
        tau = statistics.fmean(taus)
        print(f"{folder}: tau@{args.budget} {tau:.3f} (groups: {', '.join(f'{t:.3f}' for t in taus)})", flush=True)
        if args.lineage:
            point = {"label": args.label, "drafter": str(folder), "chat_answer_tokens": args.answer_tokens,
                     "training_cpu_minutes": args.cpu_minutes, "tau": round(tau, 4),
                     "group_taus": [round(t, 4) for t in taus], "measured": date.today().isoformat(), "host": host()}
            lineage = record_point(Path(args.lineage), measure, point)
            if "fit" in lineage:
                fit = lineage["fit"]
                print(f"fit: +{fit['tau_per_doubling']:.3f} tau per doubling of the data; at 3M answer tokens "
                      f"{fit['tau_at']['3000000']}; tau 2.5 at {fit['tokens_for']['2.5']} answer tokens")
            print(f"wrote {args.lineage} and {Path(args.lineage).with_suffix('.png')}")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("drafter-tau", help="drafters' float32 greedy tau on held-out requests; a drafter "
                                                       "lineage as a data-scaling curve")
    add_pair_argument(parser, " (its target; the drafters come from --drafters)")
    parser.add_argument("--drafters", nargs="+", required=True, help="drafter folders to measure")
    parser.add_argument("--prompts", default="instruct-heldout", help="a prompt set (default %(default)s)")
    parser.add_argument("--num-prompts", type=positive_int, default=36)
    parser.add_argument("--groups", type=positive_int, default=3, help="equal groups of requests (default 3)")
    parser.add_argument("--budget", type=positive_int, default=16, help="tree budget (default 16)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--tree-top-m", type=positive_int,
                        help="M, tokens per depth of the top tree (default: each drafter's own); a lineage keeps one")
    parser.add_argument("--tree-top-k", type=positive_int, help="K, children per node (default: each drafter's own)")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--lineage", help="a lineage JSON file to record the drafter in as one point")
    parser.add_argument("--label", help="the point's name (replaces a point of that name)")
    parser.add_argument("--answer-tokens", type=positive_int, help="chat answer tokens the drafter trained on")
    parser.add_argument("--cpu-minutes", type=float,
                        help="CPU minutes of training behind the drafter, cumulative over the drafters it continued")
    parser.set_defaults(func=run)
