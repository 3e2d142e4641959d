"""Training data: token streams of plain corpora and self-distillation sets with response masks.

`T` sequence length, `B` batch size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ..optional import require


def stable_split(relative_path: str, heldout_percent: int = 5) -> str:
    """"train" or "heldout" from a stable hash of the path (independent of machine and Python hash seed)."""
    digest = int(hashlib.sha1(relative_path.encode()).hexdigest()[:8], 16)
    return "heldout" if digest % 100 < heldout_percent else "train"


class TokenStream:
    """A flat token array (documents joined by EOS) that serves random windows `[B, T + 1]`.

    Window starts come from a generator seeded by (seed, step), so batch `step` is the same whatever happened
    before: resuming at step s replays exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"Corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}.")
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> torch.LongTensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] + offsets]

    def eval_batches(self, batch_size: int, num_batches: int) -> list[torch.LongTensor]:
        """Fixed, evenly spaced windows for held-out evaluation."""
        span = len(self.tokens) - self.seq_len - 1
        count = batch_size * num_batches
        starts = torch.linspace(0, span - 1, count).long()
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets]
        return list(windows.split(batch_size))


def save_tokens(path: Path, tokens: np.ndarray) -> None:
    np.save(path, np.asarray(tokens, dtype=np.uint16 if tokens.max() < 65536 else np.int32))


def load_tokens(path: Path) -> np.ndarray:
    return np.load(path).astype(np.int64)


def build_self_distillation_set(
    target, tokenizer, prompts: list[str], out_dir: Path, max_new_tokens: int = 128, batch_size: int = 8,
    do_sample: bool = False, temperature: float = 1.0,
):
    """Answer `prompts` with the target itself (in batches, left-padded) and store token sequences with a loss
    mask that covers only the response, as an Arrow dataset (`datasets.save_to_disk`).

    Columns: `input_ids` (prompt + response), `loss_mask` (0 on the prompt, 1 on the response).
    """
    datasets = require("datasets")

    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    rows = {"input_ids": [], "loss_mask": []}
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = target.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                    pad_token_id=tokenizer.pad_token_id,
                )
            prompt_width = enc["input_ids"].shape[1]
            for i in range(len(chunk)):
                prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
                response = out[i, prompt_width:].tolist()
                if tokenizer.eos_token_id in response:  # keep the EOS, drop the padding after it
                    response = response[: response.index(tokenizer.eos_token_id) + 1]
                rows["input_ids"].append(prompt_ids + response)
                rows["loss_mask"].append([0] * len(prompt_ids) + [1] * len(response))
    finally:
        tokenizer.padding_side = padding_side
    dataset = datasets.Dataset.from_dict(rows)
    dataset.save_to_disk(str(out_dir))
    return dataset


class MaskedSequences:
    """Self-distillation sequences as padded batches `[B, T + 1]` plus loss masks, seeded by step."""

    def __init__(self, dataset, seq_len: int, pad_token_id: int, seed: int = 0):
        self.dataset = dataset
        self.seq_len = seq_len
        self.pad_token_id = pad_token_id
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.LongTensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(0, len(self.dataset), (batch_size,), generator=generator).tolist()
        ids = torch.full((batch_size, self.seq_len + 1), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(batch_size, self.seq_len + 1)
        for row, index in enumerate(picks):
            item = self.dataset[index]
            seq = item["input_ids"][: self.seq_len + 1]
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = torch.tensor(item["loss_mask"][: self.seq_len + 1], dtype=torch.float)
        return ids, mask
