"""Triton kernels that quantize Q, K and V for the attention kernel.

They produce bit for bit what ``reference.quantize_q/k/v`` produce (see that module for the
numerics). Inputs are read through their strides, so (B, S, H, D) views need no copy; outputs are
contiguous, padded to ``SEQ_PAD`` tokens and a power-of-two head dim, so the attention kernel loads
whole tiles without masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import AMAX_FLOOR, FP8_MAX, INT8_MAX, LOG2E, PV, padded_head_dim
from .reference import padded_len, v_channel_amax

_ROW_BLOCK = 64  # tokens per program when the scale is per token
# Compiled kernels may only read globals that are constexpr.
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_INT8_MAX = tl.constexpr(INT8_MAX)
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _rdiv(c, x):
    """c / x with one IEEE rounding (tl.math.div_rn), for a constant c and a tensor or scalar x."""
    return tl.math.div_rn(x * 0.0 + c, x)


@triton.jit
def _round_half_even(y):
    # y is clamped to |y| <= 448, so adding 1.5·2²³ leaves no fractional bits: the fp32 add rounds
    # half to even. The clamp before it keeps the compiler from fusing the scale multiply into an FMA.
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _load_tile(X, stride_xb, stride_xh, stride_xs, stride_xd, pid_s, pid_bh, H, S, D,
               BLOCK: tl.constexpr, DP: tl.constexpr):
    """Tokens [pid_s·BLOCK, +BLOCK) of (batch, head) pid_bh as float32 (BLOCK, DP), zero outside (S, D)."""
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_s * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)
    valid = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    x_ptrs = (X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
              + offs_s[:, None].to(tl.int64) * stride_xs + offs_d[None, :] * stride_xd)
    return tl.load(x_ptrs, mask=valid, other=0.0).to(tl.float32), offs_s, offs_d, valid


@triton.jit
def _quant_qk_kernel(
    X, MEAN, AMAX, OUT, SCALE,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_ab, stride_ah,
    H, S, D, S_PAD, N_SCALES, scale_mult,
    BLOCK: tl.constexpr, DP: tl.constexpr,
    PER_TOKEN: tl.constexpr, SMOOTH: tl.constexpr, STATIC: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    x, offs_s, offs_d, valid = _load_tile(X, stride_xb, stride_xh, stride_xs, stride_xd, pid_s, pid_bh, H, S, D, BLOCK, DP)
    if SMOOTH:
        mean = tl.load(MEAN + pid_bh * D + offs_d, mask=offs_d < D, other=0.0)
        x = tl.where(valid, x - mean[None, :], 0.0)

    # -- range per token (Q) or per block (K); x·0 sums to NaN iff the block holds a NaN/Inf --
    poison = x * 0.0
    if PER_TOKEN:
        nonfinite = tl.sum(poison, axis=1)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        nonfinite = tl.sum(tl.sum(poison, axis=1), axis=0)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if STATIC:
        amax = tl.load(AMAX + (pid_bh // H) * stride_ab + (pid_bh % H) * stride_ah) + nonfinite * 0.0
    amax = tl.maximum(amax, _AMAX_FLOOR) + nonfinite

    # -- symmetric INT8 --
    inv = _rdiv(_INT8_MAX, amax)
    if PER_TOKEN:
        y = x * inv[:, None]
    else:
        y = x * inv
    y = tl.minimum(tl.maximum(y, -_INT8_MAX), _INT8_MAX)
    out_ptrs = OUT + pid_bh.to(tl.int64) * S_PAD * DP + offs_s[:, None] * DP + offs_d[None, :]
    tl.store(out_ptrs, _round_half_even(y).to(tl.int8))

    scale = tl.math.div_rn(amax, amax * 0.0 + _INT8_MAX) * scale_mult
    if PER_TOKEN:
        tl.store(SCALE + pid_bh * N_SCALES + offs_s, scale)
    else:
        tl.store(SCALE + pid_bh * N_SCALES + pid_s, scale)


@triton.jit
def _quant_v_kernel(
    X, AMAX, OUT, SCALE,
    stride_xb, stride_xh, stride_xs, stride_xd,
    H, S, D, S_PAD,
    BLOCK: tl.constexpr, DP: tl.constexpr, FP8: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    x, offs_s, offs_d, valid = _load_tile(X, stride_xb, stride_xh, stride_xs, stride_xd, pid_s, pid_bh, H, S, D, BLOCK, DP)
    amax = tl.load(AMAX + pid_bh * DP + offs_d)
    base = pid_bh.to(tl.int64) * S_PAD * DP
    if FP8:
        inv = _rdiv(_FP8_MAX, amax)
        y = tl.minimum(tl.maximum(x * inv[None, :], -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)
        # stored transposed, (DP, S_PAD): the FP8 MMA wants V K-major
        tl.store(OUT + base + offs_d[:, None] * S_PAD + offs_s[None, :], tl.trans(y))
        qmax = _FP8_MAX
    else:
        inv = _rdiv(_INT8_MAX, amax)
        y = tl.minimum(tl.maximum(x * inv[None, :], -_INT8_MAX), _INT8_MAX)
        tl.store(OUT + base + offs_s[:, None] * DP + offs_d[None, :], _round_half_even(y).to(tl.int8))
        qmax = _INT8_MAX
    if pid_s == 0:
        tl.store(SCALE + pid_bh * DP + offs_d, tl.math.div_rn(amax, amax * 0.0 + qmax))


@triton.jit
def _kv_stats_kernel(
    K, V, KSUM, VMAX,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H, S, D, N_CHUNKS,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, FINAL: tl.constexpr,
):
    # One (batch, head, chunk of CHUNK tokens): partial K column sums and V column |max|, in fp32.
    # FINAL (one chunk holds every token): K's mean and V's range as reference.v_channel_amax gives it
    # (floored, NaN where a NaN/Inf was seen, padded with 1), sparing the host the small ops that
    # finish the partials — at short sequences their launches cost more than the pass itself.
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, DP)
    ksum = tl.zeros([DP], tl.float32)
    vmax = tl.zeros([DP], tl.float32)
    vpoison = tl.zeros([DP], tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    for start in range(0, CHUNK, BLOCK):
        offs_s = pid_c * CHUNK + start + tl.arange(0, BLOCK)
        valid = (offs_s[:, None] < S) & (offs_d[None, :] < D)
        k = tl.load(k_base + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd, mask=valid, other=0.0)
        v = tl.load(v_base + offs_s[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd, mask=valid, other=0.0)
        ksum += tl.sum(k.to(tl.float32), axis=0)
        v = v.to(tl.float32)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v), axis=0))
        vpoison += tl.sum(v * 0.0, axis=0)  # NaN iff a NaN/Inf was seen (GPU max drops NaN)
    out = pid_bh * N_CHUNKS * DP + pid_c * DP + offs_d
    vmax = vmax + vpoison
    if FINAL:
        ksum = tl.math.div_rn(ksum, ksum * 0.0 + S)
        vmax = tl.where(offs_d < D, tl.maximum(vmax, _AMAX_FLOOR) + vmax * 0.0, 1.0)
    tl.store(KSUM + out, ksum)
    tl.store(VMAX + out, vmax)


_STATS_CHUNK = 1024


def kv_stats(k: torch.Tensor, v: torch.Tensor | None):
    """K's token mean (B, H, D) and V's range ``reference.v_channel_amax(v)`` (B, H, DP), float32, in one
    pass over K and V (the range is None when ``v`` is).

    Replaces ``reference.k_mean`` and ``reference.v_channel_amax`` on the GPU: PyTorch's reductions
    over the token dim allocate float32 copies. Chunk partials are combined in a fixed order, so the
    result is deterministic; the mean may differ from PyTorch's in the last bit.
    """
    B, H, S, D = k.shape
    dp = padded_head_dim(D)
    n_chunks = triton.cdiv(S, _STATS_CHUNK)
    ksum = torch.empty((B, H, n_chunks, dp), dtype=torch.float32, device=k.device)
    vmax = torch.empty_like(ksum)
    vv = k if v is None else v
    final = n_chunks == 1
    _kv_stats_kernel[(n_chunks, B * H)](
        k, vv, ksum, vmax, *k.stride(), *vv.stride(), H, S, D, n_chunks,
        CHUNK=_STATS_CHUNK, BLOCK=64 if dp <= 128 else 32, DP=dp, FINAL=final,
    )
    if final:
        return ksum[:, :, 0, :D], (None if v is None else vmax[:, :, 0])
    mean = ksum.sum(2)[..., :D] / S
    return mean, (None if v is None else v_channel_amax(v, vmax.amax(2)[..., :D]))


def _grid_rows(s_pad: int, block: int, bh: int):
    return (s_pad // block, bh)


def quantize_q(q: torch.Tensor, sm_scale: float, q_amax: torch.Tensor | None = None):
    """Triton twin of ``reference.quantize_q``: q (B, H, S, D) -> q8 (B, H, S_pad, DP), qs (B, H, S_pad)."""
    B, H, S, D = q.shape
    s_pad, dp = padded_len(S), padded_head_dim(D)
    q8 = torch.empty((B, H, s_pad, dp), dtype=torch.int8, device=q.device)
    qs = torch.empty((B, H, s_pad), dtype=torch.float32, device=q.device)
    amax, sa = _static_amax(q_amax, B, H, q)
    _quant_qk_kernel[_grid_rows(s_pad, _ROW_BLOCK, B * H)](
        q, q, amax, q8, qs, *q.stride(), *sa, H, S, D, s_pad, s_pad, sm_scale * LOG2E,
        BLOCK=_ROW_BLOCK, DP=dp, PER_TOKEN=True, SMOOTH=False, STATIC=q_amax is not None,
    )
    return q8, qs


def quantize_k(k: torch.Tensor, block_n: int, mean: torch.Tensor | None, k_amax: torch.Tensor | None = None):
    """Triton twin of ``reference.quantize_k``; ``mean`` is ``reference.k_mean(k)`` or None (no smoothing)."""
    B, H, S, D = k.shape
    s_pad, dp = padded_len(S), padded_head_dim(D)
    k8 = torch.empty((B, H, s_pad, dp), dtype=torch.int8, device=k.device)
    ks = torch.empty((B, H, s_pad // block_n), dtype=torch.float32, device=k.device)
    amax, sa = _static_amax(k_amax, B, H, k)
    _quant_qk_kernel[_grid_rows(s_pad, block_n, B * H)](
        k, k if mean is None else mean.contiguous(), amax, k8, ks, *k.stride(), *sa,
        H, S, D, s_pad, s_pad // block_n, 1.0,
        BLOCK=block_n, DP=dp, PER_TOKEN=False, SMOOTH=mean is not None, STATIC=k_amax is not None,
    )
    return k8, ks


def quantize_v(v: torch.Tensor, pv: PV, amax: torch.Tensor):
    """Triton twin of ``reference.quantize_v``; ``amax`` is ``reference.v_channel_amax(v, ...)``."""
    B, H, S, D = v.shape
    s_pad, dp = padded_len(S), padded_head_dim(D)
    fp8 = pv is PV.FP8
    shape = (B, H, dp, s_pad) if fp8 else (B, H, s_pad, dp)
    v8 = torch.empty(shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=v.device)
    vs = torch.empty((B, H, dp), dtype=torch.float32, device=v.device)
    _quant_v_kernel[_grid_rows(s_pad, _ROW_BLOCK, B * H)](
        v, amax.contiguous(), v8, vs, *v.stride(), H, S, D, s_pad, BLOCK=_ROW_BLOCK, DP=dp, FP8=fp8,
    )
    return v8, vs


def _static_amax(amax: torch.Tensor | None, B: int, H: int, like: torch.Tensor):
    """A (B, H) float32 view of a static range, or a placeholder, and its two strides."""
    if amax is None:
        return like, (0, 0)
    a = amax.float().expand(B, H)
    return a, a.stride()
