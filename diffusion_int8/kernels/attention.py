"""The fused INT8 attention kernel (Triton) and its launcher.

One program computes ``BLOCK_M`` query rows of one (batch, head): an INT8 Q·Kᵀ per K tile, scores
dequantized with one multiply (per-token Q scale × the K scale of the key's group, softmax scale and
log2(e) already folded in), online softmax in FP32 with exp2, and P·V in the precision chosen by ``PV``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..caller import warn_user
from . import pool
from . import quantize as tq
from .config import (FP8_P_SHIFT, FP_FUSION, INT8_MAX, LN2, LOG2E, P_FLOOR, PV, SPARSE_BLOCK, TESTED_TRITON, Kernel,
                     is_sm90, padded_head_dim, tile_config)
from .cache import signature
from .launch import EAGER, Runner, plan_or_run
from .key_mask import KeyMaskPlan, as_key_mask
from .layout import cdiv, output_like, padded_len, rows_16b_aligned, to_bhsd
from .sparsity import MIN_SIMILARITY
from .tl_helpers import columns_to_v8_order, rdiv, round_to_int8, v8_keys_permuted

try:  # the sm_90 Gluon kernels; a Triton whose Gluon API they do not cover runs the portable kernel
    from . import hopper

    _HOPPER_IMPORT_ERROR = None
except Exception as exc:  # ImportError, or AttributeError where a Gluon name they use is gone
    hopper = None
    _HOPPER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# Compiled kernels may only read globals that are constexpr.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_INT8_MAX = tl.constexpr(INT8_MAX)
_P_FLOOR = tl.constexpr(P_FLOOR)
_FP8_P_SHIFT = tl.constexpr(FP8_P_SHIFT)
_SPARSE_BLOCK = tl.constexpr(SPARSE_BLOCK)
_MASK_NONE, _MASK_BOOL, _MASK_ADD, _MASK_KEY = 0, 1, 2, 3  # none, bool and additive (B, H, Sq, Sk), a key bias

# Ablation switches of the portable kernel, for ``benchmarks/ablate.py`` (bits of its ``ABLATE`` constexpr, given
# through ``triton_attention``'s private ``_ablate``): each removes one piece of the work, so the results are
# wrong by design. 0, the default, compiles the kernel as shipped: the switches are constexpr, resolved at compile
# time, so none of them leaves code behind.
ABLATE_EXP2 = 1  # unmasked full tiles: p = the exponent's argument, no exp2 (MUFU)
ABLATE_ROWMAX = 2  # unmasked full tiles: the running max stays 0 (no reduction, no alpha rescale)
ABLATE_PV_MMA = 4  # FP8 P·V: no V loads and no P·V MMA; P's row sums go into acc instead
ABLATE_FP8_CAST = 8  # FP8 P·V: P's e4m3 conversion replaced by a bitcast of its exponent bits
_ABLATE_EXP2 = tl.constexpr(ABLATE_EXP2)
_ABLATE_ROWMAX = tl.constexpr(ABLATE_ROWMAX)
_ABLATE_PV_MMA = tl.constexpr(ABLATE_PV_MMA)
_ABLATE_FP8_CAST = tl.constexpr(ABLATE_FP8_CAST)


@triton.jit
def _attn_block(
    acc, m_i, l_i, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, start_n, offs_m, offs_n, offs_d,
    SQ, SK, D,
    stride_vs, stride_mn, kv,
    BLOCK_N: tl.constexpr, DP: tl.constexpr, PV: tl.constexpr, MASK: tl.constexpr, TAIL: tl.constexpr,
    P_SHIFT: tl.constexpr, K_GROUPS: tl.constexpr, ABLATE: tl.constexpr, TMA: tl.constexpr,
):
    """One key tile into the running state. ``TMA``: K and FP8 V tiles come by TMA, ``kv`` = (K's descriptor, FP8
    Vᵀ's, the row of this (batch, KV head) in K's 2-D view, in Vᵀ's), and ``k_ptrs``/``v_ptrs`` are unused; else
    they are loaded from the pointers."""
    # -- S = Q·Kᵀ on INT8 tensor cores; logits in base 2 are qk · (q scale · k scale) --
    if TMA:
        k_desc, _, k_row, _ = kv
        k = tl.trans(k_desc.load([k_row + start_n, 0]))
    else:
        k = tl.load(k_ptrs)
    qk = tl.dot(q, k)
    # The tile's keys in their K groups, (BLOCK_M, BLOCK_N // 8, K_GROUPS, 8 // K_GROUPS): key j is in
    # group (j mod 8) div (8 / K_GROUPS), which the MMA's accumulator layout keeps inside one thread, so
    # this reshape moves no data and the group's scale is one multiplier per row and thread.
    G: tl.constexpr = K_GROUPS
    qk4 = tl.reshape(qk, [qk.shape[0], BLOCK_N // 8, G, 8 // G])
    qsk = qs[:, None] * tl.load(ks_ptr + (8 // G) * tl.arange(0, G))[None, :]  # (BLOCK_M, G)
    cols = start_n + offs_n
    if TAIL or MASK != 0:
        s = tl.reshape(qk4.to(tl.float32) * qsk[:, None, :, None], [qk.shape[0], BLOCK_N])
        if TAIL:
            s = tl.where(cols[None, :] < SK, s, float("-inf"))
        if MASK == 3:  # a key bias (``key_mask``): one value a key, -inf past the sequence; mask_ptrs is the tile's
            s = s + tl.load(mask_ptrs + offs_n)[None, :]
        elif MASK != 0:
            mvalid = (offs_m[:, None] < SQ) & (cols[None, :] < SK)
            if MASK == 1:
                keep = tl.load(mask_ptrs, mask=mvalid, other=0)
                s = tl.where(keep != 0, s, float("-inf"))
            else:
                s = s + tl.load(mask_ptrs, mask=mvalid, other=0.0).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK != 0:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with every key masked so far
        else:
            m_safe = m_new
        p = tl.math.exp2(s - (m_safe - P_SHIFT)[:, None])
    else:
        # the scales are positive, so each group's max is taken on the INT32 scores (first over the
        # thread's own columns) and the exponent's argument is a single FMA per score
        gmax = tl.max(tl.max(qk4, 1), 2).to(tl.float32) * qsk
        if (_ABLATE_ROWMAX & ABLATE) != 0:
            m_new = m_i * 0.0
        else:
            m_new = tl.maximum(m_i, tl.max(gmax, 1))
        m_safe = m_new
        if (_ABLATE_EXP2 & ABLATE) != 0:
            p4 = qk4.to(tl.float32) * qsk[:, None, :, None] - (m_safe - P_SHIFT)[:, None, None, None]
        else:
            p4 = tl.math.exp2(qk4.to(tl.float32) * qsk[:, None, :, None] - (m_safe - P_SHIFT)[:, None, None, None])
        p = tl.reshape(p4, [qk.shape[0], BLOCK_N])
    # -- update running max and sum --
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    # -- P·V, accumulated in FP32 outside the MMA --
    if PV == 0:
        if TAIL:
            v = tl.load(v_ptrs, mask=(cols[:, None] < SK) & (offs_d[None, :] < D), other=0.0)
        else:
            v = tl.load(v_ptrs, mask=offs_d[None, :] < D, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    elif PV == 1:
        if (_ABLATE_PV_MMA & ABLATE) == 0:
            if TMA:
                _, v_desc, _, v_row = kv
                v = tl.trans(v_desc.load([v_row, start_n]))
            else:
                v = tl.load(v_ptrs)
        if (_ABLATE_FP8_CAST & ABLATE) != 0:
            p8 = (p.to(tl.int32, bitcast=True) >> 23).to(tl.int8).to(tl.float8e4nv, bitcast=True)
        else:
            p8 = p.to(tl.float8e4nv)  # already scaled by 2^P_SHIFT through the exponent
        if v8_keys_permuted(DP, BLOCK_N):  # V's keys are stored in layout.v8_key_order: P's columns follow
            p8 = columns_to_v8_order(p8, DP)
        if (_ABLATE_PV_MMA & ABLATE) != 0:
            acc = acc * alpha[:, None] + tl.sum(p8.to(tl.float32), 1)[:, None]
        else:
            acc = acc * alpha[:, None] + tl.dot(p8, v)
    else:
        v = tl.load(v_ptrs)
        p_max = tl.maximum(tl.max(p, 1), _P_FLOOR)
        y = tl.minimum(p * rdiv(_INT8_MAX, p_max)[:, None], _INT8_MAX)
        p8 = round_to_int8(y)
        if DP > 128:
            # Triton 3.6 miscompiles this INT8 dot at N=256 on sm_90 (columns past 128 are wrong).
            # Small integers are exact in fp16 and every fp32 partial sum stays below 2^24, so the
            # fp16 MMA gives the same result.
            pv = tl.dot(p8.to(tl.float16), v.to(tl.float16))
        else:
            pv = tl.dot(p8, v).to(tl.float32)
        acc = acc * alpha[:, None] + pv * tl.math.div_rn(p_max, p_max * 0.0 + _INT8_MAX)[:, None]
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q8, QS, K8, KS, V, VS, K_DESC, V_DESC, MASK_PTR, KB_CNT, KB_CLEAN, KB_IDX, O, LSE, OS, LSES,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_os, stride_od,
    H, H_KV, SQ, SK, SQ_PAD, SK_PAD, D, N_FULL, NQB, NKB,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DP: tl.constexpr,
    PV: tl.constexpr, MASK: tl.constexpr, V_ALIGN8: tl.constexpr, K_GROUPS: tl.constexpr, SPARSE: tl.constexpr,
    ABLATE: tl.constexpr, RETURN_LSE: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
):
    tl.static_assert(BLOCK_N % 16 == 0)
    tl.static_assert(not TMA or PV == 1)
    tl.static_assert(DP >= 32)
    # FP8 P·V: P is scaled by 2^P_SHIFT (into e4m3's normal range) through the exponent's offset; the
    # running sum carries the same factor, so it cancels in acc / l.
    P_SHIFT: tl.constexpr = _FP8_P_SHIFT if PV == 1 else 0.0
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    kvh = b * H_KV + h // (H // H_KV)
    off_kv = kvh.to(tl.int64)
    # TMA: K_DESC and V_DESC describe K as (B·H_KV·SK_PAD, DP) and FP8 Vᵀ as (B·H_KV·DP, SK_PAD); this KV head's first
    # row in each goes with them
    kv = (K_DESC, V_DESC, kvh * SK_PAD, kvh * DP)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)

    # Quantized buffers are padded to whole tiles: no load masks.
    q = tl.load(Q8 + off_bh.to(tl.int64) * SQ_PAD * DP + offs_m[:, None] * DP + offs_d[None, :])
    qs = tl.load(QS + off_bh.to(tl.int64) * SQ_PAD + offs_m)
    k_ptrs = K8 + off_kv * SK_PAD * DP + offs_n[None, :] * DP + offs_d[:, None]  # Kᵀ tile (DP, BLOCK_N)
    ks_ptr = KS + off_kv * SK_PAD  # K's scales, stored per key
    if PV == 0:
        v_offs = (b.to(tl.int64) * stride_vb + (h // (H // H_KV)).to(tl.int64) * stride_vh
                  + offs_n[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd)
        if V_ALIGN8:
            # V is read in place: the wrapper checked that D and V's strides are multiples of 8, which
            # Triton cannot see below 16; told so (and D written as a multiple of 8 for the column mask),
            # it copies V tiles asynchronously (cp.async, pipelined) instead of element by element
            v_offs = tl.multiple_of(v_offs, [1, 8])
            D = D // 8 * 8
        v_ptrs = V + v_offs
        v_tok = stride_vs
    elif PV == 1:
        v_ptrs = V + off_kv * DP * SK_PAD + offs_d[None, :] * SK_PAD + offs_n[:, None]  # from (DP, SK_PAD)
        v_tok = 1
    else:
        v_ptrs = V + off_kv * SK_PAD * DP + offs_n[:, None] * DP + offs_d[None, :]
        v_tok = DP
    mask_ptrs = (MASK_PTR + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
                 + offs_m[:, None].to(tl.int64) * stride_mm + offs_n[None, :] * stride_mn)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    if SPARSE:
        # the key blocks this query block keeps, ascending (``_block_list_kernel``): the tiles of the others are
        # never loaded. SPLIT: every key block, the mask's skipped ones first (``_split_list_kernel``); the
        # attention over those is written out (OS, LSES) before the kept ones join the same accumulator.
        row = off_bh.to(tl.int64) * NQB + start_m * BLOCK_M // _SPARSE_BLOCK
        idx_ptr = KB_IDX + row * NKB
        n_first = tl.load(KB_CNT + row)
        # SPLIT with one tile a block: the sequence's partial last block runs once, between the lists: before the
        # skipped blocks' write when the mask skips it, after it when the mask keeps it (a masked tile in each list
        # would not fit the loop's registers). With several tiles a block each list runs its own: there a second
        # copy of the write spills more than a second copy of the partial block.
        ONE_TAIL: tl.constexpr = SPLIT and BLOCK_N == _SPARSE_BLOCK
        acc, m_i, l_i = _attn_listed(
            acc, m_i, l_i, idx_ptr, n_first, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m, offs_n, offs_d,
            SQ, SK, D, NKB, stride_vs, stride_mn, v_tok, kv, BLOCK_N, DP, PV, MASK, P_SHIFT, K_GROUPS, ABLATE,
            not ONE_TAIL, TMA)
        if ONE_TAIL:
            tail_skipped = _has_tail(idx_ptr, n_first, SK, NKB)
            if not tail_skipped:
                _store_rows(acc, m_i, l_i, OS, LSES, VS, off_kv, b, h, off_bh, offs_m, offs_d, SQ, D,
                            stride_ob, stride_oh, stride_os, stride_od, DP, PV, P_SHIFT, True)
            if SK % _SPARSE_BLOCK != 0:  # the lists hold every block: the partial one is in one of them
                acc, m_i, l_i = _attn_tail(
                    acc, m_i, l_i, NKB - 1, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m, offs_n, offs_d,
                    SQ, SK, D, stride_vs, stride_mn, v_tok, kv, BLOCK_N, DP, PV, MASK, P_SHIFT, K_GROUPS, ABLATE, TMA)
            if tail_skipped:
                _store_rows(acc, m_i, l_i, OS, LSES, VS, off_kv, b, h, off_bh, offs_m, offs_d, SQ, D,
                            stride_ob, stride_oh, stride_os, stride_od, DP, PV, P_SHIFT, True)
        elif SPLIT:
            _store_rows(acc, m_i, l_i, OS, LSES, VS, off_kv, b, h, off_bh, offs_m, offs_d, SQ, D,
                        stride_ob, stride_oh, stride_os, stride_od, DP, PV, P_SHIFT, True)
        if SPLIT:
            acc, m_i, l_i = _attn_listed(
                acc, m_i, l_i, idx_ptr + n_first, NKB - n_first, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m,
                offs_n, offs_d, SQ, SK, D, NKB, stride_vs, stride_mn, v_tok, kv, BLOCK_N, DP, PV, MASK, P_SHIFT,
                K_GROUPS, ABLATE, not ONE_TAIL, TMA)
    elif MASK == 3:
        # a key mask (``key_mask_plan``): this row's clean tiles unmasked, then its partial ones with the key bias
        # (MASK_PTR); tiles whose every key is masked are not listed. stride_mb/stride_mh: the list row's strides.
        lrow = (b * stride_mb + h * stride_mh).to(tl.int64)
        n_tiles = tl.load(KB_CNT + lrow)
        n_clean = tl.load(KB_CLEAN + 2 * lrow)
        n_prefix = tl.load(KB_CLEAN + 2 * lrow + 1)  # the clean tiles 0 .. n_prefix - 1, in order: no list reads
        idx_ptr = KB_IDX + lrow * NKB
        bias_ptr = MASK_PTR + lrow * SK_PAD
        for start_n in range(0, n_prefix * BLOCK_N, BLOCK_N):
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + tl.cast(start_n, tl.int64) * v_tok,
                ks_ptr + start_n, bias_ptr, start_n, offs_m, offs_n, offs_d, SQ, SK, D, stride_vs, stride_mn, kv,
                BLOCK_N, DP, PV, 0, False, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
        for i in range(n_prefix, n_clean):
            start_n = tl.load(idx_ptr + i) * BLOCK_N
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok, ks_ptr + start_n,
                bias_ptr, start_n, offs_m, offs_n, offs_d, SQ, SK, D, stride_vs, stride_mn, kv,
                BLOCK_N, DP, PV, 0, False, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
        for i in range(n_clean, n_tiles):
            start_n = tl.load(idx_ptr + i) * BLOCK_N
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok, ks_ptr + start_n,
                bias_ptr + start_n, start_n, offs_m, offs_n, offs_d, SQ, SK, D, stride_vs, stride_mn, kv,
                BLOCK_N, DP, PV, 3, True, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
    else:
        for start_n in range(0, N_FULL, BLOCK_N):
            # 8-bit tiles are addressed from the loop index: fewer instructions a step than pointers carried
            # through the pipelined loop, 2-7% faster. With 16-bit V (read in place through its strides) the
            # carried pointers were faster at image lengths, so they stay (``at`` is 0 and the pointers move).
            at = start_n * 0 if PV == 0 else start_n
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + at * DP, v_ptrs + at.to(tl.int64) * v_tok, ks_ptr + at,
                mask_ptrs + at.to(tl.int64) * stride_mn, start_n, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, False, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
            if PV == 0:
                k_ptrs += BLOCK_N * DP
                v_ptrs += BLOCK_N * v_tok
                ks_ptr += BLOCK_N
                mask_ptrs += BLOCK_N * stride_mn
        at = N_FULL * 0 if PV == 0 else N_FULL
        if N_FULL < SK:
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + at * DP, v_ptrs + at.to(tl.int64) * v_tok, ks_ptr + at,
                mask_ptrs + at.to(tl.int64) * stride_mn, N_FULL, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, True, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )

    _store_rows(acc, m_i, l_i, O, LSE, VS, off_kv, b, h, off_bh, offs_m, offs_d, SQ, D,
                stride_ob, stride_oh, stride_os, stride_od, DP, PV, P_SHIFT, RETURN_LSE)


@triton.jit
def _has_tail(idx_ptr, n, SK, NKB):
    """Whether the ``n`` key blocks listed ascending at ``idx_ptr`` end with the sequence's partial last block."""
    last = tl.load(idx_ptr + tl.maximum(n - 1, 0), mask=n > 0, other=0)
    return (n > 0) & (SK % _SPARSE_BLOCK != 0) & (last == NKB - 1)


@triton.jit
def _attn_listed(
    acc, m_i, l_i, idx_ptr, n, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m, offs_n, offs_d,
    SQ, SK, D, NKB, stride_vs, stride_mn, v_tok, kv,
    BLOCK_N: tl.constexpr, DP: tl.constexpr, PV: tl.constexpr, MASK: tl.constexpr, P_SHIFT: tl.constexpr,
    K_GROUPS: tl.constexpr, ABLATE: tl.constexpr, TAIL: tl.constexpr, TMA: tl.constexpr,
):
    """The ``n`` key blocks listed ascending at ``idx_ptr``, into the running state. The sequence's partial last
    block, when listed, is the list's last: with ``TAIL`` its tiles run after the loop, else the caller runs them."""
    has_tail = _has_tail(idx_ptr, n, SK, NKB)
    kb_next = tl.load(idx_ptr, mask=n > 0, other=0)
    for i in range(n - has_tail.to(tl.int32)):
        kb = kb_next
        kb_next = tl.load(idx_ptr + tl.minimum(i + 1, n - 1))  # a step ahead: its latency hides
        for t in tl.static_range(_SPARSE_BLOCK // BLOCK_N):
            start_n = kb * _SPARSE_BLOCK + t * BLOCK_N
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok,
                ks_ptr + start_n, mask_ptrs + start_n * stride_mn, start_n, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, False, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
    if TAIL:
        if has_tail:
            acc, m_i, l_i = _attn_tail(
                acc, m_i, l_i, NKB - 1, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, v_tok, kv, BLOCK_N, DP, PV, MASK, P_SHIFT, K_GROUPS, ABLATE, TMA)
    return acc, m_i, l_i


@triton.jit
def _attn_tail(
    acc, m_i, l_i, kb, q, qs, k_ptrs, v_ptrs, ks_ptr, mask_ptrs, offs_m, offs_n, offs_d,
    SQ, SK, D, stride_vs, stride_mn, v_tok, kv,
    BLOCK_N: tl.constexpr, DP: tl.constexpr, PV: tl.constexpr, MASK: tl.constexpr, P_SHIFT: tl.constexpr,
    K_GROUPS: tl.constexpr, ABLATE: tl.constexpr, TMA: tl.constexpr,
):
    """Key block ``kb``, the sequence's partial last one: its whole tiles as the dense loop runs them, then the
    partial one masked."""
    for t in tl.static_range(_SPARSE_BLOCK // BLOCK_N):
        start_n = kb * _SPARSE_BLOCK + t * BLOCK_N
        if BLOCK_N == _SPARSE_BLOCK:  # one tile, the partial one: no copy of the whole tiles' code
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok,
                ks_ptr + start_n, mask_ptrs + start_n * stride_mn, start_n, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, True, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
        elif start_n + BLOCK_N <= SK:
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok,
                ks_ptr + start_n, mask_ptrs + start_n * stride_mn, start_n, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, False, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
        elif start_n < SK:
            acc, m_i, l_i = _attn_block(
                acc, m_i, l_i, q, qs, k_ptrs + start_n * DP, v_ptrs + start_n.to(tl.int64) * v_tok,
                ks_ptr + start_n, mask_ptrs + start_n * stride_mn, start_n, offs_m, offs_n, offs_d,
                SQ, SK, D, stride_vs, stride_mn, kv, BLOCK_N, DP, PV, MASK, True, P_SHIFT, K_GROUPS, ABLATE, TMA,
            )
    return acc, m_i, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, O, LSE, VS, off_kv, b, h, off_bh, offs_m, offs_d, SQ, D,
                stride_ob, stride_oh, stride_os, stride_od, DP: tl.constexpr, PV: tl.constexpr,
                P_SHIFT: tl.constexpr, WITH_LSE: tl.constexpr):
    """Normalize the running state and store the rows (rows without keys give 0); ``WITH_LSE``: their log-sum-exp
    too (natural log; l carries P's 2^P_SHIFT, and m is -inf exactly where l is 0)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * rdiv(1.0, l_safe)[:, None]
    if PV != 0:
        out = out * tl.load(VS + off_kv * DP + offs_d)[None, :]
    o_ptrs = (O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D))
    if WITH_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe) - P_SHIFT) * _LN2)
        tl.store(LSE + off_bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)


@triton.jit
def _block_list_kernel(MASK, stride_b, stride_h, stride_q, stride_k, CNT, IDX, H, NQB, NKB, NKB_P2: tl.constexpr,
                       SPLIT: tl.constexpr):
    """Per (batch, head, query block): how many key blocks the bool block mask keeps, and which, ascending.
    ``SPLIT``: every key block, those the mask skips first, then those it keeps (each part ascending), and how many
    it skips."""
    row = tl.program_id(0)
    bh = row // NQB
    offs = tl.arange(0, NKB_P2)
    ptrs = (MASK + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
            + (row % NQB).to(tl.int64) * stride_q + offs * stride_k)
    keep = (tl.load(ptrs, mask=offs < NKB, other=0) != 0).to(tl.int32)
    if SPLIT:
        rest = ((offs < NKB) & (keep == 0)).to(tl.int32)
        n_rest = tl.sum(rest, 0)
        row_ptr = IDX + row.to(tl.int64) * NKB
        tl.store(row_ptr + tl.cumsum(rest, 0) - 1, offs, mask=rest != 0)
        tl.store(row_ptr + n_rest + tl.cumsum(keep, 0) - 1, offs, mask=keep != 0)
        tl.store(CNT + row, n_rest)
    else:
        pool.store_block_list(keep, offs, CNT, IDX, row.to(tl.int64), NKB)


def block_lists(block_mask: torch.Tensor, B: int, H: int, Sq: int, Sk: int, runner: Runner = EAGER,
                split: bool = False):
    """The kernels' form of a block mask broadcastable to (B, H, NQB, NKB) (NQB, NKB: ``SPARSE_BLOCK`` blocks of
    Sq and Sk): counts (B·H·NQB,) int32 and the kept key blocks' indices (B·H·NQB, NKB) int32, ascending, first
    ``count`` of each row valid. ``split``: each row lists every key block, the skipped ones first, and its count
    is of those. One launch, no host synchronization."""
    nqb, nkb = cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)
    mask = block_mask.expand(B, H, nqb, nkb).view(torch.uint8)
    counts = runner.empty((B * H * nqb,), torch.int32, block_mask.device)
    idx = runner.empty((B * H * nqb, nkb), torch.int32, block_mask.device)
    runner.launch(_block_list_kernel, (B * H * nqb,), (
        mask, *mask.stride(), counts, idx, H, nqb, nkb, triton.next_power_of_2(nkb), split,
    ), dict(enable_fp_fusion=FP_FUSION))
    return counts, idx


@triton.jit
def _key_bias_kernel(MASK, stride_mb, stride_mh, stride_mn, BIAS, KIND, H_M, SK, SK_PAD, NT,
                     IS_BOOL: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key tile of one list row: its bias, and its kind (clean, partial or empty)."""
    t = tl.program_id(0)
    row = tl.program_id(1)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < SK
    m = tl.load(MASK + (row // H_M).to(tl.int64) * stride_mb + (row % H_M).to(tl.int64) * stride_mh
                + cols.to(tl.int64) * stride_mn, mask=inside, other=0)
    if IS_BOOL:
        bias = tl.where(m != 0, 0.0, float("-inf"))
    else:
        bias = m.to(tl.float32) * _LOG2E
    bias = tl.where(inside, bias, float("-inf"))
    tl.store(BIAS + row.to(tl.int64) * SK_PAD + cols, bias)
    clean = tl.sum((bias != 0.0).to(tl.int32), 0) == 0
    empty = tl.sum((bias != float("-inf")).to(tl.int32), 0) == 0
    tl.store(KIND + row * NT + t, tl.where(clean, 0, tl.where(empty, 2, 1)), mask=t < NT)


@triton.jit
def _key_list_kernel(KIND, CNT, CLEAN, IDX, NT, NT_P2: tl.constexpr):
    """One list row: its clean tiles, then its partial ones, ascending; how many are clean, and how many of those
    are the sequence's first tiles in order (the prefix, which the kernels address without reading the list)."""
    row = tl.program_id(0)
    offs = tl.arange(0, NT_P2)
    kind = tl.load(KIND + row * NT + offs, mask=offs < NT, other=2)
    is_clean = (kind == 0).to(tl.int32)
    is_partial = (kind == 1).to(tl.int32)
    n_clean = tl.sum(is_clean, 0)
    tl.store(IDX + row * NT + tl.cumsum(is_clean, 0) - 1, offs, mask=is_clean != 0)
    tl.store(IDX + row * NT + n_clean + tl.cumsum(is_partial, 0) - 1, offs, mask=is_partial != 0)
    tl.store(CNT + row, n_clean + tl.sum(is_partial, 0))
    tl.store(CLEAN + 2 * row, n_clean)
    tl.store(CLEAN + 2 * row + 1, tl.min(tl.where(kind != 0, offs, NT), 0))


def key_mask_plan(key_mask: torch.Tensor, Sk: int, block_n: int, runner: Runner = EAGER) -> KeyMaskPlan:
    """The kernels' form of ``key_mask.as_key_mask``'s (B', H', Sk) mask, with key tiles of ``block_n``
    (``key_mask.KeyMaskPlan``): two small launches, no host synchronization."""
    Bm, Hm = key_mask.shape[:2]
    rows, nt, sk_pad = Bm * Hm, cdiv(Sk, block_n), padded_len(Sk)
    mask = key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else key_mask
    dev = key_mask.device
    bias = runner.empty((rows, sk_pad), torch.float32, dev)
    kind = runner.empty((rows, nt), torch.int32, dev)
    counts = runner.empty((rows,), torch.int32, dev)
    clean = runner.empty((rows, 2), torch.int32, dev)
    tiles = runner.empty((rows, nt), torch.int32, dev)
    runner.launch(_key_bias_kernel, (sk_pad // block_n, rows), (
        mask, mask.stride(0), mask.stride(1), mask.stride(2), bias, kind, Hm, Sk, sk_pad, nt,
        key_mask.dtype == torch.bool, block_n), dict(enable_fp_fusion=FP_FUSION))
    runner.launch(_key_list_kernel, (rows,), (kind, counts, clean, tiles, nt, triton.next_power_of_2(nt)),
                  dict(enable_fp_fusion=FP_FUSION))
    return KeyMaskPlan(bias, counts, clean, tiles, Hm if Bm > 1 else 0, 1 if Hm > 1 else 0)


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str,
    pv: PV,
    sm_scale: float,
    smooth_k: bool = True,
    qk_balance: bool | torch.Tensor = False,
    qk_rotate: bool = False,
    attn_mask: torch.Tensor | None = None,
    block_mask: torch.Tensor | None = None,
    q_amax: torch.Tensor | None = None,
    k_amax: torch.Tensor | None = None,
    v_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    sparsity: float | None = None,
    keep_kv_blocks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    return_block_mask: bool = False,
    return_skipped: bool = False,
    sm90: bool = True,
    key: tuple | None = None,
    _ablate: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quantize and run the fused kernel. Inputs are validated by ``int8_attention``.

    Returns ``out`` (allocated if None: ``layout.output_like(q)``), and with ``return_lse``
    each query row's log-sum-exp (``reference.emulate_attention``'s), with ``return_skipped`` (and a
    ``block_mask``: every block is computed) the output and log-sum-exp over the blocks the mask skips, written
    by the same launch, and with ``return_block_mask`` the mask that ``sparsity`` predicted (after the other
    outputs). ``sparsity``: the predictor's level tau
    (``sparsity.predict_block_mask``'s, with ``keep_kv_blocks``), from sums the quantization launch makes as it
    reads Q and K, in two more launches before the attention's (``pool.predict``). Three launches
    (statistics, Q/K/V quantization, attention; two when nothing is measured, or when both sequences are
    short and the statistics and the quantization run in one) and no host synchronization. On sm_90 the attention launch is the Gluon kernel of ``hopper`` where
    it applies (``sm90=False`` forces the portable Triton kernel, for comparisons). The first call of each
    signature is recorded and later ones replay it (``launch.Plan``). ``key``: the signature of this call's
    arguments as ``int8_attention`` computed it (``out`` must then be None), so none is computed here.
    ``_ablate``: the portable kernel's ablation switches (``ABLATE_*``), for ``benchmarks/ablate.py`` only.
    """
    if key is not None and out is None:
        key = ("plan", *key[1:], return_lse, sm90, _ablate)  # out is allocated below, so its signature follows from q's
    else:
        given_bal = qk_balance if isinstance(qk_balance, torch.Tensor) else None
        key = ("plan", layout, pv, sm_scale, smooth_k, given_bal is None and qk_balance, qk_rotate, sparsity, return_lse,
               return_block_mask, return_skipped, sm90, _ablate,
               *map(signature, (q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, keep_kv_blocks, out,
                                given_bal)))
    if return_skipped and (block_mask is None or sparsity is not None):
        raise ValueError("return_skipped needs a block_mask of the caller's (not sparsity=)")
    if out is None:
        out = output_like(q)
    B, H, Sq = to_bhsd(q, layout).shape[:3]
    Sk = to_bhsd(k, layout).shape[2]
    lse = mask_out = skipped = None
    if return_lse:
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if return_skipped:
        skipped = (torch.empty_like(out), torch.empty((B, H, Sq), dtype=torch.float32, device=q.device))
    # a log-sum-exp of the smoothed scores lacks what smoothing took off each row; the quantization launch writes it
    offset = None
    if smooth_k and (return_lse or return_skipped):
        offset = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if return_block_mask:
        mask_out = (torch.ones if sparsity is not None and sparsity >= 1 else torch.empty)(
            (B, H, cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)), dtype=torch.bool, device=q.device)
    if sparsity is not None and sparsity >= 1:  # every block kept: the dense call
        sparsity = None
    inputs = [q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, out, lse,
              qk_balance if isinstance(qk_balance, torch.Tensor) else None, keep_kv_blocks, mask_out,
              *(skipped or (None, None)), offset]

    def record(runner):
        qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
        blocks = None
        if block_mask is not None:
            blocks = block_lists(block_mask, B, H, Sq, Sk, runner, split=return_skipped)
        pooled = None
        if sparsity is not None:
            pooled = pool.pooled_buffers(B, H, kb.shape[1], Sq, Sk, padded_head_dim(qb.shape[3]), q.device, runner)
        quantized = tq.quantize_qkv(  # K quantized in the tile table's K tiles, which attend() runs
            qb, kb, vb, sm_scale, pv, smooth_k=smooth_k, qk_balance=qk_balance, qk_rotate=qk_rotate, q_amax=q_amax,
            k_amax=k_amax, v_amax=v_amax, k_mean=k_mean, pooled=pooled, offset=offset, runner=runner,
        )
        if sparsity is not None:
            mask = mask_out if mask_out is not None else runner.empty(
                (B, H, cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)), torch.bool, q.device)
            blocks = pool.predict(pooled, B, H, Sq, Sk, sm_scale, sparsity, MIN_SIMILARITY, keep_kv_blocks, mask,
                                  lists=True, runner=runner)
        attend(quantized, vb, to_bhsd(out, layout), pv=pv, attn_mask=attn_mask, blocks=blocks, lse=lse, sm90=sm90,
               skipped=None if skipped is None else (to_bhsd(skipped[0], layout), skipped[1]), runner=runner,
               _ablate=_ablate)

    plan_or_run(key, inputs, record)
    if lse is None and skipped is None:
        return (out, mask_out) if mask_out is not None else out
    results = [out]
    for lse_out in (lse, None if skipped is None else skipped[1]):
        if lse_out is not None and offset is not None:
            lse_out.add_(offset)
    if lse is not None:
        results.append(lse)
    if skipped is not None:
        results.extend(skipped)
    if mask_out is not None:
        results.append(mask_out)
    return tuple(results)


def attend(
    quantized: tq.Quantized,
    vb: torch.Tensor,
    ob: torch.Tensor,
    *,
    pv: PV,
    attn_mask: torch.Tensor | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse: torch.Tensor | None = None,
    skipped: tuple[torch.Tensor, torch.Tensor] | None = None,
    sm90: bool = True,
    runner: Runner = EAGER,
    _ablate: int = 0,
) -> None:
    """The attention launch alone, on ``quantize.quantize_qkv``'s outputs (made with the tile table's
    ``k_tile`` for this head dim and ``pv``); ``triton_attention`` is the two in a row. Benchmarks time it
    to compare with kernels whose published speed excludes quantization.

    quantized: what ``quantize_qkv`` returns; vb: the caller's V viewed
    (B, H_kv, Sk, D), read in place for fp16 P·V; ob: the output viewed (B, H, Sq, D), written in place.
    blocks: a block mask as ``block_lists`` gives it (None: dense); attn_mask, where there is none: a key mask
    (``key_mask.as_key_mask``) runs as ``key_mask_plan``'s lists, any other mask element by element (portable kernel).
    lse: where to write each query row's log-sum-exp, float32 (B, H, Sq) contiguous, or None.
    skipped: with ``blocks`` from ``block_lists(..., split=True)``: where to write the attention over the blocks
    the mask skips, (output viewed (B, H, Sq, D) with ``ob``'s strides, log-sum-exp like ``lse``); ``ob`` then gets
    every block.
    ``_ablate``: as ``triton_attention``'s; nonzero runs the portable kernel.
    """
    q8, qs, k8, ks, vk, vs = quantized
    B, H, Sq, D = ob.shape
    H_kv, Sk = vb.shape[1], vb.shape[2]
    cfg = tile_config(D, pv)
    if pv is PV.FP16:
        vk, vs = vb, qs  # V read in place; vs unused
    key = as_key_mask(attn_mask, B, H, Sk) if blocks is None else None
    keys = None if key is None else key_mask_plan(key, Sk, cfg.block_n, runner)
    if skipped is not None and (blocks is None or skipped[0].stride() != ob.stride()):
        raise ValueError("skipped needs split block lists and an output with ob's strides")
    if (sm90 and not _ablate and (skipped is None or pv is PV.FP8)  # the split lists: the FP8 ping-pong kernel
            and call_kernel(ob, vb, pv, q8.shape[-1], attn_mask is not None and keys is None) is Kernel.SM90_GLUON):
        if hopper.launch(q8, qs, k8, ks, vk, vs, ob, pv=pv, block_n=cfg.block_n, H=H, H_kv=H_kv, Sq=Sq, Sk=Sk, D=D,
                         blocks=blocks, keys=keys, lse=lse, skipped=skipped, runner=runner):
            return

    counts, clean, idx = (*blocks[:1], qs, *blocks[1:]) if blocks is not None else (qs, qs, qs)
    n_lists = cdiv(Sk, SPARSE_BLOCK)
    if keys is not None:
        mask, mask_kind, mstride = keys.bias, _MASK_KEY, (keys.stride_b, keys.stride_h, 0, 0)
        counts, clean, idx, n_lists = keys.counts, keys.clean, keys.tiles, keys.tiles.shape[1]
    elif attn_mask is None:
        mask, mask_kind, mstride = qs, _MASK_NONE, (0, 0, 0, 0)
    else:
        mask = attn_mask.expand(B, H, Sq, Sk)
        if mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), _MASK_BOOL
        else:
            mask_kind = _MASK_ADD
        mstride = mask.stride()

    dp = q8.shape[-1]
    tma = is_sm90(ob.device) and tma_tiles(pv, dp, mask_kind, B * H * Sq * Sk)
    k_desc, v_desc = k8, vk  # unread without TMA
    if tma:  # K as (B·H_kv·Sk_pad, DP) in (BLOCK_N, DP) tiles, FP8 Vᵀ as (B·H_kv·DP, Sk_pad) in (DP, BLOCK_N)
        k_desc = TensorDescriptor.from_tensor(k8.view(-1, dp), [cfg.block_n, dp])
        v_desc = TensorDescriptor.from_tensor(vk.view(-1, vk.shape[-1]), [dp, cfg.block_n])
    runner.launch(_attn_fwd_kernel, (triton.cdiv(Sq, cfg.block_m), B * H), (
        q8, qs, k8, ks, vk, vs, k_desc, v_desc, mask, counts, clean, idx, ob, lse if lse is not None else qs,
        *(skipped if skipped is not None else (ob, qs)), *vb.stride(), *mstride, *ob.stride(),
        H, H_kv, Sq, Sk, padded_len(Sq), padded_len(Sk), D, Sk // cfg.block_n * cfg.block_n,
        cdiv(Sq, SPARSE_BLOCK), n_lists,
        # BLOCK_M, BLOCK_N, DP, PV, MASK, V_ALIGN8, K_GROUPS, SPARSE, ABLATE, RETURN_LSE, SPLIT, TMA
        cfg.block_m, cfg.block_n, dp, pv.code, mask_kind,
        pv is PV.FP16 and D % 8 == 0 and rows_16b_aligned(vb), cfg.k_groups, blocks is not None, _ablate, lse is not None,
        skipped is not None, tma,
    ), dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
            **(launch_options(pv, dp, mask_kind, tma) if is_sm90(ob.device) else {})))


# Scores (B·H·Sq·Sk) from which a call's head-dim-64 loops take their tiles by TMA (``tma_tiles``): about 0.45 ms
# of kernel at 600 TOPS, several times a call's host time.
TMA_MIN_SCORES = 1 << 30


def tma_tiles(pv: PV, dp: int, mask_kind: int, scores: int) -> bool:
    """Whether the portable kernel's loops take K and FP8 V tiles by TMA (tensor descriptors) on sm_90 rather than
    by cp.async from pointers: its FP8 P·V loops at padded head dim 64 without an elementwise or key mask (dense,
    block-listed and the refresh's split lists), in calls of at least ``TMA_MIN_SCORES`` scores.

    TMA writes shared memory through the async proxy, so no fence stands between a tile's arrival and the wgmma
    that reads it; Triton 3.9 puts a ``MEMBAR`` and a proxy fence before each of a cp.async tile's two wgmmas.
    Kernel alone, NVIDIA H200, half the key blocks skipped where a mask applies, both at their best caps
    (``benchmarks/loop_options.py`` at CogVideoX's (1, 24, 17550, 64) and LTX-Video's (2, 32, 6272, 64)): with
    Triton 3.9 cp.async took 1.04-1.05 times as long as TMA in the dense loop, 1.05-1.11 in the block-listed and
    1.03-1.06 in the refresh; with 3.6 0.99-1.0, 1.01-1.04 and 1.01-1.02 (at SDXL's (2, 10, 4096, 64): 1.01, 1.03,
    1.03). But Triton's launcher encodes the two tensor maps at every launch, in Python: an eager call at
    (2, 4, 256, 64) took 105 µs of host time against 78 with cp.async (same run, replayed plans, H200's host). A
    call that short is host-bound, so TMA waits for calls long enough to hide that. The scores are counted dense: a
    block-sparse call of that size skipping most blocks takes TMA tiles with a shorter kernel, its host time hidden
    only where the loop is GPU-bound or replayed from a CUDA graph."""
    return pv is PV.FP8 and dp == 64 and mask_kind == _MASK_NONE and scores >= TMA_MIN_SCORES


# The cp.async loops' register caps that spill are applied only with the Triton release they were timed with
# (``launch_options``): another release allocates differently (3.9 keeps local loads inside those loops).
_SPILLING_CAPS_TIMED = triton.__version__.startswith("3.6.")


def launch_options(pv: PV, dp: int, mask_kind: int, tma: bool) -> dict:
    """The portable kernel's launch options beyond its tile, on sm_90: register caps for its FP8 P·V loops at padded
    head dim 64, where 4-warp CTAs share an SM three at 168 registers a thread and four at 128.

    With TMA tiles (``tma_tiles``) every loop runs best at 128 with Triton 3.6 and 3.9 (same runs): at 168 the
    dense, block-listed and refresh loops took 1.04-1.09 times as long, uncapped 1.03-1.08 (the block-listed loop at
    LTX-Video's shape: 0.99-1.0). Uncapped they need about 134, 165 and 168 registers (offline sm_90 build, Triton
    3.6); at 128 the dense and block-listed loops spill nothing with either release, the refresh 32 bytes with 3.9.
    That cap applies with every release; ``tests/test_compile.py`` bounds its spills.
    With cp.async tiles and Triton 3.6: capped at 128 the dense and block-listed loops (about 165 uncapped) run 1-4%
    and 0.5-3% faster at every head-dim-64 shape timed, and the refresh's (about 210) 6-14% faster than uncapped and
    up to 4% faster than at 168, despite 24-160 bytes of spills, mostly outside the loops. With other releases only caps
    that spill nothing in the offline sm_90 build are kept: 168, where with Triton 3.9 uncapped the dense loop took
    1.02 times as long, the block-listed one the same within 1% and the refresh 1.14 times. The key-mask loop
    (cp.async; about 240 where the keys end in a partial tile) runs best at 168: 8-9% faster than uncapped there,
    and 1-5% slower at 128 where it fits in 168 anyway. Elementwise masks and 16-bit P·V are left uncapped (a cap
    at 168 cost the dense 16-bit P·V loop 15%)."""
    if pv is not PV.FP8 or dp != 64 or mask_kind in (_MASK_BOOL, _MASK_ADD):
        return {}
    if tma or (mask_kind == _MASK_NONE and _SPILLING_CAPS_TIMED):
        return dict(maxnreg=128)
    return dict(maxnreg=168)


def call_kernel(ob: torch.Tensor, vb: torch.Tensor, pv: PV, dp: int, masked: bool) -> Kernel:
    """The kernel that runs the attention of a call with output ``ob`` and V ``vb`` (both (B, H, S, D) views) at
    padded head dim ``dp``: ``SM90_GLUON`` where the sm_90 kernels take it (should their compilation fail at
    this first call, ``hopper.launch`` declines and the portable kernel runs), else ``TRITON``."""
    if sm90_kernel_usable(ob.device) and hopper.supports(ob, vb, pv, dp, masked):
        return Kernel.SM90_GLUON
    return Kernel.TRITON


def planned_kernel(device: torch.device, pv: PV, dp: int) -> tuple[Kernel, str | None]:
    """The kernel an unmasked call at padded head dim ``dp`` on ``device`` runs, without running it, and why
    the sm_90 Gluon kernel does not run where it would apply (None where it runs or does not apply)."""
    if hopper_applies(device, pv, dp):
        reason = sm90_unavailable()
        return (Kernel.TRITON if reason else Kernel.SM90_GLUON), reason
    return Kernel.TRITON, None


def sm90_unavailable() -> str | None:
    """None when the sm_90 Gluon kernels can run with this Triton, else why the portable kernel runs instead
    (they did not import, or one failed to compile at its first call)."""
    if hopper is None:
        return f"the sm_90 Gluon kernels do not import with Triton {triton.__version__} ({_HOPPER_IMPORT_ERROR})"
    return hopper.compile_failure


def hopper_applies(device: torch.device, pv: PV, dp: int) -> bool:
    """Whether a call at padded head dim ``dp`` on ``device``, unmasked or with a key mask (``hopper.supports``
    refuses masks that vary over the queries), is one the sm_90 kernels are for."""
    return pv is not PV.INT8 and dp == 128 and is_sm90(device)


def sm90_kernel_usable(device: torch.device) -> bool:
    """Whether the Gluon kernels may run; warns once where an sm_90 GPU meets a Triton whose Gluon they cannot use."""
    if hopper is not None:
        return hopper.compile_failure is None
    if device.type == "cuda":
        _warn_sm90_import(device.index)
    return False


@functools.lru_cache(maxsize=None)
def _warn_sm90_import(device_index: int | None) -> None:
    if torch.cuda.get_device_capability(device_index) == (9, 0):
        warn_user(f"diffusion_int8: {sm90_unavailable()}; the portable Triton kernel runs instead (same "
                  f"numerics, slower at head dim 128). Tested: Triton {TESTED_TRITON}.")
