"""Pure-PyTorch emulation of exactly what the Triton kernels compute, and an upcast reference.

``emulate_attention`` reproduces the kernel step by step: the same quantization blocks, the same
round-half-to-even, the same per-block online softmax in base 2 and the same 8-bit rounding of P
against the running row maximum. It is what every test compares the kernel with, and the fallback on
CPUs and on GPUs the kernel does not support. ``attention_ref`` is plain attention in float64.

Numerics shared by both backends (``q``, ``k``, ``v`` in (B, H, S, D), D padded to ``DP``):

* Q·Kᵀ balance (``balance_scales``; optional, ``layout.balance_applies`` says where): Q's channel c divided by a power of
  two s_c and K's multiplied by it, which leaves Q·Kᵀ unchanged exactly and evens out channels that are large
  in one of the two (outlier channels), so one per-token or per-block range no longer follows them.
* Q·Kᵀ rotation (``hadamard``; optional): Q's and K's rows, each on a grid of integers up to 2^14, times a ±1 Hadamard matrix in
  exact integer sums, which spreads every channel over all of them, so outlier channels, shared by Q and K or not,
  no longer set a token's range; Q·Kᵀ is multiplied by DP (exactly), which Q's scale divides out.
* Q, per token: ``q8 = round(clamp(q · 127/amax, ±127))``, scale ``amax/127 · sm_scale · log2(e)``.
* K, per tile of ``block_n`` keys or per 4 interleaved groups of a tile (``config.TileConfig``), after
  subtracting the per-(batch, head) token mean or a given static mean (smoothing: softmax is invariant
  to subtracting any one vector from every key): ``k8 = round(clamp(k · 127/amax, ±127))``, scale
  ``amax/127``, stored per key. The score of query i and key j is ``(q8_i · k8_j) · (qs_i · ks_j)``.
* V, per channel over all tokens: FP8 e4m3 with range 448 or INT8 with range 127.
* Any NaN/Inf in a token (Q), K group or channel (V) makes its scale NaN, so it shows in the output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import AMAX_FLOOR, BALANCE_DEAD_BAND, BALANCE_MAX_LOG2, FP8_MAX, FP8_P_SHIFT, INT8_MAX, LN2, LOG2E, P_FLOOR, PV, SPARSE_BLOCK, padded_head_dim
from .key_mask import CLEAN, PARTIAL, as_key_mask, plan_reference
from .layout import MAX_CHUNKS, Q_SAMPLE_EVERY, balance_applies, check_rotation, chunking, output_like, padded_len, static_range, stats_block, to_bhsd, v_channel_amax  # noqa: F401 (part of this module's API)


def _pad(x: torch.Tensor, s_pad: int, dp: int) -> torch.Tensor:
    """Float32 copy of (B, H, S, D) zero-padded to (B, H, s_pad, dp)."""
    return F.pad(x.float(), (0, dp - x.shape[-1], 0, s_pad - x.shape[-2]))


def _guard(amax: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """Floor the range and turn it NaN where the block held a NaN/Inf (``nonfinite`` is 0 or NaN)."""
    return amax.clamp_min(AMAX_FLOOR) + nonfinite


def _div(a: float | torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """One correctly rounded fp32 division, as ``tl.math.div_rn`` (``scalar / tensor`` in PyTorch is
    ``reciprocal() * scalar``, which rounds twice)."""
    ref = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(ref, a)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(ref, b)
    return torch.div(a, b)


def _round_int8(y: torch.Tensor) -> torch.Tensor:
    # torch.round rounds half to even, as the kernels' (y + 1.5·2²³) − 1.5·2²³ does for |y| ≤ 127.
    return torch.round(y.clamp(-INT8_MAX, INT8_MAX)).to(torch.int8)


def _quantize_groups(x: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one range per row of float32 ``x`` (B, H, n, size), measured or static
    (broadcastable to (B, H)). Returns the int8 tensor and ``amax/127`` (B, H, n); a NaN/Inf in a row makes
    its scale NaN."""
    B, H = x.shape[:2]
    nonfinite = (x * 0.0).sum(-1)
    if amax is None:
        amax = x.abs().amax(-1)
    else:
        amax = static_range(amax).expand(B, H)[..., None].expand_as(nonfinite)
    amax = _guard(amax, nonfinite)
    return _round_int8(x * _div(INT8_MAX, amax)[..., None]), _div(amax, INT8_MAX)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """The biased binary exponent of float32 ``x`` >= 0 (0 for zero and subnormals, 255 for Inf/NaN)."""
    return (x.view(torch.int32) >> 23) & 0xFF


def balance_scales(q: torch.Tensor, k: torch.Tensor, k_mean: torch.Tensor | None) -> torch.Tensor:
    """Per-channel powers of two that balance Q·Kᵀ: Q's channel c is divided by s_c and K's multiplied by it.

    s_c = 2^floor((e_q - e_k) / 2), clamped to 2^±``BALANCE_MAX_LOG2``, from the binary exponents of Q's channel
    |max| (over the query heads sharing a K/V head, on the tokens of one tile in ``Q_SAMPLE_EVERY`` of the
    statistics pass: enough to find a channel large in every token; NaNs skipped) and of K's (after subtracting
    ``k_mean``, if given), so both ranges end within a factor of 2 of their geometric mean; 1 where either
    range is zero or the exponents differ by at most ``BALANCE_DEAD_BAND`` (moving channels of like ranges
    only reshuffles which channel sets a token's range: measured, it costs accuracy where Q and K share
    their outlier channels). Powers of two make the scaling exact. q: (B, H, Sq, D); k: (B, H_kv, Sk, D); k_mean:
    (B, H_kv, D) float32 or None. Returns (B, H_kv, DP) float32, 1 in the padded channels.
    """
    B, H_kv, _, D = k.shape
    # the sampled tokens: one tile of ``stats_block`` tokens in ``Q_SAMPLE_EVERY``
    block = stats_block(padded_head_dim(D))
    sampled = torch.arange(q.shape[2], device=q.device) // block % Q_SAMPLE_EVERY == 0
    qf = q[:, :, sampled].float().unflatten(1, (H_kv, q.shape[1] // H_kv))
    q_range = qf.abs().nan_to_num(nan=0.0).amax(dim=(2, 3))
    kf = k.float()
    k_max = kf.nan_to_num(nan=-math.inf).amax(2)
    k_min = kf.nan_to_num(nan=math.inf).amin(2)
    mean = torch.zeros_like(k_max) if k_mean is None else k_mean.float().expand(B, H_kv, D)
    k_range = torch.maximum(k_max - mean, mean - k_min)
    return F.pad(balance_from_ranges(q_range, k_range), (0, padded_head_dim(D) - D), value=1.0)


def needs_balance(q: torch.Tensor, k: torch.Tensor, smooth_k: bool = True) -> bool:
    """Whether ``balance_scales`` moves any channel of ``q`` (B, H, Sq, D) and ``k`` (B, H_kv, Sk, D), K smoothed
    by its token mean (``smooth_k``): whether Q or K carries outlier channels of its own. Reads one flag from the
    tensors' device."""
    return bool((balance_scales(q, k, k.float().mean(2) if smooth_k else None) != 1).any())


def balance_from_ranges(q_range: torch.Tensor, k_range: torch.Tensor) -> torch.Tensor:
    """The balance of ``balance_scales`` from per-channel ranges (float32, same shape, e.g. (..., D)) of Q (over the
    query heads of a K/V head) and of K (smoothed, if the call smooths): the same shape, powers of two."""
    e_q, e_k = _exponent(q_range.float().contiguous()), _exponent(k_range.float().contiguous())
    e = ((e_q - e_k) >> 1).clamp(-BALANCE_MAX_LOG2, BALANCE_MAX_LOG2)
    e = torch.where((e_q == 0) | (e_k == 0) | ((e_q - e_k).abs() <= BALANCE_DEAD_BAND), 0, e)
    return ((127 + e) << 23).view(torch.float32)


def given_balance(balance: torch.Tensor, B: int, H_kv: int, D: int) -> torch.Tensor:
    """A given Q·Kᵀ balance (e.g. ``Calibration.ranges``'s), broadcastable to (B, H_kv, D), as ``balance_scales``
    gives one: (B, H_kv, DP) float32, 1 in the padded channels."""
    return F.pad(balance.float().expand(B, H_kv, D), (0, padded_head_dim(D) - D), value=1.0)


def _per_query_head(balance: torch.Tensor, H: int) -> torch.Tensor:
    """(B, H_kv, DP) balance -> (B, H, 1, DP), each query head with its K/V head's."""
    return balance.repeat_interleave(H // balance.shape[1], dim=1)[:, :, None, :]


def quantize_q(q: torch.Tensor, sm_scale: float, q_amax: torch.Tensor | None = None,
               balance: torch.Tensor | None = None, rotate: bool = False):
    """Per-token INT8 Q with ``sm_scale·log2(e)`` folded into its scale.

    q: (B, H, S, D) fp16/bf16. q_amax: optional static range broadcastable to (B, H). balance: ``balance_scales``
    (B, H_kv, DP), Q's channels divided by it, or None. rotate: Q's padded rows through ``hadamard`` (K's too,
    in ``quantize_k``), with the 1/DP it multiplies Q·Kᵀ by folded into the scale.
    Returns q8 (B, H, S_pad, DP) int8 and qs (B, H, S_pad) float32.
    """
    S, D = q.shape[2:]
    dp = padded_head_dim(D)
    x = _pad(q, padded_len(S), dp)
    if balance is not None:
        x = x * _div(1.0, _per_query_head(balance, q.shape[1]))
    if rotate:
        x = hadamard(x)
    q8, qs = _quantize_groups(x, q_amax)
    return q8, qs * torch.tensor(q_scale_mult(sm_scale, dp, rotate), dtype=torch.float32)


def q_scale_mult(sm_scale: float, dp: int, rotate: bool) -> float:
    """What Q's scales are multiplied by: sm_scale·log2(e), and 1/DP for Hadamard-rotated Q and K (their
    product is DP times Q·Kᵀ; a power of two, so exact)."""
    return sm_scale * LOG2E / dp if rotate else sm_scale * LOG2E


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The last dim (a power of two, DP) of float32 ``x`` times the unnormalized Sylvester Hadamard matrix H (entries
    ±1, ``H[i, j] = (-1)^popcount(i & j)``), as the kernels compute it. (xH)(yH)ᵀ = DP · x·yᵀ, and an outlier channel's
    value is spread evenly over every channel, so one per-token or per-block range no longer follows it.

    Each row is first rounded (half to even) to a grid: integers of magnitude <= 2^14 times the power of two that
    puts the row's |max| in [2^13, 2^14) (2^-126 at the least, so rows below 2^-113 get fewer levels). The product
    with H is then exact in integers (|xH| <= 2^22), so any order of sums gives the same bits: the kernels use two
    INT8 MMAs (the grid's high and low bytes), this uses float64. The grid's error is at most 2^-14 of the row's
    range (rows of |max| >= 2^-113), against INT8's 2^-8. A row holding a NaN/Inf comes out NaN; a finite row near
    float32's limit may come out Inf, as its exact product would."""
    amax = x.abs().amax(dim=-1, keepdim=True)  # NaN or Inf where the row holds one
    shift = (127 + 140 - _exponent(amax)).clamp(max=127 + 126)  # 2^shift·|max| < 2^14, 2^±shift normal
    grid = torch.round(x * _pow2(shift)).double() + 0.0  # -0 to +0, as the kernels' integers
    for _ in range(x.shape[-1].bit_length() - 1):  # the fast transform; integer sums, exact in float64
        a, b = grid[..., 0::2], grid[..., 1::2]
        grid = torch.cat([a + b, a - b], dim=-1)
    poison = torch.where(amax < float("inf"), torch.zeros_like(amax), float("nan"))
    return grid.float() * (_pow2(2 * 127 - shift) + poison)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) as float32, for int32 exponents in [1, 254]."""
    return (biased << 23).view(torch.float32)


def token_mean(k: torch.Tensor) -> torch.Tensor:
    """Token mean of K per (batch, head) in float32: (B, H, S, D) -> (B, H, D), summed in the statistics pass's
    order (``quantize.kv_moments``): tokens in chunks of ``chunk`` (``chunking``) and tiles of ``stats_block``;
    a chunk's tiles added one after another, row by row; its rows, then the chunks (up to ``MAX_CHUNKS``, zeros
    after the last), folded in adjacent pairs; one rounded division by S."""
    B, H, S, D = k.shape
    block = stats_block(padded_head_dim(D))
    chunk, n_chunks = chunking(S)
    x = F.pad(k.float(), (0, 0, 0, n_chunks * chunk - S)).view(B, H, n_chunks, chunk // block, block, D)
    rows = torch.zeros_like(x[:, :, :, 0])  # from +0, as the kernel's accumulators (a column of -0 sums to +0)
    for t in range(chunk // block):
        rows = rows + x[:, :, :, t]
    sums = _pair_sums(F.pad(_pair_sums(rows), (0, 0, 0, MAX_CHUNKS - n_chunks)))
    return _div(sums, float(S))


def _pair_sums(x: torch.Tensor) -> torch.Tensor:
    """(..., R, D) -> (..., D), R a power of two: adjacent rows added in pairs until one is left."""
    while x.shape[-2] > 1:
        x = x[..., 0::2, :] + x[..., 1::2, :]
    return x[..., 0, :]


def smoothing_offset(q: torch.Tensor, k: torch.Tensor, sm_scale: float, smooth_k: bool = True,
                     k_mean: torch.Tensor | None = None) -> torch.Tensor | None:
    """What subtracting K's mean (``quantize_k``) took off each query row's logits: ``sm_scale · q·mean``, float32
    (B, Hq, Sq) from BHSD ``q`` (B, Hq, Sq, D) and ``k`` (B, Hkv, Sk, D); None without smoothing. Softmax does
    not see it; a log-sum-exp does, and one computed on smoothed scores adds it back (each ring-attention chunk
    has its own mean)."""
    if not smooth_k:
        return None
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    mean = token_mean(k) if k_mean is None else k_mean.float().expand(B, H_kv, D)
    # the mean as two of Q's 16-bit numbers (high and low parts: 16 bits of mantissa in bf16), products summed in
    # float32: on a GPU the emulation's batched GEMV per batch element reads Q in place, without a float32 copy of Q
    # (the Triton path has the quantization launch write the offset: ``quantize.quantize_qkv(..., offset=)``)
    mean = mean.index_select(1, _gqa_index(H, H_kv, q.device))
    hi = mean.to(q.dtype)
    parts = torch.stack([hi, (mean - hi.float()).to(q.dtype)], dim=-1)  # (B, H, D, 2)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.stack([torch.bmm(q[b], parts[b], out_dtype=torch.float32) for b in range(B)])
    else:
        out = q.float() @ parts.float()
    return out.sum(-1) * sm_scale


def quantize_k(
    k: torch.Tensor,
    block_n: int,
    k_groups: int = 1,
    smooth_k: bool = True,
    k_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    balance: torch.Tensor | None = None,
    rotate: bool = False,
):
    """INT8 K after mean subtraction, with ``k_groups`` (1 or 4) scales per tile of ``block_n`` keys.

    With 4, key j of a tile is in group (j mod 8) div 2 (``config.TileConfig``).
    k: (B, H, S, D). k_amax: optional static range (of the smoothed K) broadcastable to (B, H).
    k_mean: optional static mean subtracted instead of K's token mean, broadcastable to (B, H, D).
    balance: ``balance_scales`` (B, H, DP), K's channels multiplied by it after the subtraction, or None.
    rotate: the padded rows through ``hadamard`` after both.
    Returns k8 (B, H, S_pad, DP) int8 and ks (B, H, S_pad) float32: each key's group scale.
    """
    B, H, S, D = k.shape
    s_pad, dp = padded_len(S), padded_head_dim(D)
    x = k.float()
    if smooth_k:
        mean = token_mean(k) if k_mean is None else k_mean.float().expand(B, H, D)
        x = x - mean[:, :, None, :]
    if balance is not None:
        x = x * balance[:, :, None, :D]
    x = _pad(x, s_pad, dp)
    if rotate:
        x = hadamard(x)
    # (B, H, tile, key // 8, group, key within the group's pair, channel); groups to the front, flattened
    x = x.view(B, H, s_pad // block_n, block_n // 8, k_groups, 8 // k_groups, dp)
    x = x.permute(0, 1, 2, 4, 3, 5, 6)
    k8, ks = _quantize_groups(x.reshape(B, H, -1, block_n // k_groups * dp), k_amax)
    k8 = k8.view(x.shape).permute(0, 1, 2, 4, 3, 5, 6).reshape(B, H, s_pad, dp)
    ks = ks.view(B, H, -1, 1, k_groups, 1).expand(-1, -1, -1, block_n // 8, -1, 8 // k_groups)
    return k8, ks.reshape(B, H, s_pad)


def quantize_v(v: torch.Tensor, pv: PV, amax: torch.Tensor):
    """8-bit V with per-channel scales.

    v: (B, H, S, D); amax: from ``v_channel_amax``. Returns v8 and vs (B, H, DP) float32, where v8 is
    FP8 e4m3 (B, H, DP, S_pad) — transposed, as Hopper's FP8 MMA wants K-major operands — or
    INT8 (B, H, S_pad, DP).
    """
    B, H, S, D = v.shape
    x = _pad(v, padded_len(S), amax.shape[-1])
    if pv is PV.FP8:
        y = (x * _div(FP8_MAX, amax)[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX)
        return y.to(torch.float8_e4m3fn).transpose(2, 3).contiguous(), _div(amax, FP8_MAX)
    if pv is PV.INT8:
        return _round_int8(x * _div(INT8_MAX, amax)[:, :, None, :]), _div(amax, INT8_MAX)
    raise ValueError(f"V is not quantized for P·V {pv}")


def _gqa_index(h_q: int, h_kv: int, device) -> torch.Tensor:
    return torch.arange(h_q, device=device) // (h_q // h_kv)


def emulate_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "BHSD",
    pv: PV | str = PV.FP16,
    sm_scale: float | None = None,
    smooth_k: bool = True,
    qk_balance: bool | torch.Tensor = False,
    qk_rotate: bool = False,
    attn_mask: torch.Tensor | None = None,
    block_mask: torch.Tensor | None = None,
    q_amax: torch.Tensor | None = None,
    k_amax: torch.Tensor | None = None,
    v_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    block_n: int | None = None,
    k_groups: int | None = None,
    return_lse: bool = False,
    p_trace=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What the Triton kernel computes, in PyTorch. Same arguments as the kernel wrapper; ``block_n`` and
    ``k_groups`` override the tile table's (for studies of K's quantization). ``p_trace``, a list or anything
    with ``append``, gets ``(start, p, m)`` for each key tile in the order they are visited: P before its 8-bit
    rounding (B, H, Sq, block_n) float32, FP8's 2^8 included, and the running max it is relative to (B, H, Sq);
    for tests that bound where a GPU's last bit of exp2 may round P differently.

    Returns a tensor shaped like ``q``, in ``q``'s dtype, laid out by ``layout.output_like(q)``; with ``return_lse``
    also the log-sum-exp of each query row's scaled logits as the kernel computed them, K's smoothing added back
    (``smoothing_offset``; natural log, float32, (B, H, Sq); -inf for a row without keys).
    """
    from .config import tile_config

    pv = PV(pv)  # "fp8" as PV.FP8
    qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
    B, H, Sq, D = qb.shape
    H_kv, Sk = kb.shape[1], kb.shape[2]
    if sm_scale is None:
        sm_scale = D**-0.5
    cfg = tile_config(D, pv)
    block_n, k_groups = block_n or cfg.block_n, k_groups or cfg.k_groups
    check_rotation(qk_rotate, q_amax, k_amax)
    balance = None
    if isinstance(qk_balance, torch.Tensor):
        balance = given_balance(qk_balance, B, H_kv, D)
    elif balance_applies(qk_balance, q_amax, k_amax, k_mean, Sq * (H // H_kv)):
        balance = balance_scales(qb, kb, token_mean(kb) if smooth_k else None)
    q8, qs = quantize_q(qb, sm_scale, q_amax, balance, qk_rotate)
    k8, ks = quantize_k(kb, block_n, k_groups, smooth_k, k_amax, k_mean, balance, qk_rotate)
    idx = _gqa_index(H, H_kv, q.device)
    if pv is PV.FP16:
        vq = F.pad(vb, (0, q8.shape[-1] - D, 0, k8.shape[2] - Sk)).index_select(1, idx)
    else:
        v8, vs = quantize_v(vb, pv, v_channel_amax(vb, v_amax))
        if pv is PV.FP8:
            v8 = v8.transpose(2, 3)
        vq, vs = v8.index_select(1, idx).float(), vs.index_select(1, idx)
    k8, ks = k8.index_select(1, idx).float(), ks.index_select(1, idx)

    qf = q8[:, :, :Sq].float()
    qs = qs[:, :, :Sq]
    mask = key_bias = None
    key = as_key_mask(attn_mask, B, H, Sk) if block_mask is None else None
    if key is not None:  # the kernels' key-mask path: clean tiles, then partial ones (``key_mask``)
        key_bias, kinds = plan_reference(key, Sk, block_n)
        key_bias = key_bias[:, :, None, :].expand(B, H, 1, -1)
        kinds = kinds.expand(B, H, -1)
        steps = [(t, kind) for kind in (CLEAN, PARTIAL) for t in range(kinds.shape[-1])
                 if (kinds[..., t] == kind).any()]
    elif attn_mask is not None:
        mask = attn_mask.expand(B, H, Sq, Sk)
    if key is None:
        steps = [(start // block_n, None) for start in range(0, Sk, block_n)]
    keep = None
    if block_mask is not None:  # per query row, which SPARSE_BLOCK-key blocks it attends to
        if SPARSE_BLOCK % block_n:
            raise ValueError(f"a block mask needs key tiles that divide {SPARSE_BLOCK}, got block_n={block_n}")
        keep = block_mask.expand(B, H, -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK))
        keep = keep.repeat_interleave(SPARSE_BLOCK, dim=2)[:, :, :Sq]
    p_shift = FP8_P_SHIFT if pv is PV.FP8 else 0.0  # FP8: P·2^8 through the exponent, cancels in acc / l
    m_i = torch.full((B, H, Sq), -math.inf, dtype=torch.float32, device=q.device)
    l_i = torch.zeros((B, H, Sq), dtype=torch.float32, device=q.device)
    acc = torch.zeros((B, H, Sq, q8.shape[-1]), dtype=torch.float32, device=q.device)
    for tile, kind in steps:
        start = tile * block_n
        end = min(start + block_n, Sk)
        # -- scores in base 2: exact INT32 dot (every partial sum < 2^24, so fp32 is exact) --
        qk = qf @ k8[:, :, start : start + block_n].transpose(-1, -2)
        s = qk * (qs[..., None] * ks[:, :, None, start : start + block_n])
        s[..., end - start :] = -math.inf
        if kind is not None:
            # the rows whose list holds this tile in this pass; for the others the step changes nothing
            if kind == PARTIAL:
                s = s + key_bias[..., start : start + block_n]
            s = s.masked_fill((kinds[..., tile] != kind)[..., None, None], -math.inf)
        if mask is not None:
            mblk = mask[..., start:end]
            mblk = F.pad(mblk, (0, block_n - (end - start)))
            if mblk.dtype == torch.bool:
                s = s.masked_fill(~mblk, -math.inf)
            else:
                s = s + mblk.float() * LOG2E
        if keep is not None:
            # a skipped block is never loaded: for its rows the step changes nothing (p = 0, alpha = 1), as here
            s = s.masked_fill(~keep[..., start // SPARSE_BLOCK, None], -math.inf)
        # -- online softmax --
        m_new = torch.maximum(m_i, s.amax(-1))
        masked = mask is not None or keep is not None or key is not None
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new) if masked else m_new
        p = torch.exp2(s - (m_safe - p_shift)[..., None])
        alpha = torch.exp2(m_i - m_safe)
        if p_trace is not None:
            p_trace.append((start, p, m_safe))
        l_i = l_i * alpha + p.sum(-1)
        vj = vq[:, :, start : start + block_n]
        if pv is PV.FP16:
            pv_blk = p.to(vb.dtype).float() @ vj.float()
        elif pv is PV.FP8:
            pv_blk = p.to(torch.float8_e4m3fn).float() @ vj
        else:
            p_max = p.amax(-1).clamp_min(P_FLOOR)
            p8 = _round_int8(p * _div(INT8_MAX, p_max)[..., None]).float()
            pv_blk = (p8 @ vj) * _div(p_max, INT8_MAX)[..., None]
        acc = acc * alpha[..., None] + pv_blk
        m_i = m_new
    out = acc * _div(1.0, torch.where(l_i == 0, 1.0, l_i))[..., None]
    if pv is not PV.FP16:
        out = out * vs[:, :, None, :]
    out = out[..., :D].to(q.dtype)
    out = output_like(q).copy_(out if layout == "BHSD" else out.transpose(1, 2))
    if not return_lse:
        return out
    # l carries P's 2^p_shift; m is -inf exactly where l is 0. The scores were of the smoothed K.
    lse = torch.where(l_i == 0, -math.inf, (m_i + torch.log2(torch.where(l_i == 0, 1.0, l_i)) - p_shift) * LN2)
    offset = smoothing_offset(qb, kb, sm_scale, smooth_k, k_mean)
    return out, lse if offset is None else lse + offset


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "BHSD",
    attn_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in ``dtype`` (float64 by default); returned in ``dtype`` and ``layout``, with
    ``return_lse`` also each row's log-sum-exp of the scaled logits, (B, H, Sq) in ``dtype``.

    Rows whose keys are all masked give 0 (and a log-sum-exp of -inf), as the kernel does.
    """
    qb, kb, vb = (to_bhsd(t, layout).to(dtype) for t in (q, k, v))
    H, H_kv = qb.shape[1], kb.shape[1]
    idx = _gqa_index(H, H_kv, q.device)
    kb, vb = kb.index_select(1, idx), vb.index_select(1, idx)
    scale = qb.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    s = (qb @ kb.transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask.to(dtype)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(m == -math.inf, 0.0, m))
    l = p.sum(-1, keepdim=True)
    out = (p @ vb) / torch.where(l == 0, 1.0, l)
    out = out if layout == "BHSD" else out.transpose(1, 2)
    if not return_lse:
        return out
    return out, torch.where(l == 0, -math.inf, m + torch.log(torch.where(l == 0, 1.0, l))).squeeze(-1)
