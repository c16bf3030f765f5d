"""Warnings raised deep inside a pipeline's call, shown at the user's line."""

from __future__ import annotations

import sys
import warnings

import torch

_INTERNAL = ("diffusion_int8", "torch", "diffusers")


def _internal(frame) -> bool:
    # generated code (torch.compile's wrappers) has no module name, or a file name such as <string>
    name = frame.f_globals.get("__name__") or ""
    return not name or frame.f_code.co_filename.startswith("<") or name.partition(".")[0] in _INTERNAL


@torch.compiler.disable  # outside any compiled graph: Dynamo cannot trace sys._getframe
def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` at the first frame outside diffusion_int8, torch and diffusers: the user's call of the
    pipeline, the model or the op, where a fixed ``stacklevel`` would show a line of the package's or diffusers'
    source for a warning given inside a denoiser's forward."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and _internal(frame):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
