"""``diffusion-int8`` command line: ``demo``, ``calibrate``, ``eval``, ``check`` and ``tune`` (each has ``--help``).

A user error (a bad argument, a missing or invalid file, outputs that exist) prints one line,
``diffusion-int8 <command>: error: <what to change>``, and exits with status 2; ``--debug`` or
DIFFUSION_INT8_DEBUG=1 shows its traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from .cli.usage import UsageError

DEBUG_ENV = "DIFFUSION_INT8_DEBUG"


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``--help`` shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        # the descriptions are the modules' docstrings: show their ``literals`` as plain text
        return re.sub(r"``(.+?)``", r"\1", super().format_help(), flags=re.S)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffusion-int8", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of user errors too (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)  # subcommands' parsers are _Parsers too
    from .cli.calibrate import add_parser as add_calibrate
    from .cli.check import add_parser as add_check
    from .cli.demo import add_parser as add_demo
    from .cli.eval import add_parser as add_eval
    from .cli.tune import add_parser as add_tune

    add_demo(sub)
    add_calibrate(sub)
    add_eval(sub)
    add_check(sub)
    add_tune(sub)
    for command in sub.choices.values():  # also after the command; not given there, the one before it stands
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of user errors too")
    return parser


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each, written above a progress bar rather than through it (no source line)."""
    from tqdm.auto import tqdm

    text = str(message).removeprefix("diffusion_int8: ")
    tqdm.write(f"diffusion-int8: warning: {text}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line
            return args.func(args)
    except UsageError as e:
        if args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        one_line = " ".join(str(e).split("\n"))
        print(f"diffusion-int8 {args.command}: error: {one_line}", file=sys.stderr)
        return 2


def run() -> None:
    """The program: ``main``'s status as the exit status. After Ctrl-C or SIGTERM (130, 143: the command has cleaned
    up and said so) the process ends at once, without the interpreter's shutdown, where a Ctrl-C that landed in
    torch's compute threads could still end it by SIGINT instead of with the status."""
    try:
        code = main()
    except KeyboardInterrupt:  # before a command's own handler is in place (importing torch and diffusers)
        print("diffusion-int8: interrupted before the command started; nothing was written", file=sys.stderr)
        code = 130
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
