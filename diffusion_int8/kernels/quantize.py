"""Triton kernels that quantize Q, K and V for the attention kernel.

They produce bit for bit what ``reference.quantize_q/k/v`` produce (see that module for the
numerics); FP8 V in 128-key tiles stores each tile's keys in ``layout.v8_key_order``,
the order the attention kernels multiply P's columns in. Inputs are read through their strides, so
(B, S, H, D) views need no copy; outputs are contiguous, padded to ``SEQ_PAD`` tokens and a power-of-two
head dim, so the attention kernel loads whole tiles without masks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import (
    AMAX_FLOOR, BALANCE_DEAD_BAND, BALANCE_MAX_LOG2, FP8_MAX, FP_FUSION, INT8_MAX, PV, SPARSE_BLOCK, padded_head_dim,
    tile_config,
)
from .launch import EAGER, Runner
from .layout import MAX_CHUNKS, Q_SAMPLE_EVERY, balance_applies, check_rotation, chunking, padded_len, stats_block
from .pool import Pooled, pool_tile
from .reference import hadamard, q_scale_mult
from .tl_helpers import keys_to_v8_order, rdiv, round_to_int8, v8_keys_permuted

_ROW_BLOCK = 64  # Q's tokens per block of the quantization launch (one scale per token)
# Compiled kernels may only read globals that are constexpr.
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_INT8_MAX = tl.constexpr(INT8_MAX)
_FP8_MAX = tl.constexpr(FP8_MAX)
_SPARSE_BLOCK = tl.constexpr(SPARSE_BLOCK)
_BALANCE_MAX_LOG2 = tl.constexpr(BALANCE_MAX_LOG2)
_BALANCE_DEAD_BAND = tl.constexpr(BALANCE_DEAD_BAND)
# Both sequences at most this long (queries counted over the query heads of a K/V head): one program per
# K/V head measures and quantizes (``_quant_fused_kernel``), one launch instead of two. Where a call's host
# time is what the GPU waits for; at 1,024 tokens the programs' serial work cost more GPU time than the launch
# saved (the H100's crossover table, DiT's shape: 0.53x SDPA at two launches, 0.36x at one)
_FUSED_MAX_TOKENS = 256


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
def _per_group(x, GROUPS: tl.constexpr, reduce: tl.constexpr):
    """Reduce per-token values (tokens,) over each K group of the tile (token j in group (j mod 8) div
    (8 / GROUPS): ``config.TileConfig``) and give every token its group's result."""
    n: tl.constexpr = x.shape[0]
    x3 = tl.reshape(x, [n // 8, GROUPS, 8 // GROUPS])
    if reduce == "sum":
        g = tl.sum(tl.sum(x3, axis=2), axis=0)
    else:
        g = tl.max(tl.max(x3, axis=2), axis=0)
    return tl.reshape(tl.broadcast_to(g[None, :, None], [n // 8, GROUPS, 8 // GROUPS]), [n])


@triton.jit
def _max_nan(a, b):
    """max that keeps a NaN (the GPU's max drops it), to reduce with."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _hadamard(x, HAD, DP: tl.constexpr):
    """``reference.hadamard`` of a float32 (rows, DP) tile; HAD: the (DP, DP) int8 ±1 matrix (``_hadamard_int8``).

    Each row on its grid ``g = hi·256 + lo`` (|g| <= 2^14, so hi and lo are int8), and ``g·H`` as two INT8 MMAs:
    exact in int32, so the tensor cores' order of sums does not matter. A butterfly network in registers would be
    as exact, but Triton moves the data of every stage through shared memory. Written for few instructions, which
    paid down to this form (docs/DESIGN.md): H read (from L2) rather than built from parity bits, which cost more
    than the rest of the rotation; no clamp on the grid (it cannot overflow); a NaN/Inf row caught by the max the
    shift needs anyway, and poisoned through the row's scale."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)  # NaN or Inf iff the row holds one
    poison = tl.where(amax < float("inf"), 0.0, float("nan"))
    shift = tl.minimum(127 + 140 - _exponent(amax), 127 + 126)
    g = (x * _pow2(shift)[:, None] + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # round half to even
    hi = (g + 128) >> 8
    offs = tl.arange(0, DP)
    h = tl.load(HAD + offs[None, :] * DP + offs[:, None])  # H is symmetric: loaded K-major, as the MMA reads it
    acc = tl.dot(hi.to(tl.int8), h, out_dtype=tl.int32) * 256
    acc = tl.dot((g - hi * 256).to(tl.int8), h, acc=acc, out_dtype=tl.int32)
    return acc.to(tl.float32) * (_pow2(2 * 127 - shift) + poison)[:, None]


@triton.jit
def _pow2(biased):
    """2^(biased - 127) as float32, for int32 exponents in [1, 254]."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _static_range(amax):
    """``reference.static_range``: a given range where finite and positive, NaN elsewhere."""
    return tl.where((amax > 0.0) & (amax < float("inf")), amax, float("nan"))


@triton.jit
def _quant_int8(x, AMAX, GROUPS: tl.constexpr, STATIC: tl.constexpr):
    """Symmetric INT8 of a float32 (tokens, DP) tile: one range per token (GROUPS = 0, Q) or per K group
    of the tile (GROUPS = 1 or 4), measured or read from the scalar at ``AMAX`` (STATIC). Returns the
    int8 tile and each token's ``amax / 127``; a NaN/Inf in a token makes its token's (group's) scale NaN."""
    poison = tl.sum(x * 0.0, axis=1)  # NaN iff the token holds a NaN/Inf (GPU max drops NaN)
    amax = tl.max(tl.abs(x), axis=1)
    if GROUPS != 0:
        poison = _per_group(poison, GROUPS, "sum")
        amax = _per_group(amax, GROUPS, "max")
    if STATIC:
        amax = _static_range(tl.load(AMAX)) + poison * 0.0
    # the GPU's max drops a NaN operand: adding amax·0 keeps a NaN (invalid static) range
    amax = tl.maximum(amax, _AMAX_FLOOR) + amax * 0.0 + poison
    y = tl.minimum(tl.maximum(x * rdiv(_INT8_MAX, amax)[:, None], -_INT8_MAX), _INT8_MAX)
    return round_to_int8(y), tl.math.div_rn(amax, amax * 0.0 + _INT8_MAX)


@triton.jit
def _quant_qkv_kernel(
    Q, QAMAX, Q8, QS, K, KMEAN, KAMAX, K8, KS, V, VRANGE, VAMAX, V8, VS, BAL, HAD, QSUM, QSQ, KSUM, KSQ, OFF,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qab, stride_qah, stride_kab, stride_kah, stride_vab, stride_vah, stride_vad,
    stride_kmb, stride_kmh, stride_kmd, stride_bb, stride_bh, stride_bd,
    H, H_KV, SQ, SK, D, SQ_PAD, SK_PAD, NQ, scale_mult, off_scale,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, K_GROUPS: tl.constexpr, DP: tl.constexpr,
    SMOOTH: tl.constexpr, Q_STATIC: tl.constexpr, K_STATIC: tl.constexpr, V_FMT: tl.constexpr,
    V_STATIC: tl.constexpr, BALANCE: tl.constexpr, ROTATE: tl.constexpr, Q_TILES: tl.constexpr, POOL: tl.constexpr,
    OFFSET: tl.constexpr,
):
    # One launch for Q, K and V: programs [0, NQ) take Q_TILES blocks of Q_BLOCK tokens of Q, the rest one K tile
    # of K_BLOCK tokens (K_GROUPS scales) and the same tokens of V. POOL: each block's sums for the block-sparse
    # predictor too (``pool.Pooled``), of Q as loaded and of K as smoothed. OFFSET: each query row's smoothing offset
    # too (``reference.smoothing_offset``), from K's mean in KMEAN. (K and V in separate programs, with fewer
    # registers each, were 4-8% slower at 8-bit V: the launch is memory-bound, and a program with both tiles keeps
    # more loads in flight.)
    pid = tl.program_id(0)
    if pid < NQ:
        n_s = SQ_PAD // (Q_BLOCK * Q_TILES)
        for t in range(0, Q_TILES):
            _quant_q_block(
                Q, QAMAX, Q8, QS, BAL, HAD, QSUM, QSQ, KMEAN, OFF, stride_qb, stride_qh, stride_qs, stride_qd,
                stride_qab, stride_qah, stride_bb, stride_bh, stride_bd, stride_kmb, stride_kmh, stride_kmd,
                pid % n_s * Q_TILES + t, pid // n_s, H, H_KV, SQ, D, SQ_PAD, scale_mult, off_scale, Q_BLOCK, DP,
                Q_STATIC, BALANCE, ROTATE, POOL, OFFSET,
            )
    else:
        n_s = SK_PAD // K_BLOCK
        pid_s, pid_bh = (pid - NQ) % n_s, (pid - NQ) // n_s
        _quant_k_tile(
            K, KMEAN, KAMAX, K8, KS, BAL, HAD, KSUM, KSQ, stride_kb, stride_kh, stride_ks, stride_kd, stride_kab,
            stride_kah, stride_kmb, stride_kmh, stride_kmd, stride_bb, stride_bh, stride_bd, pid_s, pid_bh,
            H_KV, SK, D, SK_PAD, K_BLOCK, K_GROUPS, DP, SMOOTH, K_STATIC, BALANCE, ROTATE, POOL,
        )
        if V_FMT != 0:
            _quant_v_tile(
                V, VRANGE, VAMAX, V8, VS, stride_vb, stride_vh, stride_vs, stride_vd, stride_vab, stride_vah, stride_vad,
                pid_s, pid_bh, H_KV, SK, D, SK_PAD, K_BLOCK, DP, V_FMT, V_STATIC,
            )


@triton.jit
def _load_balance(BAL, stride_bb, stride_bh, stride_bd, b, h_kv, D, DP: tl.constexpr):
    """The Q·Kᵀ balance of K/V head (b, h_kv), (DP,) float32: measured (``kv_moments``) or given, read through
    its strides; 1 in the padded channels."""
    offs_d = tl.arange(0, DP)
    return tl.load(BAL + b * stride_bb + h_kv * stride_bh + offs_d * stride_bd, mask=offs_d < D, other=1.0)


@triton.jit
def _quant_q_block(
    Q, QAMAX, Q8, QS, BAL, HAD, QSUM, QSQ, KMEAN, OFF, stride_qb, stride_qh, stride_qs, stride_qd, stride_qab,
    stride_qah, stride_bb, stride_bh, stride_bd, stride_kmb, stride_kmh, stride_kmd, pid_s, pid_bh, H, H_KV, SQ, D,
    SQ_PAD, scale_mult, off_scale, BLOCK: tl.constexpr, DP: tl.constexpr, STATIC: tl.constexpr,
    BALANCE: tl.constexpr, ROTATE: tl.constexpr, POOL: tl.constexpr, OFFSET: tl.constexpr,
):
    x, offs_s, offs_d, _ = _load_tile(Q, stride_qb, stride_qh, stride_qs, stride_qd, pid_s, pid_bh, H, SQ, D, BLOCK, DP)
    if OFFSET:  # off_scale · q·mean per row (OFF: (B·H, SQ)), of Q as given: balance and rotation leave q·k alone
        mean = tl.load(KMEAN + (pid_bh // H) * stride_kmb + (pid_bh % H // (H // H_KV)) * stride_kmh
                       + offs_d * stride_kmd, mask=offs_d < D, other=0.0)
        tl.store(OFF + pid_bh * SQ + offs_s, tl.sum(x * mean[None, :], 1) * off_scale, mask=offs_s < SQ)
    if POOL:
        pool_tile(x, QSUM, QSQ, pid_bh, SQ_PAD // _SPARSE_BLOCK, pid_s * BLOCK, DP, False)
    if BALANCE:  # Q's channels divided by the (power-of-two) balance of their K/V head's channels: exact
        bal = _load_balance(BAL, stride_bb, stride_bh, stride_bd, pid_bh // H, pid_bh % H // (H // H_KV), D, DP)
        x = x * rdiv(1.0, bal)[None, :]
    if ROTATE:
        x = _hadamard(x, HAD, DP)
    q8, qs = _quant_int8(x, QAMAX + (pid_bh // H) * stride_qab + (pid_bh % H) * stride_qah, 0, STATIC)
    tl.store(Q8 + pid_bh.to(tl.int64) * SQ_PAD * DP + offs_s[:, None] * DP + offs_d[None, :], q8)
    tl.store(QS + pid_bh * SQ_PAD + offs_s, qs * scale_mult)


@triton.jit
def _quant_k_tile(
    K, KMEAN, KAMAX, K8, KS, BAL, HAD, KSUM, KSQ, stride_kb, stride_kh, stride_ks, stride_kd, stride_kab, stride_kah,
    stride_kmb, stride_kmh, stride_kmd, stride_bb, stride_bh, stride_bd, pid_s, pid_bh, H, S, D, S_PAD,
    BLOCK: tl.constexpr, GROUPS: tl.constexpr, DP: tl.constexpr, SMOOTH: tl.constexpr, STATIC: tl.constexpr,
    BALANCE: tl.constexpr, ROTATE: tl.constexpr, POOL: tl.constexpr,
):
    # One K tile, less K's mean (measured by the statistics pass or static, read through strides), times K's
    # channel balance (BALANCE), rotated (ROTATE), in GROUPS scales.
    b, h = pid_bh // H, pid_bh % H
    x, offs_s, offs_d, _ = _load_tile(K, stride_kb, stride_kh, stride_ks, stride_kd, pid_s, pid_bh, H, S, D, BLOCK, DP)
    if SMOOTH:  # padded channels stay 0 (mean 0 there); a row mask, as a (BLOCK, DP) one holds more registers
        mean = tl.load(KMEAN + b * stride_kmb + h * stride_kmh + offs_d * stride_kmd, mask=offs_d < D, other=0.0)
        x = tl.where(offs_s[:, None] < S, x - mean[None, :], 0.0)
    if POOL:
        pool_tile(x, KSUM, KSQ, pid_bh, S_PAD // _SPARSE_BLOCK, pid_s * BLOCK, DP, True)
    if BALANCE:
        x = x * _load_balance(BAL, stride_bb, stride_bh, stride_bd, b, h, D, DP)[None, :]
    if ROTATE:
        x = _hadamard(x, HAD, DP)
    k8, ks = _quant_int8(x, KAMAX + b * stride_kab + h * stride_kah, GROUPS, STATIC)
    tl.store(K8 + pid_bh.to(tl.int64) * S_PAD * DP + offs_s[:, None] * DP + offs_d[None, :], k8)
    tl.store(KS + pid_bh * S_PAD + offs_s, ks)


@triton.jit
def _quant_v_tile(
    V, VRANGE, VAMAX, V8, VS, stride_vb, stride_vh, stride_vs, stride_vd, stride_vab, stride_vah, stride_vad,
    pid_s, pid_bh, H, S, D, S_PAD, BLOCK: tl.constexpr, DP: tl.constexpr, V_FMT: tl.constexpr,
    V_STATIC: tl.constexpr,
):
    # One tile of V (V_FMT: 1 FP8, 2 INT8) in per-channel scales: V's range from the statistics pass (read
    # from VAMAX instead if V_STATIC), as reference.v_channel_amax gives it: floored, NaN where non-finite,
    # padded with 1.
    b, h = pid_bh // H, pid_bh % H
    offs_d = tl.arange(0, DP)
    if V_STATIC:
        amax = _static_range(tl.load(VAMAX + b * stride_vab + h * stride_vah + offs_d * stride_vad,
                                     mask=offs_d < D, other=1.0))
    else:
        amax = tl.load(VRANGE + pid_bh * DP + offs_d)
    amax = tl.where(offs_d < D, tl.maximum(amax, _AMAX_FLOOR) + amax * 0.0, 1.0)
    v, offs_s, _, _ = _load_tile(V, stride_vb, stride_vh, stride_vs, stride_vd, pid_s, pid_bh, H, S, D, BLOCK, DP)
    base = pid_bh.to(tl.int64) * S_PAD * DP
    if V_FMT == 1:
        inv = rdiv(_FP8_MAX, amax)
        y = tl.minimum(tl.maximum(v * inv[None, :], -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)
        if v8_keys_permuted(DP, BLOCK):
            y = keys_to_v8_order(y, DP)
        # stored transposed, (DP, S_PAD): the FP8 MMA wants V K-major
        tl.store(V8 + base + offs_d[:, None] * S_PAD + offs_s[None, :], tl.trans(y))
        qmax = _FP8_MAX
    else:
        inv = rdiv(_INT8_MAX, amax)
        y = tl.minimum(tl.maximum(v * inv[None, :], -_INT8_MAX), _INT8_MAX)
        tl.store(V8 + base + offs_s[:, None] * DP + offs_d[None, :], round_to_int8(y))
        qmax = _INT8_MAX
    if pid_s == 0:
        tl.store(VS + pid_bh * DP + offs_d, tl.math.div_rn(amax, amax * 0.0 + qmax))


# The statistics pass. Per (batch, K/V head), in chunks of tokens: K's column sums (and, to balance Q·Kᵀ,
# K's column max and min), V's column |max|, and Q's column |max| over the query heads sharing the K/V head.
# Partials are kept per chunk and folded in a fixed order (``_sum_rows``) by one finishing step (``_finish_stats``),
# so the results do not depend on how many programs ran the chunks. Slots of the partials buffer:
_KSUM, _KMAX, _KMIN, _VMAX, _QMAX = (tl.constexpr(i) for i in range(5))
_N_SLOTS = 5
_MAX_CHUNKS_C = tl.constexpr(MAX_CHUNKS)
_Q_SAMPLE_EVERY = tl.constexpr(Q_SAMPLE_EVERY)


@triton.jit
def _stats_chunk(
    Q, K, V, PART, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, cls, pid_c, pid_bh, H_KV, G, SQ, SK, D, N_CHUNKS, chunk, chunk_q,
    slot, BLOCK: tl.constexpr, DP: tl.constexpr, BALANCE: tl.constexpr,
):
    # Chunk pid_c of class cls (0: K, 1: V, 2: Q) of K/V head pid_bh, into PART[slot, pid_bh, pid_c]. fp32,
    # kept per element and reduced across rows once at the end rather than per tile. V's |max| is NaN where
    # a NaN/Inf was seen (the GPU's max drops NaN, so a sum of x·0 carries it); the max/min of K and Q drop
    # NaNs explicitly (NaN rows come out NaN through the quantization scales anyway), so every backend agrees.
    offs_d = tl.arange(0, DP)
    out = PART + (pid_bh * N_CHUNKS + pid_c) * DP + offs_d
    if cls == 0:
        first = pid_c * (chunk // BLOCK)
        ksum = tl.zeros([BLOCK, DP], tl.float32)
        kmax = tl.full([BLOCK, DP], float("-inf"), tl.float32)
        kmin = tl.full([BLOCK, DP], float("inf"), tl.float32)
        for i in range(0, chunk // BLOCK):
            k, _, _, valid = _load_tile(K, stride_kb, stride_kh, stride_ks, stride_kd, first + i, pid_bh, H_KV, SK, D,
                                        BLOCK, DP)
            ksum += k
            if BALANCE:
                keep = valid & (k == k)
                kmax = tl.maximum(kmax, tl.where(keep, k, float("-inf")))
                kmin = tl.minimum(kmin, tl.where(keep, k, float("inf")))
        tl.store(out + _KSUM * slot, _sum_rows(ksum, BLOCK, DP))
        if BALANCE:
            tl.store(out + _KMAX * slot, tl.max(kmax, axis=0))
            tl.store(out + _KMIN * slot, tl.min(kmin, axis=0))
    elif cls == 1:
        first = pid_c * (chunk // BLOCK)
        vmax = tl.zeros([BLOCK, DP], tl.float32)
        vpoison = tl.zeros([BLOCK, DP], tl.float32)
        for i in range(0, chunk // BLOCK):
            v, _, _, _ = _load_tile(V, stride_vb, stride_vh, stride_vs, stride_vd, first + i, pid_bh, H_KV, SK, D,
                                    BLOCK, DP)
            vmax = tl.maximum(vmax, tl.abs(v))
            vpoison += v * 0.0
        tl.store(out + _VMAX * slot, tl.max(vmax, axis=0) + tl.sum(vpoison, axis=0))
    else:
        # Q's channel |max| over one tile in Q_SAMPLE_EVERY (chunk_q is a multiple of that many tiles): the
        # balance only needs to find Q's large channels, which are large in every token, not the exact range
        first = pid_c * (chunk_q // BLOCK)
        qmax = tl.zeros([BLOCK, DP], tl.float32)
        b = pid_bh // H_KV
        for g in range(0, G):
            qh = b * H_KV * G + pid_bh % H_KV * G + g
            for i in range(0, chunk_q // BLOCK, _Q_SAMPLE_EVERY):
                x, _, _, _ = _load_tile(Q, stride_qb, stride_qh, stride_qs, stride_qd, first + i, qh, H_KV * G, SQ, D,
                                        BLOCK, DP)
                a = tl.abs(x)
                qmax = tl.maximum(qmax, tl.where(a == a, a, 0.0))
        tl.store(out + _QMAX * slot, tl.max(qmax, axis=0))


@triton.jit
def _sum_rows(x, ROWS: tl.constexpr, DP: tl.constexpr):
    """Column sums of a float32 (ROWS, DP) tile, ROWS a power of two, in a fixed order: adjacent rows in pairs,
    then pairs of those sums, and so on (``reference.token_mean``). tl.sum's order follows the tile's layout,
    which the compiler picks per kernel, so the one-launch and two-launch paths could differ in the last bit."""
    x = tl.trans(x)
    for i in tl.static_range(8):
        if (ROWS >> i) > 1:
            a, b = tl.split(tl.reshape(x, [DP, (ROWS >> i) // 2, 2]))
            x = a + b
    return tl.reshape(x, [DP])


@triton.jit
def _fold(PART, pid_bh, N_CHUNKS, DP: tl.constexpr, how: tl.constexpr, init: tl.constexpr):
    """The chunk partials of one (batch, head) folded: their sum, max or min. All chunks are loaded at once
    (at most ``layout.MAX_CHUNKS``): the finishing program is the pass's tail, and a loop of dependent loads per
    chunk would lengthen it by a memory latency each."""
    offs_c = tl.arange(0, _MAX_CHUNKS_C)
    offs_d = tl.arange(0, DP)
    parts = tl.load(PART + (pid_bh * N_CHUNKS + offs_c[:, None]) * DP + offs_d[None, :],
                    mask=offs_c[:, None] < N_CHUNKS, other=init, cache_modifier=".cg")
    if how == "sum":
        return _sum_rows(parts, _MAX_CHUNKS_C, DP)
    elif how == "max":
        return tl.max(parts, axis=0)
    else:
        return tl.min(parts, axis=0)


@triton.jit
def _exponent(x):
    """The biased binary exponent of float32 ``x`` >= 0 (0 for zero and subnormals, 255 for Inf/NaN)."""
    return (x.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _finish_stats(PART, MOM, pid_bh, SK, N_CHUNKS, slot, mom_slot, DP: tl.constexpr, HAS_K: tl.constexpr,
                  HAS_V: tl.constexpr, SMOOTH: tl.constexpr, BALANCE: tl.constexpr):
    # From the partials of (batch, head) pid_bh: K's token mean (MOM[0]: chunks folded in pairs, one rounded
    # division), V's per-channel |max| (MOM[1]: NaN where any chunk's is) and the Q·Kᵀ balance (MOM[2],
    # ``reference.balance_scales``).
    offs_d = tl.arange(0, DP)
    out = MOM + pid_bh * DP + offs_d
    if HAS_K:
        ksum = _fold(PART + _KSUM * slot, pid_bh, N_CHUNKS, DP, "sum", 0.0)
        mean = tl.math.div_rn(ksum, ksum * 0.0 + SK)
        tl.store(out, mean)
        if BALANCE:
            kmax = _fold(PART + _KMAX * slot, pid_bh, N_CHUNKS, DP, "max", float("-inf"))
            kmin = _fold(PART + _KMIN * slot, pid_bh, N_CHUNKS, DP, "min", float("inf"))
            if not SMOOTH:
                mean = tl.zeros([DP], tl.float32)
            k_range = tl.maximum(kmax - mean, mean - kmin)
            q_range = _fold(PART + _QMAX * slot, pid_bh, N_CHUNKS, DP, "max", 0.0)
            e_q, e_k = _exponent(q_range), _exponent(k_range)
            e = tl.minimum(tl.maximum((e_q - e_k) >> 1, -_BALANCE_MAX_LOG2), _BALANCE_MAX_LOG2)
            e = tl.where((e_q == 0) | (e_k == 0) | (tl.abs(e_q - e_k) <= _BALANCE_DEAD_BAND), 0, e)
            tl.store(out + 2 * mom_slot, ((127 + e) << 23).to(tl.float32, bitcast=True))
    if HAS_V:
        vmax = _fold(PART + _VMAX * slot, pid_bh, N_CHUNKS, DP, "max", 0.0)
        poison = _fold(PART + _VMAX * slot, pid_bh, N_CHUNKS, DP, "sum", 0.0) * 0.0
        tl.store(out + mom_slot, vmax + poison)


@triton.jit
def _stats_kernel(
    Q, K, V, PART, DONE, MOM,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H_KV, G, SQ, SK, D, N_CHUNKS, chunk, chunk_q, slot, mom_slot,
    BLOCK: tl.constexpr, DP: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr, SMOOTH: tl.constexpr,
    BALANCE: tl.constexpr,
):
    # One (class, chunk) of K/V head program_id(1): classes K (if HAS_K), V (if HAS_V), Q (if BALANCE), in
    # that order, N_CHUNKS programs each; K, V and Q in separate programs hold fewer registers. The program
    # that finishes its head last folds every chunk's partials, so the quantization programs read finished
    # vectors instead of folding them each.
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_k: tl.constexpr = 1 if HAS_K else 0
    n_v: tl.constexpr = 1 if HAS_V else 0
    n_q: tl.constexpr = 1 if BALANCE else 0
    order = pid // N_CHUNKS  # position among the classes present
    cls = tl.where(order < n_k, 0, tl.where(order < n_k + n_v, 1, 2))
    _stats_chunk(Q, K, V, PART, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks,
                 stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, cls, pid % N_CHUNKS, pid_bh, H_KV, G, SQ, SK, D,
                 N_CHUNKS, chunk, chunk_q, slot, BLOCK, DP, BALANCE)
    # The barrier orders every thread's stores before the counter's acq_rel increment, whose acquire
    # side orders the finisher's loads after all the others' stores.
    tl.debug_barrier()
    if tl.atomic_add(DONE + pid_bh, 1) == N_CHUNKS * (n_k + n_v + n_q) - 1:
        _finish_stats(PART, MOM, pid_bh, SK, N_CHUNKS, slot, mom_slot, DP, HAS_K, HAS_V, SMOOTH, BALANCE)


@triton.jit
def _quant_fused_kernel(
    Q, Q8, QS, K, K8, KS, V, V8, VS, PART, MOM, HAD, DUMMY, OFF,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H_KV, G, SQ, SK, D, SQ_PAD, SK_PAD, N_CHUNKS, chunk, chunk_q, slot, mom_slot, scale_mult, off_scale,
    BLOCK: tl.constexpr, Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, K_GROUPS: tl.constexpr, DP: tl.constexpr,
    HAS_K: tl.constexpr, SMOOTH: tl.constexpr, V_FMT: tl.constexpr, BALANCE: tl.constexpr, ROTATE: tl.constexpr,
    OFFSET: tl.constexpr,
):
    # Short sequences: one program per K/V head measures the statistics (the statistics pass's chunks, one
    # after another, and its finishing step: the same results bit for bit), then quantizes the head's K, V
    # and query heads. One launch instead of two, and no counters to clear.
    pid_bh = tl.program_id(0)
    HAS_V: tl.constexpr = V_FMT != 0
    for c in range(0, N_CHUNKS):
        for cls in tl.static_range(3):  # K, V, Q: the classes the statistics pass runs as separate programs
            if (cls == 0 and HAS_K) or (cls == 1 and HAS_V) or (cls == 2 and BALANCE):
                _stats_chunk(Q, K, V, PART, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh,
                             stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, cls, c, pid_bh, H_KV,
                             G, SQ, SK, D, N_CHUNKS, chunk, chunk_q, slot, BLOCK, DP, BALANCE)
    tl.debug_barrier()  # the partials, stored by every thread of the program, before the fold reads them
    _finish_stats(PART, MOM, pid_bh, SK, N_CHUNKS, slot, mom_slot, DP, HAS_K, HAS_V, SMOOTH, BALANCE)
    tl.debug_barrier()
    for t in range(0, SK_PAD // K_BLOCK):
        _quant_k_tile(
            K, MOM, DUMMY, K8, KS, MOM + 2 * mom_slot, HAD, DUMMY, DUMMY, stride_kb, stride_kh, stride_ks, stride_kd, 0,
            0, H_KV * DP, DP, 1, H_KV * DP, DP, 1, t, pid_bh, H_KV, SK, D, SK_PAD, K_BLOCK, K_GROUPS, DP, SMOOTH,
            False, BALANCE, ROTATE, False,
        )
        if V_FMT != 0:
            _quant_v_tile(
                V, MOM + mom_slot, DUMMY, V8, VS, stride_vb, stride_vh, stride_vs, stride_vd, 0, 0, 0,
                t, pid_bh, H_KV, SK, D, SK_PAD, K_BLOCK, DP, V_FMT, False,
            )
    for g in range(0, G):
        qh = pid_bh // H_KV * H_KV * G + pid_bh % H_KV * G + g
        for t in range(0, SQ_PAD // Q_BLOCK):
            _quant_q_block(
                Q, DUMMY, Q8, QS, MOM + 2 * mom_slot, HAD, DUMMY, DUMMY, MOM, OFF, stride_qb, stride_qh, stride_qs,
                stride_qd, 0, 0, H_KV * DP, DP, 1, H_KV * DP, DP, 1, t, qh, H_KV * G, H_KV, SQ, D, SQ_PAD, scale_mult,
                off_scale, Q_BLOCK, DP, False, BALANCE, ROTATE, False, OFFSET,
            )


def _chunking(Sq: int, Sk: int, block: int) -> tuple[int, int, int]:
    """The statistics pass's chunks: (chunk of keys, chunk of queries, number of chunks); ``layout.chunking``,
    and as many chunks of queries, each a whole number of sampled tiles."""
    chunk, n_chunks = chunking(Sk)
    chunk_q = triton.cdiv(triton.cdiv(Sq, n_chunks), block * Q_SAMPLE_EVERY) * block * Q_SAMPLE_EVERY
    return chunk, chunk_q, n_chunks


def kv_moments(k: torch.Tensor | None, v: torch.Tensor | None, runner: Runner = EAGER, *,
               q: torch.Tensor | None = None, smooth_k: bool = True):
    """One statistics pass over K and/or V (either may be None, not both): K's token mean and V's per-channel
    |max|, (B, H, DP) float32 each, padded channels 0 (None for an input not given; NaN in a channel holding a
    NaN/Inf); with ``q`` (B, H * G, Sq, D) also Q·Kᵀ's channel balance (``reference.balance_scales``, of K's
    channels less their mean if ``smooth_k``; needs ``k``), else None. ``quantize_qkv`` reads all three.
    """
    x = k if k is not None else v
    B, H, S, D = x.shape
    dp = padded_head_dim(D)
    block = stats_block(dp)
    Sq, G = (q.shape[2], q.shape[1] // H) if q is not None else (0, 1)
    chunk, chunk_q, n_chunks = _chunking(Sq, S, block)
    n = (k is not None) + (v is not None) + (q is not None)
    partials = runner.empty((_N_SLOTS, B, H, n_chunks, dp), torch.float32, x.device)
    moments = runner.empty((3, B, H, dp), torch.float32, x.device)
    done = runner.empty((B * H,), torch.int32, x.device, zero=True)  # chunks finished per (batch, head)
    kk, vv, qq = (x if t is None else t for t in (k, v, q))
    runner.launch(_stats_kernel, (n_chunks * n, B * H), (
        qq, kk, vv, partials, done, moments, *qq.stride(), *kk.stride(), *vv.stride(),
        H, G, Sq, S, D, n_chunks, chunk, chunk_q, partials[0].numel(), moments[0].numel(),
        block, dp, k is not None, v is not None, smooth_k, q is not None,
    ), dict(enable_fp_fusion=FP_FUSION))
    return tuple(None if t is None else m for t, m in ((k, moments[0]), (v, moments[1]), (q, moments[2])))


class Quantized(NamedTuple):
    """``quantize_qkv``'s outputs, what the attention launch reads (shapes there)."""

    q8: torch.Tensor
    qs: torch.Tensor
    k8: torch.Tensor
    ks: torch.Tensor
    v8: torch.Tensor | None
    vs: torch.Tensor | None


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    pv: PV,
    *,
    k_tile: tuple[int, int] | None = None,
    smooth_k: bool = True,
    qk_balance: bool | torch.Tensor = False,
    qk_rotate: bool = False,
    q_amax: torch.Tensor | None = None,
    k_amax: torch.Tensor | None = None,
    v_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    pooled: Pooled | None = None,
    offset: torch.Tensor | None = None,
    runner: Runner = EAGER,
):
    """Triton twin of ``reference.quantize_q``, ``quantize_k`` and ``quantize_v``: Q, K and V in one
    launch, after one statistics pass when K's mean, V's range or the Q·Kᵀ balance is measured; with
    short sequences and nothing static, both in one launch.

    q: (B, H, Sq, D); k, v: (B, H_kv, Sk, D); any strides. k_tile: K's quantization, (block_n, k_groups)
    (``config.TileConfig``), by default the tile table's for this head dim and ``pv``. qk_balance: True scales
    Q's and K's channels by ``reference.balance_scales`` measured here (where ``layout.balance_applies``); a
    tensor is a given balance, float32 broadcastable to (B, H_kv, D) (``q_amax``/``k_amax``, if given, are then
    ranges of the balanced Q and K). qk_rotate: Q's and K's rows through ``reference.hadamard`` before they are
    quantized (ranges measured, not static).
    q_amax / k_amax: static ranges broadcastable to (B, H) / (B, H_kv) (``k_amax`` of the smoothed K); v_amax:
    static per-channel range broadcastable to (B, H_kv, D); k_mean: static smoothing mean broadcastable to
    (B, H_kv, D). With ``k_mean`` and ``v_amax`` given (or no smoothing and fp16 P·V) there is no statistics
    pass. V is quantized only when ``pv`` is FP8 or INT8.
    Returns ``Quantized``: q8 (B, H, Sq_pad, DP) int8, qs (B, H, Sq_pad) float32 (sm_scale·log2(e) folded in, and
    1/DP with ``qk_rotate``: ``reference.q_scale_mult``),
    k8 (B, H_kv, Sk_pad, DP) int8, ks (B, H_kv, Sk_pad) float32 (``k_groups`` scales per tile of
    ``block_n`` keys, stored per key), and v8 / vs as
    ``reference.quantize_v`` gives them (None, None for fp16 P·V), FP8 v8's keys in ``layout.v8_key_order`` where
    ``layout.fp8_v_keys_permuted(DP, block_n)``. ``pooled``: zeroed buffers
    (``pool.pooled_buffers``) that the launch adds the block-sparse predictor's sums of Q and of K (as smoothed) to, as
    it reads them. ``offset``: float32 (B, H, Sq), contiguous, with ``smooth_k``: where the launch writes each query
    row's ``reference.smoothing_offset`` (``sm_scale`` · q·mean, float32 sums over Q as given), which a log-sum-exp
    of the smoothed scores lacks. ``runner`` allocates and launches (``launch.Runner``).
    """
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    if k_tile is None:
        cfg = tile_config(D, pv)
        k_tile = cfg.block_n, cfg.k_groups
    block_n, k_groups = k_tile
    sq_pad, sk_pad, dp = padded_len(Sq), padded_len(Sk), padded_head_dim(D)
    dev = q.device
    v_fmt = pv.code
    check_rotation(qk_rotate, q_amax, k_amax)
    if offset is not None and not (smooth_k and offset.shape == (B, H, Sq) and offset.dtype == torch.float32
                                   and offset.is_contiguous()):
        raise ValueError(f"offset must be a contiguous float32 {(B, H, Sq)} tensor, with smooth_k")
    given_bal = qk_balance if isinstance(qk_balance, torch.Tensor) else None
    static = any(t is not None for t in (q_amax, k_amax, v_amax, k_mean, given_bal))
    measure_bal = balance_applies(qk_balance, q_amax, k_amax, k_mean, Sq * (H // H_kv))
    balance = measure_bal or given_bal is not None
    measure_k = smooth_k and k_mean is None
    measure_v = v_fmt != 0 and v_amax is None
    q8 = runner.empty((B, H, sq_pad, dp), torch.int8, dev)
    qs = runner.empty((B, H, sq_pad), torch.float32, dev)
    k8 = runner.empty((B, H_kv, sk_pad, dp), torch.int8, dev)
    ks = runner.empty((B, H_kv, sk_pad), torch.float32, dev)
    v8 = vs = None
    if v_fmt:
        shape = (B, H_kv, dp, sk_pad) if v_fmt == 1 else (B, H_kv, sk_pad, dp)
        v8 = runner.empty(shape, torch.float8_e4m3fn if v_fmt == 1 else torch.int8, dev)
        vs = runner.empty((B, H_kv, dp), torch.float32, dev)
    fused = pooled is None and max(Sk, Sq * (H // H_kv)) <= _FUSED_MAX_TOKENS
    if (measure_k or measure_v or measure_bal) and not static and fused:
        block = stats_block(dp)
        chunk, chunk_q, n_chunks = _chunking(Sq, Sk, block)
        partials = runner.empty((_N_SLOTS, B, H_kv, n_chunks, dp), torch.float32, dev)
        moments = runner.empty((3, B, H_kv, dp), torch.float32, dev)
        runner.launch(_quant_fused_kernel, (B * H_kv,), (
            q, q8, qs, k, k8, ks, v, k8 if v8 is None else v8, qs if vs is None else vs, partials, moments,
            runner.constant(_hadamard_int8(dp, dev)) if qk_rotate else q8, qs, qs if offset is None else offset,
            *q.stride(), *k.stride(), *v.stride(),
            H_kv, H // H_kv, Sq, Sk, D, sq_pad, sk_pad, n_chunks, chunk, chunk_q, partials[0].numel(),
            moments[0].numel(), q_scale_mult(sm_scale, dp, qk_rotate), sm_scale,
            # BLOCK, Q_BLOCK, K_BLOCK, K_GROUPS, DP, HAS_K, SMOOTH, V_FMT, BALANCE, ROTATE, OFFSET
            block, _ROW_BLOCK, block_n, k_groups, dp, smooth_k or balance, smooth_k, v_fmt, balance, qk_rotate,
            offset is not None,
        ), dict(enable_fp_fusion=FP_FUSION))
        return Quantized(q8, qs, k8, ks, v8, vs)

    kmean = vmax = bal = None
    if measure_k or measure_v or measure_bal:
        kmean, vmax, bal = kv_moments(k if measure_k or measure_bal else None, v if measure_v else None, runner,
                                      q=q if measure_bal else None, smooth_k=smooth_k)
    if given_bal is not None:
        bal, _ = _static_amax(given_bal, (B, H_kv, D), ks)
    qa, qa_strides = _static_amax(q_amax, (B, H), qs)
    ka, ka_strides = _static_amax(k_amax, (B, H_kv), qs)
    va, va_strides = _static_amax(v_amax, (B, H_kv, D), qs)
    if kmean is None or k_mean is not None:
        kmean, km_strides = _static_amax(k_mean, (B, H_kv, D), qs)
    else:
        km_strides = kmean.stride()
    # Q's programs as long as K's: at D = 128 with FP8 P·V, whose K programs take 128 tokens (and V's), two Q blocks
    # a program took 5-9% off the launch; with the rotation, whose Q blocks hold more registers, one block
    q_tiles = 1 if qk_rotate else max(1, block_n // _ROW_BLOCK)
    if sq_pad % (_ROW_BLOCK * q_tiles):
        q_tiles = 1
    nq = sq_pad // (_ROW_BLOCK * q_tiles) * B * H
    runner.launch(_quant_qkv_kernel, (nq + sk_pad // block_n * B * H_kv,), (
        q, qa, q8, qs, k, kmean, ka, k8, ks,
        v, qs if vmax is None else vmax, va, k8 if v8 is None else v8, qs if vs is None else vs, qs if bal is None else bal,
        runner.constant(_hadamard_int8(dp, dev)) if qk_rotate else q8, *(pooled if pooled is not None else (qs,) * 4),
        qs if offset is None else offset,
        *q.stride(), *k.stride(), *v.stride(), *qa_strides, *ka_strides, *va_strides, *km_strides,
        *((0, 0, 0) if bal is None else bal.stride()), H, H_kv, Sq, Sk, D, sq_pad, sk_pad, nq,
        q_scale_mult(sm_scale, dp, qk_rotate), sm_scale,
        # Q_BLOCK, K_BLOCK, K_GROUPS, DP, SMOOTH, Q_STATIC, K_STATIC, V_FMT, V_STATIC, BALANCE, ROTATE, Q_TILES, POOL,
        # OFFSET
        _ROW_BLOCK, block_n, k_groups, dp, smooth_k, q_amax is not None, k_amax is not None, v_fmt, v_amax is not None,
        balance, qk_rotate, q_tiles, pooled is not None, offset is not None,
    ), dict(enable_fp_fusion=FP_FUSION))
    return Quantized(q8, qs, k8, ks, v8, vs)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def _hadamard_int8(dp: int, device: torch.device) -> torch.Tensor:
    """The (dp, dp) Sylvester Hadamard matrix, ``H[i, j] = (-1)^popcount(i & j)``, int8 on ``device``: made once per
    device and kept (a constant the rotation's MMAs read, like a library's lookup table)."""
    h = _HADAMARD.get((dp, device))
    if h is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int8_attention(..., qk_rotate=True): call it once outside CUDA graph capture first (as "
                               "for any new shape: that call also compiles the kernels)")
        # the emulation's transform of the unit rows: H itself
        h = hadamard(torch.eye(dp, dtype=torch.float32)).to(torch.int8)
        h = _HADAMARD.setdefault((dp, device), h.to(device))  # the first thread's, if two get here
    return h


def _static_amax(amax: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor):
    """A float32 view of a static range (or mean) broadcast to ``shape``, and its strides; or a placeholder."""
    if amax is None:
        return like, (0,) * len(shape)
    a = amax.float().expand(shape)
    return a, a.stride()
