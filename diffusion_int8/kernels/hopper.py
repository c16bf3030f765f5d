"""The sm_90 attention kernels, in Gluon: the same numerics as ``attention._attn_fwd_kernel``, scheduled by hand.

Triton 3.6 waits for every ``tl.dot`` right after issuing it, so the portable kernel runs its MMAs and
its softmax one after the other. Here the wgmmas are asynchronous: while the softmax of
block j runs, the tensor cores compute P·V of block j-1 (FlashAttention-3's intra-warpgroup overlap),
and K/V tiles arrive by TMA into a ring of shared-memory stages ahead of their use. Two kernels:

- ``_attn_fwd_sm90_pingpong`` (FP8 P·V): two consumer warpgroups of 64 query rows and a producer warp
  (``gl.warp_specialize``). The consumers take turns at the tensor cores, so one's softmax runs under the
  other's MMAs (FlashAttention-3's ping-pong), and they share every K/V tile.
- ``_attn_fwd_sm90`` (16-bit P·V): one warpgroup of 128 rows that loads its own tiles. Its 64-key steps
  are too short for the ping-pong: the handshakes cost more than they hide.

Covers the hot path only: sm_90, no attention mask or a key mask (the same for every query: a text padding mask,
``key_mask``), a padded head dim of 128 (at 64 neither kernel beat the portable one in same-run sweeps), P·V in
FP8 or in V's 16-bit type with V readable by TMA. A key mask runs a list of key tiles per row (as a block mask
does): the clean ones through the unmasked steps, the few with a masked key through the masked step with the key
bias added. At that head
dim K has one scale per key tile (``config.tile_config``), stored per key: the kernels read each tile's first.
``attention.triton_attention`` routes everything else to the portable kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..caller import warn_user
from .config import FP8_P_SHIFT, FP_FUSION, LN2, PV, SPARSE_BLOCK, TESTED_TRITON, is_sm90
from .launch import EAGER, Runner
from .layout import rows_16b_aligned

# FP8 P·V: P is scaled by 2^P_SHIFT into e4m3's normal range through the exponent's offset
_P_SHIFT = gl.constexpr(FP8_P_SHIFT)
_LN2 = gl.constexpr(LN2)
_SPARSE_BLOCK = gl.constexpr(SPARSE_BLOCK)
# 12 warps (two consumer warpgroups, the producer's) at 168 registers fill the 64K register file; the
# partitions then re-split it as 240 / 240 / 24 per thread (setmaxnreg)
_PINGPONG_MAXNREG = 168


# Gluon's API moves between Triton releases: the CTA barrier is ``thread_barrier`` up to 3.6 and
# ``barrier`` from 3.7; the TMA load is ``async_copy_global_to_shared`` up to 3.7 and ``async_load``
# from 3.8 (3.9 keeps the old name only to raise). Builtins aliased here stay callable in kernels.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.constexpr_function
def _mma_layout(num_warps, n, operand_bits):
    # one warpgroup per 64 rows; the instruction's K depth is 32 bytes of the operand type
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 256 // operand_bits])


@gluon.constexpr_function
def _store_layout(num_warps, dp):
    # 16-byte stores of 8 contiguous 16-bit outputs
    cols = dp // 8
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // cols, cols],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.jit
def _program(H, H_KV):
    """(query tile, batch·head, batch, head, its K/V head, batch·K/V head) of this program."""
    pid_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    h_kv = h // (H // H_KV)
    return pid_m, off_bh, b, h, h_kv, b * H_KV + h_kv


@gluon.jit
def _key_tiles(KB_CNT, KB_CLEAN, KB_IDX, BIAS, pid_m, off_bh, b, h, stride_lb, stride_lh, SK, SK_PAD, N_BLOCKS, NQB,
               NKB, BLOCK_N: gl.constexpr, LISTS: gl.constexpr):
    """(key tiles to run, how many of the first run unmasked (from the second on), the program's tile list, its
    length, how many of its first entries are tiles 0, 1, ... in order, the program's row of the key bias).
    ``LISTS`` 0, dense: every tile of the sequence, the last masked
    (the tail). 1, a block mask (a CTA's 128 rows are one query block): the kept blocks' tiles, less the tail
    block's tiles that start past SK, so the last tile is the masked one as in the dense loop. 2, a key mask
    (``attention.key_mask_plan``; list row b · stride_lb + h · stride_lh): the row's clean tiles unmasked, then its
    partial ones with the bias. 3, a block mask split (``attention.block_lists(..., split=True)``): every tile,
    those of the blocks the mask skips first; then the second value is the tile of the sequence's tail in that
    order, the fourth the count of skipped blocks and the fifth that of their tiles. At least one tile: a program
    whose list is empty runs one stand-in tile and stores zeros."""
    if LISTS == 3:
        row = off_bh * NQB + pid_m
        n_skip = gl.load(KB_CNT + row)
        idx_row = KB_IDX + row.to(gl.int64) * NKB
        T: gl.constexpr = _SPARSE_BLOCK // BLOCK_N
        tail_tiles = (SK - (NKB - 1) * _SPARSE_BLOCK + BLOCK_N - 1) // BLOCK_N
        # each part ascending: the tail block is the last of the part that holds it
        tail_skipped = ((n_skip > 0) & (gl.load(idx_row + gl.maximum(n_skip - 1, 0)) == NKB - 1)).to(gl.int32)
        skip_tiles = n_skip * T - tail_skipped * (T - tail_tiles)
        tail_at = gl.where(tail_skipped != 0, skip_tiles - 1, N_BLOCKS - 1)
        return N_BLOCKS, tail_at, idx_row, n_skip, skip_tiles, BIAS
    elif LISTS == 2:
        row = b * stride_lb + h * stride_lh
        n_kept = gl.load(KB_CNT + row)
        return (gl.maximum(n_kept, 1), gl.load(KB_CLEAN + 2 * row), KB_IDX + row.to(gl.int64) * NKB, n_kept,
                gl.load(KB_CLEAN + 2 * row + 1), BIAS + row.to(gl.int64) * SK_PAD)
    elif LISTS == 1:
        row = off_bh * NQB + pid_m
        n_kept = gl.load(KB_CNT + row)
        idx_row = KB_IDX + row.to(gl.int64) * NKB
        last = gl.load(idx_row + gl.maximum(n_kept - 1, 0))
        T: gl.constexpr = _SPARSE_BLOCK // BLOCK_N
        tail_tiles = (SK - (NKB - 1) * _SPARSE_BLOCK + BLOCK_N - 1) // BLOCK_N
        tail = ((n_kept > 0) & (last == NKB - 1)).to(gl.int32)
        n_tiles = gl.maximum(n_kept * T - tail * (T - tail_tiles), 1)
        return n_tiles, n_tiles - 1, idx_row, n_kept, 0, BIAS
    else:
        return N_BLOCKS, N_BLOCKS - 1, KB_IDX, 0, 0, BIAS


@gluon.jit
def _key_pos(j, idx_row, n_kept, n_prefix, BLOCK_N: gl.constexpr, LISTS: gl.constexpr):
    """The first key of the program's j-th key tile: tile j of the sequence, with a block mask the tile of the
    kept blocks (``attention.block_lists``: ``n_kept`` indices at ``idx_row``), with a key mask the j-th listed
    tile; split (3: ``n_kept`` skipped blocks, whose tiles are the first ``n_prefix``), the skipped blocks' tiles
    then the kept ones'. Past the last listed tile (prefetches that ``pred`` turns off) and for an empty list, a
    valid position; split, only tiles before the last are asked for (the ping-pong kernel's reads)."""
    if LISTS == 3:
        T: gl.constexpr = _SPARSE_BLOCK // BLOCK_N
        kept = (j >= n_prefix).to(gl.int32)
        local = j - kept * n_prefix
        return gl.load(idx_row + kept * n_kept + local // T) * _SPARSE_BLOCK + (local % T) * BLOCK_N
    elif LISTS == 2:  # the list's first n_prefix entries are tiles 0, 1, ...: read only past them
        listed = gl.load(idx_row + gl.minimum(j, gl.maximum(n_kept - 1, 0)), mask=j >= n_prefix, other=0)
        return gl.where(j < n_prefix, j, listed) * (n_kept > 0).to(gl.int32) * BLOCK_N
    elif LISTS == 1:
        T: gl.constexpr = _SPARSE_BLOCK // BLOCK_N
        kb = gl.load(idx_row + gl.minimum(j // T, gl.maximum(n_kept - 1, 0)))
        return kb * (n_kept > 0).to(gl.int32) * _SPARSE_BLOCK + (j % T) * BLOCK_N
    else:
        return j * BLOCK_N


@gluon.jit
def _load_k(k_desc, k_bufs, k_bars, j, pos, k_row, N_BLOCKS, STAGES: gl.constexpr):
    """K tile j of the program (its first key at ``pos``: ``_key_pos``) into its ring stage."""
    slot = j % STAGES
    pred = j < N_BLOCKS
    bar = k_bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes, pred=pred)
    _tma_load(k_desc, [k_row + pos, 0], bar, k_bufs.index(slot), pred=pred)


@gluon.jit
def _load_v(v_desc, v_bufs, v_bars, j, pos, v_row, b, h_kv, N_BLOCKS, STAGES: gl.constexpr, PV: gl.constexpr):
    slot = j % STAGES
    pred = j < N_BLOCKS
    bar = v_bars.index(slot)
    mbarrier.expect(bar, v_desc.block_type.nbytes, pred=pred)
    if PV == 1:  # the quantized Vᵀ, (B·H_kv·DP, SK_PAD)
        _tma_load(v_desc, [v_row, pos], bar, v_bufs.index(slot), pred=pred)
    else:  # the caller's V, (B, H_kv, SK, D) through its strides; rows past SK arrive as zeros
        _tma_load(v_desc, [b, h_kv, pos, 0], bar, v_bufs.index(slot), pred=pred)


@gluon.jit
def _v_operand(v_bufs, slot, BLOCK_N: gl.constexpr, DP: gl.constexpr, PV: gl.constexpr):
    """V tile as the (BLOCK_N, DP) B operand of P·V."""
    if PV == 1:
        return v_bufs.index(slot).permute((1, 0))  # stored (DP, BLOCK_N): K-major, as FP8 wgmma wants
    else:
        return v_bufs.index(slot).reshape([BLOCK_N, DP])


@gluon.jit
def _issue_pv(p_bufs, j, acc, v_bufs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
              STAGES: gl.constexpr, PV: gl.constexpr, o_layout: gl.constexpr):
    """P·V of block j on the tensor cores, P from shared memory.

    FP8 products go into a fresh accumulator: Hopper's FP8 MMA accumulates with fewer than fp32's
    mantissa bits, which across a long sequence cost accuracy (cos 0.9997 -> 0.9985 at 17550 keys), so
    blocks are summed in fp32 by the caller; 16-bit MMAs accumulate in full fp32 and take ``acc``.
    """
    v = _v_operand(v_bufs, j % STAGES, BLOCK_N, DP, PV)
    p = p_bufs.index(j % 2)
    if PV == 1:
        return warpgroup_mma(p, v, gl.zeros([BLOCK_M, DP], gl.float32, o_layout), use_acc=False, is_async=True)
    else:
        return warpgroup_mma(p, v, acc, is_async=True)


@gluon.jit
def _stage_p(p, p_bufs, j):
    # P goes to the MMA through shared memory: an A operand in registers would be read by the wgmma
    # while the next softmax runs, and ptxas, which does not keep such registers reserved, then waits
    # for the wgmma before the softmax (SASS checked), so nothing would overlap
    p = p.to(p_bufs.dtype)
    if p_bufs.dtype == gl.float8e4nv:
        # FP8 V's keys are stored in layout.v8_key_order, so P's columns go in the same order: the thread's
        # columns 8i + 2t + e land at 32t + 2i + e, its row's 32 bytes contiguous (two 16-byte stores). That is
        # the order at padded head dim 128, the only one this kernel runs (at <= 64 V's keys are in another)
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        gl.static_assert(N == 128)
        p = gl.reshape(gl.permute(gl.reshape(p, [M, N // 8, 4, 2]), (0, 2, 1, 3)), [M, N])
    p_bufs.index(j % 2).store(p)
    fence_async_shared()


@gluon.jit
def _issue_qk(q_smem, k_bufs, k_bars, j, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr):
    slot = j % STAGES
    mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    return warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(qk, qs, ks, m_i, l_i, start_n, SK, bias_row, BLOCK_N: gl.constexpr, P_SHIFT: gl.constexpr,
             MASKED: gl.constexpr, s_layout: gl.constexpr, LISTS: gl.constexpr):
    # logits in base 2 are qk · (q scale · k scale); as in the portable kernel, the row max is taken on
    # the INT32 scores (the scale is positive) and the exponent's argument is one FMA per score
    qsk = qs * ks
    if MASKED and LISTS == 2:  # a key mask's tile: its bias (-inf past the sequence) added; rows without keys so far
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = qk.to(gl.float32) * qsk[:, None] + gl.load(bias_row + cols)[None, :]
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_safe - P_SHIFT)[:, None])
        return p, m_new, l_i * gl.exp2(m_i - m_safe) + gl.sum(p, 1), gl.exp2(m_i - m_safe)
    elif MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] < SK, qk.to(gl.float32) * qsk[:, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - (m_new - P_SHIFT)[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1).to(gl.float32) * qsk)
        p = gl.exp2(qk.to(gl.float32) * qsk[:, None] - (m_new - P_SHIFT)[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _epilogue(acc, l_i, m_i, row0, O, stride_ob, stride_oh, stride_os, stride_od, VS, LSE, b, h, H, off_kv, SQ, D,
              n_kept, BLOCK_M: gl.constexpr, DP: gl.constexpr, PV: gl.constexpr, o_layout: gl.constexpr,
              st_layout: gl.constexpr, LISTS: gl.constexpr, RETURN_LSE: gl.constexpr):
    """Normalize rows row0.. (l >= 1 once a listed tile ran), apply V's channel scales, store. With a block or key
    mask (``LISTS`` 1, 2), rows whose list is empty (``n_kept`` 0) are 0 (their one step ran on a stand-in tile).
    RETURN_LSE: also each row's log-sum-exp of its (smoothed) scores at ``LSE``, float32 (B, H, SQ), natural
    log, as the portable kernel writes it (-inf for rows without keys)."""
    if RETURN_LSE:
        P_SHIFT: gl.constexpr = _P_SHIFT if PV == 1 else 0.0
        lse = (m_i + gl.log2(l_i) - P_SHIFT) * _LN2
        if LISTS == 1 or LISTS == 2:
            lse = gl.where(gl.full_like(lse, n_kept) > 0, lse, float("-inf"))
        lse_rows = row0 + gl.arange(0, BLOCK_M, layout=l_i.type.layout)
        gl.store(LSE + (b * H + h).to(gl.int64) * SQ + lse_rows, lse, mask=lse_rows < SQ)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc * gl.div_rn(gl.full_like(l_o, 1.0), l_o)[:, None]
    out = gl.convert_layout(out, st_layout)
    if LISTS == 1 or LISTS == 2:
        out = gl.where(gl.full_like(out, n_kept) > 0, out, 0.0)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, DP, layout=gl.SliceLayout(0, st_layout))
    if PV == 1:
        out = out * gl.load(VS + off_kv * DP + cols)[None, :]
    o_ptrs = (O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + rows[:, None].to(gl.int64) * stride_os + cols[None, :] * stride_od)
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows[:, None] < SQ) & (cols[None, :] < D))


@gluon.jit
def _tile_scale(ks_ptr, j, N_BLOCKS, idx_row, n_kept, n_prefix, BLOCK_N: gl.constexpr, LISTS: gl.constexpr):
    """K tile j's scale (one a tile, stored per key: the tile's first), or tile N_BLOCKS-1's past the last."""
    return gl.load(ks_ptr + _key_pos(gl.minimum(j, N_BLOCKS - 1), idx_row, n_kept, n_prefix, BLOCK_N, LISTS))


@gluon.jit
def _step(acc, m_i, l_i, ks, j, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc, v_desc, qs, ks_ptr,
          k_row, v_row, b, h_kv, SK, N_BLOCKS, idx_row, n_kept, n_prefix, bias_row,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr, PV: gl.constexpr,
          MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, LISTS: gl.constexpr):
    """Block j's Q·Kᵀ and block j-1's P·V in flight together; block j's softmax runs under the P·V. ``ks``: block
    j's K scale, loaded a step ahead; returns block j+1's with the state."""
    # the positions this step needs, read first: with a block mask each is a load, whose latency then hides
    start_n = _key_pos(j, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    pos_k = _key_pos(j + STAGES, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    pos_v = _key_pos(j - 1 + STAGES, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    ks_next = _tile_scale(ks_ptr, j + 1, N_BLOCKS, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    s_tok = _issue_qk(q_smem, k_bufs, k_bars, j, BLOCK_M, BLOCK_N, STAGES, s_layout)
    mbarrier.wait(v_bars.index((j - 1) % STAGES), ((j - 1) // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, j - 1, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, PV, o_layout)
    qk = warpgroup_mma_wait(1, deps=[s_tok])
    p, m_i, l_i, alpha = _softmax(qk, qs, ks, m_i, l_i, start_n, SK, bias_row, BLOCK_N, 0.0, MASKED, s_layout, LISTS)
    # P's other buffer was last read by block j-2's P·V, waited for in the previous step
    _stage_p(p, p_bufs, j)
    # the MMA added block j-1 into acc; rescaled to block j's max before the next one adds to it
    acc = warpgroup_mma_wait(0, deps=[pv_tok]) * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    # every warp is past its wgmmas on K_j and V_{j-1} and has stored its rows of P_j
    _cta_barrier()
    _load_k(k_desc, k_bufs, k_bars, j + STAGES, pos_k, k_row, N_BLOCKS, STAGES)
    _load_v(v_desc, v_bufs, v_bars, j - 1 + STAGES, pos_v, v_row, b, h_kv, N_BLOCKS, STAGES, PV)
    return acc, m_i, l_i, ks_next


@gluon.jit
def _attn_fwd_sm90(
    q_desc, k_desc, v_desc, QS, KS, VS, KB_CNT, KB_CLEAN, KB_IDX, BIAS, O, LSE, OS, LSES,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh,
    H, H_KV, SQ, SK, SQ_PAD, SK_PAD, D, N_BLOCKS, NQB, NKB,
    STAGES: gl.constexpr, LISTS: gl.constexpr, RETURN_LSE: gl.constexpr, num_warps: gl.constexpr,
):
    """16-bit P·V (accumulated inside the MMA); one warpgroup per CTA, which also issues its TMA loads."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    DP: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    PV: gl.constexpr = 0  # the helpers' code for 16-bit P·V
    gl.static_assert(BLOCK_M % (16 * num_warps) == 0)
    s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N, 8)
    o_layout: gl.constexpr = _mma_layout(num_warps, DP, 16)

    pid_m, off_bh, b, h, h_kv, off_kv = _program(H, H_KV)
    k_row = off_kv * SK_PAD
    v_row = off_kv * DP
    N_BLOCKS, n_plain, idx_row, n_kept, n_prefix, bias_row = _key_tiles(
        KB_CNT, KB_CLEAN, KB_IDX, BIAS, pid_m, off_bh, b, h, stride_lb, stride_lh, SK, SK_PAD, N_BLOCKS, NQB, NKB,
        BLOCK_N, LISTS)

    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, DP], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, DP], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_bufs = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], v_desc.dtype))
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [off_bh * SQ_PAD + pid_m * BLOCK_M, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        pos = _key_pos(i, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
        _load_k(k_desc, k_bufs, k_bars, i, pos, k_row, N_BLOCKS, STAGES)
        _load_v(v_desc, v_bufs, v_bars, i, pos, v_row, b, h_kv, N_BLOCKS, STAGES, PV)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qs = gl.load(QS + off_bh * SQ_PAD + offs_m)
    ks_ptr = KS + off_kv * SK_PAD

    # block 0 (masked: it may be the only one)
    mbarrier.wait(q_bar, 0)
    qk = warpgroup_mma_wait(0, deps=[_issue_qk(q_smem, k_bufs, k_bars, 0, BLOCK_M, BLOCK_N, STAGES, s_layout)])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    start0 = _key_pos(0, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    ks = _tile_scale(ks_ptr, 1, N_BLOCKS, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)  # the loop's first, a step ahead
    p, m_i, l_i, _ = _softmax(qk, qs, gl.load(ks_ptr + start0), m_i, l_i, start0, SK, bias_row, BLOCK_N, 0.0, True,
                              s_layout, LISTS)
    _stage_p(p, p_bufs, 0)
    _cta_barrier()
    _load_k(k_desc, k_bufs, k_bars, STAGES, _key_pos(STAGES, idx_row, n_kept, n_prefix, BLOCK_N, LISTS), k_row,
            N_BLOCKS, STAGES)
    acc = gl.zeros([BLOCK_M, DP], gl.float32, o_layout)

    # tiles 1 .. n_plain - 1 unmasked; the rest (the tail, or a key mask's partial tiles) masked
    for j in range(1, n_plain):
        acc, m_i, l_i, ks = _step(acc, m_i, l_i, ks, j, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc,
                                  v_desc, qs, ks_ptr, k_row, v_row, b, h_kv, SK, N_BLOCKS, idx_row, n_kept, n_prefix,
                                  bias_row, BLOCK_M, BLOCK_N, DP, STAGES, PV, False, s_layout, o_layout, LISTS)
    for j in range(gl.maximum(n_plain, 1), N_BLOCKS):
        acc, m_i, l_i, ks = _step(acc, m_i, l_i, ks, j, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc,
                                  v_desc, qs, ks_ptr, k_row, v_row, b, h_kv, SK, N_BLOCKS, idx_row, n_kept, n_prefix,
                                  bias_row, BLOCK_M, BLOCK_N, DP, STAGES, PV, True, s_layout, o_layout, LISTS)
    mbarrier.wait(v_bars.index((N_BLOCKS - 1) % STAGES), ((N_BLOCKS - 1) // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, N_BLOCKS - 1, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, PV, o_layout)
    acc = warpgroup_mma_wait(0, deps=[pv_tok])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    _epilogue(acc, l_i, m_i, pid_m * BLOCK_M, O, stride_ob, stride_oh, stride_os, stride_od, VS, LSE, b, h, H, off_kv,
              SQ, D, n_kept, BLOCK_M, DP, PV, o_layout, _store_layout(num_warps, DP), LISTS, RETURN_LSE)


# ---- FP8 P·V: two consumer warpgroups in ping-pong and a producer warp ----

@gluon.jit
def _stage_k_scale(ks_bufs, j, STAGES: gl.constexpr, s_layout: gl.constexpr):
    """K tile j's scale as a row vector, from its stage's slot (the producer's; valid once the tile's K barrier
    was waited for)."""
    return ks_bufs.index(j % STAGES).load(gl.SliceLayout(1, s_layout))


@gluon.jit
def _turn_wait(my_turn, cid: gl.constexpr, r):
    # round r of consumer 1 follows round r of consumer 0, which follows round r-1 of consumer 1; consumer
    # 0's barrier starts out as if completed
    mbarrier.wait(my_turn, (r & 1) ^ (1 - cid))


@gluon.jit
def _pp_step(acc, m_i, l_i, alpha_prev, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs,
             my_turn, other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr, LISTS: gl.constexpr):
    """One consumer's step j: Q·Kᵀ_j and P·V_{j-1} issued in its turn, block j's softmax under the other's MMAs."""
    _turn_wait(my_turn, cid, j)
    s_tok = _issue_qk(q_smem, k_bufs, k_ready, j, BLOCK_M, BLOCK_N, STAGES, s_layout)
    mbarrier.wait(v_ready.index((j - 1) % STAGES), ((j - 1) // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, j - 1, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, 1, o_layout)
    mbarrier.arrive(other_turn, count=1)
    ks_j = _stage_k_scale(ks_bufs, j, STAGES, s_layout)
    qk = warpgroup_mma_wait(1, deps=[s_tok])
    if MASKED:  # the column mask's only use of the position
        start_n = _key_pos(j, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    else:
        start_n = 0
    p, m_i, l_i, alpha = _softmax(qk, qs, ks_j, m_i, l_i, start_n, SK, bias_row, BLOCK_N, _P_SHIFT, MASKED, s_layout,
                                  LISTS)
    # P's other buffer was last read by block j-2's P·V, waited for in the previous step
    _stage_p(p, p_bufs, j)
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    # acc holds blocks < j-1 at block j-2's max: one FMA per element moves it to block j-1's max (the
    # alpha of the previous step) and adds block j-1's fresh FP8 product
    acc = acc * gl.convert_layout(alpha_prev, gl.SliceLayout(1, o_layout))[:, None] + pv
    # the whole warpgroup is past its wgmmas on K_j and V_{j-1} before their stages are released
    _cta_barrier()
    mbarrier.arrive(kv_free.index(j % STAGES), count=1)
    return acc, m_i, l_i, alpha


@gluon.jit
def _pp_consumer(q_bufs, q_bars, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn, other_turn,
                 QS, VS, O, LSE, OS, LSES, stride_ob, stride_oh, stride_os, stride_od, pid_m, off_bh, b, h, H, off_kv,
                 SQ, SK, SQ_PAD, D, N_BLOCKS, n_plain, idx_row, n_kept, n_prefix, bias_row,
                 cid: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
                 STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, st_layout: gl.constexpr,
                 LISTS: gl.constexpr, RETURN_LSE: gl.constexpr):
    """Consumer ``cid``: query rows [cid·64, cid·64 + 64) of the CTA's 128, one round per key block + 1."""
    q_smem = q_bufs.index(cid)
    row0 = pid_m * (2 * BLOCK_M) + cid * BLOCK_M
    qs = gl.load(QS + off_bh * SQ_PAD + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)))

    # round 0: block 0's Q·Kᵀ alone (masked: it may be the only block)
    start0 = _key_pos(0, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
    mbarrier.wait(q_bars.index(cid), 0)
    _turn_wait(my_turn, cid, 0)
    s_tok = _issue_qk(q_smem, k_bufs, k_ready, 0, BLOCK_M, BLOCK_N, STAGES, s_layout)
    mbarrier.arrive(other_turn, count=1)
    ks0 = _stage_k_scale(ks_bufs, 0, STAGES, s_layout)
    qk = warpgroup_mma_wait(0, deps=[s_tok])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _softmax(qk, qs, ks0, m_i, l_i, start0, SK, bias_row, BLOCK_N, _P_SHIFT, True, s_layout,
                                  LISTS)
    _stage_p(p, p_bufs, 0)
    _cta_barrier()
    mbarrier.arrive(kv_free.index(0), count=1)
    acc = gl.zeros([BLOCK_M, DP], gl.float32, o_layout)

    if LISTS == 3:
        # the skipped blocks' tiles, then the kept ones'; n_plain is the tail's tile. Step j adds tile j-1's P·V to
        # acc: at step n_prefix, the state before the step's softmax is the skipped blocks' alone, written out (OS,
        # LSES) before the kept blocks join it. That step and the tail's run alone, masked (a mask past SK changes
        # nothing elsewhere), so the loops around them stay as the dense one (a store inside them spills)
        a_end = gl.minimum(n_plain, n_prefix)
        b_end = gl.where(n_plain >= n_prefix, n_plain, N_BLOCKS)
        for j in range(1, a_end):
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, False,
                s_layout, o_layout, LISTS)
        for j in range(gl.maximum(a_end, 1), n_prefix):  # the tail's tile, where the skipped blocks hold it
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, True,
                s_layout, o_layout, LISTS)
        for j in range(gl.maximum(n_prefix, 1), gl.minimum(n_prefix + 1, N_BLOCKS)):  # the skipped blocks written
            m_was, l_was = m_i, l_i
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, True,
                s_layout, o_layout, LISTS)
            _epilogue(acc, l_was, m_was, row0, OS, stride_ob, stride_oh, stride_os, stride_od, VS, LSES, b, h, H,
                      off_kv, SQ, D, 1, BLOCK_M, DP, 1, o_layout, st_layout, 0, True)
        for j in range(n_prefix + 1, b_end):
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, False,
                s_layout, o_layout, LISTS)
        for j in range(gl.maximum(b_end, n_prefix + 1), N_BLOCKS):  # the tail's tile, where the kept blocks hold it
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, True,
                s_layout, o_layout, LISTS)
    else:
        # blocks 1 .. n_plain - 1 unmasked; the rest (the tail, or a key mask's partial tiles) masked
        for j in range(1, n_plain):
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, False,
                s_layout, o_layout, LISTS)
        for j in range(gl.maximum(n_plain, 1), N_BLOCKS):
            acc, m_i, l_i, alpha = _pp_step(
                acc, m_i, l_i, alpha, j, q_smem, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs, my_turn,
                other_turn, qs, SK, idx_row, n_kept, n_prefix, bias_row, cid, BLOCK_M, BLOCK_N, DP, STAGES, True,
                s_layout, o_layout, LISTS)
    # last round: the last block's P·V alone
    last = N_BLOCKS - 1
    _turn_wait(my_turn, cid, N_BLOCKS)
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, last, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, 1, o_layout)
    mbarrier.arrive(other_turn, count=1)
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None] + pv
    if LISTS == 3:
        # no skipped blocks (zeros, -inf), or nothing but them; stored from the accumulator's own layout (any
        # layout stores the same values; this one needs no shared-memory round trip)
        if (n_prefix == 0) | (n_prefix == N_BLOCKS):
            _epilogue(acc, l_i, m_i, row0, OS, stride_ob, stride_oh, stride_os, stride_od, VS, LSES, b, h, H, off_kv,
                      SQ, D, n_prefix, BLOCK_M, DP, 1, o_layout, o_layout, 1, True)
    _epilogue(acc, l_i, m_i, row0, O, stride_ob, stride_oh, stride_os, stride_od, VS, LSE, b, h, H, off_kv, SQ, D,
              n_kept, BLOCK_M, DP, 1, o_layout, st_layout, LISTS, RETURN_LSE)


@gluon.jit
def _pp_producer(q_desc, k_desc, v_desc, q_bufs, q_bars, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, ks_ptr,
                 pid_m, off_bh, b, h_kv, k_row, v_row, SQ_PAD, N_BLOCKS, idx_row, n_kept, n_prefix,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LISTS: gl.constexpr):
    """One warp: both consumers' Q tiles, then K/V tiles by TMA as ring stages free up, each K tile with its
    scale in the stage's slot of ``ks_bufs``, so the consumers' loop has no global load (theirs, one a step,
    after the kept-block list's with a block mask: a load there stalls the MMA pipeline)."""
    ks_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [off_bh * SQ_PAD + pid_m * (2 * BLOCK_M) + c * BLOCK_M, 0],
                                        q_bars.index(c), q_bufs.index(c))
    for j in range(N_BLOCKS):
        # K_j and V_j replace K_{j-S} (read in step j-S) and V_{j-S} (read in step j-S+1), so wait for step
        # t = j-S+1 = u-S: completion t // S of kv_free[t % S], of parity ((u // S) & 1) ^ 1; for j < S-1 the
        # wait is for parity 1 on a fresh barrier, which passes
        u = j + 1
        # the tile's position and K scale, read before the wait, which hides their latency
        pos = _key_pos(j, idx_row, n_kept, n_prefix, BLOCK_N, LISTS)
        ks = gl.load(ks_ptr + pos + gl.zeros([BLOCK_M], gl.int32, ks_layout))
        mbarrier.wait(kv_free.index(u % STAGES), ((u // STAGES) & 1) ^ 1)
        ks_bufs.index(j % STAGES).store(ks)
        _cta_barrier()  # every lane's store before the K barrier's arrive (in _load_k), which publishes them
        _load_k(k_desc, k_bufs, k_ready, j, pos, k_row, N_BLOCKS, STAGES)
        _load_v(v_desc, v_bufs, v_ready, j, pos, v_row, b, h_kv, N_BLOCKS, STAGES, 1)


@gluon.jit
def _attn_fwd_sm90_pingpong(
    q_desc, k_desc, v_desc, QS, KS, VS, KB_CNT, KB_CLEAN, KB_IDX, BIAS, O, LSE, OS, LSES,
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh,
    H, H_KV, SQ, SK, SQ_PAD, SK_PAD, D, N_BLOCKS, NQB, NKB,
    STAGES: gl.constexpr, LISTS: gl.constexpr, RETURN_LSE: gl.constexpr, num_warps: gl.constexpr,
):
    """FP8 P·V; 128 query rows per CTA: two consumer warpgroups (the default partition and worker 0) of 64
    rows each, and a producer warp (worker 1) that loads Q, the K/V ring and each K tile's scale. With a split block
    mask (``LISTS`` 3), the skipped blocks' attention goes to OS and LSES on the way.

    The consumers issue their wgmmas in turns (mbarriers ``turn0``/``turn1``), so one's softmax runs while
    the tensor cores work for the other; each also keeps the intra-warpgroup overlap. Step j of both
    consumers (``kv_free``, count 2) releases K_j's and V_{j-1}'s stages. Needs ``maxnreg=168``: 240
    registers per consumer thread, 24 for the producer's warpgroup.
    """
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    DP: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4)
    gl.static_assert(BLOCK_M == 64)
    # layouts are built here: the partitions receive them as constexpr arguments
    s_layout: gl.constexpr = _mma_layout(4, BLOCK_N, 8)
    o_layout: gl.constexpr = _mma_layout(4, DP, 8)
    st_layout: gl.constexpr = _store_layout(4, DP)

    pid_m, off_bh, b, h, h_kv, off_kv = _program(H, H_KV)
    N_BLOCKS, n_plain, idx_row, n_kept, n_prefix, bias_row = _key_tiles(
        KB_CNT, KB_CLEAN, KB_IDX, BIAS, pid_m, off_bh, b, h, stride_lb, stride_lh, SK, SK_PAD, N_BLOCKS, NQB, NKB,
        BLOCK_N, LISTS)

    q_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_M, DP], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, DP], k_desc.layout)
    # each K tile's scale, once per query row of a consumer (so it loads as a row vector)
    ks_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, DP, BLOCK_N], v_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv)
    p_bufs0 = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N], p_layout)
    p_bufs1 = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N], p_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # separate allocations, so the compiler sees no hazard between one turn's wait and the other's arrive
    turn0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
    mbarrier.init(turn0, count=1)
    mbarrier.init(turn1, count=1)

    gl.warp_specialize([
        (_pp_consumer, (q_bufs, q_bars, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs0, turn0, turn1,
                        QS, VS, O, LSE, OS, LSES, stride_ob, stride_oh, stride_os, stride_od, pid_m, off_bh, b, h, H,
                        off_kv, SQ, SK, SQ_PAD, D, N_BLOCKS, n_plain, idx_row, n_kept, n_prefix, bias_row,
                        0, BLOCK_M, BLOCK_N, DP, STAGES, s_layout, o_layout, st_layout, LISTS, RETURN_LSE)),
        (_pp_consumer, (q_bufs, q_bars, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free, p_bufs1, turn1, turn0,
                        QS, VS, O, LSE, OS, LSES, stride_ob, stride_oh, stride_os, stride_od, pid_m, off_bh, b, h, H,
                        off_kv, SQ, SK, SQ_PAD, D, N_BLOCKS, n_plain, idx_row, n_kept, n_prefix, bias_row,
                        1, BLOCK_M, BLOCK_N, DP, STAGES, s_layout, o_layout, st_layout, LISTS, RETURN_LSE)),
        (_pp_producer, (q_desc, k_desc, v_desc, q_bufs, q_bars, k_bufs, k_ready, ks_bufs, v_bufs, v_ready, kv_free,
                        KS + off_kv * SK_PAD, pid_m, off_bh, b, h_kv, off_kv * SK_PAD, off_kv * DP, SQ_PAD, N_BLOCKS,
                        idx_row, n_kept, n_prefix, BLOCK_M, BLOCK_N, STAGES, LISTS)),
    ], [4, 1], [240, 24])


class _Plan(NamedTuple):
    rows: int  # query rows per CTA
    block_m: int  # query rows per warpgroup: Q's TMA box
    num_warps: int
    stages: int


def _plan(dp: int, pv: PV) -> _Plan | None:
    """The sm_90 kernel's tiles where it beats the portable kernel, else None.

    The key tile is K's quantization block (``config.tile_config``). From same-run sweeps: at D = 128 the ping-pong kernel for FP8 P·V (3 stages: 2 exposed the TMA latency, 4 was no
    better) and one warpgroup of 128 rows for 16-bit P·V; at D = 64 nothing beat the portable kernel.
    """
    if dp != 128:
        return None
    return _Plan(128, 64, 4, 3) if pv is PV.FP8 else _Plan(128, 128, 4, 2)


def supports(q: torch.Tensor, vb: torch.Tensor, pv: PV, dp: int, has_mask: bool) -> bool:
    """Whether the sm_90 kernel takes this call (else the portable kernel does).

    vb: V viewed (B, H_kv, Sk, D). Needs an sm_90 GPU, no mask but a key mask (``has_mask``: one that varies over
    the queries), FP8 or 16-bit P·V at a head dim the tile table covers, and for 16-bit P·V a V that TMA can read
    in place.
    """
    if has_mask or pv is PV.INT8 or not is_sm90(q.device) or _plan(dp, pv) is None:  # wgmma: sm_90 only
        return False
    if pv is PV.FP16:  # whole rows, 16-byte aligned strides and base
        return vb.shape[-1] == dp and vb.data_ptr() % 16 == 0 and rows_16b_aligned(vb)
    return True


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], gl_dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _desc(t: torch.Tensor, block: list[int], gl_dtype) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), gl_dtype))


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


# Why the Gluon kernels are off for this process (set once, by the first launch that failed), or None.
compile_failure: str | None = None


def launch(q8, qs, k8, ks, v, vs, ob, *, pv: PV, block_n: int, H: int, H_kv: int, Sq: int, Sk: int, D: int,
           blocks=None, keys=None, lse=None, skipped=None, runner: Runner = EAGER) -> bool:
    """Run the sm_90 kernel on quantized Q/K (and V, FP8) from ``quantize.quantize_qkv``.

    q8 (B, H, Sq_pad, DP) int8; k8 (B, H_kv, Sk_pad, DP) int8; v: the FP8 Vᵀ (B, H_kv, DP, Sk_pad) or the
    caller's 16-bit V viewed (B, H_kv, Sk, D); ob: the output viewed (B, H, Sq, D); lse: where to write each query
    row's log-sum-exp, float32 (B, H, Sq) contiguous, or None. blocks: a block mask (``attention.block_lists``);
    keys: a key mask (``attention.key_mask_plan``, made with ``block_n``); not both. skipped: with split block
    lists (``block_lists(..., split=True)``) and FP8 P·V, where the skipped blocks' attention goes: (output with
    ``ob``'s strides, log-sum-exp like ``lse``); ``ob`` gets every block.

    Returns False, having written nothing, when the kernel cannot be built with this Triton (its Gluon
    compiler rejects it at the first call): then one warning says why, ``compile_failure`` keeps the
    reason and every later call takes the portable kernel.
    """
    global compile_failure
    if skipped is not None and (blocks is None or keys is not None or pv is not PV.FP8):
        raise ValueError("skipped goes with split block lists and FP8 P·V (the ping-pong kernel)")
    try:
        _launch(q8, qs, k8, ks, v, vs, ob, pv=pv, block_n=block_n, H=H, H_kv=H_kv, Sq=Sq, Sk=Sk, D=D, blocks=blocks,
                keys=keys, lse=lse, skipped=skipped, runner=runner)
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind; the portable kernel computes the same
        compile_failure = (f"the sm_90 Gluon kernel failed to compile with Triton {triton.__version__} "
                           f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''})")
        warn_user(f"diffusion_int8: {compile_failure}; the portable Triton kernel runs instead (same numerics, "
                  f"slower at head dim 128). Tested: Triton {TESTED_TRITON}.")
        return False
    return True


def _launch(q8, qs, k8, ks, v, vs, ob, *, pv: PV, block_n: int, H: int, H_kv: int, Sq: int, Sk: int, D: int,
            blocks, keys, lse, skipped, runner: Runner) -> None:
    B, _, sq_pad, dp = q8.shape
    sk_pad = k8.shape[2]
    plan = _plan(dp, pv)
    q_desc = _desc(q8.view(-1, dp), [plan.block_m, dp], gl.int8)
    k_desc = _desc(k8.view(-1, dp), [block_n, dp], gl.int8)
    grid = (triton.cdiv(Sq, plan.rows), B * H)
    if pv is PV.FP8:
        v_desc = _desc(v.view(-1, sk_pad), [dp, block_n], gl.float8e4nv)
        fn, options = _attn_fwd_sm90_pingpong, dict(maxnreg=_PINGPONG_MAXNREG)
    else:
        v_desc = _desc(v, [1, 1, block_n, dp], _GL_DTYPES[v.dtype])
        fn, options = _attn_fwd_sm90, {}
    assert plan.rows == SPARSE_BLOCK  # a CTA's rows are one block of a block mask
    if keys is not None:  # LISTS 2: the key mask's tile lists and bias
        lists, counts, clean, idx, bias, n_list = 2, keys.counts, keys.clean, keys.tiles, keys.bias, keys.tiles.shape[1]
        strides = (keys.stride_b, keys.stride_h)
    else:  # LISTS 1: a block mask's kept blocks; 3: all blocks, the skipped ones first; 0: dense
        lists, counts, idx = (1 if skipped is None else 3, *blocks) if blocks is not None else (0, qs, qs)
        clean, bias, n_list, strides = qs, qs, triton.cdiv(Sk, SPARSE_BLOCK), (0, 0)
    runner.launch(fn, grid, (
        q_desc, k_desc, v_desc, qs, ks, vs, counts, clean, idx, bias, ob, lse if lse is not None else qs,
        *(skipped if skipped is not None else (ob, qs)), *ob.stride(), *strides, H, H_kv, Sq, Sk, sq_pad, sk_pad, D,
        triton.cdiv(Sk, block_n), triton.cdiv(Sq, SPARSE_BLOCK), n_list,
        plan.stages, lists, lse is not None,  # STAGES, LISTS, RETURN_LSE; num_warps below
    ), dict(num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION, **options))
