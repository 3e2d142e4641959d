"""`treeflash-hf serve-bench`: latency to the first token and tokens/s through `transformers serve`, for a TreeFlash
model folder (served with `--trust-remote-code`: TreeFlash decoding) against the same folder served without it (the
plain target).

Both servers run at once and the requests alternate between them per prompt and repeat, so machine drift hits both
alike. Every request is a streamed greedy completion through the `openai` client; the first token's latency is the
time to the first chunk with text, tokens/s counts the completion tokens the server reports over the whole request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .arguments import add_pair_argument, positive_int
from .serving import running_server

SERVERS = ("plain", "treeflash")


def stream_completion(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: `first_token_s`, `total_s`, `tokens` (as the server counts them), `text`."""
    start = time.perf_counter()
    first_token_s, pieces, tokens = None, [], 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True)
    for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else ""
        if text and first_token_s is None:
            first_token_s = time.perf_counter() - start
        pieces.append(text or "")
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total_s = time.perf_counter() - start
    return {"first_token_s": first_token_s if first_token_s is not None else total_s, "total_s": total_s,
            "tokens": tokens, "text": "".join(pieces)}


def summarise(runs: list[dict]) -> dict:
    """Medians over requests: first-token latency (ms), tokens/s (whole request) and decode tokens/s (after the
    first token)."""
    decode = [(r["tokens"] - 1) / (r["total_s"] - r["first_token_s"]) for r in runs
              if r["tokens"] > 1 and r["total_s"] > r["first_token_s"]]
    return {
        "requests": len(runs),
        "first_token_ms": 1000 * statistics.median(r["first_token_s"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens"] / r["total_s"] for r in runs),
        "decode_tokens_per_s": statistics.median(decode) if decode else float("nan"),
        "mean_tokens": statistics.mean(r["tokens"] for r in runs),
    }


def time_servers(servers: dict, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    """Warm up the running servers `{"plain": ServerProcess, "treeflash": ServerProcess}`, then time `repeats` streamed
    completions of every prompt on each, alternating which goes first. Returns the per-server summaries, their ratios
    and whether the two servers' texts matched on every prompt."""
    import openai

    clients = {name: openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                   timeout=600.0) for name, server in servers.items()}
    for name in SERVERS:  # first calls pay one-time costs (the TreeFlash folder loads its drafter on the first)
        stream_completion(clients[name], servers[name].model, prompts[0], max_tokens=min(8, max_tokens))
    runs = {name: [] for name in SERVERS}
    texts = {name: {} for name in SERVERS}
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            for name in SERVERS if (repeat + index) % 2 == 0 else SERVERS[::-1]:
                result = stream_completion(clients[name], servers[name].model, prompt, max_tokens)
                runs[name].append(result)
                texts[name].setdefault(index, result["text"])
    summary = {name: summarise(runs[name]) for name in SERVERS}
    return {
        "max_tokens": max_tokens, "repeats": repeats, "prompts": len(prompts), "servers": summary,
        "speedup_tokens_per_s": summary["treeflash"]["tokens_per_s"] / summary["plain"]["tokens_per_s"],
        "first_token_ratio": summary["treeflash"]["first_token_ms"] / summary["plain"]["first_token_ms"],
        "identical_texts": all(texts["plain"][i] == texts["treeflash"][i] for i in texts["plain"]),
        "texts": {name: [texts[name][i] for i in range(len(prompts))] for name in SERVERS},
    }


def text_divergences(target, tokenizer, prompts: list[str], plain_texts: list[str], fast_texts: list[str]
                     ) -> list[dict]:
    """Where the TreeFlash server's text leaves the plain server's, whether the target's top-2 logits there are a
    near-tie of its dtype (the only divergence a lossless method may show outside float32). Texts are mapped back
    to tokens by re-tokenizing them (the server returns text), so the place is the first differing token of the
    re-tokenized texts; the gap is the target's, after the plain text's tokens before it."""
    from .bench import first_divergence_gap

    found = []
    for index, (prompt, plain, fast) in enumerate(zip(prompts, plain_texts, fast_texts)):
        if plain == fast:
            continue
        prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0].to(target.device)
        expected = tokenizer(plain, add_special_tokens=False)["input_ids"]
        got = tokenizer(fast, add_special_tokens=False)["input_ids"]
        gap, tolerance = first_divergence_gap(target, prompt_ids, expected, got)
        found.append({"prompt": index, "gap": gap, "tolerance": tolerance, "near_tie": gap <= tolerance})
    return found


def run_serve_bench(folder: Path, prompts: list[str], max_tokens: int, repeats: int, dtype: str = "float32",
                    device: str = "auto") -> dict:
    """Serve `folder` twice at once, as the plain target and with TreeFlash, and time both (`time_servers`)."""
    with running_server(folder, trust_remote_code=False, dtype=dtype, device=device) as plain, \
            running_server(folder, trust_remote_code=True, dtype=dtype, device=device) as fast:
        report = time_servers({"plain": plain, "treeflash": fast}, prompts, max_tokens, repeats)
    divergences = []
    if not report["identical_texts"]:  # checked after the servers stop, on the plain target in their dtype
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        divergences = text_divergences(target, AutoTokenizer.from_pretrained(folder), prompts,
                                       report["texts"]["plain"], report["texts"]["treeflash"])
    return {"folder": str(folder), "dtype": dtype, "device": device, **report, "divergences": divergences}


def format_table(report: dict) -> str:
    rows = ["| server | first token (ms) | tokens/s | decode tokens/s | mean tokens |", "|---|---|---|---|---|"]
    for name in SERVERS:
        s = report["servers"][name]
        rows.append(f"| {name} | {s['first_token_ms']:.1f} | {s['tokens_per_s']:.1f} | {s['decode_tokens_per_s']:.1f}"
                    f" | {s['mean_tokens']:.1f} |")
    divergences = report.get("divergences", [])
    if report["identical_texts"]:
        same = "yes"
    elif divergences and all(d["near_tie"] for d in divergences):
        gaps = ", ".join(f"{d['gap']:.3g} <= {d['tolerance']:.3g}" for d in divergences)
        same = f"yes but {len(divergences)} near-tie (top-2 gap {gaps})"
    else:
        same = "NO" + "".join(f"; prompt {d['prompt']}: top-2 gap {d['gap']:.3g} (tolerance {d['tolerance']:.3g})"
                              for d in divergences if not d["near_tie"])
    rows.append(f"\nTreeFlash / plain: {report['speedup_tokens_per_s']:.2f}x tokens/s, first token "
                f"{report['first_token_ratio']:.2f}x the latency; identical texts: {same} ({report['prompts']} "
                f"prompts x {report['repeats']} repeats, {report['max_tokens']} tokens max, {report['dtype']}, device "
                f"{report['device']})")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from .bundle import is_bundle
    from .prompt_sets import load_prompts

    from transformers import AutoTokenizer

    from .pairs import pair_dirs

    folder = Path(args.folder) if args.folder else pair_dirs(args.pair)[0]
    if not is_bundle(folder):
        raise FileNotFoundError(f"{folder} is not a TreeFlash model folder (no treeflash.json): write one with "
                                "`treeflash-hf bundle --target T --drafter D --out DIR`.")
    prompt_set = args.prompts or ("packages-heldout" if args.pair == "tiny" and not args.folder else "instruct-heldout")
    prompts = load_prompts(prompt_set, args.num_prompts, AutoTokenizer.from_pretrained(folder))
    report = run_serve_bench(folder, prompts, args.max_tokens, args.repeats, args.dtype, args.device)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve-bench", help="First-token latency and tokens/s through `transformers serve`: TreeFlash vs. plain.")
    add_pair_argument(parser, " (unless --folder is given)")
    parser.add_argument("--folder", help="a TreeFlash model folder (default: the pair's)")
    parser.add_argument("--prompts", help="instruct-heldout (default; packages-heldout on the tiny pair), humaneval, "
                                          "stdlib-heldout, or a JSONL file of {\"prompt\": ...} or {\"messages\": ...}")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--dtype", default="auto",
                        help="the servers' --dtype (default auto: the dtype the weights are stored in)")
    parser.add_argument("--device", default="auto", help="the servers' --device (default auto)")
    parser.add_argument("--json", help="write the report here")
    parser.set_defaults(func=run)
