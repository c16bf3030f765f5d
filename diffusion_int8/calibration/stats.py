"""Per-head statistics of attention inputs and of the error each precision and each sparsity level causes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Mode
from ..kernels.api import expand_block_mask
from ..kernels.config import SPARSE_BLOCK
from ..compare import cosine, rel_l1


def quantile_lastdim(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q, dim=-1)`` (linear interpolation) for any size, through two ``kthvalue`` calls.

    ``torch.quantile`` refuses inputs above 2**24 elements; attention heads of video models exceed that.
    """
    n = x.shape[-1]
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    v_lo = x.kthvalue(lo + 1, dim=-1).values
    if hi == lo or pos == lo:
        return v_lo
    v_hi = x.kthvalue(hi + 1, dim=-1).values
    return torch.lerp(v_lo, v_hi, pos - lo)


def input_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, percentile: float = 99.0) -> dict[str, torch.Tensor]:
    """Per (batch, head) ranges of BHSD attention inputs, in float32.

    Returns ``q_p99`` and ``k_p99`` (B, H): the ``percentile`` of |Q| and of |K - mean_tokens(K)| (K as the
    kernel quantizes it, after smoothing) over tokens and channels; ``q_max`` and ``k_max`` (B, H): their
    maxima; ``k_mean`` (B, H, D): K's token mean, the smoothing vector; ``v_amax`` (B, H, D): |V|'s
    maximum over tokens, per channel; ``q_cmax`` and ``k_cmax`` (B, H, D): the per-channel maxima of |Q| and of
    |K - mean|, from which a static Q·Kᵀ balance is made.
    """
    qf, kf, vf = (t.float() for t in (q, k, v))
    mean = kf.mean(dim=2, keepdim=True)
    qa, ka = qf.abs().flatten(2), (kf - mean).abs().flatten(2)
    p = percentile / 100.0
    return {
        "q_p99": quantile_lastdim(qa, p),
        "k_p99": quantile_lastdim(ka, p),
        "q_max": qa.amax(-1),
        "k_max": ka.amax(-1),
        "k_mean": mean[:, :, 0],
        "v_amax": vf.abs().amax(dim=2),
        "q_cmax": qf.abs().amax(dim=2),
        "k_cmax": (kf - mean).abs().amax(dim=2),
    }


def output_errors(out: torch.Tensor, exact: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per (batch, head) relative L1 (sum |out - exact| / sum |exact|) and cosine similarity, BHSD inputs."""
    return {"rel_l1": rel_l1(out, exact, start_dim=2).float(), "cos": cosine(out, exact, start_dim=2).float()}


def sparse_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                scale: float | None) -> torch.Tensor:
    """Exact attention (SDPA, BHSD, any float dtype) over the (query block, key block) pairs ``block_mask`` keeps,
    bool broadcastable to (B, H, nQB, nKB): what a block-sparse kernel computes, without its quantization. Rows
    left without keys give 0, as the kernels' do (the predictor keeps at least one key block per query block; a
    carried mask's complement may keep none). One batch element at a time: the expanded mask is (H, Sq, Sk)."""
    B, H, Sq, _ = q.shape
    mask = block_mask.expand(B, H, -1, -1)
    out = [F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale=scale, enable_gqa=k.shape[1] != H,
                                          attn_mask=expand_block_mask(mask[b:b + 1], Sq, k.shape[2]))
           for b in range(B)]
    empty = ~mask.any(-1, keepdim=True).repeat_interleave(SPARSE_BLOCK, dim=-2)[..., :Sq, :]
    return torch.cat(out).masked_fill(empty, 0.0)


def sparse_stat(stat: str) -> tuple[str, float] | None:
    """``sparse.{rel_l1|cos|kept}@{tau}`` as (what, tau); None for any other name."""
    name, _, tau = stat.partition("@")
    if name not in SPARSE_STATS or not tau:
        return None
    try:
        return name, float(tau)
    except ValueError:
        return None


def sparse_key(what: str, tau: float) -> str:
    """The statistic's name for level ``tau``: ``sparse.rel_l1@0.95``."""
    return f"{what}@{float(tau)!r}"


SPARSE_STATS = ("sparse.rel_l1", "sparse.cos", "sparse.kept")  # per level: its error and the pairs it computes
# per (level, refresh interval): the error of carrying the skipped blocks (plugin.carry.BlockCarry) and the pairs
# computed at each step
CARRY_STATS = ("carry.rel_l1", "carry.cos", "carry.kept")


def carry_key(what: str, tau: float, every: int) -> str:
    """The statistic's name for level ``tau`` carried with a refresh every ``every`` steps: ``carry.rel_l1@0.9/3``."""
    return f"{what}@{float(tau)!r}/{int(every)}"


def carry_stat(stat: str) -> tuple[str, float, int] | None:
    """``carry.{rel_l1|cos|kept}@{tau}/{every}`` as (what, tau, every); None for any other name."""
    name, _, setting = stat.partition("@")
    tau, _, every = setting.partition("/")
    if name not in CARRY_STATS or not tau or not every.isdigit():
        return None
    try:
        return name, float(tau), int(every)
    except ValueError:
        return None


QUANTIZED_MODES = (Mode.INT8, Mode.INT8_FP16V)
SPLIT_SCORES = 1 << 24  # scores split_attention makes at a time


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                    scale: float | None) -> tuple[torch.Tensor, ...]:
    """Exact attention (BHSD, any float dtype) split into the (query block, key block) pairs ``block_mask`` keeps and
    the rest, from one float32 pass over the scores per batch element: ``(out_kept, lse_kept, out_rest, lse_rest)``,
    outputs in ``q``'s dtype (B, H, Sq, D), log-sum-exps float32 (B, H, Sq); a row without keys on a side gives 0
    and -inf there. Merged through their log-sum-exps the two sides are dense attention: what
    ``plugin.carry.BlockCarry`` computes at a refresh, here without quantization. The scores are made a block of
    query rows at a time (about ``SPLIT_SCORES``), so memory stays bounded at video lengths."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    mask = block_mask.expand(B, H, -1, -1)
    rows = max(SPARSE_BLOCK, SPLIT_SCORES // max(H * Sk, 1) // SPARSE_BLOCK * SPARSE_BLOCK)  # whole query blocks
    out_k, out_c = torch.empty_like(q), torch.empty_like(q)
    lse_k = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    lse_c = torch.empty_like(lse_k)
    for b in range(B):
        kb = k[b].repeat_interleave(H // k.shape[1], 0).float()
        vb = v[b].repeat_interleave(H // v.shape[1], 0).float()
        for r in range(0, Sq, rows):
            s = (q[b, :, r:r + rows].float() @ kb.transpose(-1, -2)) * scale  # (H, rows, Sk)
            top = s.amax(-1, keepdim=True)
            e = torch.exp(s - top)
            keep = expand_block_mask(mask[b, :, r // SPARSE_BLOCK:], s.shape[1], Sk)
            for out, lse, side in ((out_k, lse_k, e * keep), (out_c, lse_c, e.masked_fill_(keep, 0.0))):
                total = side.sum(-1, keepdim=True)
                o = (side @ vb) / total.clamp_min(torch.finfo(torch.float32).tiny)
                out[b, :, r:r + rows] = o.masked_fill(total == 0, 0.0)
                lse[b, :, r:r + rows] = (top + total.log()).squeeze(-1)
    return out_k, lse_k, out_c, lse_c
