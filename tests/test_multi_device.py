"""Targets beyond one plain device. Tensor parallelism: `from_pretrained(path, tp_plan="auto")` under `torchrun
--nproc-per-node 2` (gloo, CPU processes) with the drafter replicated on every rank. Every rank must verify the same trees in the same steps:
greedy output equals the single-process target's, sampled output is the same on every rank even when the ranks'
random generators differ (rank 0 decides), and `tree_budget="auto"` with the lookup branch (decisions from
measured times) neither diverges nor hangs. Targets split by accelerate's `device_map`: decoding through its
per-layer hooks (one layer offloaded, the way a layer on another device is reached) equals the plain target's.

Run as a script (`torchrun ... tests/test_tensor_parallel.py TARGET DRAFTER OUT`) this file is the worker.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 33, 12, 9, 100, 7], [4, 4, 8, 31], [61, 3, 3, 200, 18, 7, 7, 9, 12]]  # no special tokens
NEW_TOKENS = 20
pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed gloo")


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def worker(target_dir: str, drafter_dir: str, out_dir: str) -> None:
    """One rank: decode the prompts (batched) greedily at several budgets and sampled, write what it got."""
    import torch.distributed as dist
    from transformers import AutoModel, AutoModelForCausalLM

    import treeflash_hf  # noqa: F401
    from treeflash_hf.engine.sync import is_tensor_parallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, tp_plan="auto", dtype=torch.float32)
    drafter = AutoModel.from_pretrained(drafter_dir, dtype=torch.float32)
    pad = target.generation_config.pad_token_id
    ids, mask = left_pad(PROMPTS, pad)
    results = {"tensor_parallel": is_tensor_parallel(target)}
    for budget, lookup in ((4, 0), (16, 6), ("auto", 6)):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=NEW_TOKENS,
                              do_sample=False, tree_budget=budget, tree_lookup=lookup, pad_token_id=pad)
        results[f"greedy@{budget}+{lookup}"] = out[:, ids.shape[1]:].tolist()
    torch.manual_seed(1000 + rank)  # the ranks' generators differ: only shared decisions keep them together
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=NEW_TOKENS,
                          do_sample=True, temperature=0.9, tree_budget="auto", tree_lookup=6, pad_token_id=pad)
    results["sampled"] = out[:, ids.shape[1]:].tolist()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(target_dir: Path, drafter_dir: Path, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO),
           "TREEFLASH_CACHE": str(out_dir / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), __file__, str(target_dir), str(drafter_dir), str(out_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)  # a hang fails here
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def single_process_greedy(target, pad: int) -> list[list[int]]:
    """Each prompt decoded alone by the plain target (no padding)."""
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=pad)
        rows.append(out[0, len(prompt):].tolist())
    return rows


def check_ranks(ranks: list[dict], expected: list[list[int]]) -> None:
    assert all(rank["tensor_parallel"] for rank in ranks), "the target was not loaded tensor-parallel"
    for key in ranks[0]:
        if key.startswith("greedy"):
            for rank in ranks:
                assert rank[key] == expected, key
    assert ranks[0]["sampled"] == ranks[1]["sampled"]


def test_tensor_parallel_random_qwen3(tmp_path):
    from treeflash_hf.recipes.testing import matching_drafter, random_target

    from .conftest import randomise_ar_layer

    target = random_target("qwen3", vocab_size=256, seed=0)
    target.generation_config.pad_token_id = 0
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    ranks = run_two_ranks(tmp_path / "target", tmp_path / "drafter", tmp_path / "out")
    check_ranks(ranks, single_process_greedy(target, 0))


def test_tensor_parallel_bundled_pair(tmp_path):
    from transformers import AutoModelForCausalLM

    from treeflash_hf import reference

    target = AutoModelForCausalLM.from_pretrained(reference.BUNDLED_DIR / "target", dtype=torch.float32).eval()
    ranks = run_two_ranks(reference.BUNDLED_DIR / "target", reference.BUNDLED_DIR / "drafter", tmp_path / "out")
    check_ranks(ranks, single_process_greedy(target, target.generation_config.pad_token_id))


def test_target_split_by_a_device_map(tmp_path):
    """Every layer behind accelerate's hooks, one offloaded to disk: inputs, context layers, cache layers and logits
    cross the hooks' device moves (all on the CPU here, so this checks the plumbing, not real GPUs)."""
    from transformers import AutoModelForCausalLM

    from treeflash_hf.recipes.testing import matching_drafter, random_target

    from .conftest import randomise_ar_layer

    target = random_target("qwen3", vocab_size=256, seed=3)
    target.generation_config.pad_token_id = 0
    drafter = randomise_ar_layer(matching_drafter(target, seed=4))
    target.save_pretrained(tmp_path / "target")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i == 1 else "cpu" for i in range(4)})
    split = AutoModelForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map, dtype=torch.float32,
                                                 offload_folder=str(tmp_path / "offload"))
    assert all(hasattr(layer, "_hf_hook") for layer in split.model.layers)
    ids, mask = left_pad(PROMPTS, 0)
    expected = single_process_greedy(target, 0)
    out = split.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=NEW_TOKENS,
                         do_sample=False, tree_budget=8, tree_lookup=6, pad_token_id=0)
    assert out[:, ids.shape[1]:].tolist() == expected


if __name__ == "__main__":
    worker(*sys.argv[1:4])
