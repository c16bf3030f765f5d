"""Wan's rotary position embedding in one launch, equal to diffusers' bit for bit.

diffusers' Wan processors rotate Q and K with a nested ``apply_rotary_emb`` of about a dozen PyTorch ops per tensor
(strided reads, four products, two sums, two strided writes, float32 temporaries): at 480p × 81 frames, Q's and K's
cost a quarter of an INT8 attention call. ``rotate_pairs`` reads each input once and writes the result once. Every
product and sum is rounded to the dtype PyTorch computes it in (the promotion of the input's and the tables'), and
the kernel is compiled without fused multiply-adds, so the result is the stock function's, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import triton_unavailable

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the dtypes taken, and the kernel's constexpr


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """float32 ``x`` rounded to the compute dtype (ROUND: 0 float32, 1 bfloat16, 2 float16), as float32."""
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rotate_pairs_kernel(
    X, COS, SIN, OUT, R, S, H, D,
    stride_xb, stride_xs, stride_xh, stride_xd, stride_cb, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_ss, stride_sh, stride_sd, stride_ob, stride_os, stride_oh, stride_od,
    ROWS: tl.constexpr, DP: tl.constexpr, ROUND: tl.constexpr,
):
    # ROWS rows (b, s, h) of X, loaded whole and split into channel pairs (x1, x2) = (x[2j], x[2j+1]), with
    # c = cos[2j] and s = sin[2j+1]: out[2j] = x1·c - x2·s, out[2j+1] = x1·s + x2·c, each product and sum rounded as
    # PyTorch rounds it, then joined and stored whole (the loads and stores run at full width).
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DP)
    b = (r // (S * H)).to(tl.int64)
    s = (r // H % S).to(tl.int64)
    h = (r % H).to(tl.int64)
    valid = (r[:, None] < R) & (d[None, :] < D)
    x = tl.load(X + (b * stride_xb + s * stride_xs + h * stride_xh)[:, None] + d[None, :] * stride_xd, mask=valid)
    c = tl.load(COS + (b * stride_cb + s * stride_cs + h * stride_ch)[:, None] + d[None, :] * stride_cd, mask=valid)
    sn = tl.load(SIN + (b * stride_sb + s * stride_ss + h * stride_sh)[:, None] + d[None, :] * stride_sd, mask=valid)
    x1, x2 = tl.split(tl.reshape(x.to(tl.float32), [ROWS, DP // 2, 2]))
    c, _ = tl.split(tl.reshape(c.to(tl.float32), [ROWS, DP // 2, 2]))
    _, sn = tl.split(tl.reshape(sn.to(tl.float32), [ROWS, DP // 2, 2]))
    # the sums' own rounding is the store's: a 16-bit compute dtype is the output's (both inputs are of it)
    out_even = _rounded(x1 * c, ROUND) - _rounded(x2 * sn, ROUND)
    out_odd = _rounded(x1 * sn, ROUND) + _rounded(x2 * c, ROUND)
    out = tl.reshape(tl.join(out_even, out_odd), [ROWS, DP])
    tl.store(OUT + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=valid)


def rotate_pairs_takes(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> bool:
    """Whether ``rotate_pairs`` runs these inputs (``_refusal``); never raises nor warns."""
    return _refusal(x, freqs_cos, freqs_sin) is None


def _refusal(x, freqs_cos, freqs_sin) -> str | None:
    """Why ``rotate_pairs`` does not run these inputs, or None where it does: a non-empty 4-D ``x`` of an even head dim,
    tables of its head dim that broadcast to it, float16/bfloat16/float32 tensors on one device the Triton kernels run
    on (``DIFFUSION_INT8_BACKEND`` not ``emulation``), and no gradient to keep."""
    if not (isinstance(freqs_cos, torch.Tensor) and isinstance(freqs_sin, torch.Tensor)):
        return "the tables are not tensors"
    if x.dim() != 4 or x.shape[-1] % 2 or x.numel() == 0:
        return f"x must be a non-empty (B, S, H, D) tensor with D even, got {tuple(x.shape)}"
    if any(t.dtype not in _ROUND for t in (x, freqs_cos, freqs_sin)) or freqs_cos.dtype != freqs_sin.dtype:
        return (f"x and the tables must be float16, bfloat16 or float32, the two tables of one dtype; got x {x.dtype}, "
                f"tables {freqs_cos.dtype} and {freqs_sin.dtype}")
    for t in (freqs_cos, freqs_sin):
        fits = t.device == x.device and 1 <= t.dim() <= 4 and t.shape[-1] == x.shape[-1]
        try:
            fits = fits and torch.broadcast_shapes(t.shape[:-1], x.shape[:-1]) == x.shape[:-1]
        except RuntimeError:
            fits = False
        if not fits:
            return (f"the tables must be (..., D) on x's device, broadcastable to x {tuple(x.shape)} on {x.device}; "
                    f"got {tuple(t.shape)} on {t.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, freqs_cos, freqs_sin)):
        return "it has no backward: call it without gradients (torch.no_grad())"
    return triton_unavailable(x.device)


def rotate_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' Wan ``apply_rotary_emb`` in one launch: channel pairs (2j, 2j+1) of ``x`` rotated by
    ``freqs_cos[..., 2j]`` and ``freqs_sin[..., 2j+1]``, equal to the stock function bit for bit.

    x: (B, S, H, D) float16/bfloat16/float32, any strides, D even. freqs_cos, freqs_sin: (..., D) of one dtype,
    broadcastable to ``x`` (Wan's: (1, S, 1, D)). Products and sums are rounded to the promotion of the two dtypes.
    out: where to write (``x``'s shape and dtype); by default ``torch.empty_like(x)``, as the stock function's.
    Returns ``out``. Inputs ``rotate_pairs_takes`` refuses raise ``ValueError`` saying why.
    """
    reason = _refusal(x, freqs_cos, freqs_sin)
    if reason is not None:
        raise ValueError(f"rotate_pairs does not run these inputs: {reason}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype}")
    return rotate_pairs_unchecked(x, freqs_cos, freqs_sin, out)


def rotate_pairs_unchecked(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """``rotate_pairs`` for inputs ``rotate_pairs_takes`` has accepted, without checking them again."""
    if out is None:
        out = torch.empty_like(x)
    if x.is_cuda and torch.cuda.current_device() != x.device.index:
        with torch.cuda.device(x.device):  # Triton launches on the current device
            return rotate_pairs_unchecked(x, freqs_cos, freqs_sin, out)
    B, S, H, D = x.shape
    cos, sin = freqs_cos.expand(x.shape), freqs_sin.expand(x.shape)
    rows, dp = B * S * H, max(2, triton.next_power_of_2(D))
    block_rows = max(1, 4096 // dp)
    _rotate_pairs_kernel[(triton.cdiv(rows, block_rows),)](
        x, cos, sin, out, rows, S, H, D, *x.stride(), *cos.stride(), *sin.stride(), *out.stride(),
        block_rows, dp, _ROUND[torch.promote_types(x.dtype, freqs_cos.dtype)], enable_fp_fusion=False,
    )
    return out
