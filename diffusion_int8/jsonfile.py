"""Reading the JSON files the package is given (schedules, crossover tables, calibration metadata): plain JSON,
bounded in nesting, without the non-standard NaN and Infinity that Python's parser accepts; and writing a file
atomically."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import tempfile
from pathlib import Path

MAX_DEPTH = 64  # the package's own files nest 5 deep
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


class NonFinite(str):
    """A NaN, Infinity or -Infinity that ``loads`` read as text ("nan", "inf", "-inf", as ``finite`` writes them)."""


def loads(text: str, source: str, *, nonfinite_as_text: bool = False):
    """``text`` parsed; ``ValueError`` naming ``source`` for invalid JSON, NaN or Infinity, or nesting deeper than
    ``MAX_DEPTH`` (checked before parsing: Python's parser recurses). ``nonfinite_as_text``: NaN, Infinity and
    -Infinity are read as ``NonFinite`` strings instead, for the caller to accept where it can."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise ValueError(f"{source}: JSON nested {deepest} deep; the files diffusion-int8 reads nest at most "
                         f"{MAX_DEPTH} deep")

    def constant(name):
        if nonfinite_as_text:
            return NonFinite(float(name))
        raise ValueError(f"{source}: {name} is not JSON (numbers must be finite)")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def finite(obj):
    """``obj`` (dicts, lists and tuples of JSON values) with each non-finite float as its text ("nan", "inf",
    "-inf"), which JSON cannot hold (Python writes NaN and Infinity, which JSON.parse and ``loads`` reject)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write(path: str | Path, data, indent: int = 1) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (``write_bytes``), a non-finite float as its text
    (``finite``)."""
    write_bytes(path, (json.dumps(finite(data), indent=indent) + "\n").encode())


def write_bytes(path: str | Path, raw: bytes) -> None:
    """Write ``raw`` to ``path`` atomically: a reader sees the old file or the new one, never half of one (an
    interrupted write leaves the old file). A symbolic link is written through (its target replaced), and the file
    keeps the old one's permissions, or gets a new file's. The temporary file is made new under a random name beside
    it (``O_EXCL``), so nothing planted there is followed or written. A file that may not be written (read-only) is
    not replaced: ``PermissionError``, as writing it in place would give; other links to the old file keep it."""
    path = Path(os.path.realpath(path))
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    else:
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # named by the file asked for, not the temporary one
        raise type(e)(e.errno, e.strerror, str(path)) from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
