"""`treeflash-hf demo`: stream a TreeFlash generation, then compare it with plain `generate()` in the same run."""

from __future__ import annotations

import argparse
import time

import torch
from transformers import TextStreamer

DEFAULT_PROMPT = 'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n'


def load_models(args: argparse.Namespace):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from . import reference

    if args.target is None and args.drafter is None:
        return reference.load()
    if args.target is None or args.drafter is None:
        raise SystemExit("Pass both --target and --drafter (or neither, for the bundled reference models).")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa")
    drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32)
    return target.eval(), drafter.eval(), tokenizer


def run(args: argparse.Namespace) -> int:
    import treeflash_hf  # noqa: F401

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_models(args)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    knobs = {"tree_mode": args.mode, "tree_budget": args.tree_budget, "tree_lookup": args.tree_lookup}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():  # warm both paths up so that neither pays first-call costs in the comparison
        target.generate(**inputs, **{**common, "max_new_tokens": 8})
        target.generate(**inputs, assistant_model=drafter, **knobs, **{**common, "max_new_tokens": 8})

        setting = {name: knobs.get(name, getattr(drafter.generation_config, name, None))
                   for name in ("tree_mode", "tree_budget", "tree_lookup")}
        print(f"--- TreeFlash ({', '.join(f'{k}={v}' for k, v in setting.items())}) ---")
        streamer = TextStreamer(tokenizer, skip_prompt=False)
        start = time.perf_counter()
        fast = target.generate(**inputs, assistant_model=drafter, streamer=streamer, return_dict_in_generate=True,
                               **knobs, **common)
        fast_s = time.perf_counter() - start
        start = time.perf_counter()
        plain = target.generate(**inputs, **common)
        plain_s = time.perf_counter() - start
    new_fast = fast.sequences.shape[1] - inputs["input_ids"].shape[1]
    new_plain = plain.shape[1] - inputs["input_ids"].shape[1]
    identical = torch.equal(fast.sequences, plain)
    print("\n--- comparison (same process, after warm-up) ---")
    kinds = {kind: fast.step_kinds.count(kind) for kind in ("draft", "lookup", "plain")}
    print(f"tau (tokens per target forward): {fast.tau:.2f} over {len(fast.accepted_lengths)} steps: "
          f"{kinds['draft']} drafted, {kinds['lookup']} verified the lookup branch alone, {kinds['plain']} the root "
          "alone")
    print(f"TreeFlash: {new_fast / fast_s:7.1f} tokens/s   plain generate(): {new_plain / plain_s:7.1f} tokens/s")
    print(f"speedup: {(new_fast / fast_s) / (new_plain / plain_s):.2f}x")
    print(f"output identical to plain generate(): {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="Stream a TreeFlash generation and compare with plain generate().")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--target", help="target model folder (default: the bundled reference target)")
    parser.add_argument("--drafter", help="drafter folder (default: the bundled reference drafter)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the target's)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--mode", choices=["chain", "marginal_tree", "treeflash"])
    parser.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), help='an integer or "auto"')
    parser.add_argument("--tree-lookup", type=int, help="lookup-branch length (0 = off; default: the drafter's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.set_defaults(func=run)
