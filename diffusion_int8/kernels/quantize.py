"""Triton kernels that quantize Q, K and V for the attention kernel.

They produce bit for bit what ``reference.quantize_q/k/v`` produce (see that module for the
numerics). Inputs are read through their strides, so (B, S, H, D) views need no copy; outputs are
contiguous, padded to ``SEQ_PAD`` tokens and a power-of-two head dim, so the attention kernel loads
whole tiles without masks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import AMAX_FLOOR, FP8_MAX, FP_FUSION, INT8_MAX, LOG2E, PV, padded_head_dim, tile_config
from .launch import EAGER, Runner
from .layout import padded_len, v_channel_amax
from .tl_helpers import rdiv, round_to_int8

_ROW_BLOCK = 64  # tokens per program when the scale is per token
# Compiled kernels may only read globals that are constexpr.
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_INT8_MAX = tl.constexpr(INT8_MAX)
_FP8_MAX = tl.constexpr(FP8_MAX)


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
    Q, QAMAX, Q8, QS, K, KMEAN, KAMAX, K8, KS, V, VRANGE, VAMAX, V8, VS,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qab, stride_qah, stride_kab, stride_kah, stride_vab, stride_vah, stride_vad,
    stride_kmb, stride_kmh, stride_kmd,
    H, H_KV, SQ, SK, D, SQ_PAD, SK_PAD, NQ, scale_mult,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, K_GROUPS: tl.constexpr, DP: tl.constexpr,
    SMOOTH: tl.constexpr, Q_STATIC: tl.constexpr, K_STATIC: tl.constexpr, V_FMT: tl.constexpr,
    V_STATIC: tl.constexpr,
):
    # One launch for Q, K and V: programs [0, NQ) take Q_BLOCK tokens of Q, the rest one K tile of
    # K_BLOCK tokens (K_GROUPS scales) and the same tokens of V.
    pid = tl.program_id(0)
    if pid < NQ:
        n_s = SQ_PAD // Q_BLOCK
        _quant_q_block(
            Q, QAMAX, Q8, QS, stride_qb, stride_qh, stride_qs, stride_qd, stride_qab, stride_qah,
            pid % n_s, pid // n_s, H, SQ, D, SQ_PAD, scale_mult, Q_BLOCK, DP, Q_STATIC,
        )
    else:
        n_s = SK_PAD // K_BLOCK
        _quant_kv_block(
            K, KMEAN, KAMAX, K8, KS, V, VRANGE, VAMAX, V8, VS,
            stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
            stride_kab, stride_kah, stride_vab, stride_vah, stride_vad, stride_kmb, stride_kmh, stride_kmd,
            (pid - NQ) % n_s, (pid - NQ) // n_s, H_KV, SK, D, SK_PAD,
            K_BLOCK, K_GROUPS, DP, SMOOTH, K_STATIC, V_FMT, V_STATIC,
        )


@triton.jit
def _quant_q_block(
    Q, QAMAX, Q8, QS, stride_qb, stride_qh, stride_qs, stride_qd, stride_qab, stride_qah,
    pid_s, pid_bh, H, SQ, D, SQ_PAD, scale_mult,
    BLOCK: tl.constexpr, DP: tl.constexpr, STATIC: tl.constexpr,
):
    x, offs_s, offs_d, _ = _load_tile(Q, stride_qb, stride_qh, stride_qs, stride_qd, pid_s, pid_bh, H, SQ, D, BLOCK, DP)
    q8, qs = _quant_int8(x, QAMAX + (pid_bh // H) * stride_qab + (pid_bh % H) * stride_qah, 0, STATIC)
    tl.store(Q8 + pid_bh.to(tl.int64) * SQ_PAD * DP + offs_s[:, None] * DP + offs_d[None, :], q8)
    tl.store(QS + pid_bh * SQ_PAD + offs_s, qs * scale_mult)


@triton.jit
def _quant_kv_block(
    K, KMEAN, KAMAX, K8, KS, V, VRANGE, VAMAX, V8, VS,
    stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
    stride_kab, stride_kah, stride_vab, stride_vah, stride_vad, stride_kmb, stride_kmh, stride_kmd,
    pid_s, pid_bh, H, S, D, S_PAD,
    BLOCK: tl.constexpr, GROUPS: tl.constexpr, DP: tl.constexpr, SMOOTH: tl.constexpr, STATIC: tl.constexpr,
    V_FMT: tl.constexpr, V_STATIC: tl.constexpr,
):
    # One K tile and the same tokens of V (V_FMT: 0 none, 1 FP8, 2 INT8), with K's mean
    # (measured by kv_moments or static, read through strides) and V's range from kv_moments (read from
    # VAMAX instead if V_STATIC).
    b, h = pid_bh // H, pid_bh % H
    x, offs_s, offs_d, valid = _load_tile(K, stride_kb, stride_kh, stride_ks, stride_kd, pid_s, pid_bh, H, S, D, BLOCK, DP)
    if SMOOTH:
        mean = tl.load(KMEAN + b * stride_kmb + h * stride_kmh + offs_d * stride_kmd, mask=offs_d < D, other=0.0)
        x = tl.where(valid, x - mean[None, :], 0.0)
    k8, ks = _quant_int8(x, KAMAX + b * stride_kab + h * stride_kah, GROUPS, STATIC)
    base = pid_bh.to(tl.int64) * S_PAD * DP
    tl.store(K8 + base + offs_s[:, None] * DP + offs_d[None, :], k8)
    tl.store(KS + pid_bh * S_PAD + offs_s, ks)
    if V_FMT != 0:
        # the range as reference.v_channel_amax gives it: floored, NaN where non-finite, padded with 1
        if V_STATIC:
            amax = _static_range(tl.load(VAMAX + b * stride_vab + h * stride_vah + offs_d * stride_vad,
                                         mask=offs_d < D, other=1.0))
        else:
            amax = tl.load(VRANGE + pid_bh * DP + offs_d)
        amax = tl.where(offs_d < D, tl.maximum(amax, _AMAX_FLOOR) + amax * 0.0, 1.0)
        v, _, _, _ = _load_tile(V, stride_vb, stride_vh, stride_vs, stride_vd, pid_s, pid_bh, H, S, D, BLOCK, DP)
        if V_FMT == 1:
            inv = rdiv(_FP8_MAX, amax)
            y = tl.minimum(tl.maximum(v * inv[None, :], -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)
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


@triton.jit
def _kv_stats_kernel(
    K, V, KSUM, VMAX, DONE, KMEAN, VRANGE,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H, S, D, N_CHUNKS, chunk,
    BLOCK: tl.constexpr, DP: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr,
):
    # One (batch, head, chunk of tokens) of K (programs [0, N_CHUNKS) if HAS_K) or of V (the rest): K's
    # column sums or V's column |max| over the chunk, in fp32, kept per element and reduced across rows
    # once at the end rather than per tile; K and V in separate programs hold half the registers. The
    # program that finishes its (batch, head) last folds every chunk's partials, in chunk order, into
    # K's mean and V's range, so the quantization programs read two finished vectors instead of
    # folding them each. V's range is NaN where a NaN/Inf was seen (the GPU's max drops NaN, so a sum
    # of x·0 carries it).
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_c = pid % N_CHUNKS
    offs_d = tl.arange(0, DP)
    out = (pid_bh * N_CHUNKS + pid_c) * DP + offs_d
    first = pid_c * (chunk // BLOCK)  # chunk is a multiple of BLOCK
    if pid < N_CHUNKS * (1 if HAS_K else 0):
        ksum = tl.zeros([BLOCK, DP], tl.float32)
        for i in range(0, chunk // BLOCK):
            k, _, _, _ = _load_tile(K, stride_kb, stride_kh, stride_ks, stride_kd, first + i, pid_bh, H, S, D, BLOCK, DP)
            ksum += k
        tl.store(KSUM + out, tl.sum(ksum, axis=0))
    else:
        vmax = tl.zeros([BLOCK, DP], tl.float32)
        vpoison = tl.zeros([BLOCK, DP], tl.float32)
        for i in range(0, chunk // BLOCK):
            v, _, _, _ = _load_tile(V, stride_vb, stride_vh, stride_vs, stride_vd, first + i, pid_bh, H, S, D, BLOCK, DP)
            vmax = tl.maximum(vmax, tl.abs(v))
            vpoison += v * 0.0
        tl.store(VMAX + out, tl.max(vmax, axis=0) + tl.sum(vpoison, axis=0))
    # The barrier orders every thread's stores before the counter's acq_rel increment, whose acquire
    # side orders the finisher's loads after all the others' stores.
    tl.debug_barrier()
    if tl.atomic_add(DONE + pid_bh, 1) == N_CHUNKS * ((1 if HAS_K else 0) + (1 if HAS_V else 0)) - 1:
        if HAS_K:
            tl.store(KMEAN + pid_bh * DP + offs_d, _finish_k_mean(KSUM, pid_bh, S, N_CHUNKS, DP))
        if HAS_V:
            tl.store(VRANGE + pid_bh * DP + offs_d, _finish_v_range(VMAX, pid_bh, N_CHUNKS, DP))


@triton.jit
def _finish_k_mean(KSUM, pid_bh, S, N_CHUNKS, DP: tl.constexpr):
    """K's token mean from the chunk sums: summed in chunk order, one rounded division."""
    offs_d = tl.arange(0, DP)
    ksum = tl.zeros([DP], tl.float32)
    for c in range(N_CHUNKS):
        ksum += tl.load(KSUM + (pid_bh * N_CHUNKS + c) * DP + offs_d, cache_modifier=".cg")
    return tl.math.div_rn(ksum, ksum * 0.0 + S)


@triton.jit
def _finish_v_range(VMAX, pid_bh, N_CHUNKS, DP: tl.constexpr):
    """V's per-channel |max| from the chunk maxima, NaN where any chunk's is."""
    offs_d = tl.arange(0, DP)
    vmax = tl.zeros([DP], tl.float32)
    poison = tl.zeros([DP], tl.float32)
    for c in range(N_CHUNKS):
        part = tl.load(VMAX + (pid_bh * N_CHUNKS + c) * DP + offs_d, cache_modifier=".cg")
        vmax = tl.maximum(vmax, part)
        poison += part * 0.0
    return vmax + poison


def _stats_chunk(S: int) -> int:
    # enough chunks to fill the GPU at a few (batch, head)s, few enough that the finishing chunk's
    # fold of the partials stays small
    return max(256, triton.cdiv(triton.cdiv(S, 32), 64) * 64)


def kv_moments(k: torch.Tensor | None, v: torch.Tensor | None, runner: Runner = EAGER):
    """One pass over K and/or V (either may be None, not both): K's token mean and V's per-channel
    |max|, (B, H, DP) float32 each, padded channels 0 (None for an input not given; NaN in a channel
    holding a NaN/Inf). ``quantize_qkv`` reads both; ``kv_stats`` gives them in the reference's form."""
    x = k if k is not None else v
    B, H, S, D = x.shape
    dp = padded_head_dim(D)
    chunk = _stats_chunk(S)
    n_chunks = triton.cdiv(S, chunk)
    n = (k is not None) + (v is not None)
    partials = runner.empty((n, B, H, n_chunks, dp), torch.float32, x.device)
    moments = runner.empty((n, B, H, dp), torch.float32, x.device)
    done = runner.empty((B * H,), torch.int32, x.device, zero=True)  # K/V chunks finished per (batch, head)
    kk, vv = (x if t is None else t for t in (k, v))
    runner.launch(_kv_stats_kernel, (n_chunks * n, B * H), (
        kk, vv, partials[0], partials[-1], done, moments[0], moments[-1], *kk.stride(), *vv.stride(),
        H, S, D, n_chunks, chunk, 64 if dp <= 128 else 32, dp, k is not None, v is not None,
    ), dict(enable_fp_fusion=FP_FUSION))
    return (None if k is None else moments[0]), (None if v is None else moments[-1])


def kv_stats(k: torch.Tensor, v: torch.Tensor | None):
    """K's token mean (B, H, D) and V's range ``reference.v_channel_amax(v)`` (B, H, DP), float32, as
    the quantization kernel computes them (the range is None when ``v`` is).

    The Triton twin of ``reference.k_mean`` and ``reference.v_channel_amax``: the chunk sums are added
    in chunk order, so the mean is deterministic but may differ from ``torch.mean`` in the last bit.
    """
    D = k.shape[3]
    mean, vmax = kv_moments(k, v)
    return mean[..., :D], (None if v is None else v_channel_amax(v, vmax[..., :D], static=False))


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
    q_amax: torch.Tensor | None = None,
    k_amax: torch.Tensor | None = None,
    v_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    runner: Runner = EAGER,
):
    """Triton twin of ``reference.quantize_q``, ``quantize_k`` and ``quantize_v``: Q, K and V in one
    launch, after one ``kv_moments`` pass when K's mean or V's range is measured.

    q: (B, H, Sq, D); k, v: (B, H_kv, Sk, D); any strides. k_tile: K's quantization, (block_n, k_groups)
    (``config.TileConfig``), by default the tile table's for this head dim and ``pv``. q_amax / k_amax:
    static ranges broadcastable to (B, H) / (B, H_kv) (``k_amax`` of the smoothed K); v_amax: static per-channel range
    broadcastable to (B, H_kv, D); k_mean: static smoothing mean broadcastable to (B, H_kv, D). With
    ``k_mean`` and ``v_amax`` given (or no smoothing and fp16 P·V) there is no statistics pass. V is
    quantized only when ``pv`` is FP8 or INT8.
    Returns ``Quantized``: q8 (B, H, Sq_pad, DP) int8, qs (B, H, Sq_pad) float32 (sm_scale·log2(e) folded in),
    k8 (B, H_kv, Sk_pad, DP) int8, ks (B, H_kv, Sk_pad) float32 (``k_groups`` scales per tile of
    ``block_n`` keys, stored per key), and v8 / vs as
    ``reference.quantize_v`` gives them (None, None for fp16 P·V). ``runner`` allocates and launches
    (``launch.Runner``).
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
    measure_k = smooth_k and k_mean is None
    measure_v = v_fmt != 0 and v_amax is None
    kmean = vmax = None
    if measure_k or measure_v:
        kmean, vmax = kv_moments(k if measure_k else None, v if measure_v else None, runner)
    q8 = runner.empty((B, H, sq_pad, dp), torch.int8, dev)
    qs = runner.empty((B, H, sq_pad), torch.float32, dev)
    k8 = runner.empty((B, H_kv, sk_pad, dp), torch.int8, dev)
    ks = runner.empty((B, H_kv, sk_pad), torch.float32, dev)
    v8 = vs = None
    if v_fmt:
        shape = (B, H_kv, dp, sk_pad) if v_fmt == 1 else (B, H_kv, sk_pad, dp)
        v8 = runner.empty(shape, torch.float8_e4m3fn if v_fmt == 1 else torch.int8, dev)
        vs = runner.empty((B, H_kv, dp), torch.float32, dev)
    qa, qa_strides = _static_amax(q_amax, (B, H), qs)
    ka, ka_strides = _static_amax(k_amax, (B, H_kv), qs)
    va, va_strides = _static_amax(v_amax, (B, H_kv, D), qs)
    if kmean is None:
        kmean, km_strides = _static_amax(k_mean, (B, H_kv, D), qs)
    else:
        km_strides = kmean.stride()
    nq = sq_pad // _ROW_BLOCK * B * H
    runner.launch(_quant_qkv_kernel, (nq + sk_pad // block_n * B * H_kv,), (
        q, qa, q8, qs, k, kmean, ka, k8, ks,
        v, qs if vmax is None else vmax, va, k8 if v8 is None else v8, qs if vs is None else vs,
        *q.stride(), *k.stride(), *v.stride(), *qa_strides, *ka_strides, *va_strides, *km_strides,
        H, H_kv, Sq, Sk, D, sq_pad, sk_pad, nq, sm_scale * LOG2E,
        # Q_BLOCK, K_BLOCK, K_GROUPS, DP, SMOOTH, Q_STATIC, K_STATIC, V_FMT, V_STATIC
        _ROW_BLOCK, block_n, k_groups, dp, smooth_k, q_amax is not None, k_amax is not None, v_fmt, v_amax is not None,
    ), dict(enable_fp_fusion=FP_FUSION))
    return Quantized(q8, qs, k8, ks, v8, vs)


def _static_amax(amax: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor):
    """A float32 view of a static range (or mean) broadcast to ``shape``, and its strides; or a placeholder."""
    if amax is None:
        return like, (0,) * len(shape)
    a = amax.float().expand(shape)
    return a, a.stride()
