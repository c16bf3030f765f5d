"""The block-sparse predictor's GPU passes (``sparsity.predict_block_mask``).

``block_sums``: per block of ``SPARSE_BLOCK`` tokens of one (batch, head), the sum of the tokens (their mean, once
divided by the block's token count) and the sum of their unit vectors, after subtracting a per-(batch, head)
vector where one is given (K's token mean), in one read. In PyTorch the same takes a float32 copy of the tensor
and three more passes: at Wan's 32K tokens most of a millisecond.

``select_blocks``: from the pooled scores to the mask in one launch (softmax per query block, the kept set, the
similarity guards and the always-kept blocks), where PyTorch takes some fifteen.
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
    # 4 warps: at Wan's shape 0.056 ms a pass (1.8 TB/s) against 0.078 with 8 warps; tiles of fewer tokens, looped
    # over, were slower still (0.08-0.13 ms)
    _pool_kernel[(nb, B * H)](x, mu_arg, sums, units, *x.stride(), H, S, D, nb,
                              HAS_MU=mu is not None, BLOCK=SPARSE_BLOCK, DP=padded_head_dim(D), num_warps=4)
    return sums, units


@triton.jit
def _select_kernel(LOGITS, LOG_COUNT, SIM_Q, SIM_K, KEEP, stride_eb, stride_eh, stride_eq, stride_ek, MASK,
                   HQ, G, NQB, NKB, tau, min_sim,
                   GUARD: tl.constexpr, HAS_KEEP: tl.constexpr, NKB_P2: tl.constexpr):
    row = tl.program_id(0)  # (batch, query head, query block)
    bh = row // NQB
    b = bh // HQ
    h = bh % HQ
    offs = tl.arange(0, NKB_P2)
    valid = offs < NKB
    x = tl.load(LOGITS + row.to(tl.int64) * NKB + offs, mask=valid, other=float("-inf"))
    x = x + tl.load(LOG_COUNT + offs, mask=valid, other=0.0)
    e = tl.exp(x - tl.max(x, 0))
    p = e / tl.sum(e, 0)
    ordered = tl.sort(p, 0, descending=True)
    before = tl.cumsum(ordered, 0) - ordered
    smallest = tl.min(tl.where(before < tau, ordered, float("inf")), 0)
    # as int32 0/1 (the interpreter has no | of a scalar and a block of booleans)
    keep = ((p >= smallest) | (p != p)).to(tl.int32)  # NaN scores keep their blocks: NaN is never hidden
    if GUARD:
        keep = keep | (tl.load(SIM_Q + row) < min_sim).to(tl.int32)
        keep = keep | (tl.load(SIM_K + (b * (HQ // G) + h // G) * NKB + offs, mask=valid, other=1.0) < min_sim).to(tl.int32)
    if HAS_KEEP:
        kp = (KEEP + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh
              + (row % NQB).to(tl.int64) * stride_eq + offs * stride_ek)
        keep = keep | (tl.load(kp, mask=valid, other=0) != 0).to(tl.int32)
    tl.store(MASK + row.to(tl.int64) * NKB + offs, keep.to(tl.int8), mask=valid)


def select_blocks(logits: torch.Tensor, log_count: torch.Tensor, tau: float, sim_q: torch.Tensor | None,
                  sim_k: torch.Tensor | None, min_similarity: float | None,
                  keep: torch.Tensor | None) -> torch.Tensor:
    """The predictor's mask from pooled scores: ``sparsity.select_blocks_torch`` in one launch.

    logits: float32 (B, Hq, nQB, nKB) contiguous, scaled pooled scores; log_count: float32 (nKB,), added to them;
    sim_q (B, Hq, nQB) and sim_k (B, Hkv, nKB) float32, contiguous, the blocks' self-similarity (None with
    ``min_similarity`` None); keep: bool broadcastable to (B, Hq, nQB, nKB) or None. Returns bool (B, Hq, nQB, nKB).
    """
    B, Hq, nqb, nkb = logits.shape
    mask = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
    guard = min_similarity is not None
    g = Hq // sim_k.shape[1] if guard else 1
    keep_arg = logits if keep is None else keep.expand(B, Hq, nqb, nkb).view(torch.uint8)
    _select_kernel[(B * Hq * nqb,)](
        logits, log_count, sim_q if guard else logits, sim_k if guard else logits, keep_arg,
        *(keep_arg.stride() if keep is not None else (0, 0, 0, 0)), mask.view(torch.int8),
        Hq, g, nqb, nkb, float(tau), float(min_similarity) if guard else 0.0,
        GUARD=guard, HAS_KEEP=keep is not None, NKB_P2=triton.next_power_of_2(nkb))
    return mask
