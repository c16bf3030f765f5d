"""diffusion-int8: fused INT8 attention for diffusers pipelines."""

from .kernels import Mode, int8_attention, kernel_info
from .processor import Int8DiffusionProcessor, Int8Handle, Int8State, enable
from .schedule import PRESETS, PrecisionSchedule, Rule
from .calibration.run import calibrate
from .eval.run import evaluate, write_report

__version__ = "0.1.0"

__all__ = ["int8_attention", "kernel_info", "Mode", "Int8DiffusionProcessor", "Int8Handle", "Int8State", "enable", "PrecisionSchedule", "Rule", "PRESETS",
           "calibrate", "evaluate", "write_report", "__version__"]
