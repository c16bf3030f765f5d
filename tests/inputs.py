"""Attention inputs with the structure real diffusion models show (never zeros or plain N(0, 1))."""

from __future__ import annotations

import torch


def realistic_qkv(
    B: int, H: int, Sq: int, Sk: int, D: int, *, H_kv: int | None = None,
    dtype: torch.dtype = torch.float16, layout: str = "BHSD", device="cpu", seed: int | None = None,
    k_bias: float = 4.0, outlier_gain: float = 20.0, n_outliers: int = 2, sink: bool = True,
):
    """Fresh random q, k, v in ``layout``.

    K carries a per-channel bias shared by all tokens (what smoothing removes) and ``n_outliers``
    channels of both Q and K are scaled by ``outlier_gain`` / sqrt(gain) so their product stays
    moderate; token 0 of K is a sink that every query attends to strongly; V has a channel bias.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    H_kv = H_kv or H
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, H_kv, Sk, D, generator=g)
    v = torch.randn(B, H_kv, Sk, D, generator=g) + 0.5 * torch.randn(B, H_kv, 1, D, generator=g)
    k = k + k_bias * torch.randn(B, H_kv, 1, D, generator=g)
    ch = torch.randperm(D, generator=g)[:n_outliers]
    q[..., ch] *= outlier_gain**0.5
    k[..., ch] *= outlier_gain**0.5
    if sink and Sk > 1:
        # token 0: aligned with the mean query direction, so it takes a large share of attention
        qdir = q.mean(2, keepdim=True).view(B, H_kv, H // H_kv, 1, D).mean(2)  # per KV group
        qdir = qdir / qdir.norm(dim=-1, keepdim=True) * D**0.5 * 1.5
        k[:, :, :1] = qdir + k[:, :, :1] * 0.1
    out = []
    for t in (q, k, v):
        t = t.to(dtype)
        if layout == "BSHD":
            t = t.transpose(1, 2).contiguous()
        out.append(t.to(device))
    return out
