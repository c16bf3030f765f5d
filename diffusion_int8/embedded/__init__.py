"""The embedded default: a small class-conditional diffusion transformer the project trained itself."""

from .pipeline import EMBEDDED_PATH, ShapesPipeline, load_pipeline, transformer_config
from .shapes import CLASSES, NUM_CLASSES, render

__all__ = ["EMBEDDED_PATH", "ShapesPipeline", "load_pipeline", "transformer_config", "CLASSES", "NUM_CLASSES", "render"]
