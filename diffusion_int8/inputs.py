"""Attention inputs with the structure diffusion models show, for the tests, the benchmarks and ``diffusion-int8
check``: a K channel bias, outlier channels, an attention sink (``realistic_qkv``) or local attention
(``local_qkv``), never zeros or plain N(0, 1), which hide quantization errors."""

from __future__ import annotations

import torch

__all__ = ["realistic_qkv", "local_qkv"]


def realistic_qkv(
    B: int, H: int, Sq: int, Sk: int, D: int, *, H_kv: int | None = None,
    dtype: torch.dtype = torch.float16, layout: str = "BHSD", device="cpu", seed: int | None = None,
    k_bias: float = 4.0, outlier_gain: float = 20.0, n_outliers: int = 2, outliers: str = "shared",
    sink: bool = True,
) -> list[torch.Tensor]:
    """Fresh random q, k, v in ``layout`` (``"BHSD"`` or ``"BSHD"``), ``dtype``, on ``device``.

    K carries a per-channel bias shared by all tokens (what smoothing removes); ``n_outliers`` channels
    are outliers: with ``outliers="shared"`` the same channels of Q and K, each scaled by sqrt(gain) so
    their product is ``outlier_gain`` times larger; with ``"separate"``, Q's channels and K's are drawn
    apart and each scaled by ``outlier_gain`` (as where Q's and K's norms learned different weights).
    Token 0 of K is a sink that every query attends to strongly; V has a channel bias.
    The values are drawn on the CPU from a generator seeded with ``seed`` (drawn from torch's global
    generator when None), so a seed gives the same inputs on every device.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    H_kv = H_kv or H
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, H_kv, Sk, D, generator=g)
    v = torch.randn(B, H_kv, Sk, D, generator=g) + 0.5 * torch.randn(B, H_kv, 1, D, generator=g)
    k = k + k_bias * torch.randn(B, H_kv, 1, D, generator=g)
    ch = torch.randperm(D, generator=g)
    if outliers == "shared":
        q[..., ch[:n_outliers]] *= outlier_gain**0.5
        k[..., ch[:n_outliers]] *= outlier_gain**0.5
    elif outliers == "separate":
        q[..., ch[:n_outliers]] *= outlier_gain
        k[..., ch[n_outliers : 2 * n_outliers]] *= outlier_gain
    else:
        raise ValueError(f"outliers must be 'shared' or 'separate', got {outliers!r}")
    if sink and Sk > 1:
        # token 0: aligned with the mean query direction, so it takes a large share of attention
        qdir = q.mean(2, keepdim=True).view(B, H_kv, H // H_kv, 1, D).mean(2)  # per KV group
        qdir = qdir / qdir.norm(dim=-1, keepdim=True) * D**0.5 * 1.5
        k[:, :, :1] = qdir + k[:, :, :1] * 0.1
    return _as_given((q, k, v), dtype, layout, device)


def local_qkv(
    B: int, H: int, Sq: int, Sk: int, D: int, *, H_kv: int | None = None, dtype: torch.dtype = torch.float16,
    layout: str = "BHSD", device="cpu", seed: int | None = None, gain: float = 1.5, wavelength: float = 300.0,
) -> list[torch.Tensor]:
    """Fresh random q, k, v whose attention is local in the sequence, as a DiT's over an image or a video is in
    space and time: each token's Q and K hold features of its position (sines and cosines of wavelengths from
    ``wavelength`` / 4 tokens up, scaled by ``gain``) plus noise, and K a channel bias. So nearby blocks take most
    of a query block's mass, and the block-sparse predictor has structure to find: with the defaults, a mass of 0.9
    skips half (4,000 tokens) to two thirds (1,000) of the blocks. Other arguments as ``realistic_qkv``'s."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    H_kv = H_kv or H
    freqs = torch.rand(D - D // 2, generator=g) * (4.0 / wavelength)

    def tokens(S: int, heads: int) -> torch.Tensor:
        angle = torch.arange(S, dtype=torch.float32)[:, None] * freqs
        pos = torch.cat([angle.cos(), angle.sin()], -1)[:, :D] * (2 * gain * D**-0.25)
        return pos + 0.5 * torch.randn(B, heads, S, D, generator=g)

    q = tokens(Sq, H)
    k = tokens(Sk, H_kv) + 2.0 * torch.randn(B, H_kv, 1, D, generator=g)
    v = torch.randn(B, H_kv, Sk, D, generator=g)
    return _as_given((q, k, v), dtype, layout, device)


def _as_given(tensors, dtype: torch.dtype, layout: str, device) -> list[torch.Tensor]:
    """(B, H, S, D) float32 CPU tensors in ``dtype``, ``layout`` (made contiguous there) and on ``device``."""
    out = []
    for t in tensors:
        t = t.to(dtype)
        if layout == "BSHD":
            t = t.transpose(1, 2).contiguous()
        out.append(t.to(device))
    return out
