"""Calibration: per-layer, per-head ranges of Q, K, V and per-precision errors over the denoising schedule.

``calibrate`` (``run.py``) runs a pipeline with a ``Collector`` observing every attention call and merges
the records (across processes under ``accelerate launch``) into a ``Calibration``; ``write_outputs`` saves
it with a summary and a calibration-driven ``PrecisionSchedule``, as ``diffusion-int8 calibrate`` does.
"""

from .collect import Collector, merge
from .file import FILE_NAME, Calibration

__all__ = ["Calibration", "Collector", "merge", "FILE_NAME", "calibrate", "write_outputs"]


def __getattr__(name: str):
    # the runner enables the plugin (``install``), which reads calibration files: it loads on first use, so that
    # the file format imports without the plugin and the plugin imports the format without a cycle
    if name in ("calibrate", "write_outputs"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
