"""`treeflash-hf serve-bench`: latency to the first token and tokens/s through `transformers serve`, for a TreeFlash
model folder (served with `--trust-remote-code`: TreeFlash decoding) against the same folder served without it (the
plain target).

Both servers run at once and the requests alternate between them per prompt and repeat, so machine drift hits both
alike. Every request is a streamed greedy completion through the `openai` client; the first token's latency is the
time to the first chunk with text, tokens/s counts the completion tokens the server reports over the whole request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path

import torch

from ..arguments import add_pair_argument, positive_int
from ..optional import pyplot
from .serving import running_server

SERVERS = ("plain", "treeflash")
# `--concurrency`: how each server of the load test runs the folder (trust remote code: TreeFlash; extra arguments)
LOAD_SERVERS = {
    "plain": (False, ()),
    "plain_cb": (False, ("--continuous-batching",)),
    "treeflash": (True, ()),
    "treeflash_cb": (True, ("--continuous-batching",)),
}
LOAD_NOTES = {
    "plain": "plain target, one request at a time (the server's single inference thread)",
    "plain_cb": "plain target, transformers' continuous batching",
    "treeflash": "TreeFlash folder (one request at a time)",
    "treeflash_cb": "TreeFlash folder with --continuous-batching: TreeFlash's continuous-batching manager "
                    "(requests join and leave the TreeFlash batch between steps)",
}


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


def percentile(values: list[float], fraction: float) -> float:
    """The `fraction` quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def closed_loop(client, model: str, prompts: list[str], max_tokens: int, clients: int, requests: int) -> dict:
    """`clients` threads, each sending its next request as soon as its last one finished, until `requests` requests
    (prompts in turn) are done. Returns output tokens/s over the wall time, first-token latency median and p90 (ms),
    and each prompt's text."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        runs = list(pool.map(lambda i: (i % len(prompts), stream_completion(client, model, prompts[i % len(prompts)],
                                                                            max_tokens)), range(requests)))
    wall_s = time.perf_counter() - start
    first = [run["first_token_s"] * 1000 for _, run in runs]
    return {"clients": clients, "requests": requests, "wall_s": wall_s,
            "tokens_per_s": sum(run["tokens"] for _, run in runs) / wall_s,
            "first_token_ms_median": statistics.median(first), "first_token_ms_p90": percentile(first, 0.9),
            "first_token_ms": first, "texts": {index: run["text"] for index, run in runs}}


def merge_rounds(rounds: list[dict]) -> dict:
    """One load level from several `closed_loop` rounds of a server: tokens/s the median round's, first-token
    median and p90 over every request of every round; `round_tokens_per_s` keeps each round's rate."""
    first = [ms for level in rounds for ms in level["first_token_ms"]]
    return {"clients": rounds[0]["clients"], "requests": sum(level["requests"] for level in rounds),
            "wall_s": sum(level["wall_s"] for level in rounds), "rounds": len(rounds),
            "tokens_per_s": statistics.median(level["tokens_per_s"] for level in rounds),
            "round_tokens_per_s": [level["tokens_per_s"] for level in rounds],
            "first_token_ms_median": statistics.median(first), "first_token_ms_p90": percentile(first, 0.9)}


def run_load_bench(folder: Path, prompts: list[str], max_tokens: int, concurrency: list[int], requests: int,
                   dtype: str, device: str, servers: list[str], rounds: int = 1) -> dict:
    """Every server of `servers` (`LOAD_SERVERS`) started and warmed up; then, level by level of `concurrency`,
    `rounds` times, each server in turn runs `closed_loop` with `max(requests, 2 * clients)` requests (the order
    alternating from round to round, so that a ratio of two servers' rounds is measured side by side). Afterwards
    every text is compared with offline greedy decoding of its prompt alone (the plain target's `generate()` in
    `dtype`), each divergence classified as a near-tie of the target or not (`text_divergences`)."""
    import openai

    levels: dict[str, list[dict]] = {name: [] for name in servers}
    texts_by_level: dict[str, list[list[dict[int, str]]]] = {name: [] for name in servers}  # per level, per round
    with contextlib.ExitStack() as stack:
        clients_of = {}
        for name in servers:  # all up at once (an idle server waits on an event), so levels interleave
            trust, extra = LOAD_SERVERS[name]
            server = stack.enter_context(running_server(folder, trust_remote_code=trust, dtype=dtype, device=device,
                                                        extra_args=extra))
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=1800.0)
            stream_completion(client, server.model, prompts[0], max_tokens=min(8, max_tokens))  # one-time costs
            clients_of[name] = (client, server)
        for step, clients in enumerate(concurrency):
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for round_index in range(rounds):
                # the servers take turns, in alternating order, so that drift of the machine hits them alike
                for name in servers if (step + round_index) % 2 == 0 else servers[::-1]:
                    client, server = clients_of[name]
                    level = closed_loop(client, server.model, prompts, max_tokens, clients,
                                        max(requests, 2 * clients))
                    runs[name].append(level)
                    print(f"{name:13s} {clients:3d} clients: {level['tokens_per_s']:6.1f} tok/s, first token "
                          f"{level['first_token_ms_median']:.0f} ms (p90 {level['first_token_ms_p90']:.0f})",
                          flush=True)
            for name in servers:
                texts_by_level[name].append([level.pop("texts") for level in runs[name]])
                levels[name].append(merge_rounds(runs[name]))
        warned_plain = None  # whether the TreeFlash folder under continuous batching said that it runs plain
        if "treeflash_cb" in clients_of:
            warned_plain = "TreeFlash is off for continuous batching" in clients_of["treeflash_cb"][1].log_tail(200_000)
    offline = compare_with_offline(folder, prompts, max_tokens, dtype, levels, texts_by_level)
    return {"folder": str(folder), "dtype": dtype, "device": device, "max_tokens": max_tokens,
            "prompts": len(prompts), "concurrency": concurrency, "levels": levels, "treeflash_cb_warned_plain":
            warned_plain, "offline_texts": {str(k): v for k, v in sorted(offline.items())}}


def compare_with_offline(folder: Path, prompts: list[str], max_tokens: int, dtype: str, levels: dict,
                         texts_by_level: dict) -> dict[int, str]:
    """Offline greedy text of every prompt that was served; sets each level's `identical_texts` and `divergences`
    (in place). Returns the offline texts by prompt index."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    served = sorted({index for server in texts_by_level.values() for rounds in server for texts in rounds
                     for index in texts})
    offline = {}
    for index in served:
        inputs = tokenizer(prompts[index], return_tensors="pt").to(target.device)
        with torch.no_grad():
            new = target.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        offline[index] = tokenizer.decode(new, skip_special_tokens=True)
    for name, server in texts_by_level.items():
        for level, rounds in zip(levels[name], server):
            level["identical_texts"], level["divergences"] = True, []
            for texts in rounds:
                indices = sorted(texts)
                level["identical_texts"] &= all(texts[i] == offline[i] for i in indices)
                level["divergences"] += text_divergences(target, tokenizer, [prompts[i] for i in indices],
                                                         [offline[i] for i in indices], [texts[i] for i in indices])
    return offline


def paired_ratios(fast: dict, plain: dict) -> str:
    """` (rounds: median r, min-max)` of the two servers' round-by-round tokens/s ratios, '' for one round."""
    pairs = [a / b for a, b in zip(fast.get("round_tokens_per_s", []), plain.get("round_tokens_per_s", []))]
    if len(pairs) < 2:
        return ""
    return f" (rounds: median {statistics.median(pairs):.2f}x, {min(pairs):.2f}-{max(pairs):.2f}x)"


def format_load_table(report: dict) -> str:
    names = [name for name in LOAD_SERVERS if name in report["levels"]]
    rows = ["| clients | " + " | ".join(f"{name} tok/s | {name} TTFT ms (p90)" for name in names) + " |",
            "|---|" + "---|---|" * len(names)]
    for index, clients in enumerate(report["concurrency"]):
        cells = []
        for name in names:
            level = report["levels"][name][index]
            divergences = level.get("divergences", [])
            if level["identical_texts"]:
                same = ""
            elif all(d["near_tie"] for d in divergences):
                same = f" ({len(divergences)} near-tie)"
            else:
                same = f" (NOT identical: {sum(not d['near_tie'] for d in divergences)} beyond a near-tie)"
            cells.append(f"{level['tokens_per_s']:.1f}{same} | {level['first_token_ms_median']:.0f} "
                         f"({level['first_token_ms_p90']:.0f})")
        rows.append(f"| {clients} | " + " | ".join(cells) + " |")
    levels = report["levels"]
    for name in ("treeflash", "treeflash_cb"):
        if "plain_cb" in names and name in names:
            ratios = ", ".join(f"{clients}: {fast['tokens_per_s'] / plain['tokens_per_s']:.2f}x tokens/s"
                               f"{paired_ratios(fast, plain)}, "
                               f"{fast['first_token_ms_median'] / plain['first_token_ms_median']:.2f}x TTFT"
                               for clients, fast, plain in zip(report["concurrency"], levels[name], levels["plain_cb"]))
            rows.append(f"\n{name} / plain_cb by clients: {ratios}")
    rows.extend(f"- {name}: {LOAD_NOTES[name]}" for name in names)
    if report.get("treeflash_cb_warned_plain") is not None:
        warned = "yes (TreeFlash was off)" if report["treeflash_cb_warned_plain"] else "no"
        rows.append(f"- treeflash_cb logged that it runs plain: {warned}")
    rows.append(f"({report['prompts']} prompts, {report['max_tokens']} tokens max, {report['dtype']}, closed loop: "
                "each client sends its next request when its last one finished; texts compared with offline greedy "
                "decoding of each prompt alone: a divergence where the target's top-2 logits are within its dtype's "
                "tie tolerance is a near-tie)")
    return "\n".join(rows)


def plot_load(report: dict, out_dir: Path) -> Path:
    """Output tokens/s and median first-token latency by number of clients, one line per server."""
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (rate_ax, ttft_ax) = plt.subplots(1, 2, figsize=(10, 4))
    clients = report["concurrency"]
    for name, levels in report["levels"].items():
        rate_ax.plot(clients, [level["tokens_per_s"] for level in levels], marker="o", label=name)
        ttft_ax.plot(clients, [level["first_token_ms_median"] for level in levels], marker="o", label=name)
    for ax, label in ((rate_ax, "output tokens/s"), (ttft_ax, "time to first token, median (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"transformers serve under load ({report['dtype']}, {report['max_tokens']} tokens)")
    fig.tight_layout()
    path = out_dir / "serve_load.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def text_divergences(target, tokenizer, prompts: list[str], plain_texts: list[str], fast_texts: list[str]
                     ) -> list[dict]:
    """Where the TreeFlash server's text leaves the plain server's, whether the target's top-2 logits there are a
    near-tie of its dtype (the only divergence a lossless method may show outside float32). Texts are mapped back
    to tokens by re-tokenizing them (the server returns text), so the place is the first differing token of the
    re-tokenized texts; the gap is the target's, after the plain text's tokens before it (`first_divergence_gap`).
    Each divergence keeps the served text, so that it can be checked again."""
    from .bench import first_divergence_gap

    found = []
    for index, (prompt, plain, fast) in enumerate(zip(prompts, plain_texts, fast_texts)):
        if plain == fast:
            continue
        prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0].to(target.device)
        expected = tokenizer(plain, add_special_tokens=False)["input_ids"]
        got = tokenizer(fast, add_special_tokens=False)["input_ids"]
        gap, tolerance = first_divergence_gap(target, prompt_ids, expected, got)
        found.append({"prompt": index, "gap": gap, "tolerance": tolerance, "near_tie": gap <= tolerance,
                      "served_text": fast})
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
    from ..hub.bundle import is_bundle
    from ..recipes.prompt_sets import load_prompts

    from transformers import AutoTokenizer

    from ..recipes.pairs import pair_dirs

    folder = Path(args.folder) if args.folder else pair_dirs(args.pair)[0]
    if not is_bundle(folder):
        raise FileNotFoundError(f"{folder} is not a TreeFlash model folder (no treeflash.json): write one with "
                                "`treeflash-hf bundle --target T --drafter D --out DIR`.")
    prompt_set = args.prompts or ("packages-heldout" if args.pair == "tiny" and not args.folder else "instruct-heldout")
    prompts = load_prompts(prompt_set, args.num_prompts, AutoTokenizer.from_pretrained(folder))
    if args.concurrency:
        report = run_load_bench(folder, prompts, args.max_tokens, args.concurrency, args.requests, args.dtype,
                                args.device, args.servers, args.rounds)
        print(format_load_table(report))
        if args.plot:
            print(f"wrote {plot_load(report, Path(args.plot))}")
    else:
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
    parser.add_argument("--concurrency", type=positive_int, nargs="+",
                        help="the load test: closed loops of N clients on each of --servers, one server at a time")
    parser.add_argument("--requests", type=positive_int, default=8,
                        help="requests per load level (at least 2 per client)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="the load test: rounds per level, the servers alternating; tokens/s is the median "
                             "round's, and the table adds the median of the round-by-round ratios")
    parser.add_argument("--servers", nargs="+", choices=list(LOAD_SERVERS), default=list(LOAD_SERVERS),
                        help="the load test's servers (default all)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="the load test: write serve_load.png (tokens/s and TTFT by clients) here")
    parser.set_defaults(func=run)
