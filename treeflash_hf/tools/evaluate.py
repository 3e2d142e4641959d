"""`treeflash-hf eval-dist`: how close each drafting distribution is to the target's, depth by depth.

Along the target's own greedy continuation of held-out prompts, for anchors `a` and depths d = 1..Q-1, against
the target's true next-token distribution `p(x_{a+d} | x_{<a+d})`:
- `dflash`: the drafter's marginal `q_d` (sees only the prefix up to the anchor),
- `treeflash`: the AR-corrected `q'_d(. | x_{a+d-1})` given the true previous token,
- `target_marginal`: the target's own distribution of the token at depth d given only the prefix up to the anchor
  (estimated from sampled continuations): the best any marginal drafter could do.
Metrics: total variation distance, and top-k coverage (k = 1, 5) of the greedy token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..arguments import add_pair_argument, positive_int
from ..engine.draft import TreeDrafter
from ..engine.options import TreeOptions
from ..optional import pyplot

SOURCES = ("dflash", "treeflash", "target_marginal")


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


@torch.no_grad()
def eval_distributions(target, drafter, prompts_ids: list[torch.LongTensor], continuation: int = 64,
                       anchors_per_prompt: int = 4, samples: int = 64, seed: int = 0) -> dict:
    """Per-depth TVD and top-1/top-5 coverage of every source. prompts_ids: `[1, S]` each."""
    block = drafter.config.block_size
    depths = block - 1
    sums = {s: {"tvd": torch.zeros(depths), "top1": torch.zeros(depths), "top5": torch.zeros(depths)}
            for s in SOURCES}
    count = torch.zeros(depths)
    generator = TreeDrafter(drafter, target, TreeOptions())
    embed = generator.embed

    def drafted(hidden: torch.Tensor) -> torch.Tensor:
        """The distribution the drafter drafts from (over its draft vocabulary, if any), over every token `[.., V]`."""
        return generator.full_vocabulary(generator.draft_log_probs(hidden)).exp()

    torch.manual_seed(seed)
    for ids in prompts_ids:
        sequence = target.generate(ids, max_new_tokens=continuation + block, do_sample=False)
        out = target(sequence, output_hidden_states=True)
        true_p = torch.softmax(out.logits[0].float(), -1)  # row j: distribution of token j + 1
        features = generator.context_features(out.hidden_states, slice(None))[0]  # [S', n*H]
        start = ids.shape[1]
        last = sequence.shape[1] - block
        anchors = torch.linspace(start, last, anchors_per_prompt).long().tolist()
        for anchor in anchors:
            noise = torch.full((1, block), drafter.config.mask_token_id)
            noise[0, 0] = sequence[0, anchor]
            h = drafter(noise_embeds=embed(noise), context_hidden_states=features[None, :anchor],
                        position_ids=torch.arange(0, anchor + block)[None]).pre_norm_hidden_state[0]
            marginal = drafted(drafter.norm(h[1:]))  # [Q-1, V]
            prev = embed(sequence[0, anchor : anchor + depths])
            prev2 = embed(sequence[0, anchor - 1 : anchor + depths - 1]) if drafter.config.ar_num_prev_tokens == 2 \
                else None
            corrected = drafted(drafter.ar_corrected_hidden_states(h[1:], prev, prev2))
            sampled = target.generate(sequence[:, : anchor + 1].expand(samples, -1), max_new_tokens=depths,
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      min_new_tokens=depths)[:, anchor + 1 :]  # [samples, Q-1]
            empirical = torch.zeros_like(marginal)
            empirical.scatter_add_(1, sampled.T, torch.ones(sampled.T.shape))
            empirical /= samples
            truth = true_p[anchor : anchor + depths]  # [Q-1, V]: for positions anchor+1..anchor+Q-1
            greedy = sequence[0, anchor + 1 : anchor + 1 + depths]
            for name, dist in (("dflash", marginal), ("treeflash", corrected), ("target_marginal", empirical)):
                sums[name]["tvd"] += tvd(dist, truth)
                top5 = dist.topk(5, -1).indices
                sums[name]["top1"] += (top5[:, 0] == greedy).float()
                sums[name]["top5"] += (top5 == greedy[:, None]).any(-1).float()
            count += 1
    return {"depths": list(range(1, depths + 1)), "anchors": int(count[0]), "samples_per_anchor": samples,
            **{name: {metric: (values / count).tolist() for metric, values in metrics.items()}
               for name, metrics in sums.items()}}


def plot(report: dict, out_dir: Path) -> list[Path]:
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in SOURCES:
        ax.plot(report["depths"], report[name]["tvd"], marker="o", label=name)
    ax.set_xlabel("depth d")
    ax.set_ylabel("TVD to the target's next-token distribution")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "tvd_vs_depth.png", dpi=120)
    plt.close(fig)
    written.append(out_dir / "tvd_vs_depth.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in SOURCES:
        for k, style in (("top1", "-"), ("top5", "--")):
            ax.plot(report["depths"], report[name][k], style, marker=".", label=f"{name} {k}")
    ax.set_xlabel("depth d")
    ax.set_ylabel("coverage of the target's greedy token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "coverage_vs_depth.png", dpi=120)
    plt.close(fig)
    written.append(out_dir / "coverage_vs_depth.png")
    return written


def run(args: argparse.Namespace) -> int:
    from .. import reference
    from .bench import write_report
    from ..recipes.prompt_sets import load_prompts

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = reference.load(args.models or args.pair)
    prompts = load_prompts(args.prompts, args.num_prompts, tokenizer)
    ids = [tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"][:, -256:] for p in prompts]
    report = eval_distributions(target, drafter, ids, args.continuation, args.anchors, args.samples)
    print(f"{'depth':>5s} " + " ".join(f"{s + ' tvd':>20s}" for s in SOURCES) + "   treeflash top1 / dflash top5")
    for i, d in enumerate(report["depths"]):
        print(f"{d:5d} " + " ".join(f"{report[s]['tvd'][i]:20.3f}" for s in SOURCES)
              + f"   {report['treeflash']['top1'][i]:.2f} / {report['dflash']['top5'][i]:.2f}")
    write_report(report, args.json, args.plot, plot)
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval-dist", help="TVD and top-k coverage per depth of each drafting distribution.")
    add_pair_argument(parser)
    parser.add_argument("--models", help="a folder `reference build` wrote (instead of --pair)")
    parser.add_argument("--prompts", default="instruct-heldout")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--continuation", type=positive_int, default=64)
    parser.add_argument("--anchors", type=positive_int, default=4)
    parser.add_argument("--samples", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.set_defaults(func=run)
