"""How far an output is from a reference, in float64: ``cosine``, ``rel_l1`` and both as floats (``cos_l1``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cosine", "rel_l1", "cos_l1"]


def _flat(out: torch.Tensor, ref: torch.Tensor, start_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return out.double().flatten(start_dim), ref.double().flatten(start_dim)


def cosine(out: torch.Tensor, ref: torch.Tensor, start_dim: int = 0) -> torch.Tensor:
    """Cosine similarity of ``out`` and ``ref`` in float64, over the dims from ``start_dim`` on (all by
    default: a 0-d tensor; ``start_dim=2`` on (B, H, S, D): one value per (batch, head))."""
    o, r = _flat(out, ref, start_dim)
    return F.cosine_similarity(o, r, dim=-1, eps=1e-30)


def rel_l1(out: torch.Tensor, ref: torch.Tensor, start_dim: int = 0) -> torch.Tensor:
    """Relative L1 error ``sum |out - ref| / sum |ref|`` in float64, over the dims from ``start_dim`` on
    (as ``cosine``); the denominator is floored at 1e-30."""
    o, r = _flat(out, ref, start_dim)
    return (o - r).abs().sum(-1) / r.abs().sum(-1).clamp_min(1e-30)


def cos_l1(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(cosine, rel_l1)`` of the whole tensors, as Python floats."""
    return cosine(out, ref).item(), rel_l1(out, ref).item()
