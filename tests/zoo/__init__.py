"""Tiny configs of every model class diffusers exports, one registry (``registry.CASES``, ``registry.EXCLUDED``) filled
by the part modules, grouped by kind of model."""

from . import (audio_other, autoencoders, controlnets, images_a, images_b, registry, unets,  # noqa: F401
               videos_a, videos_b)
from .registry import CASES, EXCLUDED, build, run, tensors  # noqa: F401
