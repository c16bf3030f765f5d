"""The diffusers plugin: ``enable`` installs ``Int8DiffusionProcessor`` on a denoiser's attention modules."""

from .config import Int8Config
from .install import Int8Handle, disable, enable
from .observer import AttentionCall, Observer
from .processor import Int8DiffusionProcessor
from .state import Int8State

__all__ = ["AttentionCall", "Int8Config", "Int8DiffusionProcessor", "Int8Handle", "Int8State", "Observer", "disable",
           "enable"]
