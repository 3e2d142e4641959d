"""The `treeflash-hf` command line.

Failures a user can fix (missing or corrupt files, a path that is neither a folder nor a Hub id, no network or no
token, bad knobs) end the command with one line on stderr, `error: ...`, naming the fix, and exit status 1 (2 for
bad arguments); `--debug` (anywhere on the command line) shows the Python traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .hub import bundle, convert, push
from .optional import MissingExtraError
from .recipes import corpus, drafter_recipe, drafter_study, tiny_suite
from .tools import ablate, bench, demo, evaluate, lineage, profile, quant_bench, serve_bench, train
from .training.checkpoint import CheckpointError

# the subcommands: each module's `add_parser` adds its own
COMMANDS = (ablate, bench, bundle, convert, demo, evaluate, lineage, push, train, profile, quant_bench, serve_bench)
# `treeflash-hf reference ...`: the reference pairs' recipes
REFERENCE_COMMANDS = (corpus, drafter_recipe, drafter_study, tiny_suite)

# arguments that name a model to read: each must be an existing folder or a Hub id
MODEL_ARGUMENTS = {"target": "--target", "drafter": "--drafter", "tokenizer": "--tokenizer", "draft_lm": "--draft-lm"}


class ToolArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors read `error: ...` under the usage line, like every other failure here."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def model_argument_problem(value: str) -> str | None:
    """Why `value` cannot name a model (None when it is a folder or could be a Hub id)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(value).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return "is a file, not a model folder: pass the folder that holds config.json"
    try:
        validate_repo_id(value)
    except HFValidationError:
        return "is neither an existing folder nor a Hub model id (like org/name): check the path"
    return None


def check_model_arguments(args: argparse.Namespace) -> None:
    for name, flag in MODEL_ARGUMENTS.items():
        value = getattr(args, name, None)
        if isinstance(value, str) and (problem := model_argument_problem(value)):
            raise FileNotFoundError(f"{flag} {value} {problem}.")


def build_parser() -> argparse.ArgumentParser:
    parser = ToolArgumentParser(prog="treeflash-hf", description="TreeFlash speculative decoding tools.")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of a failure (accepted anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    reference = sub.add_parser("reference", help="Build or evaluate the bundled reference suite.")
    reference_sub = reference.add_subparsers(dest="reference_command", required=True)
    for command in REFERENCE_COMMANDS:
        command.add_parser(reference_sub)
    return parser


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can fix, whose messages say how: the project's errors (`ValueError` subclasses, and
    `CheckpointError`), an optional package not installed (`MissingExtraError`), missing files and Hub failures
    (`OSError`, which includes huggingface_hub's HTTP errors), corrupt weights (safetensors' own error) and the HTTP
    client's connection errors."""
    errors: list[type[BaseException]] = [ValueError, OSError, CheckpointError, MissingExtraError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:
        pass
    for client in ("httpx2", "httpx"):
        try:
            errors.append(__import__(client).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def describe(err: BaseException) -> str:
    """One line for an expected failure: its message, plus what to do where the message does not say."""
    message = " ".join(str(err).split()) or type(err).__name__
    if push.is_network_error(err):
        return (f"cannot reach the Hugging Face Hub ({message}): check the network connection, or use local folders "
                "(HF_HUB_OFFLINE=1 reads only the local cache)")
    if type(err).__name__ == "SafetensorError":
        return f"a .safetensors weights file is truncated or corrupt ({message}): re-save or re-download it"
    return message


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    args = build_parser().parse_args(argv)
    try:
        check_model_arguments(args)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then reported like any failure (below)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`... | head`): not an error of ours, no Hub
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's own flush at exit would fail)
        return 141  # a shell's status for a command killed by SIGPIPE
    except SystemExit as stop:
        if debug or not isinstance(stop.code, str):
            raise
        print(f"error: {stop.code.removeprefix('error: ')}", file=sys.stderr)
        return 1
    except Exception as err:
        if debug:
            raise
        if isinstance(err, expected_errors()):
            print(f"error: {describe(err)}", file=sys.stderr)
        else:
            print(f"error: unexpected {type(err).__name__}: {' '.join(str(err).split())} (this is a bug: rerun with "
                  "--debug and report the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
