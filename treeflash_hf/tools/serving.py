"""`transformers serve` as a child process: on the loopback address and a free port, ready once `/health` answers,
and always stopped (SIGTERM, then SIGKILL after a grace period). Used by `treeflash-hf serve-bench` and the tests.

    with running_server("path/to/treeflash-folder", trust_remote_code=True) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        client.completions.create(model=server.model, prompt="def main():", max_tokens=32)

A TreeFlash model folder served with `trust_remote_code=True` decodes with TreeFlash (see bundle.py); the same folder
without it is the plain target.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

LOOPBACK = "127.0.0.1"


class ServeError(RuntimeError):
    """The server did not start or stop as it should; the message carries the end of its log."""


@dataclass
class ServerProcess:
    """A running `transformers serve`: `base_url` is `http://127.0.0.1:PORT`, `model` the name requests use (the
    model folder as the server was given it), `log_path` its stdout and stderr."""

    process: subprocess.Popen
    base_url: str
    model: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def serve_command(model: str, port: int, trust_remote_code: bool, dtype: str = "float32",
                  device: str = "auto", extra_args: Sequence[str] = ()) -> list[str]:
    """The `transformers serve` command line for one pinned model on the loopback address, then `extra_args` (other
    `transformers serve` options, e.g. `--continuous-batching`)."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--host", LOOPBACK, "--port",
            str(port), "--dtype", dtype, "--device", device,
            "--trust-remote-code" if trust_remote_code else "--no-trust-remote-code", "--log-level", "warning",
            *extra_args]


def is_ready(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_server(process: subprocess.Popen, grace_s: float = 30.0) -> int:
    """Stop the server with SIGTERM (uvicorn shuts down gracefully, then exits by that signal: status -15); kill it
    if it has not exited after `grace_s` (status -9). Returns its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextlib.contextmanager
def running_server(model: str | Path, trust_remote_code: bool, dtype: str = "float32", device: str = "auto",
                   startup_timeout_s: float = 300.0, env: dict | None = None, log_path: Path | None = None,
                   extra_args: Sequence[str] = ()) -> Iterator[ServerProcess]:
    """Start `transformers serve MODEL` (pinned to that model, loaded at startup; `extra_args` as in `serve_command`)
    and yield it once it answers; stop it on exit however the block ends. `env` replaces the child's environment
    (default: this process's); the log goes to `log_path` (default: a temporary file, removed afterwards)."""
    port = free_port()
    keep_log = log_path is not None
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="treeflash-serve-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(serve_command(str(model), port, trust_remote_code, dtype, device,
                                                 extra_args), stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env or dict(os.environ))
    server = ServerProcess(process, f"http://{LOOPBACK}:{port}", str(model), Path(log_path))
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not is_ready(server.base_url):
            if process.poll() is not None:
                raise ServeError(f"`transformers serve {model}` exited with status {process.returncode} before it "
                                 f"answered (is `transformers[serving]` installed?); its log ends:\n"
                                 f"{server.log_tail()}")
            if time.monotonic() > deadline:
                raise ServeError(f"`transformers serve {model}` did not answer within {startup_timeout_s:.0f} s; "
                                 f"its log ends:\n{server.log_tail()}")
            time.sleep(0.25)
        yield server
    finally:
        stop_server(process)
        if not keep_log:
            log_path.unlink(missing_ok=True)
