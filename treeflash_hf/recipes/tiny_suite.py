"""The reference suite: a tokenizer, a small Qwen3 target, its TreeFlash drafter and a small AR draft LM, all
trained here on the Python standard library, bundled in `reference_models/`.

`treeflash-hf reference build` runs the recipe (every stage time-bounded and resumable; sizes and budgets are
flags, so the same recipe scales up); `load()` returns the bundled `(target, drafter, tokenizer)` in seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..arguments import add_drafter_arguments, add_optimizer_arguments, device_name, non_negative_int, positive_int
from ..optional import require
from ..reference import load
from .code_corpus import corpus_split, reserved_package_texts
from .pairs import BUNDLED_DIR

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                      mask_token="<|mask|>", model_max_length=4096)
    wrapped.save_pretrained(out_dir)
    return wrapped


def bytes_per_token(texts: list[str], num_tokens: int) -> float:
    """UTF-8 bytes of `texts` per token of their encoding."""
    return sum(len(text.encode()) for text in texts) / max(1, num_tokens)


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(texts), 64):
        for row in tokenizer(texts[start : start + 64], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def save_model(model, out_dir: Path, summary: dict, dtype: torch.dtype, description: str,
               tokenizer=None) -> None:
    """Save weights in `dtype`, the training summary, a README and (for a model folder users load by itself) the
    tokenizer files, so that `AutoTokenizer.from_pretrained(out_dir)` works."""
    model.to(dtype).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2))
    model.to(torch.float32)
    write_readme(out_dir, description, summary, sum(p.numel() for p in model.parameters()), dtype)


def load_drafter_weights(drafter, folder: Path) -> None:
    """Copy the weights of the drafter saved in `folder` into `drafter` (same shapes), or say what differs."""
    from ..hub.convert import read_weights

    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"--drafter-init {folder}: no *.safetensors weights there; pass a drafter folder "
                                f"written by `treeflash-hf reference build`.")
    state = read_weights(folder)  # a truncated or corrupt file gets its own clear error
    own = drafter.state_dict()
    wrong = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    if wrong:
        raise ValueError(f"--drafter-init {folder}: its weights do not fit this drafter's shape ({len(wrong)} "
                         f"tensors missing or of another shape, e.g. {wrong[0]}); build with the same drafter "
                         f"options as that drafter, or drop --drafter-init.")
    drafter.load_state_dict({k: state[k].to(own[k].dtype) for k in own})


def earlier_training(folder: Path, stage: str) -> dict:
    """What the drafter in `folder` had been trained for in `stage` (from its training_summary.json, if any)."""
    record = {"folder": str(folder)}
    summary_file = folder / "training_summary.json"
    if summary_file.exists():
        earlier = json.loads(summary_file.read_text()).get(stage, {})
        record.update({key: earlier[key] for key in ("steps", "tokens", "minutes") if key in earlier})
    return record


def write_readme(out_dir: Path, description: str, summary: dict, params: int, dtype: torch.dtype,
                 recipe: str = "reference build") -> None:
    stages = summary if all(isinstance(v, dict) and "curve" in v for v in summary.values()) else {"": summary}
    dtype_name = str(dtype).removeprefix("torch.")
    lines = [f"# {out_dir.name}", "", description, "", f"Parameters: {params / 1e6:.2f}M. Weights are stored in "
             f"{dtype_name}; `treeflash_hf.reference.load()` loads them in {dtype_name} (pass `dtype=` for "
             "another).", "", f"Trained by `treeflash-hf {recipe}` (see the package README); figures from "
             "`training_summary.json`:", ""]
    for stage, info in stages.items():
        evals = [row for row in info["curve"] if any(k.startswith("eval_") for k in row)]
        final = {k: round(v, 4) for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")}
        name = f"stage `{stage}`: " if stage else ""
        runs = info.get("runs", [])
        in_runs = f" in {len(runs)} runs (resumed at step {', '.join(str(r['from_step']) for r in runs[1:])})" \
            if len(runs) > 1 else ""
        earlier = info.get("initialized_from")
        if earlier and "steps" in earlier:
            in_runs += (f", fine-tuned from an earlier drafter ({earlier['steps']} steps, {earlier['tokens']:,} "
                        f"tokens, {earlier['minutes']:.1f} min)")
        lines.append(f"- {name}{info['steps']} steps, {info['tokens']:,} tokens, {info['minutes']:.1f} min on "
                     f"{info.get('device', 'cpu')}{in_runs}; final held-out {final}")
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def schedule_length(run_dir: Path, minutes: float, probe_step, fixed_steps: int | None = None,
                    probe_steps: int = 3) -> int:
    """The stage's schedule length, fixed once and kept in `run_dir/schedule.json` so a resumed run keeps it:
    `fixed_steps` when given, else what fits `minutes` from the time of a few `probe_step(step)` calls."""
    record = run_dir / "schedule.json"
    if record.exists():
        return json.loads(record.read_text())["max_steps"]
    if fixed_steps:
        max_steps = fixed_steps
    else:
        start = time.time()
        for step in range(probe_steps):
            probe_step(step)
        max_steps = max(10, int(minutes * 60 / ((time.time() - start) / probe_steps)))
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"max_steps": max_steps}))
    return max_steps


def context_layer_ids(num_layers: int, count: int) -> list[int]:
    """DFlash's choice of target layers for the context features: `[L // 2]` for one, else
    `round(1 + i * (L - 4) / (count - 1))`, spread over the depth."""
    if count == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (count - 1))) for i in range(count)]


def prepare_corpus(args: argparse.Namespace, out: Path, work: Path):
    """The tokenizer (kept when `out/tokenizer` exists, else trained on the train split) and the token streams of
    the train split, the held-out split and the reserved packages, cached in `work`."""
    from transformers import AutoTokenizer

    from ..training.data import load_tokens, save_tokens

    tokenizer_dir = out / "tokenizer"
    if not (work / "corpus.json").exists():
        texts = corpus_split(site_packages=args.site_packages, package_cap_mb=args.package_cap_mb)
        texts["packages"] = reserved_package_texts()
        print(f"corpus: {len(texts['train'])} train files, {len(texts['heldout'])} held-out files, "
              f"{len(texts['packages'])} files of the reserved packages")
        if not (tokenizer_dir / "tokenizer.json").exists():
            train_tokenizer(texts["train"], args.vocab_size, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        info = {}
        for split, split_texts in texts.items():
            ids = encode(tokenizer, split_texts)
            save_tokens(work / f"{split}.npy", ids)
            info[split] = {"files": len(split_texts), "tokens": int(len(ids)),
                           "bytes_per_token": bytes_per_token(split_texts, len(ids))}
        tmp = work / "corpus.json.tmp"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(work / "corpus.json")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    corpus = json.loads((work / "corpus.json").read_text())
    streams = {split: load_tokens(work / f"{split}.npy") for split in corpus}
    for split, info in corpus.items():
        print(f"{split}: {info['tokens']:,} tokens, {info['bytes_per_token']:.2f} bytes/token")
    return tokenizer, corpus, streams


def self_distillation_prompts(tokens, count: int, prompt_len: int, eos: int, seed: int) -> list[list[int]]:
    """`count` prompts of `prompt_len` tokens cut from a token stream at seeded random places (cut at an EOS so
    that a prompt never spans two files)."""
    generator = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < count:
        start = int(generator.integers(0, len(tokens) - prompt_len))
        window = tokens[start : start + prompt_len].tolist()
        if eos in window:
            window = window[window.index(eos) + 1 :]
        if len(window) >= prompt_len // 4:
            prompts.append(window)
    return prompts


def build_self_distillation(target, tokenizer, prompts: list[list[int]], out_dir: Path, max_new_tokens: int,
                            batch_size: int, temperature: float) -> None:
    """Answer `prompts` with the target (half greedy, half sampled at `temperature`), as a resumable Arrow set of
    `input_ids` and `loss_mask` (1 on the response): chunks land in `out_dir/chunks/` one by one."""
    datasets = require("datasets")

    from ..training.data import build_self_distillation_set

    chunks = out_dir / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    texts = [tokenizer.decode(p) for p in prompts]
    chunk_size = batch_size * 8
    for index, start in enumerate(range(0, len(texts), chunk_size)):
        chunk_dir = chunks / f"{index:05d}"
        if chunk_dir.exists():
            continue
        torch.manual_seed(index)
        sampled = index % 2 == 1
        tmp = chunks / f".tmp-{index:05d}"
        build_self_distillation_set(target, tokenizer, texts[start : start + chunk_size], tmp, max_new_tokens,
                                    batch_size, do_sample=sampled, temperature=temperature)
        tmp.rename(chunk_dir)
        print(f"self-distillation: {min(start + chunk_size, len(texts))}/{len(texts)} prompts answered")
    parts = [datasets.load_from_disk(str(path)) for path in sorted(chunks.iterdir()) if not path.name.startswith(".")]
    datasets.concatenate_datasets(parts).save_to_disk(str(out_dir / "dataset"))


STAGES = ("target", "drafter", "draft_lm")


def build(args: argparse.Namespace) -> int:
    """Run the recipe (each stage skipped when its output exists, resumed when interrupted)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from ..modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
    from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel
    from ..training.data import MaskedSequences, TokenStream
    from ..training.drafter import DrafterLossConfig, drafter_loss, freeze_for_stage, train_drafter
    from ..training.lm import lm_loss, train_lm
    from ..training.loop import LoopConfig

    torch.set_num_threads(args.threads)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
    tokenizer, corpus, streams = prepare_corpus(args, out, work)
    vocab = len(tokenizer)

    def lm_stage(name: str, config: Qwen3Config, minutes: float, steps: int | None, lr: float, extra_steps: int = 0):
        if (out / name / "config.json").exists():
            return
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(device)
        seq_len, batch = args.seq_len, args.batch_size
        train = TokenStream(streams["train"], seq_len, seed=1)
        heldout = {split: (TokenStream(streams[split], seq_len, seed=2), corpus[split]["bytes_per_token"])
                   for split in ("heldout", "packages")}
        run_dir = work / f"run-{name}"
        probe = Qwen3ForCausalLM(config).to(device)  # a throwaway copy times the steps
        max_steps = schedule_length(
            run_dir, minutes, lambda s: lm_loss(probe, train.batch(s, batch).to(device)).backward(), steps)
        # extra_steps continue a finished schedule at its floor learning rate (the cosine keeps its length)
        loop = LoopConfig(run_dir=str(run_dir), max_steps=max_steps + extra_steps, max_minutes=minutes * 1.15,
                          batch_size=batch, lr=lr, warmup_steps=min(100, max_steps // 10),
                          eval_every=max(50, max_steps // 10), save_every=max(50, max_steps // 20), resume=True,
                          mixed_precision=precision, cosine_steps=max_steps)
        summary = train_lm(model, train, heldout, loop, description=name)
        summary["loop"] = loop.__dict__
        summary["device"] = str(device)
        summary["params"] = sum(p.numel() for p in model.parameters())
        summary["corpus"] = corpus
        save_model(model, out / name, summary, dtype, descriptions[name], tokenizer=tokenizer)

    descriptions = {
        "target": "The reference target: a Qwen3-architecture causal LM trained from scratch on Python code (the "
                  "standard library and the packages of the build environment, the reserved evaluation packages "
                  "excepted; deduplicated; files split by a stable hash of their path).",
        "draft_lm": "A small autoregressive draft LM sharing the target's tokenizer: the baseline stock assisted "
                    "generation (`assistant_model=draft_lm`) needs.",
    }

    def qwen3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=True,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    # 1. the target
    if "target" in args.stages:
        lm_stage("target", qwen3(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate),
                 args.target_minutes, args.target_steps, args.lr, args.target_extra_steps)

    # 2. the drafter: backbone on the corpus, then the AR layer (backbone frozen) on self-distilled data
    if "drafter" in args.stages and not (out / "drafter" / "config.json").exists():
        target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(device).eval()
        config = TreeFlashDrafterConfig(
            vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.drafter_intermediate,
            num_hidden_layers=args.drafter_layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, rope_theta=10000.0,
            block_size=args.block_size, mask_token_id=tokenizer.mask_token_id, num_target_layers=args.layers,
            target_layer_ids=context_layer_ids(args.layers, args.context_layers),
            ar_intermediate_size=2 * args.hidden, tree_budget=args.tree_budget, tree_top_m=args.top_m,
            tree_top_k=args.top_k, tree_lookup=args.tree_lookup,
        )
        torch.manual_seed(0)
        drafter = TreeFlashDrafterModel(config).to(device)
        if args.drafter_init:  # fine-tune an earlier drafter of this recipe (e.g. after the target trained on)
            load_drafter_weights(drafter, Path(args.drafter_init))
        seq_len, batch = args.drafter_seq_len, args.drafter_batch_size
        sd_dir = work / "self-distillation"
        if not (sd_dir / "dataset").exists():
            prompts = self_distillation_prompts(streams["train"], args.sd_prompts, args.sd_prompt_len,
                                                tokenizer.eos_token_id, seed=5)
            generator_model = AutoModelForCausalLM.from_pretrained(out / "target", dtype=dtype).to(device).eval()
            build_self_distillation(generator_model, tokenizer, prompts, sd_dir, args.sd_new_tokens,
                                    args.sd_batch_size, args.sd_temperature)
            del generator_model
        datasets = require("datasets")

        sd_set = datasets.load_from_disk(str(sd_dir / "dataset"))
        split = int(len(sd_set) * 0.95)
        pad = tokenizer.pad_token_id
        sd_len = args.sd_prompt_len + args.sd_new_tokens  # a self-distilled sequence fills its window
        data = {
            "backbone": (TokenStream(streams["train"], seq_len, seed=3),
                         TokenStream(streams["heldout"], seq_len, seed=4).eval_batches(batch, 4)),
            "ar": (MaskedSequences(sd_set.select(range(split)), sd_len, pad, seed=6),
                   [MaskedSequences(sd_set.select(range(split, len(sd_set))), sd_len, pad, seed=7).batch(i, batch)
                    for i in range(4)]),
        }
        summaries = {}
        for stage, minutes, steps in (("backbone", args.backbone_minutes, args.backbone_steps),
                                      ("ar", args.ar_minutes, args.ar_steps)):
            train, heldout = data[stage]
            loss_config = DrafterLossConfig(stage=stage, num_anchors=args.num_anchors)
            run_dir = work / f"run-drafter-{stage}"
            freeze_for_stage(drafter, stage)
            generator = torch.Generator().manual_seed(0)

            def probe(step, train=train, loss_config=loss_config, generator=generator):
                item = train.batch(step, batch)
                ids, mask = item if isinstance(item, tuple) else (item, None)
                with torch.autocast(device.type, dtype=dtype, enabled=precision != "no"):
                    loss = drafter_loss(target, drafter, ids.to(device), loss_config, generator, mask)[0]
                loss.backward()

            max_steps = schedule_length(run_dir, minutes, probe, steps)  # probe gradients are dropped
            drafter.zero_grad(set_to_none=True)
            loop = LoopConfig(run_dir=str(run_dir), max_steps=max_steps, max_minutes=minutes * 1.15,
                              batch_size=batch, lr=args.drafter_lr, warmup_steps=min(50, max_steps // 10),
                              eval_every=max(25, max_steps // 8), save_every=max(25, max_steps // 16), resume=True,
                              mixed_precision=precision)
            summary = train_drafter(target, drafter, train, heldout, loss_config, loop)
            summary["loop"] = loop.__dict__
            summary["device"] = str(device)
            if args.drafter_init:
                summary["initialized_from"] = earlier_training(Path(args.drafter_init), stage)
            summaries[stage] = summary
        for param in drafter.parameters():
            param.requires_grad = True
        save_model(drafter, out / "drafter", summaries, dtype,
                   description="The TreeFlash drafter of the reference target: DFlash backbone (stage `backbone`, "
                               "KL to the target's distributions on the corpus) plus the SwiGLU AR layer (stage "
                               "`ar`, backbone frozen, on the target's own answers to corpus prompts).")

    # 3. the small autoregressive draft LM for stock assisted generation
    if "draft_lm" in args.stages:
        lm_stage("draft_lm", qwen3(args.hidden // 2, 2, 2, 1, 3 * args.hidden // 2), args.draft_lm_minutes,
                 args.draft_lm_steps, args.lr)
    print(f"reference suite written to {out}")
    return 0


@torch.no_grad()
def evaluate(args: argparse.Namespace) -> int:
    """Bits per byte of a reference target on the held-out split of the corpus and on the reserved packages'
    code (never trained on), over `--windows` evenly spaced windows of each."""
    from ..training.data import TokenStream
    from ..training.lm import bits_per_byte, lm_loss

    torch.set_num_threads(args.threads)
    target, _, tokenizer = load(args.models, dtype=getattr(torch, args.dtype))
    texts = {"heldout": corpus_split(site_packages=True)["heldout"], "packages": reserved_package_texts()}
    report = {}
    for split, split_texts in texts.items():
        ids = encode(tokenizer, split_texts)
        windows = TokenStream(ids, args.seq_len).eval_batches(8, max(1, args.windows // 8))
        nats = sum(float(lm_loss(target, batch)) for batch in windows) / len(windows)
        report[split] = {"files": len(split_texts), "tokens_evaluated": sum(b.numel() for b in windows),
                         "bits_per_byte": bits_per_byte(nats, bytes_per_token(split_texts, len(ids)))}
        print(f"{split}: {report[split]['bits_per_byte']:.3f} bits per byte over "
              f"{report[split]['tokens_evaluated']:,} tokens of {len(split_texts)} files")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> None:
    """`reference eval` and `reference build` (`sub`: the `reference` command's subparsers)."""
    e = sub.add_parser("eval", help="Bits per byte of the reference target on held-out code.")
    e.add_argument("--models", help="a folder `reference build` wrote (default: the bundled suite)")
    e.add_argument("--windows", type=positive_int, default=256, help="windows of --seq-len tokens per set")
    e.add_argument("--seq-len", type=positive_int, default=512)
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--threads", type=positive_int, default=2)
    e.add_argument("--json")
    e.set_defaults(func=evaluate)
    b = sub.add_parser("build", help="Train target, drafter and draft LM (and a tokenizer when none exists).")
    b.add_argument("--out", default=str(BUNDLED_DIR))
    b.add_argument("--work", default="reference_work", help="token streams and checkpoints (not bundled)")
    b.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    b.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--threads", type=positive_int, default=2)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weights on disk and the models' run dtype; training uses autocast in it")
    b.add_argument("--site-packages", action=argparse.BooleanOptionalAction, default=True,
                   help="add this environment's site-packages (reserved evaluation packages excepted)")
    b.add_argument("--package-cap-mb", type=float, default=8.0)
    b.add_argument("--vocab-size", type=positive_int, default=8192)
    b.add_argument("--hidden", type=positive_int, default=256)
    b.add_argument("--layers", type=positive_int, default=16)
    b.add_argument("--heads", type=positive_int, default=4)
    b.add_argument("--kv-heads", type=positive_int, default=2)
    b.add_argument("--intermediate", type=positive_int, default=768)
    add_optimizer_arguments(b, lr=1.5e-3, batch_size=8, seq_len=512)
    b.add_argument("--target-minutes", type=float, default=120)
    b.add_argument("--target-steps", type=positive_int, help="schedule length (default: what fits --target-minutes)")
    b.add_argument("--target-extra-steps", type=non_negative_int, default=0,
                   help="continue a finished target schedule for this many steps at its floor learning rate "
                        "(delete OUT/target first so the stage runs again; the drafter must then be retrained)")
    b.add_argument("--drafter-init", help="start the drafter from this earlier drafter folder of the same shape "
                                          "(fine-tuning after the target trained on) instead of from scratch")
    add_drafter_arguments(b, drafter_layers=1, num_anchors=24)
    b.add_argument("--drafter-intermediate", type=positive_int, default=768)
    b.add_argument("--context-layers", type=positive_int, default=5)
    b.add_argument("--block-size", type=positive_int, default=16)
    b.add_argument("--drafter-seq-len", type=positive_int, default=512)
    b.add_argument("--drafter-batch-size", type=positive_int, default=8)
    b.add_argument("--drafter-lr", type=float, default=6e-4)
    b.add_argument("--backbone-minutes", type=float, default=50)
    b.add_argument("--backbone-steps", type=positive_int)
    b.add_argument("--ar-minutes", type=float, default=30)
    b.add_argument("--ar-steps", type=positive_int)
    b.add_argument("--sd-prompts", type=positive_int, default=3072)
    b.add_argument("--sd-prompt-len", type=positive_int, default=128)
    b.add_argument("--sd-new-tokens", type=positive_int, default=224)
    b.add_argument("--sd-batch-size", type=positive_int, default=32)
    b.add_argument("--sd-temperature", type=float, default=0.8)
    b.add_argument("--draft-lm-minutes", type=float, default=8)
    b.add_argument("--draft-lm-steps", type=positive_int)
    b.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), default="auto")
    b.add_argument("--top-m", type=positive_int, default=4)
    b.add_argument("--tree-lookup", type=non_negative_int, default=32)
    b.add_argument("--top-k", type=positive_int, default=8)
    b.set_defaults(func=build)
