"""`treeflash-hf demo`: stream a TreeFlash generation, then compare, in the same run, plain `generate()`, TreeFlash
with the drafter alone (`tree_lookup=0`) and TreeFlash with its defaults (drafter plus lookup branch)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import RepetitionPenaltyLogitsProcessor, TextStreamer

from ..arguments import add_pair_argument, non_negative_int, positive_int, tree_budget

DEFAULT_REQUEST = "Write a Python function that checks whether a string is a palindrome."
# the tiny pair is a code model without chat training: it continues code
TINY_PROMPT = (
    "class Stack:\n"
    '    """A last-in, first-out stack."""\n\n'
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item"
)


def load_models(args: argparse.Namespace):
    from .. import reference

    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.target is None and args.drafter is None:
        return reference.load(args.pair, dtype=dtype)
    if args.target is None or args.drafter is None:
        raise SystemExit("Pass both --target and --drafter (or neither, for the bundled reference models).")
    return reference.load_folders(args.target, args.drafter, args.tokenizer or args.target, dtype)


def demo_prompt(args: argparse.Namespace, tokenizer) -> tuple[str, bool]:
    """(prompt text, whether it is a chat): `--prompt` as raw text; otherwise the user request `--request` through the
    tokenizer's chat template (the tiny pair, a code model without a chat, continues a code prompt)."""
    if args.prompt is not None:
        return args.prompt, False
    if args.pair == "tiny" and args.target is None:
        return TINY_PROMPT, False
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("The tokenizer has no chat template: pass the text to continue as --prompt.")
    return tokenizer.apply_chat_template([{"role": "user", "content": args.request}], tokenize=False,
                                         add_generation_prompt=True), True


def timed(generate, repeats: int):
    """(output of the last call, median seconds over `repeats` calls)."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate()
        seconds.append(time.perf_counter() - start)
    return out, statistics.median(seconds)


def run(args: argparse.Namespace) -> int:
    import treeflash_hf  # noqa: F401

    from ..engine.answer_store import answer_store_of
    from ..integrations.cpu_linear import is_packed, kernels_note, stock_kernels
    from .bench import first_divergence_gap

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_models(args)
    prompt, chat = demo_prompt(args, tokenizer)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat)
    knobs = {"tree_mode": args.mode, "tree_budget": args.tree_budget, "tree_lookup": args.tree_lookup}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    # a mild repetition penalty keeps a small model's greedy text from looping (a logits processor: TreeFlash applies
    # it at every node, so the output is plain generate()'s, up to near-ties of the run dtype's rounding)
    repetition_penalty = args.repetition_penalty
    if repetition_penalty is None:
        repetition_penalty = 1.2 if args.pair == "tiny" and args.target is None else 1.0
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                  repetition_penalty=repetition_penalty)
    penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty) if repetition_penalty != 1.0 else None
    runs = {"TreeFlash, drafter alone": {**knobs, "tree_lookup": 0}, "TreeFlash, defaults": knobs}
    with torch.no_grad():
        # warm every path up, so that none pays first-call costs in the comparison (and what TreeFlash learns about
        # this pair, e.g. auto's costs, is learned before the timed calls, as in any longer-running use): plain
        # decoding on a few tokens, the defaults by the streamed answer, the drafter alone by one run
        target.generate(**inputs, **{**common, "max_new_tokens": min(16, args.max_new_tokens)})
        setting = {name: knobs.get(name, getattr(drafter.generation_config, name, None))
                   for name in ("tree_mode", "tree_budget", "tree_lookup")}
        if chat:
            print(f"--- user ---\n{args.request}")
        kernels = kernels_note(is_packed(target))
        print(f"--- TreeFlash ({', '.join(f'{k}={v}' for k, v in setting.items())}), "
              f"{str(target.dtype).removeprefix('torch.')}{kernels} ---")
        streamer = TextStreamer(tokenizer, skip_prompt=chat, skip_special_tokens=True)
        target.generate(**inputs, assistant_model=drafter, streamer=streamer, **knobs, **common)
        target.generate(**inputs, assistant_model=drafter, **runs["TreeFlash, drafter alone"], **common)
        plain, plain_s = timed(lambda: target.generate(**inputs, **common), args.repeats)
        stock = None  # plain decoding as `from_pretrained` alone runs it, where the layers were packed for oneDNN
        if is_packed(target):
            with stock_kernels(target):
                target.generate(**inputs, **{**common, "max_new_tokens": min(16, args.max_new_tokens)})
                stock = timed(lambda: target.generate(**inputs, **common), args.repeats)
        results = {name: timed(lambda run_knobs=run_knobs: target.generate(
            **inputs, assistant_model=drafter, return_dict_in_generate=True, **run_knobs, **common), args.repeats)
            for name, run_knobs in runs.items()}

    width = inputs["input_ids"].shape[1]
    plain_rate = (plain.shape[1] - width) / plain_s
    print(f"\n--- comparison (same process, after warm-up, median of {args.repeats} runs each) ---")
    print(f"{'method':26s} {'tau':>5s} {'steps: draft/lookup/plain':>26s} {'tokens/s':>9s} {'speedup':>8s}  identical")
    print(f"{'plain generate()':26s} {1.0:5.2f} {'-':>26s} {plain_rate:9.1f} {1.0:7.2f}x  -")
    if stock is not None:
        stock_rate = (stock[0].shape[1] - width) / stock[1]
        same = "yes" if torch.equal(stock[0], plain) else "no: another kernel's rounding"
        print(f"{'plain, stock kernels':26s} {1.0:5.2f} {'-':>26s} {stock_rate:9.1f} {stock_rate / plain_rate:7.2f}x  "
              f"{same}")
    all_same = True
    for name, (out, seconds) in results.items():
        kinds = "/".join(str(out.step_kinds.count(kind)) for kind in ("draft", "lookup", "plain"))
        rate = (out.sequences.shape[1] - width) / seconds
        same = torch.equal(out.sequences, plain)
        verdict = "yes"
        if not same:
            expected, got = plain[0, width:].tolist(), out.sequences[0, width:].tolist()
            gap, tolerance = first_divergence_gap(target, inputs["input_ids"][0], expected, got, penalty)
            tie = gap <= tolerance
            verdict = f"near-tie (top-2 gap {gap:.3g} <= {tolerance:.3g})" if tie else f"NO (top-2 gap {gap:.3g})"
            all_same &= tie
        print(f"{name:26s} {out.tau:5.2f} {kinds:>26s} {rate:9.1f} {rate / plain_rate:7.2f}x  {verdict}")
    store = answer_store_of(drafter)
    source = "" if store is None else (f", or in the drafter's answer store (the target's earlier answers: "
                                       f"{len(store):,} tokens)")
    print("(the drafter alone: steps verify the drafter's tree; the defaults add the lookup branch, which copies what "
          f"followed an earlier occurrence of the text's ending in this text{source}, and may verify it alone or "
          "skip the drafter when that is faster)")
    if stock is not None:
        print("(plain, stock kernels: plain generate() on torch's own linear products, what `from_pretrained` alone "
              "runs; TreeFlash over it: " + ", ".join(
                  f"{name.removeprefix('TreeFlash, ')} {(out.sequences.shape[1] - width) / seconds / stock_rate:.2f}x"
                  for name, (out, seconds) in results.items()) + ")")
    for name, (out, _) in results.items():
        plain_steps = out.step_kinds.count("plain")
        if plain_steps:  # never silently off: say where the tree was left out
            print(f"note: {name}: {plain_steps} of {len(out.step_kinds)} steps decoded plainly (tree_budget="
                  f"{setting['tree_budget']}: where verifying a tree is expected to cost more than it saves on this "
                  "host; --tree-budget 16 forces trees, `treeflash-hf profile --cost-table` shows the costs)")
    return 0 if all_same else 1


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="Stream a TreeFlash generation and compare with plain generate().")
    add_pair_argument(parser, " (unless --target and --drafter are given)")
    parser.add_argument("--request", default=DEFAULT_REQUEST, help="the user's request, sent through the chat template")
    parser.add_argument("--prompt", help="raw text to continue instead of a chat request")
    parser.add_argument("--target", help="target model folder (default: the pair's)")
    parser.add_argument("--drafter", help="drafter folder (default: the pair's)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the target's)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--repetition-penalty", type=float,
                        help="greedy decoding's repetition penalty, for every method alike (default: 1.0, none; 1.2 "
                             "on the tiny pair, whose greedy text loops)")
    parser.add_argument("--mode", choices=["chain", "marginal_tree", "treeflash"])
    parser.add_argument("--tree-budget", type=tree_budget, help='an integer >= 1 or "auto"')
    parser.add_argument("--tree-lookup", type=non_negative_int,
                        help="lookup-branch length (0 = off; default: the drafter's)")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per method (median)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="run dtype (auto: the weights' own, bfloat16 for the bundled pair; float32 on a CPU "
                             "without arithmetic for the weights' half precision, its linear layers through oneDNN's "
                             "packed weights where that is timed faster)")
    parser.set_defaults(func=run)
