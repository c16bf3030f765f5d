"""Attention over two disjoint key sets from each set's result, the second one forecast: one pass for the steps
between refreshes of ``carry.BlockCarry``.

``merge_forecast`` reads the kept blocks' output and log-sum-exp and the skipped blocks' at the last two
refreshes, extrapolates the latter linearly to this step, and writes the softmax-weighted combination in the
output's dtype. In PyTorch that is a dozen elementwise launches and float32 temporaries (at Wan's shape, a third
of the dense attention call); here it is one launch that reads the four inputs once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import FP_FUSION, Backend, select_backend
from .layout import cdiv


def merge_reference(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                    before_out: torch.Tensor | None = None, before_lse: torch.Tensor | None = None,
                    step: float = 0.0) -> torch.Tensor:
    """``merge_forecast`` in PyTorch (float32): set b taken as ``b + step · (b − before)`` where a ``before`` is
    given (its log-sum-exp too, where both are finite)."""
    out_b, lse_b = out_b.float(), lse_b.float()
    if before_out is not None:
        both = torch.isfinite(lse_b) & torch.isfinite(before_lse)
        out_b = out_b + step * (out_b - before_out.float())
        lse_b = torch.where(both, lse_b + step * (lse_b - before_lse.where(both, lse_b)), lse_b)
    top = torch.maximum(lse_a, lse_b).nan_to_num(neginf=0.0)  # a row without keys in both: weights of zero
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    a = torch.where(w_a[..., None] > 0, out_a.float(), 0.0)
    b = torch.where(w_b[..., None] > 0, out_b, 0.0)
    return (w_a[..., None] * a + w_b[..., None] * b) / (w_a + w_b).clamp_min(torch.finfo(torch.float32).tiny)[..., None]


@triton.jit
def _merge_kernel(A, LA, B, LB, P, LP, O, step, H, BH, S, D,
                  sa_b, sa_h, sa_s, sb_b, sb_h, sb_s, sp_b, sp_h, sp_s, so_b, so_h, so_s,
                  FORECAST: tl.constexpr, BLOCK_S: tl.constexpr, DP: tl.constexpr):
    # consecutive programs take the heads of one row block: in (B, S, H, D) memory they read and write one
    # contiguous span
    pid_s, pid_bh = tl.program_id(0) // BH, tl.program_id(0) % BH
    b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)  # int64 offsets: S · D may pass 2^31
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, DP)
    in_rows = rows < S
    tile = in_rows[:, None] & (cols[None, :] < D)
    lse_off = pid_bh.to(tl.int64) * S + rows  # log-sum-exps are contiguous (B, H, S)
    la = tl.load(LA + lse_off, mask=in_rows, other=float("-inf"))
    lb = tl.load(LB + lse_off, mask=in_rows, other=float("-inf"))
    ob = tl.load(B + b * sb_b + h * sb_h + rows[:, None].to(tl.int64) * sb_s + cols[None, :], mask=tile,
                 other=0.0).to(tl.float32)
    if FORECAST:
        lp = tl.load(LP + lse_off, mask=in_rows, other=float("-inf"))
        op = tl.load(P + b * sp_b + h * sp_h + rows[:, None].to(tl.int64) * sp_s + cols[None, :], mask=tile,
                     other=0.0).to(tl.float32)
        ob = ob + step * (ob - op)
        both = (lb > float("-inf")) & (lp > float("-inf"))
        lb = tl.where(both, lb + step * (lb - tl.where(both, lp, lb)), lb)
    top = tl.maximum(la, lb)
    top = tl.where(top == float("-inf"), 0.0, top)
    wa, wb = tl.exp(la - top), tl.exp(lb - top)
    oa = tl.load(A + b * sa_b + h * sa_h + rows[:, None].to(tl.int64) * sa_s + cols[None, :], mask=tile,
                 other=0.0).to(tl.float32)
    oa = tl.where(wa[:, None] > 0, oa, 0.0)
    ob = tl.where(wb[:, None] > 0, ob, 0.0)
    out = (wa[:, None] * oa + wb[:, None] * ob) / tl.maximum(wa + wb, 1e-38)[:, None]
    tl.store(O + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + cols[None, :],
             out.to(O.dtype.element_ty), mask=tile)


def merge_forecast(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   before_out: torch.Tensor | None = None, before_lse: torch.Tensor | None = None,
                   step: float = 0.0) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, the second forecast linearly from two earlier results.

    Args:
        out_a, out_b: (B, H, S, D) attention outputs over each key set alone, any strides with a unit last one;
            rows of a set with no keys may hold anything (their weight is zero).
        lse_a, lse_b: contiguous (B, H, S) float32 log-sum-exp of each set's scaled logits, natural log, -inf for
            no keys.
        before_out, before_lse: set b's result at an earlier step, like ``out_b`` and ``lse_b``; None: set b is
            taken as it is.
        step: set b is taken as ``b + step · (b − before)``, its log-sum-exp likewise where both are finite.

    Returns:
        (B, H, S, D) in ``out_a``'s dtype and memory order: the softmax-weighted combination, as one call over both
        sets would give it. On the GPU one Triton launch; elsewhere ``merge_reference``.
    """
    forecast = before_out is not None
    if select_backend(out_a.device) is Backend.EMULATION or out_a.stride(-1) != 1 or out_b.stride(-1) != 1 or (
            forecast and before_out.stride(-1) != 1):
        return merge_reference(out_a, lse_a, out_b, lse_b, before_out, before_lse, step).to(out_a.dtype)
    B, H, S, D = out_a.shape
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty_like(out_a)
    before_out, before_lse = (before_out, before_lse.contiguous()) if forecast else (out_b, lse_b)
    BLOCK_S = 16  # 64 rows of three float32 tiles spill at 4 warps: 2.5x slower at Wan's shape
    _merge_kernel[(cdiv(S, BLOCK_S) * B * H,)](
        out_a, lse_a, out_b, lse_b, before_out, before_lse, out, float(step), H, B * H, S, D,
        *out_a.stride()[:3], *out_b.stride()[:3], *before_out.stride()[:3], *out.stride()[:3],
        FORECAST=forecast, BLOCK_S=BLOCK_S, DP=triton.next_power_of_2(D), num_warps=4, enable_fp_fusion=FP_FUSION)
    return out
