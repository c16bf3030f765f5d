"""Reading the JSON files the package is given (schedules, crossover tables, calibration metadata): plain JSON,
bounded in nesting, without the non-standard NaN and Infinity that Python's parser accepts; and writing one file
atomically."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

MAX_DEPTH = 64  # the package's own files nest 5 deep
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def loads(text: str, source: str):
    """``text`` parsed; ``ValueError`` naming ``source`` for invalid JSON, NaN or Infinity, or nesting deeper than
    ``MAX_DEPTH`` (checked before parsing: Python's parser recurses)."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise ValueError(f"{source}: JSON nested {deepest} deep; the files diffusion-int8 reads nest at most "
                         f"{MAX_DEPTH} deep")

    def constant(name):
        raise ValueError(f"{source}: {name} is not JSON (numbers must be finite)")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def write(path: str | Path, data) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically: a reader sees the old file or the new one, never half
    of one (an interrupted write leaves the old file). The temporary file is made new under a random name beside
    ``path`` (``O_EXCL``), so nothing planted there is followed or written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
