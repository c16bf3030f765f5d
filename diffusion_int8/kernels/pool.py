"""Block pooling for the block-sparse predictor (``sparsity.predict_block_mask``), in one pass over Q or K.

Per block of ``SPARSE_BLOCK`` tokens of one (batch, head): the sum of the tokens (their mean, once divided by
the block's token count) and the sum of their unit vectors, after subtracting a per-(batch, head) vector where
one is given (K's token mean). In PyTorch the same takes a float32 copy of the tensor and three more passes;
at Wan's 32K tokens that is most of a millisecond against this kernel's one read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import SPARSE_BLOCK, padded_head_dim
from .layout import cdiv


@triton.jit
def _pool_kernel(X, MU, SUM, UNIT, stride_xb, stride_xh, stride_xs, stride_xd, H, S, D, NB,
                 HAS_MU: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_s * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)
    valid = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    ptrs = (X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
            + offs_s[:, None].to(tl.int64) * stride_xs + offs_d[None, :] * stride_xd)
    x = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
    if HAS_MU:
        mu = tl.load(MU + pid_bh * D + offs_d, mask=offs_d < D, other=0.0)
        x = tl.where(valid, x - mu[None, :], 0.0)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    unit = x / tl.maximum(norm, 1e-30)[:, None]
    out = (pid_bh * NB + pid_s) * D + offs_d
    tl.store(SUM + out, tl.sum(x, axis=0), mask=offs_d < D)
    tl.store(UNIT + out, tl.sum(unit, axis=0), mask=offs_d < D)


def block_sums(x: torch.Tensor, mu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, H, S, D), any strides and float dtype, on a GPU; mu: None or float32 (B, H, D), subtracted from
    every token. Returns float32 (B, H, nB, D) twice: per block of ``SPARSE_BLOCK`` tokens (the last partial), the
    sum of the (shifted) tokens and the sum of their unit vectors. One launch, no host synchronization."""
    B, H, S, D = x.shape
    nb = cdiv(S, SPARSE_BLOCK)
    sums = torch.empty((B, H, nb, D), dtype=torch.float32, device=x.device)
    units = torch.empty_like(sums)
    mu_arg = sums if mu is None else mu.float().contiguous()
    _pool_kernel[(nb, B * H)](x, mu_arg, sums, units, *x.stride(), H, S, D, nb,
                              HAS_MU=mu is not None, BLOCK=SPARSE_BLOCK, DP=padded_head_dim(D), num_warps=8)
    return sums, units
