"""Image quality metrics: PSNR, SSIM, LPIPS, FID and KID, against a reference set with the same seeds.

PSNR, SSIM, FID and KID are torchmetrics' implementations; LPIPS is the ``lpips`` package. FID/KID run
torchmetrics' metrics on torch-fidelity's Inception loaded from a local weights file, given to them as their
feature network (LPIPS and Inception need torchvision, and weights that these machines cannot download): each is
``Unavailable`` with the reason and the fix when its network or weights are missing — never a guess.
FID/KID take any feature network, so they are tested with a local random one.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet, which LPIPS(net="alex") builds on
INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's FID Inception


@dataclass
class Unavailable:
    """A metric that could not be computed, and why."""

    reason: str

    def to_dict(self) -> dict:
        return {"available": False, "reason": self.reason}


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image PSNR in dB of (B, C, H, W) images in [0, data_range], in float64; inf where identical.
    torchmetrics' ``peak_signal_noise_ratio`` over each image's pixels."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return peak_signal_noise_ratio(x.double(), ref.double(), data_range=data_range, reduction="none",
                                   dim=tuple(range(1, x.dim())))


def ssim(x: torch.Tensor, ref: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image SSIM in float64 (Wang et al. 2004: 11×11 Gaussian window, σ 1.5, K1 0.01, K2 0.03, the map's
    valid region averaged over pixels and channels), from torchmetrics' ``structural_similarity_index_measure``. Images smaller than 11 pixels on a side use the largest odd window
    that fits, with σ scaled to it; images under 3 pixels on a side get NaN."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    win = min(11, x.shape[-1], x.shape[-2])
    win -= 1 - win % 2  # odd
    if win < 3:
        return torch.full((x.shape[0],), float("nan"), dtype=torch.float64)
    # torchmetrics derives the window from σ: 2·int(3.5σ + 0.5) + 1, which is `win` for σ = 1.5·win/11. Its
    # score averages the map over the whole image, borders reflect-padded; the map's valid region (windows
    # inside the image) is the definition above, and what this package has always reported.
    _, full = structural_similarity_index_measure(x.double(), ref.double(), sigma=1.5 * win / 11, kernel_size=win,
                                                  data_range=data_range, reduction="none", return_full_image=True)
    pad = (win - 1) // 2
    return full[..., pad:full.shape[-2] - pad, pad:full.shape[-1] - pad].flatten(1).mean(1)


def fid_kid(net: torch.nn.Module, images: torch.Tensor, ref: torch.Tensor, kid_subset_size: int = 100,
            kid_subsets: int = 50, seed: int = 0, batch: int = 64) -> tuple[dict, dict]:
    """FID and KID of ``images`` against ``ref`` with torchmetrics' ``FrechetInceptionDistance`` and
    ``KernelInceptionDistance`` (polynomial kernel (x·y / F + 1)³), both given ``net`` as their feature network:
    (N, 3, H, W) [0, 1] floats in, (N, F) features out. KID's subsets are drawn with ``seed`` (the global RNG is
    left as it was) and hold min(``kid_subset_size``, N) images; its std is over the subsets. Each result is a
    dict for the report, ``{"available": False, "reason": ...}`` where the sets are too small (fewer than 2)."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    n = min(len(images), len(ref))
    if n < 2:
        small = Unavailable(f"FID and KID need at least 2 images per set, got {n}").to_dict()
        return small, small
    dev = next(net.parameters()).device
    if not hasattr(net, "num_features"):  # else torchmetrics infers it from a dummy 299×299 image
        with torch.no_grad():
            net.num_features = int(net(images[:1].to(dev)).flatten(1).shape[1])
    fid = FrechetInceptionDistance(feature=net, reset_real_features=True)
    with warnings.catch_warnings():  # that it keeps every feature: N × 2048 floats per set, as intended here
        warnings.filterwarnings("ignore", message=".*will save all extracted features")
        kid = KernelInceptionDistance(feature=net, subsets=kid_subsets, subset_size=min(kid_subset_size, n),
                                      reset_real_features=True)
    with torch.no_grad():
        for metric in (fid, kid):
            for i in range(0, len(ref), batch):
                metric.update(ref[i:i + batch].to(dev), real=True)
            for i in range(0, len(images), batch):
                metric.update(images[i:i + batch].to(dev), real=False)
    fid_value = float(fid.compute())
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # KID draws its subsets with torch.randperm on the CPU
        kid_mean, kid_std = kid.compute()
    return ({"value": fid_value, "n": len(images)},
            {"mean": float(kid_mean), "std": float(kid_std), "n": len(images)})


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


def missing_package(metric: str) -> Unavailable | None:
    """Why ``metric`` (``"lpips"``, or ``"fid"`` for FID and KID) cannot be computed whatever its weights: its
    package does not import; None where it does."""
    try:
        if metric == "lpips":
            import lpips  # noqa: F401
            import torchvision  # noqa: F401
        else:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        needs = "LPIPS needs the `lpips` package" if metric == "lpips" else "FID/KID need torch-fidelity"
        return Unavailable(f"{needs} and a torchvision matching your torch ({type(e).__name__}: {e}); install a "
                           f"torchvision built for your torch from the index your torch came from, then pip install "
                           f"--no-deps lpips torch-fidelity (docs/GUIDE.md, Evaluation)")
    return None


def lpips_model(weights: str | Path | None = None, device: torch.device | str = "cpu"):
    """``lpips.LPIPS(net="alex")`` with AlexNet from ``weights`` or the TORCH_HOME cache, or ``Unavailable``."""
    missing = missing_package("lpips")
    if missing is not None:
        return missing
    import lpips
    import torchvision

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
    missing = missing_package("fid")
    if missing is not None:
        return missing
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    path = _weights(weights, INCEPTION_FILE, "FID/KID need torch-fidelity's Inception weights", "--fid-weights")
    if isinstance(path, Unavailable):
        return path
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))
    return _InceptionFeatures(net).eval().to(device)


class _InceptionFeatures(torch.nn.Module):
    """[0, 1] float images -> (N, 2048) features (torch-fidelity takes uint8 and resizes to 299 itself)."""

    num_features = 2048  # read by torchmetrics' FID/KID

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net((x.clamp(0, 1) * 255).round().to(torch.uint8))[0]


def aggregate(values: torch.Tensor) -> dict:
    """Mean, std, min, max and counts of per-image values; None statistics when there are none."""
    v = values.double()
    finite = v[torch.isfinite(v)]
    if not len(v):  # every image excluded
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "n_finite": 0}
    same = bool((v == v[0]).all())  # one value, or equal images' PSNR (inf) each time: no spread, not inf - inf
    return {"mean": float(v.mean()), "std": 0.0 if same else float(v.std()), "min": float(v.min()),
            "max": float(v.max()), "n": len(v), "n_finite": len(finite)}
