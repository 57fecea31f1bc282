"""The `gradaccum` command: plan | fit | verify | train | bench.

Dispatch only. Each command is a module here whose `COMMAND` names its settings components
(`gradaccum.settings`: the parsers are generated from them) and a run module (`fit_run.py`,
...) imported only when that command runs: `gradaccum plan` never imports torch.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
import threading

from gradaccum import __version__
from gradaccum.cli.common import ArgumentParser, print_json
from gradaccum.settings.command import build_program, in_config_file
from gradaccum.utils.atomic import interrupted, no_room, reason
from gradaccum.utils.errors import BadInput, RunFailed

# name -> module under gradaccum.cli whose COMMAND is the command's settings and run
COMMANDS = {
    "plan": "plan",
    "train": "train",
    "fit": "fit",
    "verify": "verify",
    "bench": "bench",
}


def build_parser() -> ArgumentParser:
    return build_program(
        "gradaccum",
        "Gradient accumulation for PyTorch: plan a batch, train at it, prove it exact.",
        __version__,
        [importlib.import_module(f"gradaccum.cli.{m}").COMMAND for m in COMMANDS.values()],
        ArgumentParser,
    )


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--flag -4M` -> `--flag=-4M`: argparse takes "-4M" for an option and would say only
    "expected one argument"; joined, the flag's own check names the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"^-\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    process = argv is None and threading.current_thread() is threading.main_thread()
    try:
        code = _main(argv)
    finally:
        if process:
            # The command is done and the process about to exit: a Ctrl-C now would land in
            # the interpreter's shutdown (atexit callbacks) as a traceback. Nothing is left
            # to stop.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    if process and code == 130:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End an interrupted command's process without the interpreter's teardown. A second
    Ctrl-C raises KeyboardInterrupt wherever it lands, inside a library's C++ code too, and
    what that leaves behind can abort the teardown ("Fatal Python error: PyThreadState_Get
    ... finalizing", exit -6 instead of 130). Everything the command wrote is closed by then
    (checkpoints, metrics, trackers, the lock): only the output streams are flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    args = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.run(args) or 0)
    except BadInput as err:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
            line = in_config_file(err, args)
            print(f"{getattr(err, 'prog', 'gradaccum')}: error: {line}", file=sys.stderr)
            _json_error(argv, args, str(line), 2)
        return 2
    except RunFailed as err:
        print(f"gradaccum: error: {err}", file=sys.stderr)
        _json_error(argv, args, str(err), 1)
        return 1
    except KeyboardInterrupt as err:  # its text, when there is one, says what was kept
        print(" ".join(["gradaccum: interrupted", str(err)]).rstrip(), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gradaccum plan --json | head`: the reader left, nothing to say
        sys.stderr.close()
        return 0
    except (OSError, RuntimeError) as err:
        # A writer outside gradaccum.utils.atomic that met a full disk, or a Ctrl-C a library
        # reported as its own error: still one line.
        if interrupted(err):
            print("gradaccum: interrupted", file=sys.stderr)
            return 130
        full = no_room(err)
        if full is None:
            raise
        print(f"gradaccum: error: {full.filename or 'a file'}: {reason(full)}", file=sys.stderr)
        return 1


def _json_error(argv: list[str], args, line: str, code: int) -> None:
    """With --json, the error as one JSON object on stdout too: a program reading stdout
    learns the command failed and why, not only from an empty output. `argv` names --json
    where the flags could not be parsed (`args` None)."""
    if getattr(args, "json", False) or "--json" in argv:
        print_json({"error": line, "exit_code": code})


if __name__ == "__main__":
    sys.exit(main())
