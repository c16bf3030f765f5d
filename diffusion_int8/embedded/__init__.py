"""The shipped models: small class-conditional diffusion transformers the project trained itself, at 256
tokens (``embedded``) and 4,096 tokens (``embedded-long``); ``variants`` is their registry, ``PROMPTS`` a prompts file
for them (one prompt naming each class)."""

from pathlib import Path

from .shapes import CLASSES, NUM_CLASSES, render
from .variants import EMBEDDED_PATH, NAMES, VARIANTS, Variant, get_variant, shipped, transformer_config

PROMPTS = Path(__file__).parent / "prompts.txt"

__all__ = ["PROMPTS", "EMBEDDED_PATH", "NAMES", "VARIANTS", "Variant", "get_variant", "shipped", "ShapesPipeline", "load_pipeline",
           "transformer_config", "CLASSES", "NUM_CLASSES", "render"]


def __getattr__(name: str):
    # the pipeline needs diffusers: it loads on first use, so the registry imports without it
    if name in ("ShapesPipeline", "load_pipeline"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
