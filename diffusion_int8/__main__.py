"""``diffusion-int8`` command line: ``demo``, ``calibrate``, ``eval``, ``check`` and ``tune`` (each has ``--help``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffusion-int8", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .calibration.cli import add_parser as add_calibrate
    from .check import add_parser as add_check
    from .demo import add_parser as add_demo
    from .eval.cli import add_parser as add_eval
    from .speed_gate import add_parser as add_tune

    add_demo(sub)
    add_calibrate(sub)
    add_eval(sub)
    add_check(sub)
    add_tune(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
