"""User errors of the command line: ``UsageError``, the wrapper that marks them, checked argument types, and
checks of input files and of memory made before any work.

``diffusion-int8 <command>`` prints a ``UsageError`` as one line, ``diffusion-int8 <command>: error: ...``,
and exits with status 2 (``diffusion_int8.__main__.main``); any other exception is a bug and keeps its traceback. Code
that reads what the user named (files, model directories, labels) runs inside ``user_errors()``, which
turns the ``ValueError``/``OSError`` such reading raises into a ``UsageError`` with the same message.
"""

from __future__ import annotations

import argparse
import math
import os
from contextlib import contextmanager
from pathlib import Path


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


# ----------------------------------------------------------------------------- input files
def check_readable(path: str | Path) -> None:
    """``UsageError`` for a file that exists but cannot be read (some loaders report it as missing); a missing
    file is left to the loader, which says what it wanted."""
    try:
        if Path(path).is_file():
            with open(path, "rb"):
                pass
        elif Path(path).exists() and not os.access(path, os.R_OK):  # a pipe: opening it would wait for a writer
            raise PermissionError
    except PermissionError:
        raise UsageError(f"cannot read {path} (permission denied)") from None
    except OSError:
        pass


def check_input_file(path: str | Path, flag: str, accepted: str) -> None:
    """``UsageError`` unless ``path``, given as ``flag``, is a file this process can read."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UsageError(f"{flag} {path} {what}; give {accepted}")
    check_readable(path)


# ----------------------------------------------------------------------------- resources
def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}"
        n /= 1000


def available_bytes(device) -> int | None:
    """Free memory of ``device``: a CUDA GPU's, else the host's RAM; None where it cannot be told."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def check_fits(nbytes: int, device, what: str, remedy: str) -> None:
    """``UsageError`` when ``what`` needs more than ``device`` has free: refused up front, not out of memory later."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise UsageError(f"{what} needs about {_size(nbytes)}, and {_size(free)} is available on {device}: {remedy}")


# ----------------------------------------------------------------------------- argument types
def path_arg(text: str) -> Path:
    """argparse ``type=``: a path, not empty (``--out "$DIR"`` with ``DIR`` unset would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset shell variable?); give a path")
    return Path(text)


def text_path(text: str) -> str:
    """``path_arg`` for options kept as text (a preset name or a path)."""
    path_arg(text)
    return text


def int_at_least(low: int, high: int | None = None):
    """argparse ``type=``: an integer >= ``low`` (and <= ``high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
at_least_two = int_at_least(2)


def device_arg(text: str) -> str:
    """argparse ``type=``: ``cpu``, ``cuda`` or ``cuda:N``, present on this machine."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cpu":
        return "cpu"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not available: this machine has no CUDA GPU; use cpu")
    if device.index is not None and device.index >= n:
        gpus = "1 CUDA GPU (cuda:0)" if n == 1 else f"{n} CUDA GPUs (cuda:0 to cuda:{n - 1})"
        raise argparse.ArgumentTypeError(f"{text!r} is not available: this machine has {gpus}")
    return text


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def error_budget(text: str) -> float:
    """argparse ``type=``: a relative L1 error budget, a number in (0, 1] (1: an error as large as the attention
    output, beyond which every budget admits every setting)."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a relative L1 error in (0, 1], got {text!r} (1 is an error as "
                                         f"large as the attention output)")
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


def refresh_intervals(text: str) -> list[int]:
    """argparse ``type=``: comma-separated refresh intervals, integers >= 2, e.g. ``2,3,4``; ascending, distinct."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 2:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 2 (a refresh every that many steps), "
                                             f"got {part!r} in {text!r}")
        values.append(int(part))
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"intervals repeat in {text!r}")
    return sorted(values)
