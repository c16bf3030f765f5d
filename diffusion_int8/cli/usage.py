"""User errors of the command line: ``UsageError``, the wrapper that marks them, and checked argument types.

``diffusion-int8 <command>`` prints a ``UsageError`` as one line, ``diffusion-int8 <command>: error: ...``,
and exits with status 2 (``diffusion_int8.__main__.main``); any other exception is a bug and keeps its traceback. Code
that reads what the user named (files, model directories, labels) runs inside ``user_errors()``, which
turns the ``ValueError``/``OSError`` such reading raises into a ``UsageError`` with the same message.
"""

from __future__ import annotations

import argparse
import math
from contextlib import contextmanager


class UsageError(Exception):
    """Something the user gave (argument, file, output directory) that must change; the message says what."""


@contextmanager
def user_errors(*types: type[BaseException]):
    """Re-raise ``types`` (default ``ValueError`` and ``OSError``) raised inside as ``UsageError``."""
    types = types or (ValueError, OSError)
    try:
        yield
    except UsageError:
        raise
    except types as e:
        raise UsageError(_message(e)) from e


def _message(e: BaseException) -> str:
    # the system's OSErrors ("[Errno 13] Permission denied: 'x'") read better as "x: Permission denied"
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


# ----------------------------------------------------------------------------- argument types
def int_at_least(low: int):
    """argparse ``type=``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
at_least_two = int_at_least(2)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def percentile(text: str) -> float:
    """argparse ``type=``: a percentile in (0, 100]."""
    value = _finite(text)
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentile in (0, 100], got {text!r}")
    return value


def sparsity_level(text: str) -> float:
    """argparse ``type=``: one sparsity level in (0, 1)."""
    value = _finite(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a sparsity level in (0, 1) (1 is dense), got {text!r}")
    return value


def sparsity_levels(text: str) -> list[float]:
    """argparse ``type=``: comma-separated sparsity levels in (0, 1), e.g. ``0.99,0.95,0.9``; ascending, distinct."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated numbers in (0, 1), got {part.strip()!r} in "
                                             f"{text!r}") from None
        if not 0 < value < 1:
            raise argparse.ArgumentTypeError(f"each level must be in (0, 1) (1 is dense), got {part.strip()!r}")
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"levels repeat in {text!r}")
    return sorted(values)
