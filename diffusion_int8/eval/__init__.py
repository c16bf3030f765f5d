"""Evaluation: FP16 against INT8 images with the same seeds, scored (PSNR, SSIM, LPIPS, FID, KID) and reported."""
