"""The sm_90 attention kernel, in Gluon: the same numerics as ``attention._attn_fwd_kernel``, scheduled by hand.

Triton 3.6 waits for every ``tl.dot`` right after issuing it, so the portable kernel runs its MMAs and
its softmax one after the other (NOTES v11). Here the wgmmas are asynchronous: while the softmax of
block j runs, the tensor cores compute P·V of block j-1 (FlashAttention-3's intra-warpgroup overlap),
and K/V tiles arrive by TMA into a ring of shared-memory stages ahead of their use.

Covers the hot path only: sm_90, no attention mask, a padded head dim of 128 (at 64 it did not beat the
portable kernel: NOTES v12), P·V in FP8 or in V's 16-bit type with V readable by TMA.
``attention.triton_attention`` routes everything else to the portable kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .config import FP8_P_SHIFT, PV

_P_SHIFT = gl.constexpr(FP8_P_SHIFT)


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
def _load_k(k_desc, k_bufs, k_bars, j, k_row, N_BLOCKS, STAGES: gl.constexpr):
    slot = j % STAGES
    pred = j < N_BLOCKS
    bar = k_bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [k_row + j * k_desc.block_type.shape[0], 0], bar, k_bufs.index(slot),
                                    pred=pred)


@gluon.jit
def _load_v(v_desc, v_bufs, v_bars, j, v_row, b, h_kv, N_BLOCKS, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            PV: gl.constexpr):
    slot = j % STAGES
    pred = j < N_BLOCKS
    bar = v_bars.index(slot)
    mbarrier.expect(bar, v_desc.block_type.nbytes, pred=pred)
    if PV == 1:  # the quantized Vᵀ, (B·H_kv·DP, SK_PAD)
        tma.async_copy_global_to_shared(v_desc, [v_row, j * BLOCK_N], bar, v_bufs.index(slot), pred=pred)
    else:  # the caller's V, (B, H_kv, SK, D) through its strides; rows past SK arrive as zeros
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, j * BLOCK_N, 0], bar, v_bufs.index(slot), pred=pred)


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
    blocks are summed in fp32 by ``_add_pv``; 16-bit MMAs accumulate in full fp32 and take ``acc``.
    """
    v = _v_operand(v_bufs, j % STAGES, BLOCK_N, DP, PV)
    p = p_bufs.index(j % 2)
    if PV == 1:
        return warpgroup_mma(p, v, gl.zeros([BLOCK_M, DP], gl.float32, o_layout), use_acc=False, is_async=True)
    else:
        return warpgroup_mma(p, v, acc, is_async=True)


@gluon.jit
def _add_pv(acc, pv, PV: gl.constexpr):
    if PV == 1:
        return acc + pv
    else:
        return pv


@gluon.jit
def _stage_p(p, p_bufs, j):
    # P goes to the MMA through shared memory: an A operand in registers would be read by the wgmma
    # while the next softmax runs, and ptxas, which does not keep such registers reserved, then waits
    # for the wgmma before the softmax (SASS checked), so nothing would overlap
    p_bufs.index(j % 2).store(p.to(p_bufs.dtype))
    fence_async_shared()


@gluon.jit
def _issue_qk(q_smem, k_bufs, k_bars, j, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr):
    slot = j % STAGES
    mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    return warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(qk, qs, ks, m_i, l_i, start_n, SK, BLOCK_N: gl.constexpr, P_SHIFT: gl.constexpr,
             MASKED: gl.constexpr, s_layout: gl.constexpr):
    # logits in base 2 are qk · (q scale · k scale); as in the portable kernel, the row max is taken on
    # the INT32 scores (the scale is positive) and the exponent's argument is one FMA per score
    qsk = qs * ks
    if MASKED:
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
def _step(acc, m_i, l_i, j, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc, v_desc, qs, ks_ptr,
          k_row, v_row, b, h_kv, SK, N_BLOCKS,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr, PV: gl.constexpr,
          P_SHIFT: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Block j's Q·Kᵀ and block j-1's P·V in flight together; block j's softmax runs under the P·V."""
    s_tok = _issue_qk(q_smem, k_bufs, k_bars, j, BLOCK_M, BLOCK_N, STAGES, s_layout)
    mbarrier.wait(v_bars.index((j - 1) % STAGES), ((j - 1) // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, j - 1, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, PV, o_layout)
    qk = warpgroup_mma_wait(1, deps=[s_tok])
    p, m_i, l_i, alpha = _softmax(qk, qs, gl.load(ks_ptr + j), m_i, l_i, j * BLOCK_N, SK, BLOCK_N, P_SHIFT,
                                  MASKED, s_layout)
    # P's other buffer was last read by block j-2's P·V, waited for in the previous step
    _stage_p(p, p_bufs, j)
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    acc = _add_pv(acc, pv, PV) * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    # every warp is past its wgmmas on K_j and V_{j-1} and has stored its rows of P_j
    gl.thread_barrier()
    _load_k(k_desc, k_bufs, k_bars, j + STAGES, k_row, N_BLOCKS, STAGES)
    _load_v(v_desc, v_bufs, v_bars, j - 1 + STAGES, v_row, b, h_kv, N_BLOCKS, BLOCK_N, STAGES, PV)
    return acc, m_i, l_i


@gluon.jit
def _attn_fwd_sm90(
    q_desc, k_desc, v_desc, QS, KS, VS, O,
    stride_ob, stride_oh, stride_os, stride_od,
    H, H_KV, SQ, SK, SQ_PAD, SK_PAD, D, N_BLOCKS,
    PV: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    DP: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(BLOCK_M % (16 * num_warps) == 0)
    s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N, 8)
    o_layout: gl.constexpr = _mma_layout(num_warps, DP, v_desc.dtype.primitive_bitwidth)
    # FP8 P·V: P is scaled by 2^P_SHIFT into e4m3's normal range through the exponent's offset
    P_SHIFT: gl.constexpr = _P_SHIFT if PV == 1 else 0.0

    pid_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    h_kv = h // (H // H_KV)
    off_kv = b * H_KV + h_kv
    k_row = off_kv * SK_PAD
    v_row = off_kv * DP

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
    tma.async_copy_global_to_shared(q_desc, [off_bh * SQ_PAD + pid_m * BLOCK_M, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_k(k_desc, k_bufs, k_bars, i, k_row, N_BLOCKS, STAGES)
        _load_v(v_desc, v_bufs, v_bars, i, v_row, b, h_kv, N_BLOCKS, BLOCK_N, STAGES, PV)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qs = gl.load(QS + off_bh * SQ_PAD + offs_m)
    ks_ptr = KS + off_kv * (SK_PAD // BLOCK_N)

    # block 0 (masked: it may be the only one)
    mbarrier.wait(q_bar, 0)
    qk = warpgroup_mma_wait(0, deps=[_issue_qk(q_smem, k_bufs, k_bars, 0, BLOCK_M, BLOCK_N, STAGES, s_layout)])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, _ = _softmax(qk, qs, gl.load(ks_ptr), m_i, l_i, 0, SK, BLOCK_N, P_SHIFT, True, s_layout)
    _stage_p(p, p_bufs, 0)
    gl.thread_barrier()
    _load_k(k_desc, k_bufs, k_bars, STAGES, k_row, N_BLOCKS, STAGES)
    acc = gl.zeros([BLOCK_M, DP], gl.float32, o_layout)

    for j in range(1, N_BLOCKS - 1):
        acc, m_i, l_i = _step(acc, m_i, l_i, j, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc, v_desc,
                              qs, ks_ptr, k_row, v_row, b, h_kv, SK, N_BLOCKS, BLOCK_M, BLOCK_N, DP, STAGES,
                              PV, P_SHIFT, False, s_layout, o_layout)
    if N_BLOCKS > 1:  # the last block holds the sequence's tail
        acc, m_i, l_i = _step(acc, m_i, l_i, N_BLOCKS - 1, q_smem, k_bufs, k_bars, v_bufs, v_bars, p_bufs, k_desc,
                              v_desc, qs, ks_ptr, k_row, v_row, b, h_kv, SK, N_BLOCKS, BLOCK_M, BLOCK_N, DP,
                              STAGES, PV, P_SHIFT, True, s_layout, o_layout)
    mbarrier.wait(v_bars.index((N_BLOCKS - 1) % STAGES), ((N_BLOCKS - 1) // STAGES) & 1)
    pv_tok = _issue_pv(p_bufs, N_BLOCKS - 1, acc, v_bufs, BLOCK_M, BLOCK_N, DP, STAGES, PV, o_layout)
    acc = _add_pv(acc, warpgroup_mma_wait(0, deps=[pv_tok]), PV)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # -- normalize (l >= 1 after the first block: no masks here), V's channel scales, store --
    st_layout: gl.constexpr = _store_layout(num_warps, DP)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc * gl.div_rn(gl.full_like(l_o, 1.0), l_o)[:, None]
    out = gl.convert_layout(out, st_layout)
    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, DP, layout=gl.SliceLayout(0, st_layout))
    if PV == 1:
        out = out * gl.load(VS + off_kv * DP + cols)[None, :]
    o_ptrs = (O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + rows[:, None].to(gl.int64) * stride_os + cols[None, :] * stride_od)
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows[:, None] < SQ) & (cols[None, :] < D))


def _tiles(dp: int, pv: PV) -> tuple[int, int, int] | None:
    """(block_m, num_warps, stages) where the sm_90 kernel beats the portable one, else None.

    From the sweep in NOTES v12 (ratios to the portable kernel in one run, CUDA graphs): at D = 128,
    +4–7% (FP8 P·V, 64 rows) and +4–6% (fp16 P·V, 128 rows on one warpgroup); at D = 64, −5% to +2%.
    The key tile is K's quantization block (``config.tile_config``).
    """
    if dp != 128:
        return None
    return (64, 4, 2) if pv is PV.FP8 else (128, 4, 2)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int | None) -> bool:
    # wgmma exists on sm_90 only; asked once per device, not per call
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports(q: torch.Tensor, vb: torch.Tensor, pv: PV, dp: int, has_mask: bool) -> bool:
    """Whether the sm_90 kernel takes this call (else the portable kernel does).

    vb: V viewed (B, H_kv, Sk, D). Needs an sm_90 GPU, no mask, FP8 or 16-bit P·V at a head dim the
    tile table covers, and for 16-bit P·V a V that TMA can read in place.
    """
    if has_mask or pv is PV.INT8 or q.device.type != "cuda" or _tiles(dp, pv) is None:
        return False
    if not _is_sm90(q.device.index):
        return False
    if pv is PV.FP16:  # whole rows, 16-byte aligned strides and base
        elem = vb.element_size()
        return (vb.shape[-1] == dp and vb.stride(3) == 1 and vb.data_ptr() % 16 == 0
                and all(s * elem % 16 == 0 for s in vb.stride()[:3]))
    return True


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], gl_dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _desc(t: torch.Tensor, block: list[int], gl_dtype) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), gl_dtype))


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def launch(q8, qs, k8, ks, v, vs, ob, *, pv: PV, block_n: int, H: int, H_kv: int, Sq: int, Sk: int, D: int) -> None:
    """Run the sm_90 kernel on quantized Q/K (and V, FP8) from ``quantize.quantize_qkv``.

    q8 (B, H, Sq_pad, DP) int8; k8 (B, H_kv, Sk_pad, DP) int8; v: the FP8 Vᵀ (B, H_kv, DP, Sk_pad) or the
    caller's 16-bit V viewed (B, H_kv, Sk, D); ob: the output viewed (B, H, Sq, D).
    """
    B, _, sq_pad, dp = q8.shape
    sk_pad = k8.shape[2]
    block_m, num_warps, stages = _tiles(dp, pv)
    q_desc = _desc(q8.view(-1, dp), [block_m, dp], gl.int8)
    k_desc = _desc(k8.view(-1, dp), [block_n, dp], gl.int8)
    if pv is PV.FP8:
        v_desc = _desc(v.view(-1, sk_pad), [dp, block_n], gl.float8e4nv)
    else:
        v_desc = _desc(v, [1, 1, block_n, dp], _GL_DTYPES[v.dtype])
    grid = (triton.cdiv(Sq, block_m), B * H)
    _attn_fwd_sm90[grid](
        q_desc, k_desc, v_desc, qs, ks, vs, ob, *ob.stride(),
        H, H_kv, Sq, Sk, sq_pad, sk_pad, D, triton.cdiv(Sk, block_n),
        PV=pv.code, STAGES=stages, num_warps=num_warps,
    )
