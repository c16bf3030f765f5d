"""Evaluation: FP16 against INT8 images with the same seeds, scored (PSNR, SSIM, LPIPS, FID, KID) and reported.

``evaluate`` (``run.py``) makes and scores the images and returns the report; ``write_report`` writes it.
"""

from .run import evaluate, write_report

__all__ = ["evaluate", "write_report"]
