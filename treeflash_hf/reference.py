"""The reference suite: a tokenizer, a small Qwen3 target, its TreeFlash drafter and a small AR draft LM, all
trained here on the Python standard library, bundled in `reference_models/`.

`treeflash-hf reference build` runs the recipe (every stage time-bounded and resumable; sizes and budgets are
flags, so the same recipe scales up); `load()` returns the bundled `(target, drafter, tokenizer)` in seconds.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_DIR = PACKAGE_DIR / "reference_models"
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]


def load(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """`(target, drafter, tokenizer)` of the bundled reference suite (or of a folder `reference build` wrote)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import treeflash_hf  # noqa: F401  (registers the drafter class)

    root = Path(path) if path is not None else BUNDLED_DIR
    if not (root / "target").exists():
        raise FileNotFoundError(
            f"No reference models in {root}: run `treeflash-hf reference build --out {root}` first."
        )
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=dtype, attn_implementation="sdpa").eval()
    drafter = AutoModel.from_pretrained(root / "drafter", dtype=dtype).eval()
    return target, drafter, tokenizer


def load_draft_lm(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """The small autoregressive draft LM (the baseline stock assisted generation needs)."""
    from transformers import AutoModelForCausalLM

    root = Path(path) if path is not None else BUNDLED_DIR
    return AutoModelForCausalLM.from_pretrained(root / "draft_lm", dtype=dtype).eval()


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file of this Python's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted((str(p.relative_to(root)), p) for p in files)


def corpus_split() -> dict[str, list[str]]:
    from .training.data import stable_split

    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    for relative, path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts[stable_split(relative)].append(text)
    return texts


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


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(texts), 64):
        for row in tokenizer(texts[start : start + 64], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def save_model(model, out_dir: Path, summary: dict, half: bool, description: str) -> None:
    """Save weights (fp16 on disk when `half`), the training summary and a README for the folder."""
    model = model.to(torch.float16) if half else model
    model.save_pretrained(out_dir)
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2))
    model.to(torch.float32)
    write_readme(out_dir, description, summary, sum(p.numel() for p in model.parameters()))


def write_readme(out_dir: Path, description: str, summary: dict, params: int) -> None:
    stages = summary if all(isinstance(v, dict) and "curve" in v for v in summary.values()) else {"": summary}
    lines = [f"# {out_dir.name}", "", description, "", f"Parameters: {params / 1e6:.2f}M. Weights are stored in "
             "float16; `treeflash_hf.reference.load()` loads them as float32.", "",
             "Trained by `treeflash-hf reference build` (see the package README); figures from "
             "`training_summary.json`:", ""]
    for stage, info in stages.items():
        evals = [row for row in info["curve"] if any(k.startswith("eval_") for k in row)]
        final = {k: round(v, 4) for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")}
        name = f"stage `{stage}`: " if stage else ""
        lines.append(f"- {name}{info['steps']} steps, {info['tokens']:,} tokens, {info['minutes']:.1f} min on "
                     f"{info.get('device', 'cpu')}; final held-out {final}")
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


def build(args: argparse.Namespace) -> int:
    """Run the recipe (each stage skipped when its output exists, resumed when interrupted)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from .modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
    from .modeling.modeling_treeflash_drafter import TreeFlashDrafterModel
    from .training.data import TokenStream
    from .training.drafter import DrafterLossConfig, drafter_loss, freeze_for_stage, train_drafter
    from .training.lm import lm_loss, train_lm
    from .training.loop import LoopConfig

    torch.set_num_threads(args.threads)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    # 1. tokenizer and token streams
    if not (out / "tokenizer" / "tokenizer.json").exists() or not (work / "train.npy").exists():
        texts = corpus_split()
        print(f"corpus: {len(texts['train'])} train files, {len(texts['heldout'])} held-out files")
        tokenizer = train_tokenizer(texts["train"], args.vocab_size, out / "tokenizer")
        train_ids, heldout_ids = encode(tokenizer, texts["train"]), encode(tokenizer, texts["heldout"])
        np.save(work / "train.npy", train_ids)
        np.save(work / "heldout.npy", heldout_ids)
        heldout_bytes = sum(len(t.encode()) for t in texts["heldout"])
        (work / "corpus.json").write_text(json.dumps({
            "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(heldout_ids)),
            "heldout_bytes": heldout_bytes, "bytes_per_token": heldout_bytes / len(heldout_ids)}))
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    corpus = json.loads((work / "corpus.json").read_text())
    train_ids, heldout_ids = np.load(work / "train.npy"), np.load(work / "heldout.npy")
    vocab = len(tokenizer)
    print(f"tokens: {corpus['train_tokens']} train, {corpus['heldout_tokens']} held-out, "
          f"{corpus['bytes_per_token']:.2f} bytes/token")

    def lm_stage(name: str, config: Qwen3Config, minutes: float, seq_len: int, batch: int, lr: float,
                 steps: int | None = None):
        if (out / name / "config.json").exists():
            return
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(device)
        train, heldout = TokenStream(train_ids, seq_len, seed=1), TokenStream(heldout_ids, seq_len, seed=2)
        run_dir = work / f"run-{name}"
        probe = Qwen3ForCausalLM(config).to(device)  # a throwaway copy times the steps
        max_steps = schedule_length(
            run_dir, minutes, lambda s: lm_loss(probe, train.batch(s, batch).to(device)).backward(), steps)
        loop = LoopConfig(run_dir=str(run_dir), max_steps=max_steps, max_minutes=minutes * 1.15, batch_size=batch,
                          lr=lr, warmup_steps=min(100, max_steps // 10), eval_every=max(50, max_steps // 10),
                          save_every=max(50, max_steps // 10), resume=True)
        summary = train_lm(model, train, heldout, loop, corpus["bytes_per_token"], description=name)
        summary["loop"] = loop.__dict__
        summary["device"] = str(device)
        summary["params"] = sum(p.numel() for p in model.parameters())
        save_model(model, out / name, summary, half=args.half, description=descriptions[name])

    descriptions = {
        "target": "The reference target: a small Qwen3-architecture causal LM trained from scratch on the Python "
                  "standard library (train split; files split by a stable hash of their path).",
        "draft_lm": "A small autoregressive draft LM sharing the target's tokenizer: the baseline stock assisted "
                    "generation (`assistant_model=draft_lm`) needs.",
    }

    def qwen3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=True,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    # 2. the target
    lm_stage("target", qwen3(args.hidden, args.layers, args.heads, args.heads // 2, 3 * args.hidden),
             args.target_minutes, args.seq_len, args.batch_size, args.lr, steps=args.target_steps)

    # 3. the drafter: backbone, then the AR layer with the backbone frozen
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(device).eval()
    if not (out / "drafter" / "config.json").exists():
        target_layer_ids = [int(round(i * (args.layers - 1) / 2)) for i in range(3)]
        config = TreeFlashDrafterConfig(
            vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
            num_hidden_layers=args.drafter_layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads // 2, head_dim=args.hidden // args.heads, rope_theta=10000.0,
            block_size=args.block_size, mask_token_id=tokenizer.mask_token_id, num_target_layers=args.layers,
            target_layer_ids=target_layer_ids, ar_intermediate_size=2 * args.hidden, tree_budget=args.tree_budget,
            tree_top_m=args.top_m, tree_top_k=args.top_k, tree_lookup=args.tree_lookup,
        )
        torch.manual_seed(0)
        drafter = TreeFlashDrafterModel(config).to(device)
        train = TokenStream(train_ids, args.drafter_seq_len, seed=3)
        heldout = TokenStream(heldout_ids, args.drafter_seq_len, seed=4).eval_batches(args.drafter_batch_size, 4)
        summaries = {}
        for stage, minutes in (("backbone", args.backbone_minutes), ("ar", args.ar_minutes)):
            loss_config = DrafterLossConfig(stage=stage, num_anchors=args.num_anchors)
            run_dir = work / f"run-drafter-{stage}"
            freeze_for_stage(drafter, stage)
            generator = torch.Generator().manual_seed(0)
            max_steps = schedule_length(  # probe steps only accumulate gradients, which are dropped
                run_dir, minutes,
                lambda s: drafter_loss(target, drafter, train.batch(s, args.drafter_batch_size).to(device),
                                       loss_config, generator)[0].backward())
            drafter.zero_grad(set_to_none=True)
            loop = LoopConfig(run_dir=str(run_dir), max_steps=max_steps, max_minutes=minutes * 1.15,
                              batch_size=args.drafter_batch_size, lr=args.drafter_lr,
                              warmup_steps=min(50, max_steps // 10), eval_every=max(25, max_steps // 8),
                              save_every=max(25, max_steps // 8), resume=True)
            summary = train_drafter(target, drafter, train, heldout, loss_config, loop)
            summary["loop"] = loop.__dict__
            summary["device"] = str(device)
            summaries[stage] = summary
        for param in drafter.parameters():
            param.requires_grad = True
        save_model(drafter, out / "drafter", summaries, half=args.half,
                   description="The TreeFlash drafter of the reference target: DFlash backbone (stage `backbone`, "
                               "KL to the target's marginals) plus the SwiGLU AR layer (stage `ar`, backbone frozen).")

    # 4. the small autoregressive draft LM for stock assisted generation
    lm_stage("draft_lm", qwen3(args.hidden // 2, 2, 2, 1, 3 * args.hidden // 2), args.draft_lm_minutes,
             args.seq_len, args.batch_size, args.lr)
    print(f"reference suite written to {out}")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("reference", help="Build the bundled reference suite.")
    sub = parser.add_subparsers(dest="reference_command", required=True)
    b = sub.add_parser("build", help="Train tokenizer, target, drafter and draft LM on the standard library.")
    b.add_argument("--out", default=str(BUNDLED_DIR))
    b.add_argument("--work", default="reference_work", help="token streams and checkpoints (not bundled)")
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--vocab-size", type=int, default=8192)
    b.add_argument("--hidden", type=int, default=256)
    b.add_argument("--layers", type=int, default=6)
    b.add_argument("--heads", type=int, default=4)
    b.add_argument("--seq-len", type=int, default=256)
    b.add_argument("--batch-size", type=int, default=16)
    b.add_argument("--lr", type=float, default=1.5e-3)
    b.add_argument("--target-minutes", type=float, default=45)
    b.add_argument("--target-steps", type=int, help="schedule length (default: what fits --target-minutes)")
    b.add_argument("--drafter-layers", type=int, default=2)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--drafter-seq-len", type=int, default=256)
    b.add_argument("--drafter-batch-size", type=int, default=8)
    b.add_argument("--drafter-lr", type=float, default=6e-4)
    b.add_argument("--num-anchors", type=int, default=16)
    b.add_argument("--backbone-minutes", type=float, default=15)
    b.add_argument("--ar-minutes", type=float, default=10)
    b.add_argument("--draft-lm-minutes", type=float, default=6)
    b.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), default="auto")
    b.add_argument("--top-m", type=int, default=4)
    b.add_argument("--tree-lookup", type=int, default=32)
    b.add_argument("--top-k", type=int, default=8)
    b.add_argument("--half", action=argparse.BooleanOptionalAction, default=True)
    b.set_defaults(func=build)
