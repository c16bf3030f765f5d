"""diffusion-int8: fused INT8 attention for diffusers pipelines."""

from .kernels import Mode, int8_attention, kernel_info
from .install import Int8Handle, enable
from .processor import Int8DiffusionProcessor, Int8State
from .schedule import PRESETS, PrecisionSchedule, Rule

__version__ = "0.1.0"

__all__ = ["int8_attention", "kernel_info", "Mode", "Int8DiffusionProcessor", "Int8Handle", "Int8State", "enable", "PrecisionSchedule", "Rule", "PRESETS", "__version__"]
