"""The user's frame, for warnings raised deep inside a pipeline's call."""

from __future__ import annotations

import sys

_INTERNAL = ("diffusion_int8", "torch", "diffusers")


def outside_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller at the first frame outside diffusion_int8, torch
    and diffusers: the user's call of the pipeline, the model or the op (a warning given inside a denoiser's forward
    otherwise shows a line of the package's or of diffusers' source)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL:
        level, frame = level + 1, frame.f_back
    return level
