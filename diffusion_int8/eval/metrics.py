"""Image quality metrics: PSNR, SSIM, LPIPS, FID and KID, against a reference set with the same seeds.

PSNR and SSIM are computed here. LPIPS uses the ``lpips`` package and FID/KID use torch-fidelity's
Inception (both need torchvision, and weights that these machines cannot download): each is
``Unavailable`` with the reason and the fix when its network or weights are missing — never a guess.
FID/KID take any feature network, so they are tested with a local random one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet, which LPIPS(net="alex") builds on
INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's FID Inception


@dataclass
class Unavailable:
    """A metric that could not be computed, and why."""

    reason: str

    def to_dict(self) -> dict:
        return {"available": False, "reason": self.reason}


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image PSNR in dB of (B, C, H, W) images in [0, data_range]; inf where identical."""
    mse = ((x.double() - ref.double()) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - (size - 1) / 2) ** 2) / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(x: torch.Tensor, ref: torch.Tensor, data_range: float = 1.0, window: int = 11) -> torch.Tensor:
    """Per-image SSIM (Wang et al. 2004: 11×11 Gaussian window, σ 1.5, K1 0.01, K2 0.03, valid region),
    averaged over channels. Images smaller than the window use a window of their size."""
    x, ref = x.double(), ref.double()
    C = x.shape[1]
    win = min(window, x.shape[-1], x.shape[-2])
    w = _gaussian_window(win, 1.5 * win / 11).to(x.device)[None, None].expand(C, 1, win, win)
    conv = lambda t: F.conv2d(t, w, groups=C)  # noqa: E731
    mu_x, mu_y = conv(x), conv(ref)
    sxx = conv(x * x) - mu_x**2
    syy = conv(ref * ref) - mu_y**2
    sxy = conv(x * ref) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
    return s.flatten(1).mean(1)


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """FID formula on (N, F) feature sets: |μa − μb|² + Tr(Σa + Σb − 2 (Σa Σb)^½), in float64."""
    a, b = a.double(), b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    # Tr((Σa Σb)^½) = Σ sqrt(eigenvalues of Σa Σb), which are real and >= 0 up to rounding
    eig = torch.linalg.eigvals(cov_a @ cov_b)
    tr_sqrt = eig.sqrt().real.sum()
    return float(((mu_a - mu_b) ** 2).sum() + cov_a.trace() + cov_b.trace() - 2 * tr_sqrt)


def kernel_inception_distance(a: torch.Tensor, b: torch.Tensor, subsets: int = 50, subset_size: int = 100,
                              seed: int = 0) -> tuple[float, float]:
    """KID: unbiased MMD² with the kernel (x·y / F + 1)³, mean and std over random subsets."""
    a, b = a.double(), b.double()
    n = min(subset_size, len(a), len(b))
    if n < 2:
        raise ValueError("KID needs at least 2 images per set")
    g = torch.Generator().manual_seed(seed)
    d = a.shape[1]
    vals = []
    for _ in range(subsets):
        x = a[torch.randperm(len(a), generator=g)[:n]]
        y = b[torch.randperm(len(b), generator=g)[:n]]
        kxx, kyy, kxy = ((x @ x.T) / d + 1) ** 3, ((y @ y.T) / d + 1) ** 3, ((x @ y.T) / d + 1) ** 3
        off = 1 - torch.eye(n, dtype=torch.float64)
        vals.append(float((kxx * off).sum() / (n * (n - 1)) + (kyy * off).sum() / (n * (n - 1)) - 2 * kxy.mean()))
    t = torch.tensor(vals, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(vals) > 1 else 0.0


def _cache_dir() -> Path:
    return Path(os.environ.get("TORCH_HOME", Path.home() / ".cache" / "torch")) / "hub" / "checkpoints"


def _weights(given: str | Path | None, file_name: str, what: str, flag: str) -> Path | Unavailable:
    """The weights file given, else the TORCH_HOME cache's, else why it is missing and how to provide it."""
    cached = _cache_dir() / file_name
    path = Path(given) if given else cached
    if path.is_file():
        return path
    return Unavailable(f"{what} ({file_name}), which cannot be downloaded here: pass {flag} PATH "
                       f"or place the file in {cached.parent}")


def lpips_model(weights: str | Path | None = None, device: torch.device | str = "cpu"):
    """``lpips.LPIPS(net="alex")`` with AlexNet from ``weights`` or the TORCH_HOME cache, or ``Unavailable``."""
    try:
        import lpips
        import torchvision
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        return Unavailable(f"LPIPS needs the `lpips` package and a torchvision matching your torch "
                           f"({type(e).__name__}: {e}); pip install lpips torchvision")
    path = _weights(weights, ALEXNET_FILE, "LPIPS needs torchvision's AlexNet weights", "--lpips-weights")
    if isinstance(path, Unavailable):
        return path
    model = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False)  # linear heads ship with lpips
    alex = torchvision.models.alexnet()
    alex.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    for slice_ in (model.net.slice1, model.net.slice2, model.net.slice3, model.net.slice4, model.net.slice5):
        for name, module in slice_.named_children():
            module.load_state_dict(alex.features[int(name)].state_dict())
    return model.eval().to(device)


@torch.no_grad()
def lpips_distance(model, x: torch.Tensor, ref: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """Per-image LPIPS of [0, 1] images (the model expects [-1, 1])."""
    dev = next(model.parameters()).device
    out = [model(x[i:i + batch].to(dev) * 2 - 1, ref[i:i + batch].to(dev) * 2 - 1).flatten().cpu()
           for i in range(0, len(x), batch)]
    return torch.cat(out).double()


def inception_model(weights: str | Path | None = None, device: torch.device | str = "cpu"):
    """torch-fidelity's FID Inception (2048-d pool features) from ``weights`` or the cache, or ``Unavailable``."""
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except Exception as e:  # noqa: BLE001
        return Unavailable(f"FID/KID need torch-fidelity and a torchvision matching your torch "
                           f"({type(e).__name__}: {e}); pip install torch-fidelity torchvision")
    path = _weights(weights, INCEPTION_FILE, "FID/KID need torch-fidelity's Inception weights", "--fid-weights")
    if isinstance(path, Unavailable):
        return path
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))
    return _InceptionFeatures(net).eval().to(device)


class _InceptionFeatures(torch.nn.Module):
    """[0, 1] float images -> (N, 2048) features (torch-fidelity takes uint8 and resizes to 299 itself)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net((x.clamp(0, 1) * 255).round().to(torch.uint8))[0]


@torch.no_grad()
def features(net: torch.nn.Module, images: torch.Tensor, batch: int = 64) -> torch.Tensor:
    dev = next(net.parameters()).device
    return torch.cat([net(images[i:i + batch].to(dev)).flatten(1).double().cpu() for i in range(0, len(images), batch)])


def aggregate(values: torch.Tensor) -> dict:
    """Mean, std, min, max and counts of per-image values; None statistics when there are none."""
    v = values.double()
    finite = v[torch.isfinite(v)]
    if not len(v):  # every image excluded
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "n_finite": 0}
    return {"mean": float(v.mean()), "std": float(v.std()) if len(v) > 1 else 0.0, "min": float(v.min()),
            "max": float(v.max()), "n": len(v), "n_finite": len(finite)}
