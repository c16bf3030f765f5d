"""Per-head statistics of attention inputs and of the error each precision and each sparsity level causes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Mode
from ..kernels.api import exact_lse, expand_block_mask
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


def sparse_sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                         scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_sdpa`` and each row's exact log-sum-exp over its kept blocks, float32 (B, H, Sq), -inf for a row
    without keys: what ``plugin.carry.BlockCarry`` merges, in exact attention of any float dtype."""
    return sparse_sdpa(q, k, v, block_mask, scale), exact_lse(q, k, block_mask=block_mask, scale=scale)


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
