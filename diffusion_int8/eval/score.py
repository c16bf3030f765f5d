"""Scoring image sets against a reference set: per-image and aggregated metrics, set-level FID/KID."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from . import metrics as M


IMAGE_FILE = re.compile(r"\d{5,}\.png")  # the names save_images gives


def save_images(images: torch.Tensor, folder: Path, indices: list[int]) -> None:
    """(B, 3, H, W) [0, 1] floats as ``{index:05d}.png``."""
    folder.mkdir(parents=True, exist_ok=True)
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, a in zip(indices, arr):
        Image.fromarray(a).save(folder / f"{i:05d}.png")


def image_names(folder: Path) -> list[str]:
    """The names of the PNG/JPEG/WebP images of a folder, sorted; ``FileNotFoundError`` where it holds none."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    if not names:
        raise FileNotFoundError(f"no images (.png, .jpg, .webp) in {folder}")
    return names


def load_folder(folder: Path) -> tuple[list[str], torch.Tensor]:
    """The images of a folder (``image_names``), sorted by name, as (N, 3, H, W) float32 in [0, 1]."""
    names = image_names(folder)
    files = [Path(folder) / n for n in names]
    arrs = [np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255 for p in files]
    shapes = {a.shape for a in arrs}
    if len(shapes) > 1:
        raise ValueError(f"images in {folder} differ in size: {sorted(shapes)}")
    return names, torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).contiguous()


class Scorer:
    """Holds the (optional) LPIPS and Inception networks; scores candidate sets against one reference."""

    def __init__(self, lpips_weights=None, fid_weights=None, device="cpu", kid_subset_size: int = 100):
        """``FileNotFoundError`` for weights given that are not a file: only weights not given, and not found,
        make a metric unavailable."""
        for what, path in (("LPIPS", lpips_weights), ("FID/KID", fid_weights)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{what} weights {path}: no such file")
        self.lpips = M.lpips_model(lpips_weights, device)
        self.inception = M.inception_model(fid_weights, device)
        self.kid_subset_size = kid_subset_size

    def availability(self) -> dict:
        out = {"psnr": {"available": True}, "ssim": {"available": True}}
        for name, net in (("lpips", self.lpips), ("fid", self.inception), ("kid", self.inception)):
            out[name] = net.to_dict() if isinstance(net, M.Unavailable) else {"available": True}
        return out

    def score(self, images: torch.Tensor, ref: torch.Tensor, exclude=()) -> dict:
        """Per-image lists and aggregates of PSNR, SSIM, LPIPS; FID and KID of the sets.

        Images listed in ``exclude``, and images with NaN/Inf values in either set, are not scored: their
        per-image values are None, the aggregates and FID/KID cover the others, and ``excluded`` lists them.
        """
        if images.shape != ref.shape:
            raise ValueError(f"image sets differ in shape: {tuple(images.shape)} vs reference {tuple(ref.shape)}")
        keep = non_finite(images).logical_or_(non_finite(ref)).logical_not_()
        keep[list(exclude)] = False
        images, ref, kept = images[keep], ref[keep], keep.nonzero().flatten().tolist()
        per = {"psnr": M.psnr(images, ref), "ssim": M.ssim(images, ref)}
        if not isinstance(self.lpips, M.Unavailable) and kept:
            per["lpips"] = M.lpips_distance(self.lpips, images, ref)
        excluded = (~keep).nonzero().flatten().tolist()
        out = {"per_image": {k: _scatter(v, kept, len(keep)) for k, v in per.items()},
               "aggregate": {k: {**M.aggregate(v), "excluded": len(excluded)} for k, v in per.items()},
               "excluded": excluded}
        if isinstance(self.lpips, M.Unavailable):
            out["aggregate"]["lpips"] = self.lpips.to_dict()
        if isinstance(self.inception, M.Unavailable):
            out["aggregate"]["fid"] = out["aggregate"]["kid"] = self.inception.to_dict()
        elif kept:
            out["aggregate"]["fid"], out["aggregate"]["kid"] = M.fid_kid(self.inception, images, ref,
                                                                          kid_subset_size=self.kid_subset_size)
        return out


def non_finite(images: torch.Tensor) -> torch.Tensor:
    """(N,) bool: which of (N, ...) images hold a NaN or an Inf."""
    return ~torch.isfinite(images).flatten(1).all(1)


def _scatter(values: torch.Tensor, kept: list[int], n: int) -> list:
    """Per-image values of the kept images at their indices, None for the excluded ones."""
    out = [None] * n
    for i, x in zip(kept, values.tolist()):
        out[i] = float(x)
    return out
