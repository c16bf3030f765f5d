"""Shapes, views and ranges shared by the kernels' launchers and their PyTorch emulation (``reference``).

Nothing here computes attention: how a sequence is padded for the quantized buffers, how a layout is
viewed as (B, H, S, D), whether a tensor's rows can be read in 16-byte units, and how a given or measured
range is read (``static_range``, ``v_channel_amax``), which the Triton kernels and the emulation must agree on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import AMAX_FLOOR, SEQ_PAD, padded_head_dim


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_len(n: int) -> int:
    """Tokens of a quantized buffer holding ``n``: the next multiple of ``config.SEQ_PAD``."""
    return cdiv(n, SEQ_PAD) * SEQ_PAD


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, S, D) view of ``x`` given in ``layout`` (no copy)."""
    return x if layout == "BHSD" else x.transpose(1, 2)


def output_like(q: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """An uninitialized (or zeroed) attention output shaped like the 4-D ``q``, in its dtype and on its device,
    dense, with ``q``'s first three dims in the memory order of its strides and its last dim innermost. A (B, H,
    S, D) view of (B, S, H, D) memory, as diffusers' processors pass Q, gets a (B, S, H, D)-dense output, which
    their ``transpose(1, 2).flatten(2, 3)`` reads without a copy, as they do SDPA's output."""
    # stable: dims of equal stride keep their order; a broadcast (stride-0) dim goes outermost
    order = sorted(range(3), key=lambda d: -q.stride(d) if q.stride(d) else -math.inf)
    shape = [q.shape[d] for d in order] + [q.shape[3]]
    out = (torch.zeros if zero else torch.empty)(shape, dtype=q.dtype, device=q.device)
    return out.permute(*(order.index(d) for d in range(3)), 3)


def rows_16b_aligned(x: torch.Tensor) -> bool:
    """Whether every stride but the last (which is 1) spans whole 16-byte units: vector loads and TMA."""
    return x.stride(-1) == 1 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])


def fp8_v_keys_permuted(dp: int, block_n: int) -> bool:
    """Whether FP8 Vᵀ stores each tile's keys in ``v8_key_order``: with 128-key tiles (the tile table's for FP8
    P·V at padded head dim 32 to 128)."""
    return dp <= 128 and block_n == 128


def v8_key_order(s_pad: int, dp: int) -> torch.Tensor:
    """Where FP8 Vᵀ (with ``fp8_v_keys_permuted``) stores key k, (s_pad,) int64, in each 128-key tile. P·V sums
    over keys, so V's keys may be stored in any order P's columns are multiplied in; the order is chosen so that
    P, as the Q·Kᵀ accumulator holds it, needs no data moved between threads. The accumulator (wgmma and
    mma.sync alike) gives the thread of a quad at place t the columns 8i + 2t + e (i < 16, e < 2) of its rows.

    - padded head dim 128, where the sm_90 kernel stages P in shared memory (the portable kernel, where it runs
      instead, follows the same order): key 8i + 2t + e at 32t + 2i + e, so a thread's row of P is 32 contiguous
      bytes, two 16-byte stores instead of sixteen 2-byte ones;
    - padded head dim ≤ 64, where the portable kernel gives P to the MMA from registers, whose 8-bit A operand
      holds k = 16h + 4t + e' (h < 2, e' < 4) of every 32: key 32c + 16h + 8j + 2t + e (c < 4, j < 2) at
      32c + 16h + 4t + 2j + e, so each thread's register of P already holds the keys the MMA reads from it."""
    if dp not in (32, 64, 128):
        raise ValueError(f"FP8 V's keys are permuted at padded head dims 32, 64 and 128, got {dp}")
    k = torch.arange(s_pad)
    tile, r = k // 128 * 128, k % 128
    if dp == 128:
        return tile + r % 8 // 2 * 32 + r // 8 * 2 + r % 2
    return tile + r // 16 * 16 + r % 8 // 2 * 4 + r // 8 % 2 * 2 + r % 2


def static_range(amax: torch.Tensor) -> torch.Tensor:
    """A given range as the kernels read it: itself where finite and positive, NaN elsewhere, so an invalid
    range makes NaN of every output it reaches rather than finite, wrong values."""
    amax = amax.float()
    return torch.where((amax > 0) & torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))


def v_channel_amax(v: torch.Tensor, v_amax: torch.Tensor | None = None, static: bool = True) -> torch.Tensor:
    """Per-channel range of V, floored, NaN where a channel holds a NaN/Inf, padded with 1.

    v: (B, H, S, D). v_amax: a measured (e.g. ``quantize.kv_moments``) or static range broadcastable to
    (B, H, D) (a static one, ``static=True``, is read through ``static_range``); measured here when None.
    Returns (B, H, DP) float32.
    """
    B, H, S, D = v.shape
    if v_amax is None:
        lo, hi = torch.aminmax(v, dim=2)
        amax = torch.maximum(-lo, hi).float()
    else:
        amax = (static_range(v_amax) if static else v_amax.float()).expand(B, H, D)
    amax = amax.clamp_min(AMAX_FLOOR) + amax * 0.0  # inf * 0 = NaN
    return F.pad(amax, (0, padded_head_dim(D) - D), value=1.0)


# The statistics pass reads tiles of this many tokens (``stats_block``); for the Q·Kᵀ balance it measures Q's
# channel ranges on one tile in Q_SAMPLE_EVERY
Q_SAMPLE_EVERY = 4


def stats_block(dp: int) -> int:
    """Tokens per tile of the statistics pass at padded head dim ``dp``."""
    return 64 if dp <= 128 else 32


MAX_CHUNKS = 32  # the statistics pass's chunks per (batch, head), at most


def chunking(sk: int) -> tuple[int, int]:
    """The statistics pass's chunks of ``sk`` keys: (keys per chunk, a multiple of 64; number of chunks). Enough
    chunks to fill the GPU at a few (batch, head)s, few enough that folding the partials stays small."""
    chunk = max(256, cdiv(cdiv(sk, MAX_CHUNKS), 64) * 64)
    return chunk, cdiv(sk, chunk)


# The Q·Kᵀ balance needs this many queries per K/V head (over its query heads): from fewer sampled tokens, Q's
# channel ranges are noise, not outlier channels, and balancing by them cost accuracy (one query row: rel L1
# 0.028 -> 0.075 against float64 in the emulation)
BALANCE_MIN_QUERIES = 1024


def check_rotation(qk_rotate: bool, q_amax, k_amax) -> None:
    """The Hadamard rotation quantizes the rotated Q and K, so their ranges must be measured: ``ValueError`` for
    static ``q_amax``/``k_amax`` (ranges of the unrotated tensors) with ``qk_rotate``."""
    if qk_rotate and (q_amax is not None or k_amax is not None):
        raise ValueError("qk_rotate needs Q's and K's ranges measured in the call: static q_amax/k_amax are ranges of "
                         "the unrotated tensors (k_mean and v_amax may stay)")


def balance_applies(qk_balance, q_amax, k_amax, k_mean, queries: int) -> bool:
    """Whether a call measures a Q·Kᵀ balance: asked for (``qk_balance`` True; a tensor is a given balance, not
    measured), Q's and K's ranges and K's mean measured (static ones were taken of the unbalanced tensors), and
    at least ``BALANCE_MIN_QUERIES`` ``queries`` per K/V head."""
    return (qk_balance is True and q_amax is None and k_amax is None and k_mean is None
            and queries >= BALANCE_MIN_QUERIES)
