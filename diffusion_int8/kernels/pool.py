"""The block-sparse predictor's GPU kernels (``sparsity.predict_block_mask`` and ``int8_attention(...,
sparsity=...)``).

A block of ``SPARSE_BLOCK`` tokens is represented by two sums over its tokens: the tokens themselves (their mean,
once divided by the count) and their squared norms (how well that mean represents them: ``sparsity.block_similarity``).
The quantization launch adds them up as it quantizes Q and K (``quantize.quantize_qkv(..., pooled=...)``), so the
predictor inside the attention call reads neither again; ``block_sums`` makes them in a pass of its own for the
standalone predictor. A program whose tile holds part of a block adds its share atomically: at most two shares
reach a block, and two float additions onto zero give the same result in either order.

``predict``: from the sums to the mask (and the attention kernel's block lists) in two launches: the pooled
scores, tiled as a matrix product; then per query block a softmax, the kept set, the similarity guards and the
always-kept blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import FP_FUSION, SPARSE_BLOCK, padded_head_dim
from .launch import EAGER, Runner
from .layout import cdiv

_SPARSE_BLOCK = tl.constexpr(SPARSE_BLOCK)
_TINY = tl.constexpr(1e-30)


class Pooled(NamedTuple):
    """Per block of ``SPARSE_BLOCK`` tokens, sums over its tokens: of Q, qsum float32 (B·Hq, nQB, DP) and the tokens'
    squared norms qsq (B·Hq, nQB); of K less its smoothing mean (where it is smoothed), ksum channel-major
    (B·Hkv, DP, nKB), so that a tile of several blocks' channels is a plain tile for the score product, and ksq
    (B·Hkv, nKB). Padded tokens and channels add zeros."""

    qsum: torch.Tensor
    qsq: torch.Tensor
    ksum: torch.Tensor
    ksq: torch.Tensor


def pooled_buffers(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, dp: int, device, runner: Runner = EAGER) -> Pooled:
    """Zeroed ``Pooled`` buffers for the shares to be added to."""
    nqb, nkb = cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)
    shapes = (B * Hq, nqb, dp), (B * Hq, nqb), (B * Hkv, dp, nkb), (B * Hkv, nkb)
    return Pooled(*(runner.empty(s, torch.float32, device, zero=True) for s in shapes))


@triton.jit
def pool_tile(x, SUM, SQ, pid_bh, n_blocks, first, DP: tl.constexpr, CHANNELS_FIRST: tl.constexpr):
    """Add a float32 (tokens, DP) tile of (batch, head) ``pid_bh`` whose first token is ``first`` to its block's sums:
    the column sums and the squared norm (``Pooled``'s layouts; n_blocks blocks a head)."""
    row, blk = pid_bh.to(tl.int64), first // _SPARSE_BLOCK
    offs_d = tl.arange(0, DP)
    if CHANNELS_FIRST:
        ptrs = SUM + (row * DP + offs_d) * n_blocks + blk
    else:
        ptrs = SUM + (row * n_blocks + blk) * DP + offs_d
    tl.atomic_add(ptrs, tl.sum(x, axis=0), sem="relaxed")
    tl.atomic_add(SQ + row * n_blocks + blk, tl.sum(tl.sum(x * x, axis=1), axis=0), sem="relaxed")


@triton.jit
def store_block_list(keep, offs, CNT, IDX, row, NKB):
    """The attention kernel's form of one mask row (``attention.block_lists``): at ``row`` of CNT, how many key
    blocks ``keep`` (int32 0/1 over ``offs``) keeps; at ``row`` of IDX (NKB a row), which, ascending."""
    tl.store(IDX + row * NKB + tl.cumsum(keep, 0) - 1, offs, mask=keep != 0)
    tl.store(CNT + row, tl.sum(keep, 0))


@triton.jit
def _pool_kernel(X, SUM, SQ, stride_xb, stride_xh, stride_xs, stride_xd, H, S, D, NB,
                 DP: tl.constexpr, CHANNELS_FIRST: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_s * _SPARSE_BLOCK + tl.arange(0, _SPARSE_BLOCK)
    offs_d = tl.arange(0, DP)
    valid = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    ptrs = (X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
            + offs_s[:, None].to(tl.int64) * stride_xs + offs_d[None, :] * stride_xd)
    x = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
    pool_tile(x, SUM, SQ, pid_bh, NB, pid_s * _SPARSE_BLOCK, DP, CHANNELS_FIRST)


def block_sums(x: torch.Tensor, channels_first: bool = False):
    """x: (B, H, S, D), any strides and float dtype, on a GPU. Per block of ``SPARSE_BLOCK`` tokens (the last
    partial), the sum of the tokens, float32 (B, H, nB, DP) (DP: ``padded_head_dim(D)``), or (B, H, DP, nB) if
    ``channels_first``, and of their squared norms (B, H, nB): ``Pooled``'s layouts, zeros in the padded channels.
    One launch, no host synchronization."""
    B, H, S, D = x.shape
    nb, dp = cdiv(S, SPARSE_BLOCK), padded_head_dim(D)
    sums = torch.zeros((B, H, dp, nb) if channels_first else (B, H, nb, dp), dtype=torch.float32, device=x.device)
    sq = torch.zeros((B, H, nb), dtype=torch.float32, device=x.device)
    # 4 warps: at Wan's shape 0.056 ms a pass (1.8 TB/s) against 0.078 with 8 warps; tiles of fewer tokens, looped
    # over, were slower still (0.08-0.13 ms)
    _pool_kernel[(nb, B * H)](x, sums, sq, *x.stride(), H, S, D, nb, DP=dp, CHANNELS_FIRST=channels_first,
                              num_warps=4, enable_fp_fusion=FP_FUSION)
    return sums, sq


@triton.jit
def _similarity(sum_sq, norms_sq, count):
    """``sparsity.block_similarity`` from |a block's sum|², its tokens' squared norms summed and their count."""
    return tl.sqrt(sum_sq) / tl.maximum(tl.sqrt(count * norms_sq), _TINY)


@triton.jit
def _scores_kernel(QSUM, QSQ, KSUM, KSQ, LOGITS, SIM_Q, SIM_K, HQ, G, SQ, SK, NQB, NKB, scale,
                   DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DC: tl.constexpr):
    # One (BM query blocks, BN key blocks) tile of (batch, query head) program_id(2)'s pooled scores, an fp32 matrix
    # product over DC channels at a time, plus log(key count) (the softmax over a block's tokens weighs it by them);
    # the first tile of a row (column) writes its query (key) blocks' similarity too.
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_q = bh.to(tl.int64)
    row_kv = (bh // HQ * (HQ // G) + bh % HQ // G).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_c = tl.arange(0, DC)
    q_ok, k_ok = offs_m < NQB, offs_n < NKB
    acc = tl.zeros([BM, BN], tl.float32)
    q_norm = tl.zeros([BM], tl.float32)
    k_norm = tl.zeros([BN], tl.float32)
    q_ptrs = QSUM + (row_q * NQB + offs_m[:, None]) * DP + offs_c[None, :]  # (BM, DC) of (B·Hq, nQB, DP)
    k_ptrs = KSUM + row_kv * DP * NKB + offs_c[:, None] * NKB + offs_n[None, :]  # (DC, BN) of (B·Hkv, DP, nKB)
    for d in range(0, DP, DC):
        qs = tl.load(q_ptrs + d, mask=q_ok[:, None], other=0.0)
        ks = tl.load(k_ptrs + d * NKB, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(qs, ks, acc, input_precision="ieee")
        q_norm += tl.sum(qs * qs, 1)
        k_norm += tl.sum(ks * ks, 0)
    q_cnt = tl.where(q_ok, tl.minimum(SQ - offs_m * _SPARSE_BLOCK, _SPARSE_BLOCK), 1).to(tl.float32)
    k_cnt = tl.where(k_ok, tl.minimum(SK - offs_n * _SPARSE_BLOCK, _SPARSE_BLOCK), 1).to(tl.float32)
    x = acc * (scale / q_cnt)[:, None] * (1.0 / k_cnt)[None, :] + tl.log(k_cnt)[None, :]
    rows = row_q * NQB + offs_m
    tl.store(LOGITS + rows[:, None] * NKB + offs_n[None, :], x, mask=q_ok[:, None] & k_ok[None, :])
    if pid_n == 0:
        q_sq = tl.load(QSQ + rows, mask=q_ok, other=0.0)
        tl.store(SIM_Q + rows, _similarity(q_norm, q_sq, q_cnt), mask=q_ok)
    if pid_m == 0:
        # K's sums are of K less the vector it was smoothed with (its measured token mean, a static one, or none
        # with smooth_k=False); its similarity is of K less its own token mean, so the rest of that mean, delta
        # (the blocks' sums over Sk), is taken off here: sum - n·delta, and sq - 2·delta·sum + n·|delta|²
        k_dot = tl.zeros([BN], tl.float32)
        d_sq = tl.sum(tl.zeros([DC], tl.float32), 0)
        offs_b = tl.arange(0, BN)
        for d in range(0, DP, DC):
            delta = tl.zeros([DC], tl.float32)
            for n in range(0, NKB, BN):
                delta += tl.sum(tl.load(k_ptrs - pid_n * BN + d * NKB + n, mask=(n + offs_b < NKB)[None, :],
                                        other=0.0), 1)
            delta = delta / SK
            k_dot += tl.sum(tl.load(k_ptrs + d * NKB, mask=k_ok[None, :], other=0.0) * delta[:, None], 0)
            d_sq += tl.sum(delta * delta, 0)
        k_norm = tl.maximum(k_norm - 2.0 * k_cnt * k_dot + k_cnt * k_cnt * d_sq, 0.0)
        k_sq = tl.maximum(tl.load(KSQ + row_kv * NKB + offs_n, mask=k_ok, other=0.0) - 2.0 * k_dot + k_cnt * d_sq, 0.0)
        tl.store(SIM_K + row_q * NKB + offs_n, _similarity(k_norm, k_sq, k_cnt), mask=k_ok)


@triton.jit
def _select_kernel(LOGITS, SIM_Q, SIM_K, KEEP, stride_eb, stride_eh, stride_eq, stride_ek, MASK, CNT, IDX,
                   HQ, NQB, NKB, tau, min_sim,
                   NKB_P2: tl.constexpr, GUARD: tl.constexpr, HAS_KEEP: tl.constexpr, LISTS: tl.constexpr):
    # One query block: the softmax of its pooled scores, the smallest set of key blocks holding tau of it (and every
    # block as likely as that set's least), the guards and the always-kept blocks; the mask row, and the attention
    # kernel's block list.
    row = tl.program_id(0).to(tl.int64)  # (batch, query head, query block)
    bh = row // NQB
    offs = tl.arange(0, NKB_P2)
    valid = offs < NKB
    x = tl.load(LOGITS + row * NKB + offs, mask=valid, other=float("-inf"))
    e = tl.exp(x - tl.max(x, 0))
    p = e / tl.sum(e, 0)
    ordered = tl.sort(p, 0, descending=True)
    before = tl.cumsum(ordered, 0) - ordered
    smallest = tl.min(tl.where(before < tau, ordered, float("inf")), 0)
    # as int32 0/1 (the interpreter has no | of a scalar and a block of booleans)
    keep = ((p >= smallest) | (p != p)).to(tl.int32)  # NaN scores keep their blocks: NaN is never hidden
    if GUARD:
        keep = keep | (tl.load(SIM_Q + row) < min_sim).to(tl.int32)
        keep = keep | (tl.load(SIM_K + bh * NKB + offs, mask=valid, other=1.0) < min_sim).to(tl.int32)
    if HAS_KEEP:
        kp = (KEEP + (bh // HQ) * stride_eb + (bh % HQ) * stride_eh + (row % NQB) * stride_eq + offs * stride_ek)
        keep = keep | (tl.load(kp, mask=valid, other=0) != 0).to(tl.int32)
    keep = tl.where(valid, keep, 0)
    tl.store(MASK + row * NKB + offs, keep.to(tl.int8), mask=valid)
    if LISTS:
        store_block_list(keep, offs, CNT, IDX, row, NKB)


def predict(pooled: Pooled, B: int, Hq: int, Sq: int, Sk: int, sm_scale: float, tau: float,
            min_similarity: float | None, keep: torch.Tensor | None, mask: torch.Tensor, lists: bool = False,
            runner: Runner = EAGER):
    """The predictor's mask from pooled sums (``sparsity.predict_block_mask``'s, the same sums in another order),
    written into ``mask``: bool (B, Hq, nQB, nKB) contiguous.

    keep: bool broadcastable to (B, Hq, nQB, nKB), or None. ``lists``: also return the attention kernel's block
    lists of the mask (``attention.block_lists``'s (counts, indices)); else None. Two launches."""
    nqb, nkb = cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)
    dp, hkv = pooled.qsum.shape[2], pooled.ksum.shape[0] // B
    dev = mask.device
    logits = runner.empty((B * Hq * nqb, nkb), torch.float32, dev)
    sim_q = runner.empty((B * Hq * nqb,), torch.float32, dev)
    sim_k = runner.empty((B * Hq, nkb), torch.float32, dev)
    bm = bn = 64  # 64 x 64 tiles of 16 channels at a time: the fastest of 32-64 x 32-64 x 16-32, 4-8 warps (H100)
    runner.launch(_scores_kernel, (cdiv(nqb, bm), cdiv(nkb, bn), B * Hq), (
        pooled.qsum, pooled.qsq, pooled.ksum, pooled.ksq, logits, sim_q, sim_k, Hq, Hq // hkv, Sq, Sk, nqb, nkb,
        float(sm_scale), dp, bm, bn, 16,  # DP, BM, BN, DC
    ), dict(num_warps=4, enable_fp_fusion=FP_FUSION))
    counts = idx = None
    if lists:
        counts = runner.empty((B * Hq * nqb,), torch.int32, dev)
        idx = runner.empty((B * Hq * nqb, nkb), torch.int32, dev)
    guard, nkb_p2 = min_similarity is not None, triton.next_power_of_2(nkb)
    keep_arg = keep.expand(B, Hq, nqb, nkb).view(torch.uint8) if keep is not None else mask
    runner.launch(_select_kernel, (B * Hq * nqb,), (
        logits, sim_q, sim_k, keep_arg, *(keep_arg.stride() if keep is not None else (0, 0, 0, 0)),
        mask.view(torch.int8), mask if counts is None else counts, mask if idx is None else idx,
        Hq, nqb, nkb, float(tau), float(min_similarity) if guard else 0.0,
        nkb_p2, guard, keep is not None, lists,  # NKB_P2, GUARD, HAS_KEEP, LISTS
    ), dict(num_warps=1 if nkb_p2 <= 256 else 4, enable_fp_fusion=FP_FUSION))  # up to 256 sorted within a warp
    return (counts, idx) if lists else None


def predict_bhsd(qb: torch.Tensor, kb: torch.Tensor, tau: float, sm_scale: float, min_similarity: float | None,
                 keep: torch.Tensor | None) -> torch.Tensor:
    """``sparsity.predict_block_mask`` of (B, H, S, D) views on a GPU (its checks done): one pooling pass over Q and
    one over K (as it is: ``predict`` takes K's token mean off for the similarity), then ``predict``. Four
    launches."""
    B, Hq, Sq, _ = qb.shape
    Sk = kb.shape[2]
    mask = torch.empty((B, Hq, cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)), dtype=torch.bool, device=qb.device)
    qsum, qsq = block_sums(qb)
    ksum, ksq = block_sums(kb, channels_first=True)
    pooled = Pooled(*(t.flatten(0, 1) for t in (qsum, qsq, ksum, ksq)))
    predict(pooled, B, Hq, Sq, Sk, sm_scale, tau, min_similarity, keep, mask)
    return mask
