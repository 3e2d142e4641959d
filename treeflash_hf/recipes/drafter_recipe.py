"""`treeflash-hf reference train-drafter`: the recipe of the bundled SmolLM2-135M-Instruct drafter.

Stages (each time-bounded and resumable from `--work`, an ignored folder that may carry a stage into the next
session; a stage whose output exists is skipped):
1. `distill`: the target's own greedy answers (self-distillation, as DFlash trains) to training requests
   (`prompt_sets.training_requests`: from docstrings of the training corpus, topics and arithmetic templates; never
   the evaluation set, never HumanEval), batched, saved chunk by chunk.
2. `vocab` (`--draft-vocab N`): the N most frequent tokens of the distilled answers and the code stream, the
   drafter's draft vocabulary (`training/draft_vocab.py`): the drafter the recipe makes trains on it (the head's
   product `V / N` times cheaper) and drafts from it; with no `backbone`, `ar` or `export` stage it is written into
   the drafter already in `--out` (weights unchanged).
3. `windows`: fixed windows of `--seq-len + 1` tokens: the chat answers (loss on the answer tokens only) and the
   code corpus (`reference.corpus_split`: standard library and site-packages, reserved packages excluded), shuffled;
   the first windows (held-out code and the first chat answers) are the held-out set. On an existing store, the
   distilled chunks it does not list yet (a later `distill` run) are appended as new training windows.
4. `features`: the frozen target runs once over every window (`training/features.py`): context features and its
   top-K next-token log-probs, kept for every epoch of the stages below. With `--online-features` there is no such
   stage: the stages below run the target over each batch as they draw it (the same rows; on a GPU that forward
   costs less than the store's disk, ~1.8 MB a window).
5. `backbone`, then `ar`: the drafter stages of `training/drafter.py`, from the cached features (`--chat-fraction`:
   that share of each batch from chat windows; `--backbone-init RUN` starts a new `--backbone-run` schedule from an
   earlier backbone run, a continuation on grown data; `--ar-init RUN` starts a new `--ar-run` from an earlier AR
   layer on that backbone).
6. `export`: the drafter in bfloat16 with its tree defaults, README and training summary, into `--out`.

Recalibration (`--target-quant SPEC`): the same recipe fits a trained drafter to a quantized copy of the target.
`windows` takes the first `--recalibration-windows` training windows (and the held-out ones) of the full-precision
store (`--windows-from`), `features` runs the quantized target over them in its own float32 compute, `ar`
fine-tunes the AR layer of `--init` (the bundled drafter; the backbone stays frozen, as the paper's cheap
recalibration), and `export` writes it to `--out` (default `<work>/drafter`). `--stages ... backbone ar ...` also
fine-tunes the backbone of `--init` first (at `--lr`), for a quantizer that moves the target's features more than the
AR layer alone can follow. `--stages distill windows features ar export` first answers training requests with the
quantized target itself (its own greedy text, in its own compute; from `--distill-from`, past the requests whose
answers hold the held-out windows) and appends them to the store as training windows, so the drafter also learns
the text it will be asked to draft. Work goes to `reference_work/smollm2-SPEC` by default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..arguments import (add_device_argument, add_drafter_arguments, add_optimizer_arguments,
                         add_target_quant_argument, non_negative_int, positive_int)
from .corpus import DEFAULT_FOLDER as DEFAULT_CORPUS
from .corpus import load_shard, shard_paths

STAGES = ("distill", "vocab", "windows", "features", "backbone", "ar", "export")
RECALIBRATION_STAGES = ("windows", "features", "ar", "export")  # the default; distill and backbone may be asked for
NEW_DRAFTER_LR = 6e-4  # peak lr of a drafter trained from scratch (and of a recalibration)
CONTINUED_LR = 1e-4  # of a continuation (`--init`): at 3e-4 held-out KL first rose and v15 gained nothing; at 1e-4
# v17 gained on the same data (docs/training.md, v17)
MASK_TOKEN = "<empty_output>"  # id 16: a special token never used in chat; the target's embeddings are frozen


def load_target(args: argparse.Namespace):
    """The SmolLM2 target on `--device` (float32 weights: the stages run it under bfloat16 autocast where that is
    faster, `uses_bfloat16`; quantized by `--target-quant`, float32 compute) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .pairs import smollm2_target_dir
    from ..integrations.quantize import quantize_target

    folder = smollm2_target_dir()
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    target = quantize_target(target.to(args.device), args.target_quant)
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(folder)


def distill(target, tokenizer, work: Path, args: argparse.Namespace, autocast: bool = True,
            requests_from: Path | None = None) -> None:
    """Answer the training requests from `--distill-from` on greedily, `--distill-batch` at a time; each chunk is
    saved on its own (`distill/chunk-NNNNN.json`, named by its first request: token ids and prompt length per
    request), so the stage resumes by chunk. Batches are large: under autocast a decode step's cost is mostly casting
    the weights, which a bigger batch shares (`autocast=False`: the target's own compute, for a quantized one).
    `requests_from`: another work folder's `requests.json` to answer (the same requests, by another target)."""
    from .prompt_sets import grow_training_requests
    from .code_corpus import corpus_split

    out = work / "distill"
    out.mkdir(parents=True, exist_ok=True)
    requests_file = out / "requests.json"  # made once: parsing the corpus's docstrings takes minutes
    if not requests_file.exists() and requests_from is not None and requests_from.exists():
        requests_file.write_text(requests_from.read_text())
    requests = json.loads(requests_file.read_text()) if requests_file.exists() else []
    if len(requests) < args.distill_requests and requests_from is None:  # new, or grown by a larger --distill-requests
        requests = grow_training_requests(corpus_split(site_packages=True)["train"], requests,
                                          args.distill_requests, seed=args.seed)
        requests_file.write_text(json.dumps(requests))
    tokenizer.padding_side = "left"
    started = time.time()
    for start in range(args.distill_from, len(requests), args.distill_batch):
        path = out / f"chunk-{start:05d}.json"  # named by its first request: a rerun may change the batch size
        if path.exists():
            continue
        if time.time() - started > args.distill_minutes * 60:
            print(f"distill: time budget spent at request {start}; rerun to continue")
            return
        messages = [[{"role": "user", "content": text}] for text in requests[start : start + args.distill_batch]]
        batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              padding=True, return_dict=True).to(target.device)
        with torch.no_grad(), torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=autocast):
            generated = target.generate(**batch, max_new_tokens=args.distill_tokens, do_sample=False)
        rows = []
        prompt_width = batch["input_ids"].shape[1]
        for row in range(generated.shape[0]):
            prompt = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            answer = generated[row, prompt_width:].tolist()
            if tokenizer.eos_token_id in answer:
                answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
            rows.append({"ids": prompt + answer, "prompt_len": len(prompt)})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(path)
        print(f"distill: requests {start}-{start + len(rows)} of {len(requests)} ("
              f"{(time.time() - started) / 60:.1f} min)", flush=True)


def distilled_tokens(chunks: list[Path]) -> tuple[list[int], list[int], int]:
    """The distilled conversations of `chunks` (the `distill` stage's JSON chunks, or the committed corpus's `.npz`
    shards) concatenated: token ids, loss mask (prompt tokens 0, answer tokens 1), and the number of requests."""
    ids, mask, requests = [], [], 0
    for path in chunks:
        if path.suffix == ".npz":
            shard = load_shard(path)
            offsets = shard["offsets"]
            for row, prompt_len in enumerate(shard["prompt_lengths"].tolist()):
                tokens = shard["tokens"][offsets[row]:offsets[row + 1]].tolist()
                ids.extend(tokens)
                mask.extend([0] * prompt_len + [1] * (len(tokens) - prompt_len))
                requests += 1
            continue
        for row in json.loads(path.read_text()):
            ids.extend(row["ids"])
            mask.extend([0] * row["prompt_len"] + [1] * (len(row["ids"]) - row["prompt_len"]))
            requests += 1
    return ids, mask, requests


def distilled_windows(chunks: list[Path], length: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The distilled conversations of `chunks`, cut into windows `[N, length]` with loss masks, and their sizes."""
    ids, mask, requests = distilled_tokens(chunks)
    windows, masks = cut_windows(ids, mask, length)
    return windows, masks, {"chat_requests": requests, "chat_tokens": len(ids), "chat_answer_tokens": int(sum(mask))}


def cut_windows(ids: list[int], mask: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    count = len(ids) // length
    return (np.asarray(ids[: count * length], dtype=np.int32).reshape(count, length),
            np.asarray(mask[: count * length], dtype=np.uint8).reshape(count, length))


def distill_chunks(work: Path, corpus: Path | None = None) -> list[Path]:
    """The chat data, in the order windows are cut from it: this work folder's distilled chunks, then the committed
    corpus's shards (oldest first; `corpus` None: none). A store lists their names, so data added later (a later
    `distill` run, new shards) is appended to it as training windows."""
    return sorted((work / "distill").glob("chunk-*.json")) + ([] if corpus is None else shard_paths(corpus))


def corpus_folder(args: argparse.Namespace) -> Path | None:
    """`--corpus`, when that folder exists (the committed shards of a clone; none elsewhere)."""
    folder = Path(args.corpus) if getattr(args, "corpus", None) else None
    return folder if folder is not None and folder.is_dir() else None


def make_windows(tokenizer, work: Path, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, int, dict]:
    """Windows `[W, L + 1]` and loss masks; the first `heldout` windows are held out, and the first
    `--skip-training-windows` of the shuffled training windows are left out. Returns them with the data sizes for
    the README."""
    from .code_corpus import corpus_split

    length = args.seq_len + 1
    chunks = distill_chunks(work, corpus_folder(args))
    chat, chat_masks, chat_sizes = distilled_windows(chunks, length)
    split = corpus_split(site_packages=True)
    code = code_stream(tokenizer, split["train"], args.code_tokens)
    code_windows, code_masks = cut_windows(code, [1] * len(code), length)
    held_code = code_stream(tokenizer, split["heldout"], args.heldout_windows // 2 * length)
    held_code_windows, held_code_masks = cut_windows(held_code, [1] * len(held_code), length)
    held_chat = args.heldout_windows - len(held_code_windows)
    rng = np.random.default_rng(args.seed)
    train_windows = np.concatenate([chat[held_chat:], code_windows])
    train_masks = np.concatenate([chat_masks[held_chat:], code_masks])
    if args.skip_training_windows >= len(train_windows):
        raise SystemExit(f"error: --skip-training-windows {args.skip_training_windows} leaves none of the "
                         f"{len(train_windows)} training windows: pass a smaller count, or a --corpus with more shards.")
    order = rng.permutation(len(train_windows))[args.skip_training_windows:]
    windows = np.concatenate([held_code_windows, chat[:held_chat], train_windows[order]])
    masks = np.concatenate([held_code_masks, chat_masks[:held_chat], train_masks[order]])
    sizes = {**chat_sizes, "chat_chunks": [path.name for path in chunks], "code_tokens": len(code),
             "windows": len(windows), "heldout_windows": args.heldout_windows, "seq_len": args.seq_len,
             "skipped_training_windows": args.skip_training_windows}
    return windows, masks, args.heldout_windows, sizes


def code_stream(tokenizer, texts: list[str], cap: int) -> list[int]:
    """The first `cap` tokens of `texts` tokenized one after another, each file closed by `<|endoftext|>`."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for start in range(0, len(texts), 64):
        for row in tokenizer(texts[start : start + 64], add_special_tokens=False)["input_ids"]:
            ids.extend(row + [eos])
        if len(ids) >= cap:
            break
    return ids[:cap]


def choose_draft_vocab(tokenizer, work: Path, args: argparse.Namespace) -> dict:
    """The `--draft-vocab` most frequent tokens of the training data (`training/draft_vocab.py`): the target's
    distilled answers (answer tokens only, past the first `--heldout-windows` windows' worth of the chat stream,
    which hold the held-out chat windows) and the training code stream, with the end-of-turn token always in.
    Written to `<work>/draft_vocab.json`; returns its sizes."""
    from .code_corpus import corpus_split
    from ..training.draft_vocab import frequent_tokens

    ids, mask, requests = distilled_tokens(distill_chunks(work, corpus_folder(args)))
    skip = args.heldout_windows * (args.seq_len + 1)
    answers = [token for token, answer in zip(ids[skip:], mask[skip:]) if answer]
    code = code_stream(tokenizer, corpus_split(site_packages=True)["train"], args.code_tokens)
    required = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    required = [token for token in required if token is not None and token != tokenizer.unk_token_id]
    token_ids, coverage = frequent_tokens([answers, code], args.draft_vocab, len(tokenizer), required)
    answer_coverage = float(np.isin(np.asarray(answers), token_ids.numpy()).mean()) if answers else 1.0
    sizes = {"size": len(token_ids), "answer_tokens": len(answers), "answer_requests": requests,
             "code_tokens": len(code), "coverage": round(coverage, 4), "answer_coverage": round(answer_coverage, 4)}
    (work / "draft_vocab.json").write_text(json.dumps({**sizes, "token_ids": token_ids.tolist()}))
    print(f"vocab: {len(token_ids)} tokens cover {answer_coverage:.1%} of {len(answers)} answer tokens "
          f"({coverage:.1%} with {len(code)} code tokens)")
    return sizes


def load_draft_vocab(work: Path) -> torch.LongTensor | None:
    """The token ids the `vocab` stage chose, or None when it has not run."""
    path = work / "draft_vocab.json"
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long) if path.exists() else None


def add_chat_windows(work: Path, store_dir: Path, args: argparse.Namespace) -> dict | None:
    """Distilled chunks that are not in the store yet (a later `distill` run answered more requests), cut into
    windows and appended to it as training windows (the held-out set stays). Returns the grown data sizes, or None
    when there is nothing new."""
    from ..training.features import extend_store

    meta = json.loads((store_dir / "store.json").read_text())
    if "chat_chunks" not in meta:
        raise SystemExit(f"error: {store_dir}/store.json does not list the distilled chunks it was cut from "
                         "(\"chat_chunks\"): add that list to grow it, or remove the store to rebuild it.")
    new_chunks = [path for path in distill_chunks(work, corpus_folder(args)) if path.name not in meta["chat_chunks"]]
    if not new_chunks:
        return None
    windows, masks, sizes = distilled_windows(new_chunks, args.seq_len + 1)
    count = extend_store(store_dir, windows, masks, chat_chunks=meta["chat_chunks"] + [p.name for p in new_chunks])
    print(f"windows: {len(windows)} chat windows from {len(new_chunks)} new distilled chunks ({count} in all)")
    return {**sizes, "windows_added": len(windows), "windows": count}


def new_drafter(target, args: argparse.Namespace, tokenizer):
    from .tiny_suite import context_layer_ids
    from ..training.drafter import new_drafter as fresh_drafter

    torch.manual_seed(args.seed)
    return fresh_drafter(target, args.drafter_layers, block_size=16,
                         mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN),
                         target_layer_ids=context_layer_ids(target.config.num_hidden_layers, args.context_layers),
                         ar_intermediate_size=args.ar_intermediate, layer_init=args.layer_init)


def open_store(store_dir: Path, target, args: argparse.Namespace, autocast: bool = True):
    """The training data of the backbone and ar stages: the feature store in `store_dir`, or its windows with the
    target's outputs computed per batch (`--online-features`)."""
    from ..training.features import FeatureStore, OnlineFeatures

    options = dict(seed=args.seed, chat_fraction=args.chat_fraction, chat_windows=args.chat_windows)
    if args.online_features:
        return OnlineFeatures(store_dir, target, autocast=autocast, **options)
    return FeatureStore(store_dir, **options)


def add_online_features_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--online-features", action="store_true",
                        help="run the target over each training batch instead of reading the feature store (no "
                             "features stage: for a GPU, where that forward is cheaper than the store's disk)")


def uses_bfloat16(args: argparse.Namespace, target) -> bool:
    """Whether the stages compute under bfloat16 autocast (float32 weights and optimizer state either way):
    `--compute-dtype bfloat16` / `float32`, or "auto" (the default): bfloat16 on a GPU and on a CPU with bfloat16
    arithmetic (AVX512-BF16, AMX, Arm BF16: `dtype="auto"`'s rule, `cpu_has_native`), float32 on other CPUs, which
    emulate bfloat16 several times slower (a feature batch 5x on a 2-core AVX2 EPYC)."""
    from ..integrations.cpu_linear import bfloat16_is_fast

    choice = getattr(args, "compute_dtype", "auto")
    if choice != "auto":
        return choice == "bfloat16"
    return bfloat16_is_fast(next(target.parameters()).device)


def add_compute_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compute-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="the stages' arithmetic: bfloat16 autocast or float32 (auto: bfloat16 on a GPU and on a "
                             "CPU with bfloat16 units, float32 on others, where bfloat16 is several times slower)")


def peak_lr(lr: float | None, continuing: bool) -> float:
    """The stages' peak learning rate: `lr` when given, else `CONTINUED_LR` for a continuation of a trained drafter
    and `NEW_DRAFTER_LR` otherwise."""
    if lr is not None:
        return lr
    return CONTINUED_LR if continuing else NEW_DRAFTER_LR


def train_stage(stage: str, target, drafter, store, run_dir: Path, args, minutes: float | None = None,
                fixed_steps: int | None = None, full_finetune: bool = False) -> dict:
    """One drafter stage on the cached features `store`, resumable from `run_dir`: `fixed_steps` steps, or as many as
    fit `minutes` (first estimated on a few steps, then re-estimated from the pace at every save, so the cosine
    ends with the time). `args`: `num_anchors`, `batch_size`, `lr`, `seed`. `full_finetune`: stage ar trains the
    backbone too."""
    from .tiny_suite import schedule_length
    from ..training.drafter import DrafterLossConfig, block_loss_terms, freeze_for_stage, sample_anchors
    from ..training.loop import LoopConfig, LossTerms, Shard, train_loop

    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    loss_config = DrafterLossConfig(stage=stage, num_anchors=args.num_anchors, decay=args.decay,
                                    ce_weight=args.ce_weight)
    block = drafter.config.block_size
    generator = torch.Generator()
    drafter.to(target.device)  # (trains where the target runs: `--device`)
    freeze_for_stage(drafter, stage, full_finetune)

    def terms(item, seed: int, stage_name: str = stage) -> LossTerms:
        ids, mask, context, teacher = item  # the store's rows, CPU tensors
        generator.manual_seed(seed)  # (a CPU generator: the same anchors on every device)
        anchors = sample_anchors(ids.shape[0], ids.shape[1] - 1, block, args.num_anchors, generator, mask)
        ids, mask, context, teacher = (part.to(drafter.device) for part in item)
        return block_loss_terms(drafter, embed, head, ids, context, teacher, loss_config, anchors, mask, stage_name)

    def loss_fn(step: int, shard: Shard) -> LossTerms:
        return terms(store.batch(step, args.batch_size), args.seed * 7919 + step)

    heldout = store.heldout_batches(args.batch_size)

    def eval_fn(shard: Shard) -> dict:
        totals: dict[str, tuple] = {}
        for stage_name in (["backbone", "ar"] if stage == "ar" else ["backbone"]):
            for index, item in enumerate(heldout):
                for key, (num, den) in terms(item, 12345 + index, stage_name).metrics.items():
                    old = totals.get(f"{stage_name}_{key}", (0.0, 0.0))
                    totals[f"{stage_name}_{key}"] = (old[0] + float(num), old[1] + float(den))
        return totals

    bfloat16 = uses_bfloat16(args, target)

    def probe(step: int) -> None:
        with torch.autocast(drafter.device.type, dtype=torch.bfloat16, enabled=bfloat16):
            loss = terms(store.batch(step, args.batch_size), step)
        (loss.loss_sum / loss.weight).backward()
        drafter.zero_grad(set_to_none=True)

    max_steps = schedule_length(run_dir, minutes, probe, fixed_steps=fixed_steps)
    config = LoopConfig(run_dir=str(run_dir), max_steps=max_steps, max_minutes=minutes, batch_size=args.batch_size,
                        lr=args.lr, warmup_steps=min(50, max_steps // 10), eval_every=max(10, max_steps // 8),
                        save_every=max(10, max_steps // 16), seed=args.seed, resume=True,
                        mixed_precision="bf16" if bfloat16 else "no",
                        replan=fixed_steps is None and minutes is not None)
    return train_loop(drafter, loss_fn, eval_fn, config, f"drafter-{stage}")


def run(args: argparse.Namespace) -> int:
    from .pairs import SMOLLM2_DRAFTER
    from ..training.checkpoint import latest_checkpoint
    from ..training.features import copy_windows, create_store, fill_store

    torch.set_num_threads(args.threads)
    recalibrating = args.target_quant != "none"
    args.lr = peak_lr(args.lr, continuing=bool(args.init) and not recalibrating)
    if recalibrating and args.device != "cpu":
        raise SystemExit(f"error: --target-quant {args.target_quant} recalibrates on the CPU (its quantized targets "
                         "have only been run there): leave --device out.")
    if args.grow_layers and not (args.init or recalibrating):
        raise SystemExit("error: --grow-layers adds layers to a trained drafter: give it with --init (a new drafter "
                         "takes --drafter-layers).")
    work = Path(args.work or ("reference_work/smollm2" + (f"-{args.target_quant}" if recalibrating else "")))
    out = Path(args.out or (work / "drafter" if recalibrating else SMOLLM2_DRAFTER))
    if args.stages is None:
        args.stages = list(RECALIBRATION_STAGES if recalibrating else STAGES)
    work.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(args)
    bfloat16 = uses_bfloat16(args, target)
    print(f"compute: {'bfloat16 autocast' if bfloat16 else 'float32'} (--compute-dtype {args.compute_dtype})")
    target_autocast = bfloat16 and not recalibrating  # (a quantized target computes in its own dtype)
    summary_file = work / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}

    def record(key: str, value) -> None:
        summary[key] = value
        summary_file.write_text(json.dumps(summary, indent=2))

    if "distill" in args.stages:
        started = time.time()
        distill(target, tokenizer, work, args, autocast=target_autocast,
                requests_from=Path(args.windows_from).parent / "distill" / "requests.json" if recalibrating else None)
        record("distill_minutes", summary.get("distill_minutes", 0.0) + (time.time() - started) / 60)
    if "vocab" in args.stages and args.draft_vocab:
        chosen = load_draft_vocab(work)
        if chosen is not None and len(chosen) != args.draft_vocab:
            raise SystemExit(f"error: {work}/draft_vocab.json holds {len(chosen)} tokens, not --draft-vocab "
                             f"{args.draft_vocab}: the drafter of this work folder trains on that one; remove the "
                             "file to choose again (and retrain), or pass its size.")
        if chosen is None:  # chosen once per work folder: every stage trains on the same vocabulary
            record("draft_vocab", choose_draft_vocab(tokenizer, work, args))
        if not {"backbone", "ar", "export"} & set(args.stages):  # a drafter already made: the vocabulary in place
            if not (out / "config.json").is_file():
                raise SystemExit(f"error: stage vocab gives the drafter in --out ({out}) its draft vocabulary, and "
                                 "there is none there: point --out at a drafter folder, or add the export stage.")
            apply_draft_vocab(out, load_draft_vocab(work), summary["draft_vocab"])
    store_dir = work / "features"
    if recalibrating or args.init:  # a trained drafter: recalibrated, or continued on this folder's data
        drafter = initial_drafter(args.init or str(SMOLLM2_DRAFTER), target)
        if args.grow_layers:
            from ..training.drafter import with_identity_layers

            drafter = with_identity_layers(drafter, args.grow_layers)
    else:
        drafter = new_drafter(target, args, tokenizer)
    layer_init = args.layer_init if not args.init else (
        f"from {args.init}" + (f", grown by {args.grow_layers} identity layers" if args.grow_layers else ""))
    if not recalibrating and args.draft_vocab and (token_ids := load_draft_vocab(work)) is not None:
        drafter.set_draft_vocab(token_ids)  # trained as it will draft (and the head's product V / V' cheaper)
    if "windows" in args.stages and not (store_dir / "store.json").exists():
        layer_ids = list(drafter.config.target_layer_ids)
        if recalibrating:
            copy_windows(args.windows_from, store_dir, args.recalibration_windows, layer_ids,
                         target.config.hidden_size, args.top_k)
            record("data", {"windows_from": str(args.windows_from),
                            "windows": json.loads((store_dir / "store.json").read_text())["windows"]})
        else:
            windows, masks, heldout, sizes = make_windows(tokenizer, work, args)
            create_store(store_dir, windows, masks, layer_ids, target.config.hidden_size, args.top_k, heldout,
                         outputs=not args.online_features, chat_chunks=sizes["chat_chunks"])
            record("data", sizes)
    elif "windows" in args.stages:  # (a recalibration store grows by the quantized target's own answers)
        if (added := add_chat_windows(work, store_dir, args)) is not None:
            record("data_added", summary.get("data_added", []) + [added])
    if "features" in args.stages and args.online_features:
        print("features: none stored (--online-features: the target runs over each training batch)")
    elif "features" in args.stages:
        started = time.time()
        done = fill_store(target, store_dir, batch_size=4, minutes=args.features_minutes, autocast=target_autocast)
        record("features_minutes", summary.get("features_minutes", 0.0) + (time.time() - started) / 60)
        record("feature_windows_done", done)
    run_dirs = {"backbone": work / args.backbone_run, "ar": work / args.ar_run}
    for stage in ("backbone", "ar"):
        if stage in args.stages:
            store = open_store(store_dir, target, args, autocast=target_autocast)
            if stage == "ar" and (not recalibrating or latest_checkpoint(run_dirs["backbone"]) is not None):
                load_stage(drafter, run_dirs["backbone"])  # (a recalibration without one keeps --init's backbone)
            if stage == "backbone" and args.backbone_init and latest_checkpoint(run_dirs["backbone"]) is None:
                load_stage(drafter, work / args.backbone_init)  # a new schedule continuing an earlier backbone
            if stage == "ar" and args.ar_init and latest_checkpoint(run_dirs["ar"]) is None:
                from ..training.drafter import AR_PREFIX
                load_stage(drafter, work / args.ar_init, only_prefix=AR_PREFIX)  # warm start on a newer backbone
            minutes = args.backbone_minutes if stage == "backbone" else args.ar_minutes
            stage_summary = train_stage(stage, target, drafter, store, run_dirs[stage], args, minutes)
            stage_summary.update(windows_available=store.done, run=run_dirs[stage].name,
                                 chat_fraction=args.chat_fraction, chat_windows=store.chat_window_count,
                                 chat_answer_tokens=store.chat_answer_tokens, loss_decay=args.decay,
                                 ce_weight=args.ce_weight, drafter_layers=drafter.config.num_hidden_layers,
                                 layer_init=layer_init, online_features=args.online_features,
                                 device=str(target.device), bfloat16=bfloat16)
            if stage == "backbone" and args.backbone_init:
                stage_summary["continues"] = stage_key("backbone", args.backbone_init)
            if stage == "ar" and args.ar_init:
                stage_summary["ar_layer_from"] = stage_key("ar", args.ar_init)
            record(stage_key(stage, args.backbone_run if stage == "backbone" else args.ar_run), stage_summary)
    if "export" in args.stages:
        load_stage(drafter, run_dirs["ar"])
        export(drafter, out, summary, args.target_quant,
               stage_history(summary, stage_key("backbone", args.backbone_run), "continues")
               + stage_history(summary, stage_key("ar", args.ar_run), "ar_layer_from"))
    return 0


def stage_key(stage: str, run: str) -> str:
    """A stage's entry in the work folder's `summary.json`: `backbone` / `ar` for the default runs, else
    `stage:run`."""
    return stage if run == f"run-{stage}" else f"{stage}:{run}"


def stage_history(summary: dict, key: str, link: str) -> list[str]:
    """`key` preceded by the stages it started from, earliest first, following each summary entry's `link` (a
    backbone's `continues`, an AR run's `ar_layer_from`). Export keeps only the entries the summary has."""
    history = [key]
    while (earlier := summary.get(history[0], {}).get(link)) is not None:
        history.insert(0, earlier)
    return history


def initial_drafter(path: str, target):
    """The drafter a recalibration starts from (float32), checked to fit the recipe's target."""
    from transformers import AutoModel

    import treeflash_hf  # noqa: F401  (registers the drafter classes)

    if not (Path(path) / "config.json").is_file():
        raise SystemExit(f"error: --init {path} is not a drafter folder (no config.json).")
    drafter = AutoModel.from_pretrained(path, dtype=torch.float32)
    for name in ("hidden_size", "vocab_size"):
        if getattr(drafter.config, name) != getattr(target.config, name):
            raise SystemExit(f"error: --init {path} was not trained for this target ({name} "
                             f"{getattr(drafter.config, name)} vs {getattr(target.config, name)}).")
    return drafter


def load_stage(drafter, run_dir: Path, only_prefix: str | None = None) -> None:
    """The drafter weights of the last checkpoint of a stage (`only_prefix`: only the parameters whose names start
    with it, the rest kept)."""
    from ..training.checkpoint import latest_checkpoint, load_checkpoint, with_own_draft_vocab

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"No checkpoint in {run_dir}: run the stage before the next one.")
    weights = load_checkpoint(checkpoint)["model"]
    if only_prefix is not None:
        weights = {**drafter.state_dict(), **{k: v for k, v in weights.items() if k.startswith(only_prefix)}}
    drafter.load_state_dict(with_own_draft_vocab(drafter, weights))


def apply_draft_vocab(folder: Path, token_ids: torch.LongTensor, sizes: dict) -> None:
    """Give the drafter saved in `folder` the draft vocabulary `token_ids` (weights unchanged), recorded in its
    training summary."""
    from transformers import AutoModel

    import treeflash_hf  # noqa: F401  (registers the drafter classes)

    drafter = AutoModel.from_pretrained(folder, dtype="auto")  # saved again in the dtype it was saved in
    drafter.set_draft_vocab(token_ids)
    drafter.save_pretrained(folder)
    summary_file = folder / "training_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    summary_file.write_text(json.dumps({**summary, "draft_vocab": sizes}, indent=2))
    add_draft_vocab_note(folder, sizes)
    print(f"saved the draft vocabulary ({len(token_ids)} tokens) into {folder}")


DRAFT_VOCAB_HEADING = "## Draft vocabulary"


def add_draft_vocab_note(folder: Path, sizes: dict) -> None:
    """Say in the drafter's README which tokens it drafts from (replacing an earlier such section)."""
    readme = folder / "README.md"
    text = readme.read_text().split(f"\n{DRAFT_VOCAB_HEADING}")[0].rstrip() if readme.exists() else ""
    note = (f"{DRAFT_VOCAB_HEADING}\n\nDrafts come from {sizes['size']:,} tokens (`draft_token_ids`): the most "
            f"frequent of the training data (the target's answers to {sizes['answer_requests']:,} training requests, "
            f"{sizes['answer_tokens']:,} answer tokens, and {sizes['code_tokens']:,} tokens of the code corpus; they "
            f"cover {sizes['answer_coverage']:.1%} of those answer tokens). The target's head scores drafts on these "
            "rows only; verification uses the whole head, so the output is unchanged.\n")
    readme.write_text(f"{text}\n\n{note}" if text else note)


CURVE_EVERY = 10  # training rows a bundled summary keeps: every 10th step (a row a step made it ~1 MB)


def thinned_curve(stage_summary: dict, every: int = CURVE_EVERY) -> dict:
    """A stage's summary with its curve cut to its evaluated rows, every `every`-th step and the last step (the
    work folder keeps every row)."""
    curve = stage_summary.get("curve", [])
    kept = [row for i, row in enumerate(curve) if row.get("step", i + 1) % every == 0 or i == len(curve) - 1
            or any(key.startswith("eval_") for key in row)]
    return {**stage_summary, "curve": kept}


def export(drafter, out: Path, summary: dict, target_quant: str = "none",
           stage_keys: tuple[str, ...] = ("backbone", "ar")) -> None:
    """The drafter in bfloat16 with the reference tree defaults, its training summary and README; `stage_keys`: the
    summary entries of the stages that made it, in order."""
    from .tiny_suite import write_readme

    defaults = {"tree_budget": "auto", "tree_mode": "treeflash", "tree_top_m": 256, "tree_top_k": 16}
    for name, value in defaults.items():
        setattr(drafter.config, name, value)
        setattr(drafter.generation_config, name, value)
    for param in drafter.parameters():
        param.requires_grad = True
    drafter.to(torch.bfloat16).save_pretrained(out)
    stages = {k: thinned_curve(summary[k]) for k in stage_keys if k in summary}
    (out / "training_summary.json").write_text(json.dumps({**stages, "data": summary.get("data", {}),
                                                           "data_added": summary.get("data_added", []),
                                                           "distill_minutes": summary.get("distill_minutes"),
                                                           "features_minutes": summary.get("features_minutes"),
                                                           "draft_vocab": summary.get("draft_vocab")},
                                                          indent=2))
    title = "TreeFlash drafter for SmolLM2-135M-Instruct (the `smollm2-135m` pair), trained by " \
            "`treeflash-hf reference train-drafter`."
    if target_quant != "none":
        from ..integrations.quantize import describe

        tuned = "backbone and AR layer" if any(key.startswith("backbone") for key in stages) else "AR layer"
        title += (f" Recalibrated (`--target-quant {target_quant}`: {tuned} fine-tuned) for the target quantized "
                  f"by {describe(target_quant)}.")
    write_readme(out, title, stages, sum(p.numel() for p in drafter.parameters()),
                 torch.bfloat16, recipe="reference train-drafter")
    if getattr(drafter, "draft_token_ids", None) is not None and summary.get("draft_vocab"):
        add_draft_vocab_note(out, summary["draft_vocab"])
    drafter.to(torch.float32)
    print(f"saved {out}")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """`--context-layers`, `--ar-intermediate`: the rest of a new SmolLM2 drafter's shape."""
    parser.add_argument("--context-layers", type=positive_int, default=3,
                        help="target layers whose outputs are the drafter's context (default 3)")
    parser.add_argument("--ar-intermediate", type=positive_int, default=1024,
                        help="the AR layer's inner width (default 1024)")


def add_parser(subparsers) -> None:
    from .pairs import SMOLLM2_DRAFTER

    parser = subparsers.add_parser("train-drafter", help="the recipe of the bundled SmolLM2 drafter (resumable)")
    parser.add_argument("--work", help="data, features and checkpoints (ignored; default reference_work/smollm2, "
                                       "reference_work/smollm2-SPEC with --target-quant)")
    parser.add_argument("--out", help=f"default {SMOLLM2_DRAFTER}; <work>/drafter with --target-quant")
    add_target_quant_argument(parser)
    add_device_argument(parser, " (the target and the drafter; not with --target-quant)")
    parser.add_argument("--init", help="a trained drafter folder to start from instead of a new drafter (a "
                                       "continuation on this folder's data; a recalibration starts from the bundled "
                                       f"drafter, {SMOLLM2_DRAFTER}, unless given)")
    parser.add_argument("--grow-layers", type=non_negative_int, default=0,
                        help="with --init: append this many decoder layers that start as the identity (zero output "
                             "projections), a deeper drafter continuing the one given (default 0)")
    parser.add_argument("--windows-from", default="reference_work/smollm2/features",
                        help="the full-precision feature store whose windows a recalibration reuses")
    parser.add_argument("--recalibration-windows", type=positive_int, default=240)
    parser.add_argument("--stages", nargs="+", choices=STAGES,
                        help=f"default: {' '.join(STAGES)}; {' '.join(RECALIBRATION_STAGES)} with --target-quant")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distill-requests", type=positive_int, default=2048,
                        help="training requests (a larger count later appends new ones to the work folder's list)")
    parser.add_argument("--distill-batch", type=positive_int, default=128)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS,
                        help="the committed corpus of distilled answers (`reference corpus grow`): its shards join "
                             "the work folder's distilled chunks as chat windows (default %(default)s; '' for none)")
    parser.add_argument("--distill-from", type=non_negative_int, default=0,
                        help="the first request to answer (a recalibration: past the first ~10, whose dense answers "
                             "hold the held-out chat windows; 128 used)")
    parser.add_argument("--distill-tokens", type=positive_int, default=192, help="new tokens per answer at most")
    parser.add_argument("--distill-minutes", type=float, default=15)
    parser.add_argument("--code-tokens", type=non_negative_int, default=600_000)
    parser.add_argument("--draft-vocab", type=non_negative_int, default=8192,
                        help="tokens the drafter drafts from (stage vocab: the most frequent of the training data; "
                             "0: the whole vocabulary)")
    parser.add_argument("--heldout-windows", type=positive_int, default=8)
    parser.add_argument("--skip-training-windows", type=non_negative_int, default=0,
                        help="leave out the first N training windows of the shuffled order (stage windows): those an "
                             "earlier store over the same chat data, seed and code tokens had features for, so a "
                             "continued drafter trains on windows it has not seen")
    parser.add_argument("--top-k", type=positive_int, default=16, help="teacher log-probs kept per position")
    parser.add_argument("--features-minutes", type=float, default=15)
    add_online_features_argument(parser)
    add_compute_dtype_argument(parser)
    add_drafter_arguments(parser, drafter_layers=1, num_anchors=48)
    add_shape_arguments(parser)
    add_optimizer_arguments(parser, lr=NEW_DRAFTER_LR, batch_size=4, seq_len=512, continued_lr=CONTINUED_LR)
    parser.add_argument("--backbone-minutes", type=float, default=35)
    parser.add_argument("--ar-minutes", type=float, default=20)
    parser.add_argument("--backbone-run", default="run-backbone", help="the backbone stage's folder in --work")
    parser.add_argument("--ar-run", default="run-ar", help="the ar stage's folder in --work (export reads it)")
    parser.add_argument("--backbone-init", help="a backbone run folder in --work whose last checkpoint starts a new "
                                                "--backbone-run schedule (a continuation on new data)")
    parser.add_argument("--ar-init", help="an ar run folder in --work whose AR layer starts a new --ar-run (a warm "
                                          "start on a continued backbone)")
    parser.add_argument("--chat-fraction", type=float,
                        help="share of each batch drawn from chat windows (default: uniform over all windows)")
    parser.add_argument("--chat-windows", type=positive_int,
                        help="train on the first N chat training windows of the store only (a data-scaling point; "
                             "default: all of them)")
    parser.set_defaults(func=run)
