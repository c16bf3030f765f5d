"""The shipped models, one registry: their names on the command line, their weights in the package and
their architecture, read by the loader, the training script and the CLIs alike.

Both are the same class-conditional ``DiTTransformer2DModel`` (6 layers, 4 heads of dim 64) on the same
procedural shapes (``shapes.render``), at two sequence lengths:

- ``embedded`` (variant ``base``): 32×32 RGB pixels in 2×2 patches, 256 tokens;
- ``embedded-long`` (variant ``long``): 64×64 RGB pixels, one token per pixel, 4,096 tokens: the length and
  head dim of SDXL's largest self-attention, with the spatial locality of a trained image model.

This module needs neither diffusers nor a model: the command line builds its help from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .shapes import NUM_CLASSES

ROOT = Path(__file__).parent


@dataclass(frozen=True)
class Variant:
    """One shipped model."""

    key: str  # the training script's --variant and load_pipeline(variant=...)
    name: str  # the command line's --model
    directory: str  # its pipeline (model_index.json, scheduler/, transformer/, training.json), beside this file
    image_size: int  # pixels per side
    patch_size: int
    shift: float  # timestep shift of training and sampling: 1 at 32×32, 2 at twice the side (SD3's rule)

    @property
    def path(self) -> Path:
        return ROOT / self.directory

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def transformer_config(self) -> dict:
        """The ``DiTTransformer2DModel`` arguments; the label table has a null class for CFG."""
        return dict(num_attention_heads=4, attention_head_dim=64, in_channels=3, out_channels=3, num_layers=6,
                    sample_size=self.image_size, patch_size=self.patch_size, num_embeds_ada_norm=NUM_CLASSES,
                    norm_type="ada_norm_zero")


VARIANTS = {v.key: v for v in (
    Variant("base", "embedded", "shapes-dit", image_size=32, patch_size=2, shift=1.0),
    Variant("long", "embedded-long", "shapes-dit-long", image_size=64, patch_size=1, shift=2.0),
)}
NAMES = tuple(v.name for v in VARIANTS.values())  # what --model accepts besides a directory
EMBEDDED_PATH = VARIANTS["base"].path


def get_variant(key: str) -> Variant:
    """The variant ``key`` (``base``, ``long``), or the one the command line names so (``embedded``,
    ``embedded-long``); ``ValueError`` naming the known ones."""
    found = VARIANTS.get(key) or shipped(key)
    if found is None:
        raise ValueError(f"unknown shipped model variant {key!r}; the variants are: "
                         f"{', '.join(f'{v.key} (--model {v.name})' for v in VARIANTS.values())}")
    return found


def shipped(model) -> Variant | None:
    """The variant a ``--model`` value names (``embedded``, ``embedded-long``), or None for a path."""
    return next((v for v in VARIANTS.values() if str(model) == v.name), None)


def transformer_config(variant: str = "base") -> dict:
    """The architecture of a variant: head dim 64, 6 layers; 256 tokens (``base``) or 4,096 (``long``)."""
    return get_variant(variant).transformer_config()


def describe() -> str:
    """The shipped names for help texts: ``'embedded' (256 tokens), 'embedded-long' (4096 tokens)``."""
    return ", ".join(f"'{v.name}' ({v.tokens} tokens)" for v in VARIANTS.values())
