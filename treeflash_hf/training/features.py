"""The frozen target's outputs cached once, for many epochs of drafter training.

A training step of `drafter.py` runs the frozen target over its batch, and on a real target that forward is most
of the step. Here the target runs once over every training window; per position the store keeps the drafter's
context features (the outputs of `target_layer_ids`, concatenated: `[n*H]`, bfloat16) and the target's top-K
next-token log-probs (`[K]` ids and float16 log-probs). Drafter training then reads batches from disk: one
drafter forward and one head product per step, no target forward.

Files in the store's folder (all preallocated, filled window by window, so building resumes where it stopped):
`windows.npy` `[W, L + 1]` int32 token ids, `loss_mask.npy` `[W, L + 1]` uint8 (1 where a predicted token counts),
`features.bin` `[W, L, F]` bfloat16 bits, `top_ids.bin` `[W, L, K]` int32, `top_log_probs.bin` `[W, L, K]` float16,
`store.json` (shapes, layer ids, and `done`: windows whose outputs are written). A store grows by `extend_store`
(new windows appended after the existing ones, filled by the next `fill_store`).

Chat windows (self-distilled answers) are the windows whose loss mask masks some positions (their prompts); code
windows count every position. `FeatureStore(chat_fraction=...)` draws that share of each batch from chat windows;
`chat_windows=N` trains on the first N chat training windows only (a point of a data-scaling curve).

`OnlineFeatures` is the same store with the target's outputs computed when a batch is drawn instead of read from
disk: the same rows, rounded the same way (`target_outputs`), for a device where the target's forward over a batch
costs less than reading it back (a GPU; the whole corpus would need ~1.8 MB a window on disk).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .drafter import Teacher

STORE_FILE = "store.json"


class FeatureStore:
    """Cached target outputs over fixed windows (see the module docstring); `batch(step, B)` draws windows."""

    def __init__(self, folder: str | Path, seed: int = 0, chat_fraction: float | None = None,
                 chat_windows: int | None = None):
        if chat_fraction is not None and not 0.0 <= chat_fraction <= 1.0:
            raise ValueError(f"chat_fraction must be within [0, 1], got {chat_fraction}.")
        if chat_windows is not None and chat_windows < 1:
            raise ValueError(f"chat_windows must be at least 1 (or None for all), got {chat_windows}.")
        self.folder = Path(folder)
        meta_file = self.folder / STORE_FILE
        if not meta_file.exists():
            raise FileNotFoundError(f"{self.folder} is not a feature store (no {STORE_FILE}): build it first.")
        self.meta = json.loads(meta_file.read_text())
        self.windows = np.load(self.folder / "windows.npy", mmap_mode="r")
        self.loss_mask = np.load(self.folder / "loss_mask.npy", mmap_mode="r")
        self.seed = seed
        self.chat_fraction = chat_fraction
        self.chat_windows = chat_windows

    @property
    def done(self) -> int:
        return int(self.meta["done"])

    @functools.cached_property
    def outputs(self) -> dict[str, np.memmap]:
        return output_arrays(self.folder, self.meta)

    def rows(self, indices: np.ndarray) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor, Teacher]:
        """Windows `indices`: ids `[B, L + 1]`, loss mask `[B, L + 1]`, context features `[B, L, F]` (bfloat16),
        the teacher `[B, L, K]`."""
        indices = np.sort(indices)
        ids = torch.from_numpy(self.windows[indices].astype(np.int64))
        mask = torch.from_numpy(self.loss_mask[indices].astype(np.float32))
        return ids, mask, *self.window_outputs(indices, ids)

    def window_outputs(self, indices: np.ndarray, ids: torch.LongTensor) -> tuple[torch.Tensor, Teacher]:
        """The target's outputs for windows `indices` (sorted; their ids `ids`), read from the store's files."""
        features = torch.from_numpy(self.outputs["features.bin"][indices].astype(np.int16)).view(torch.bfloat16)
        teacher = Teacher(torch.from_numpy(self.outputs["top_log_probs.bin"][indices].astype(np.float32)),
                          torch.from_numpy(self.outputs["top_ids.bin"][indices].astype(np.int64)))
        return features, teacher

    def batch(self, step: int, batch_size: int) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor, Teacher]:
        """`batch_size` windows drawn for `step` (the same windows for the same step and seed, so a resumed run
        sees the data it would have seen), among the training windows done."""
        heldout = int(self.meta["heldout"])
        if self.done <= heldout:
            raise ValueError(f"The feature store {self.folder} has no training windows done yet: fill it first.")
        rng = np.random.default_rng([self.seed, step])
        if self.chat_fraction is None and self.chat_windows is None:
            return self.rows(rng.integers(heldout, self.done, size=batch_size))
        chat, code = self.training_windows()
        if self.chat_fraction is None:
            pool = np.concatenate([chat, code])
            return self.rows(pool[rng.integers(0, len(pool), size=batch_size)])
        if len(chat) == 0 or len(code) == 0:
            raise ValueError(f"chat_fraction needs chat and code windows among the {self.done - heldout} training "
                             f"windows done ({len(chat)} chat, {len(code)} code).")
        pick_chat = rng.random(batch_size) < self.chat_fraction
        indices = np.where(pick_chat, chat[rng.integers(0, len(chat), size=batch_size)],
                           code[rng.integers(0, len(code), size=batch_size)])
        return self.rows(indices)

    def training_windows(self) -> tuple[np.ndarray, np.ndarray]:
        """The training windows done, as indices: chat (the first `chat_windows` of them when set; the windows are
        stored shuffled, so that is a random subset, and a larger one contains a smaller) and code."""
        heldout = int(self.meta["heldout"])
        is_chat = self.is_chat[heldout : self.done]
        chat, code = np.flatnonzero(is_chat) + heldout, np.flatnonzero(~is_chat) + heldout
        return chat[: self.chat_windows], code

    @property
    def chat_window_count(self) -> int:
        """Chat windows training draws from."""
        return len(self.training_windows()[0])

    @property
    def chat_answer_tokens(self) -> int:
        """Answer tokens (loss-counted positions) in the chat windows training draws from."""
        return int(np.asarray(self.loss_mask[self.training_windows()[0]], dtype=np.int64).sum())  # (indices sorted)

    @functools.cached_property
    def is_chat(self) -> np.ndarray:
        """`[W]` bool: the windows with masked (prompt) positions, i.e. chat answers (computed once)."""
        return ~np.asarray(self.loss_mask).astype(bool).all(axis=1)

    def heldout_batches(self, batch_size: int) -> list:
        """The held-out windows (the store's first `heldout`), in batches."""
        heldout = min(int(self.meta["heldout"]), self.done)
        return [self.rows(np.arange(start, min(start + batch_size, heldout))) for start in range(0, heldout, batch_size)]


class OnlineFeatures(FeatureStore):
    """A store's windows, with the frozen `target`'s outputs computed on its device when rows are drawn: `rows`
    gives what a filled store would read (features bfloat16, top-K log-probs rounded to float16) without the
    features stage or its disk (`window_outputs` runs the target instead of reading). Every window counts as done.
    The features and the teacher stay on the target's device; ids and mask come back on the CPU (anchors are drawn
    there)."""

    def __init__(self, folder: str | Path, target, autocast: bool = True, **kwargs):
        super().__init__(folder, **kwargs)
        self.target = target
        self.autocast = autocast

    @property
    def done(self) -> int:
        return int(self.meta["windows"])

    def window_outputs(self, indices: np.ndarray, ids: torch.LongTensor) -> tuple[torch.Tensor, Teacher]:
        device = next(self.target.parameters()).device
        features, top_ids, top_log_probs = target_outputs(self.target, ids[:, :-1].to(device), self.meta["layer_ids"],
                                                          int(self.meta["top_k"]), self.autocast)
        return features, Teacher(top_log_probs.float(), top_ids.long())


def output_files(width: int, top_k: int) -> tuple[tuple[str, type, int], ...]:
    """The store's per-position output files: (name, dtype, last dimension)."""
    return (("features.bin", np.uint16, width), ("top_ids.bin", np.int32, top_k),
            ("top_log_probs.bin", np.float16, top_k))


def output_arrays(folder: str | Path, meta: dict, mode: str = "r") -> dict[str, np.memmap]:
    """The store's output files as arrays `[W, L, last]`. Mode "r+" lays out a file not there yet (sparse: a store
    filled in part takes the disk of what is done; one made for `OnlineFeatures` has none until a features stage)."""
    arrays = {}
    for name, dtype, last in output_files(meta["feature_width"], meta["top_k"]):
        path = Path(folder) / name
        arrays[name] = np.memmap(path, dtype=dtype, mode="w+" if mode == "r+" and not path.exists() else mode,
                                 shape=(meta["windows"], meta["seq_len"], last))
    return arrays


@torch.no_grad()
def target_outputs(target, tokens: torch.LongTensor, layer_ids: list[int], top_k: int,
                   autocast: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the store keeps for `tokens [B, L]`, on the target's device: the context features `[B, L, n*H]` (the
    outputs of `layer_ids`, concatenated, bfloat16), the top-K next-token ids `[B, L, K]` (int32) and their log-probs
    `[B, L, K]` (float16). `autocast`: run under bfloat16 autocast (a quantized target computes in its own dtype)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = target(tokens, output_hidden_states=[i + 1 for i in layer_ids])
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16)
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(top_k, dim=-1)
    return features, top.indices.int(), top.values.half()


def create_store(folder: str | Path, windows: np.ndarray, loss_mask: np.ndarray, layer_ids: list[int],
                 hidden_size: int, top_k: int, heldout: int, outputs: bool = True, **meta_extra) -> None:
    """Lay out an empty store for `windows [W, L + 1]` (nothing is done yet); the first `heldout` windows are the
    held-out set (filled first). `outputs=False`: no output files yet (`OnlineFeatures` needs none; `fill_store`
    lays them out). `meta_extra` goes into `store.json` (e.g. the data it was cut from)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    count, seq_len = windows.shape[0], windows.shape[1] - 1
    np.save(folder / "windows.npy", windows.astype(np.int32))
    np.save(folder / "loss_mask.npy", loss_mask.astype(np.uint8))
    meta = {"windows": count, "seq_len": seq_len, "feature_width": len(layer_ids) * hidden_size, "top_k": top_k,
            "layer_ids": layer_ids, "heldout": heldout, "done": 0, **meta_extra}
    if outputs:
        for array in output_arrays(folder, meta, "r+").values():
            array.flush()
    (folder / STORE_FILE).write_text(json.dumps(meta, indent=2))


def extend_store(folder: str | Path, windows: np.ndarray, loss_mask: np.ndarray, **meta_updates) -> int:
    """Append `windows [N, L + 1]` (and their loss masks) to the store after its existing windows, training windows
    not done yet (the next `fill_store` runs the target over them); `meta_updates` go into `store.json`. The feature
    files grow in place (their new tail reads as zeros until filled). Returns the new window count."""
    folder = Path(folder)
    meta = json.loads((folder / STORE_FILE).read_text())
    if windows.shape[1] != meta["seq_len"] + 1:
        raise ValueError(f"New windows have {windows.shape[1]} tokens; the store's have {meta['seq_len'] + 1}.")
    old = np.load(folder / "windows.npy")
    old_mask = np.load(folder / "loss_mask.npy")
    count = old.shape[0] + windows.shape[0]
    for name, dtype, last in output_files(meta["feature_width"], meta["top_k"]):
        if not (folder / name).exists():  # (laid out by the next fill_store)
            continue
        with open(folder / name, "r+b") as handle:
            handle.truncate(count * meta["seq_len"] * last * np.dtype(dtype).itemsize)
    for name, array in (("windows.npy", np.concatenate([old, windows.astype(np.int32)])),
                        ("loss_mask.npy", np.concatenate([old_mask, loss_mask.astype(np.uint8)]))):
        tmp = folder / f"{name}.tmp.npy"
        np.save(tmp, array)
        tmp.replace(folder / name)
    meta.update(meta_updates, windows=count)
    (folder / STORE_FILE).write_text(json.dumps(meta, indent=2))
    return count


def copy_windows(source: str | Path, folder: str | Path, count: int, layer_ids: list[int], hidden_size: int,
                 top_k: int) -> None:
    """Lay out an empty store over the first `count` training windows of the store `source` (and all its held-out
    ones, kept held out): the same data for another target, e.g. a quantized copy of the first one."""
    source_meta = json.loads((Path(source) / STORE_FILE).read_text())
    heldout = int(source_meta["heldout"])
    stop = min(int(source_meta["windows"]), heldout + count)
    windows = np.load(Path(source) / "windows.npy", mmap_mode="r")[:stop]
    loss_mask = np.load(Path(source) / "loss_mask.npy", mmap_mode="r")[:stop]
    create_store(folder, np.asarray(windows), np.asarray(loss_mask), layer_ids, hidden_size, top_k, heldout,
                 chat_chunks=[])  # (no distilled chunk of its own yet: a later one may grow it, `extend_store`)


@torch.no_grad()
def fill_store(target, folder: str | Path, batch_size: int = 4, minutes: float | None = None,
               autocast: bool = True) -> int:
    """Run the frozen `target` over the store's windows not done yet, `batch_size` at a time, under bfloat16
    autocast (`autocast`; on a CPU its AMX units, bfloat16 weights are slower there; a quantized target runs in its
    own compute dtype instead), writing each batch's outputs and then the `done` count, so an interrupted build
    resumes. Stops after `minutes`. Returns the windows done."""
    folder = Path(folder)
    meta = json.loads((folder / STORE_FILE).read_text())
    count, top_k = meta["windows"], meta["top_k"]
    windows = np.load(folder / "windows.npy", mmap_mode="r")
    outputs = output_arrays(folder, meta, "r+")
    device = next(target.parameters()).device
    started = time.time()
    bar = tqdm(total=count, initial=meta["done"], desc="target features")
    while meta["done"] < count and (minutes is None or time.time() - started < minutes * 60):
        start = meta["done"]
        stop = min(count, start + batch_size)
        tokens = torch.from_numpy(windows[start:stop, :-1].astype(np.int64)).to(device)
        features, top_ids, top_log_probs = target_outputs(target, tokens, meta["layer_ids"], top_k, autocast)
        outputs["features.bin"][start:stop] = features.view(torch.int16).cpu().numpy().view(np.uint16)
        outputs["top_ids.bin"][start:stop] = top_ids.cpu().numpy()
        outputs["top_log_probs.bin"][start:stop] = top_log_probs.cpu().numpy()
        for array in outputs.values():
            array.flush()
        meta["done"] = stop
        (folder / STORE_FILE).write_text(json.dumps(meta, indent=2))
        bar.update(stop - start)
    bar.close()
    return meta["done"]


__all__ = ["FeatureStore", "OnlineFeatures", "copy_windows", "create_store", "extend_store", "fill_store",
           "target_outputs"]
