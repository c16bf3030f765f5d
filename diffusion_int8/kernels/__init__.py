"""Fused INT8 attention kernels (Triton), their PyTorch emulation and an upcast reference."""

from .api import int8_attention, kernel_info
from .cache import clear as clear_cache
from .config import PV, Backend, Kernel, Mode, StaticRanges, tile_config
from .reference import attention_ref, emulate_attention

__all__ = [
    "int8_attention",
    "kernel_info",
    "clear_cache",
    "attention_ref",
    "emulate_attention",
    "Mode",
    "PV",
    "Backend",
    "StaticRanges",
    "Kernel",
    "tile_config",
]
