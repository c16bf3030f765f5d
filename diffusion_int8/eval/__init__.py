"""Evaluation: FP16 against INT8 images with the same seeds, scored (PSNR, SSIM, LPIPS, FID, KID) and reported.

``evaluate`` (``run.py``) makes and scores the images and returns the report; ``write_report`` writes it.
"""

__all__ = ["evaluate", "write_report"]


def __getattr__(name: str):
    # loaded on first use, so that importing a submodule (report, metrics) does not import run.py's dependencies
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
