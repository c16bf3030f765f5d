"""diffusion-int8: fused INT8 attention for diffusers pipelines."""

from .kernels import Mode, int8_attention, kernel_info
from .plugin import AttentionCall, Int8Config, Int8DiffusionProcessor, Int8Handle, Int8State, disable, enable
from .schedule import PRESETS, PrecisionSchedule, Rule
from .calibration.run import calibrate

__version__ = "0.1.0"

__all__ = ["int8_attention", "kernel_info", "Mode", "AttentionCall", "Int8Config", "Int8DiffusionProcessor",
           "Int8Handle", "Int8State", "enable", "disable", "PrecisionSchedule", "Rule", "PRESETS", "calibrate",
           "evaluate", "write_report", "__version__"]


def __getattr__(name: str):
    # evaluate and write_report load on first use: evaluation needs Pillow (the "eval" extra), the rest does not
    if name in ("evaluate", "write_report"):
        from .eval import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
