"""Tiny configs of every model class diffusers exports, and of those only its pipelines' modules hold, one registry
(``registry.CASES``, ``registry.EXCLUDED``) filled by the part modules, grouped by kind of model."""

from . import (audio_other, autoencoders, controlnets, images_a, images_b, pipeline_models, registry,  # noqa: F401
               unets, videos_a, videos_b)
from .registry import CASES, EXCLUDED, build, run, tensors  # noqa: F401
