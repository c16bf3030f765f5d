"""Calibration: per-layer, per-head ranges of Q, K, V and per-precision errors over the denoising schedule.

``calibrate`` (``run.py``) runs a pipeline with a ``Collector`` observing every attention call and merges
the records (across processes under ``accelerate launch``) into a ``Calibration``; ``write_outputs`` saves
it with a summary and a calibration-driven ``PrecisionSchedule``, as ``diffusion-int8 calibrate`` does.
"""

from .collect import Collector, merge
from .file import FILE_NAME, Calibration
from .run import calibrate, write_outputs

__all__ = ["Calibration", "Collector", "merge", "FILE_NAME", "calibrate", "write_outputs"]
