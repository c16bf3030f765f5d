"""Calibration: per-layer, per-head ranges of Q, K, V and per-precision errors over the denoising schedule.

``diffusion-int8 calibrate`` runs a pipeline with a ``Collector`` observing every attention call, merges
the records (across processes under ``accelerate launch``) and writes a ``Calibration`` file, a summary
and a calibration-driven ``PrecisionSchedule``.
"""

from .collect import Collector, merge
from .file import FILE_NAME, Calibration

__all__ = ["Calibration", "Collector", "merge", "FILE_NAME"]
