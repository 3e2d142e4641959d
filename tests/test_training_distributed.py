"""Multi-process training (DDP over gloo, CPU processes): the same global batch gives the one-process loss curve
for stages `backbone` and `ar` and for causal-LM training, only the main process writes checkpoints, and a
checkpoint resumes with another number of processes. `--seed` fixes a whole `treeflash-hf train` run: a run
killed with SIGKILL after a checkpoint and resumed ends bit-identical to an uninterrupted one.

Run as a module (`accelerate launch ... -m tests.test_training_distributed OUT`) this file is also the worker
of the multi-process runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.training.data import MaskedSequences, TokenStream, save_tokens
from treeflash_hf.training.drafter import DrafterLossConfig, train_drafter
from treeflash_hf.training.lm import train_lm
from treeflash_hf.training.loop import LoopConfig

VOCAB = 96
STEPS, SAVE_EVERY = 6, 3
PATTERN = [3, 17, 5, 40, 22, 9, 61, 13]
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed gloo")


def masked_sequences(seq_len: int = 24) -> MaskedSequences:
    """Self-distillation-like rows whose prompts (loss mask 0) have different lengths, so the processes' shares
    of a batch carry different loss weights."""
    import datasets

    rows = {"input_ids": [], "loss_mask": []}
    for i in range(12):
        ids = [PATTERN[(i + j) % len(PATTERN)] for j in range(seq_len + 1)]
        prompt = 2 + 3 * (i % 6)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * prompt + [1] * (seq_len + 1 - prompt))
    return MaskedSequences(datasets.Dataset.from_dict(rows), seq_len, pad_token_id=0, seed=2)


def loop_config(run_dir: Path, **overrides) -> LoopConfig:
    settings = {"max_steps": STEPS, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "eval_every": SAVE_EVERY,
                "save_every": SAVE_EVERY, **overrides}
    return LoopConfig(run_dir=str(run_dir), **settings)


def train_all(out: Path, resume: bool = False) -> dict:
    """Stage backbone on a token stream, then stage ar on masked sequences, then causal-LM training of a second
    model; returns the three curves and the final weights."""
    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                           seed=0)
    drafter = matching_drafter(target, num_layers=1, block_size=4, seed=1)
    lm = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       seed=3).train()
    stream = TokenStream(np.array(PATTERN * 100), seq_len=24, seed=0)
    masked = masked_sequences()
    # held-out batches of one row: the second process has no share of them
    heldout = {"backbone": [stream.batch(999, 1)], "ar": [masked.batch(999, 4), masked.batch(998, 1)]}
    curves = {}
    for stage, data in (("backbone", stream), ("ar", masked)):
        summary = train_drafter(target, drafter, data, heldout[stage], DrafterLossConfig(stage, num_anchors=4),
                                loop_config(out / stage, resume=resume))
        curves[stage] = summary["curve"]
    curves["lm"] = train_lm(lm, stream, {"held": (stream, 3.0)}, loop_config(out / "lm", resume=resume))["curve"]
    return {"curves": curves, "drafter": drafter.state_dict(), "lm": lm.state_dict()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict:
    # No GPU (so `--multi_gpu` runs gloo on CPU processes), one thread each, no network.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_checked(command: list[str], timeout: float = 180) -> None:
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def accelerate_launch(num_processes: int, *module_and_args: str) -> None:
    """`accelerate launch --multi_gpu` starts `num_processes` processes (torchrun); without a GPU each one is a
    CPU process and they talk over gloo. (`--cpu --num_processes N` starts a single process unless given an
    `--mpirun_hostfile`.)"""
    run_checked([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                 str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_port", str(free_port()), "-m", *module_and_args])


def rewind(run_dir: Path, step: int) -> None:
    """Make `step` the latest checkpoint of `run_dir`, as if the run had stopped there."""
    for checkpoint in run_dir.glob("step-*"):
        if int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    (run_dir / "latest").write_text(f"step-{step:08d}")


def written_by(checkpoint: Path) -> int:
    return json.loads((checkpoint / "meta.json").read_text())["num_processes"]


def assert_curves_match(curve: list[dict], expected: list[dict], rel: float = 1e-5) -> None:
    assert [row.keys() for row in curve] == [row.keys() for row in expected]
    for row, want in zip(curve, expected):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=rel, abs=1e-7), (row["step"], key)


def assert_weights_close(weights: dict, expected: dict, atol: float = 1e-5) -> None:
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The three trainings with 2 processes (the worker below), saved by the main process."""
    out = tmp_path_factory.mktemp("two")
    accelerate_launch(2, "tests.test_training_distributed", str(out))
    return out, torch.load(out / "result.pt")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return out, train_all(out)


def test_two_processes_follow_the_one_process_curve(two_processes, one_process):
    (_, two), (_, one) = two_processes, one_process
    for name in ("backbone", "ar", "lm"):
        assert len(two["curves"][name]) == STEPS
        assert_curves_match(two["curves"][name], one["curves"][name])
    assert any(key.startswith("eval_ar_") for key in two["curves"]["ar"][-1])
    assert_weights_close(two["drafter"], one["drafter"])
    assert_weights_close(two["lm"], one["lm"])
    # the runs did train: the AR layer (zero at start) moved, the LM loss fell
    assert torch.count_nonzero(two["drafter"]["ar_approximation.d.weight"]) > 0
    assert two["curves"]["lm"][-1]["loss"] < two["curves"]["lm"][0]["loss"]


def test_only_the_main_process_writes_checkpoints(two_processes):
    out, _ = two_processes
    assert not (out / "writes-rank1").exists()
    steps = [SAVE_EVERY * (i + 1) for i in range(STEPS // SAVE_EVERY)]
    assert (out / "writes-rank0").read_text().split() == [str(step) for step in steps] * 3
    for stage in ("backbone", "ar", "lm"):
        assert sorted(path.name for path in (out / stage).glob("step-*")) == [f"step-{s:08d}" for s in steps]
        assert written_by(out / stage / f"step-{STEPS:08d}") == 2
        assert not list((out / stage).glob(".tmp-*"))


def test_two_process_checkpoints_resume_with_one_process(two_processes, one_process, tmp_path):
    (two_dir, two), (_, one) = two_processes, one_process
    for stage in ("backbone", "ar", "lm"):
        shutil.copytree(two_dir / stage, tmp_path / stage)
        rewind(tmp_path / stage, SAVE_EVERY)
    resumed = train_all(tmp_path, resume=True)
    for stage in ("backbone", "ar", "lm"):
        assert written_by(tmp_path / stage / f"step-{SAVE_EVERY:08d}") == 2  # resumed: not rewritten
        assert written_by(tmp_path / stage / f"step-{STEPS:08d}") == 1
        assert resumed["curves"][stage][:SAVE_EVERY] == two["curves"][stage][:SAVE_EVERY]
        assert_curves_match(resumed["curves"][stage], one["curves"][stage])
    assert_weights_close(resumed["drafter"], one["drafter"])
    assert_weights_close(resumed["lm"], one["lm"])


def train_command(data_dir: Path, out: Path, steps: int, save_every: int, stage: str = "backbone") -> list[str]:
    return ["train", "--stage", stage, "--target", str(data_dir / "target"), "--data", str(data_dir / "tokens.npy"),
            "--heldout", str(data_dir / "tokens.npy"), "--out", str(out), "--steps", str(steps), "--batch-size", "4",
            "--seq-len", "24", "--num-anchors", "4", "--drafter-layers", "1", "--block-size", "4",
            "--mask-token-id", str(VOCAB - 1), "--lr", "3e-3", "--warmup-steps", "2", "--eval-every",
            str(save_every), "--save-every", str(save_every), "--seed", "7"]


@pytest.fixture(scope="module")
def command_data(tmp_path_factory) -> Path:
    """A saved tiny target and a `.npy` token stream for `treeflash-hf train`."""
    data_dir = tmp_path_factory.mktemp("data")
    random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                  seed=0).save_pretrained(data_dir / "target")
    save_tokens(data_dir / "tokens.npy", np.array(PATTERN * 100))
    return data_dir


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def test_one_process_checkpoint_resumes_with_two_processes_from_the_command_line(command_data, tmp_path):
    from treeflash_hf.cli import main

    assert main(train_command(command_data, tmp_path / "one", STEPS, SAVE_EVERY) + ["--device", "cpu"]) == 0
    shutil.copytree(tmp_path / "one" / "run", tmp_path / "two" / "run")
    rewind(tmp_path / "two" / "run", SAVE_EVERY)
    accelerate_launch(2, "treeflash_hf.cli", *train_command(command_data, tmp_path / "two", STEPS, SAVE_EVERY),
                      "--resume")
    run = tmp_path / "two" / "run"
    assert written_by(run / f"step-{SAVE_EVERY:08d}") == 1  # resumed: not rewritten
    assert written_by(run / f"step-{STEPS:08d}") == 2
    curves = [[json.loads(line) for line in (out / "run" / "curve.jsonl").read_text().splitlines()]
              for out in (tmp_path / "one", tmp_path / "two")]
    assert_curves_match(curves[1], curves[0])
    assert_weights_close(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


def test_killed_run_resumes_bit_identical_to_an_uninterrupted_one(command_data, tmp_path):
    """Separate `python -m treeflash_hf.cli train` processes: an uninterrupted run, and a run killed (SIGKILL)
    once its first checkpoint exists and then resumed; their final weights are equal bit for bit."""
    steps, save_every = 40, 4

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "treeflash_hf.cli", *train_command(command_data, out, steps, save_every)]

    log = open(tmp_path / "uninterrupted.log", "w")
    uninterrupted = subprocess.Popen(command(tmp_path / "full"), cwd=REPO, env=subprocess_env(), stdout=log,
                                     stderr=subprocess.STDOUT)
    killed = subprocess.Popen(command(tmp_path / "killed"), cwd=REPO, env=subprocess_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / "killed" / "run" / "latest"
    deadline = time.time() + 120
    while not latest.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    interrupted_at = int(latest.read_text().split("-")[1])
    assert interrupted_at < steps and not (tmp_path / "killed" / "final").exists()
    run_checked(command(tmp_path / "killed") + ["--resume"])
    uninterrupted.wait(timeout=180)
    log.close()
    assert uninterrupted.returncode == 0, (tmp_path / "uninterrupted.log").read_text()[-5000:]
    full, resumed = final_weights(tmp_path / "full"), final_weights(tmp_path / "killed")
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[name], resumed[name]) for name in full)


if __name__ == "__main__":  # the worker of `two_processes`
    from treeflash_hf.training import loop

    out_dir = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    save_checkpoint = loop.save_checkpoint

    def recorded_save(run_dir, step, *args, **kwargs):
        with open(out_dir / f"writes-rank{rank}", "a") as log:
            log.write(f"{step}\n")
        return save_checkpoint(run_dir, step, *args, **kwargs)

    loop.save_checkpoint = recorded_save
    result = train_all(out_dir)
    if rank == "0":
        torch.save(result, out_dir / "result.pt")
