"""Stock linear layers against oneDNN's packed ones (`treeflash_hf/integrations/cpu_linear.py`), side by side:
the bench's methods on held-out requests under three kernel settings (stock; every layer packed at every row count;
`plan_packed_linears`'s plan, each layer packed from the row count where it was timed faster), alternating request
by request in a rotating order, so a drifting host loads all alike. Prints tokens/s per setting and method, each
method's speedup over plain decoding in the same setting, and each setting over the stock one.

    .venv/bin/python scripts/cpu_linear_ab.py --num-prompts 6 --max-new-tokens 96

(`--dtype auto`: the pair's run dtype on this CPU, bfloat16 where it has the arithmetic, else float32.)
"""

from __future__ import annotations

import argparse

import torch

from treeflash_hf import reference
from treeflash_hf.engine.budget import verify_cost_curve
from treeflash_hf.integrations.cpu_linear import pack_linears, plan_packed_linears, unpack_linears
from treeflash_hf.recipes.prompt_sets import load_prompts
from treeflash_hf.tools.bench import parse_methods, run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--prompts", default="instruct-heldout")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--modes", nargs="+", default=["autoregressive", "treeflash", "auto", "auto+lookup"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--settings", nargs="+", default=["stock", "packed", "planned"],
                        choices=["stock", "packed", "planned"], help="the kernel settings compared (stock first)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    target, drafter, tokenizer = reference.load(args.pair, dtype=dtype)  # each setting (un)packs below
    plan = plan_packed_linears(target, drafter)
    print(f"{target.dtype}, {args.threads} threads")
    print(f"the timed plan (`plan_packed_linears`; out, in features -> rows kept stock): {plan}")
    settings = {name: value for name, value in {"stock": None, "packed": "all", "planned": plan or {}}.items()
                if name in {"stock", *args.settings}}
    methods = parse_methods(args.modes, args.budgets)
    totals: dict[str, dict[str, list[float]]] = {setting: {} for setting in settings}
    names = list(settings)

    def use(setting: str) -> None:
        for model in (target, drafter):
            unpack_linears(model)
            if settings[setting] is not None:
                pack_linears(model, None if settings[setting] == "all" else settings[setting])

    for setting in names:  # each setting's cost curve (its own cache key) measured before anything is timed
        use(setting)
        verify_cost_curve(target)
    for index, prompt in enumerate(load_prompts(args.prompts, args.num_prompts, tokenizer)):
        for setting in names[index % len(names):] + names[:index % len(names)]:
            use(setting)
            report = run_bench(target, drafter, None, tokenizer, [prompt], methods, args.max_new_tokens, 0.0, 1,
                               progress=False, measure_shape_noise=False)
            for label, row in report["results"].items():
                total = totals[setting].setdefault(label, [0.0, 0, 0, 0])  # seconds, tokens, identical, near-tie
                total[0] += row["new_tokens"] / row["tokens_per_s"]
                total[1] += row["new_tokens"]
                total[2] += row.get("identical_rows", 0)
                total[3] += row.get("near_tie_rows", 0)
            print(f"request {index} {setting}: " + ", ".join(
                f"{label} {row['tokens_per_s']:.2f} tok/s" for label, row in report["results"].items()), flush=True)
    rate = {setting: {label: tokens / seconds for label, (seconds, tokens, *_) in rows.items()}
            for setting, rows in totals.items()}
    print(f"\n{'method':20s} " + " ".join(f"{setting + ' tok/s':>13s} {'speedup':>8s} {'/stock':>7s}"
                                         for setting in settings) + "  identical / near-tie")
    for label in rate["stock"]:
        cells = []
        for setting in settings:
            value = rate[setting][label]
            cells.append(f"{value:13.2f} {value / rate[setting]['autoregressive']:7.2f}x "
                         f"{value / rate['stock'][label]:6.2f}x")
        print(f"{label:20s} " + " ".join(cells) + "  " + ", ".join(
            f"{totals[setting][label][2]}/{totals[setting][label][3]}" for setting in settings)
              + f" of {args.num_prompts}")

if __name__ == "__main__":
    main()
