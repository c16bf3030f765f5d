"""The diffusers releases the plugin is tested against, and the one warning an untested release gives."""

from __future__ import annotations

import functools
import warnings

# Releases whose every attention-bearing model class passed tests/test_zoo.py (pyproject.toml says the same)
TESTED_DIFFUSERS = ("0.42.1",)


@functools.lru_cache(maxsize=None)
def check_diffusers_version() -> None:
    """Warn once per process where the installed diffusers is not a tested release: a new release can add model
    families, or processors with keyword arguments of their own, that the plugin has not been run on."""
    import diffusers

    if diffusers.__version__ not in TESTED_DIFFUSERS:
        warnings.warn(f"diffusion_int8: diffusers {diffusers.__version__} is untested (tested: "
                      f"{', '.join(TESTED_DIFFUSERS)}); if a model's output changes in fp16 mode, please report it. "
                      f"`pytest tests/test_zoo.py` from the source checks every model class your diffusers exports.",
                      RuntimeWarning, stacklevel=4)
