"""Which (query block, key block) pairs of an attention call to compute: the block-sparse predictor.

``predict_block_mask`` is SpargeAttn's prediction from pooled Q and K. Each block of ``SPARSE_BLOCK`` tokens is
represented by its mean; the pooled scores, a softmax over key blocks per query block, estimate how much
probability mass each key block takes, and per query block the smallest set of key blocks that holds a
cumulative mass ``tau`` is kept. A block whose tokens point in different directions is not represented by its
mean, so it is never skipped on the estimate's word: a dissimilar query block keeps its whole row, a dissimilar
key block its whole column.

On a GPU it is four Triton launches (``pool``), elsewhere a handful of PyTorch operations on static shapes: no host
synchronization either way, so it runs under CUDA graph capture and ``torch.compile``. ``int8_attention(...,
sparsity=tau)`` predicts the same way inside the call, from sums its quantization launch makes as it reads Q and K
(``pool``): no pass of its own over them.
"""

from __future__ import annotations

import math
import numbers

import torch

from .config import SPARSE_BLOCK
from .layout import cdiv, to_bhsd

# A block is represented by its mean when its ``block_similarity`` is at least this. Independent random tokens give
# about 1/sqrt(128) = 0.09 in a 128-token block; tokens of one smooth image region, 0.7-1.
MIN_SIMILARITY = 0.5
_LAYOUTS = ("BHSD", "BSHD")
_TINY = 1e-30


def predict_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    tau: float,
    *,
    layout: str = "BHSD",
    sm_scale: float | None = None,
    keep_kv_blocks: torch.Tensor | None = None,
    min_similarity: float | None = MIN_SIMILARITY,
) -> torch.Tensor:
    """The (query block, key block) pairs worth computing, for ``int8_attention(..., block_mask=...)``.

    Args:
        q: (B, Hq, Sq, D) for ``layout="BHSD"`` or (B, Sq, Hq, D) for ``"BSHD"``; any float dtype (pooled in
            float32).
        k: (B, Hkv, Sk, D) or (B, Sk, Hkv, D); ``Hq`` a multiple of ``Hkv`` (GQA/MQA), as in ``int8_attention``.
        tau: the probability mass to keep per query block, in (0, 1]: the smallest set of key blocks whose pooled
            attention mass reaches ``tau`` is kept. 1 keeps every block.
        sm_scale: the attention's softmax scale; default ``D ** -0.5``.
        keep_kv_blocks: bool, broadcastable to (B, Hq, nQB, nKB): pairs always kept (e.g. ``(nKB,)`` True
            where key blocks hold text tokens).
        min_similarity: a block whose ``block_similarity`` (of K after subtracting its token mean, which softmax
            ignores) is below this is kept dense: its row (Q) or column (K). None: no such guard.

    Returns:
        bool (B, Hq, nQB, nKB), nQB = ceil(Sq / SPARSE_BLOCK), nKB = ceil(Sk / SPARSE_BLOCK); True = compute.
        The last block of a sequence holds the remaining tokens: it is pooled over those only, and its pooled
        score carries log(its token count), as the softmax over its tokens would.
    """
    _check(q, k, tau, layout, sm_scale, min_similarity)
    qb, kb = to_bhsd(q, layout), to_bhsd(k, layout)
    B, Hq, Sq, D = qb.shape
    Hkv, Sk = kb.shape[1], kb.shape[2]
    nqb, nkb = cdiv(Sq, SPARSE_BLOCK), cdiv(Sk, SPARSE_BLOCK)
    if keep_kv_blocks is not None:
        check_keep(keep_kv_blocks, q, (B, Hq, nqb, nkb))
    if tau >= 1 or 0 in (B, nqb, nkb):
        return torch.ones((B, Hq, nqb, nkb), dtype=torch.bool, device=q.device)
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    if q.is_cuda:
        from .pool import predict_bhsd

        return predict_bhsd(qb, kb, tau, scale, min_similarity, keep_kv_blocks)
    pq, sim_q, _ = _pool(qb, smooth=False)
    pk, sim_k, count_k = _pool(kb, smooth=True)
    # -- pooled scores per K/V head: its G query heads' blocks as G·nQB rows --
    G = Hq // Hkv
    logits = (pq.view(B, Hkv, G * nqb, D) @ pk.transpose(-1, -2)).mul_(scale).view(B, Hq, nqb, nkb)
    return select_blocks_torch(logits, count_k.log(), tau, sim_q, sim_k, min_similarity, keep_kv_blocks)


def select_blocks_torch(logits: torch.Tensor, log_count: torch.Tensor, tau: float, sim_q: torch.Tensor | None,
                        sim_k: torch.Tensor | None, min_similarity: float | None,
                        keep: torch.Tensor | None) -> torch.Tensor:
    """The mask from pooled scores (``pool.predict`` is its twin on the GPU): per query block, the
    softmax over key blocks; sorted by mass, a block is in the kept set while the mass before it is short of tau,
    and every block with at least the set's smallest mass is kept (ties at the threshold included); then the rows of
    dissimilar query blocks, the columns of dissimilar key blocks and ``keep``."""
    p = torch.softmax(logits + log_count, dim=-1)
    p_sorted = p.sort(dim=-1, descending=True).values
    before = p_sorted.cumsum(-1) - p_sorted
    smallest = torch.where(before < tau, p_sorted, torch.inf).amin(-1, keepdim=True)
    mask = (p >= smallest) | p.isnan()  # NaN scores keep their blocks: NaN is never hidden
    if min_similarity is not None:
        G = logits.shape[1] // sim_k.shape[1]
        dense_rows = (sim_q < min_similarity)[..., None]  # (B, Hq, nQB, 1)
        dense_cols = (sim_k < min_similarity).repeat_interleave(G, dim=1)[:, :, None, :]  # (B, Hq, 1, nKB)
        mask = mask | dense_rows | dense_cols
    if keep is not None:
        mask = mask | keep
    return mask


def _pool(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of ``SPARSE_BLOCK`` tokens of x (B, H, S, D): the mean (B, H, nB, D), ``block_similarity``
    (B, H, nB) and the token count (nB,), all float32. ``smooth``: x less its token mean (softmax over keys ignores
    it; it is K's channel bias, which would make every block look alike)."""
    S = x.shape[2]
    count = (S - torch.arange(cdiv(S, SPARSE_BLOCK), device=x.device, dtype=torch.float32) * SPARSE_BLOCK).clamp(
        max=SPARSE_BLOCK)
    xf = x.float()
    sums = _block_sums(xf)
    if smooth:
        token_mean = sums.sum(2, keepdim=True) / S
        sums = sums - count[:, None] * token_mean
        xf = xf - token_mean
    norms_sq = _block_sums(xf.square().sum(-1, keepdim=True))[..., 0]
    return sums / count[:, None], block_similarity(sums, norms_sq, count), count


def block_similarity(sums: torch.Tensor, norms_sq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """How well a block's mean represents its tokens: |mean| / the tokens' RMS norm, from their sum (..., D), their
    squared norms summed (...) and their count; in [0, 1]. 1 where every token is the same vector, about
    1/sqrt(count) for independent ones; for tokens of equal norm, their mean cosine to the mean."""
    return sums.norm(dim=-1) / (count * norms_sq).sqrt().clamp_min(_TINY)


def _block_sums(x: torch.Tensor) -> torch.Tensor:
    """Sums over blocks of ``SPARSE_BLOCK`` tokens (the last one partial) of x (B, H, S, D): (B, H, nB, D)."""
    S = x.shape[2]
    full = S // SPARSE_BLOCK
    parts = []
    if full:
        parts.append(x[:, :, : full * SPARSE_BLOCK].unflatten(2, (full, SPARSE_BLOCK)).sum(3))
    if S % SPARSE_BLOCK:
        parts.append(x[:, :, full * SPARSE_BLOCK :].sum(2, keepdim=True))
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


def check_tau(tau, name: str = "tau") -> float:
    """``tau`` as a float, or ``ValueError``: a sparsity level is a number in (0, 1] (1 = dense)."""
    if not (isinstance(tau, numbers.Real) and not isinstance(tau, bool) and math.isfinite(tau) and 0 < tau <= 1):
        raise ValueError(f"{name} must be a number in (0, 1] (the attention mass kept per query block; 1 = dense), "
                         f"got {tau!r}")
    return float(tau)


def _check(q, k, tau, layout, sm_scale, min_similarity) -> None:
    check_tau(tau)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: a floating-point dtype")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'B, H, S, D' if layout == 'BHSD' else 'B, S, H, D'} for layout "
                             f"{layout!r}), got shape {tuple(t.shape)}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    h_ax = 1 if layout == "BHSD" else 2
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch size and head dim")
    hq, hkv = q.shape[h_ax], k.shape[h_ax]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads and k has {hkv}: the query heads must be a multiple of the key heads "
                         f"(check the layout: {layout!r} puts heads on dim {h_ax})")
    if sm_scale is not None and not (isinstance(sm_scale, numbers.Real) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive number or None, got {sm_scale!r}")
    if min_similarity is not None and not (isinstance(min_similarity, numbers.Real) and -1 <= min_similarity <= 1):
        raise ValueError(f"min_similarity must be a cosine in [-1, 1] or None (no guard), got {min_similarity!r}")


def check_keep(keep: torch.Tensor, q: torch.Tensor, full: tuple[int, int, int, int]) -> None:
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"keep_kv_blocks must be a bool tensor broadcastable to (B, Hq, nQB, nKB) = {full}")
    if keep.device != q.device:
        raise ValueError(f"keep_kv_blocks is on {keep.device}, q on {q.device}")
    try:
        ok = keep.dim() <= 4 and torch.broadcast_shapes(keep.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"keep_kv_blocks of shape {tuple(keep.shape)} does not broadcast to (B, Hq, nQB, nKB) = "
                         f"{full}; blocks are of {SPARSE_BLOCK} tokens")
