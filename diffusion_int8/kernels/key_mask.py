"""Key masks: attention masks that are the same for every query row (a text padding mask, (B, 1, 1, Sk) or (B, Sk)
broadcast by diffusers), in the form the kernels run them at unmasked speed.

A key mask becomes one additive bias per key in base-2 units (0 or -inf for a bool mask, ``mask · log2(e)`` for an
additive one, -inf past the sequence), and per row of the bias (a batch, or a batch and head where the mask differs
by head) a list of the row's key tiles: first the *clean* tiles (every bias 0: no mask to apply), then the
*partial* ones (some key masked: the bias is added), ascending within each; tiles whose every key is masked are
left out, never loaded. So the kernels run the clean tiles through their unmasked loop and the few partial ones
(text padding, the sequence's tail) through the masked step, and the emulation (``reference``) takes the tiles in
the same order. ``attention.key_mask_plan`` builds the kernels' form on the GPU; ``plan_reference`` is the same in
PyTorch (no Triton needed here: the emulation is the CPU fallback). Every query row of a list row sees the same
keys, so after the first tile no row's max is -inf, except in a list row with no tile at all, whose rows give 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import LOG2E
from .layout import cdiv

CLEAN, PARTIAL, EMPTY = 0, 1, 2  # a key tile's kind


def is_key_mask(shape: torch.Size | tuple[int, ...], B: int, H: int) -> bool:
    """Whether a mask of ``shape`` (broadcastable to (B, H, Sq, Sk)) is the same for every query row: size 1 along
    the queries of its 4-D broadcast, and (1 or B, 1 or H) before them. Shapes only: no tensor is made."""
    if len(shape) > 4:
        return False
    full = (1,) * (4 - len(shape)) + tuple(shape)
    return full[2] == 1 and full[0] in (1, B) and full[1] in (1, H)


def as_key_mask(attn_mask: torch.Tensor | None, B: int, H: int, Sk: int) -> torch.Tensor | None:
    """The mask as (B or 1, H or 1, Sk) where it is a key mask (``is_key_mask``), else None. No copy: a mask of
    size 1 along the keys is expanded to ``Sk`` (stride 0)."""
    if attn_mask is None or not is_key_mask(attn_mask.shape, B, H):
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() < 4 else attn_mask
    return m[:, :, 0, :].expand(-1, -1, Sk)


def valid_prefix(attn_mask: torch.Tensor, B: int, H: int, Sk: int) -> int | None:
    """The number of keys ``n`` where ``attn_mask`` keeps exactly keys 0..n-1 of every batch and head (padding at
    the end of the keys: text padding after the text), so attention over the first ``n`` keys without the mask is
    the same computation; None for any other mask (not a key mask, a float mask other than 0 and -inf, or kept
    keys that differ between rows or do not start at 0). It reads the mask: one host synchronization on a GPU."""
    key = as_key_mask(attn_mask, B, H, Sk)
    if key is None:
        return None
    if key.dtype == torch.bool:
        kept = key
    else:
        if not bool(((key == 0) | (key == float("-inf"))).all()):
            return None
        kept = key == 0
    kept = kept.reshape(-1, Sk)
    prefix = kept.int().cumprod(-1).sum(-1)  # each row's leading run of kept keys
    first = prefix[:1]
    ok = (prefix == first).all() & (kept.sum(-1) == prefix).all()  # every row the same run, nothing kept after it
    n, ok = (int(x) for x in torch.stack([first[0], ok.int()]).tolist())
    return n if ok else None


class KeyMaskPlan(NamedTuple):
    """A key mask in the kernels' form. A list row is ``b · stride_b + h · stride_h``.

    bias: float32 (rows, Sk_pad), base-2 units; counts: int32 (rows,), tiles listed; clean: int32 (rows, 2), how
    many are clean, and how many of those are tiles 0, 1, ... in order (the prefix, addressed without the list);
    tiles: int32 (rows, n_tiles): the row's tile indices, clean ones first (first ``counts`` valid)."""

    bias: torch.Tensor
    counts: torch.Tensor
    clean: torch.Tensor
    tiles: torch.Tensor
    stride_b: int
    stride_h: int


def plan_reference(key_mask: torch.Tensor, Sk: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.key_mask_plan``'s bias, float32 (B', H', n_tiles · block_n), and each tile's kind, int64 (B', H',
    n_tiles), in PyTorch: what the emulation follows."""
    nt = cdiv(Sk, block_n)
    if key_mask.dtype == torch.bool:
        bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=key_mask.device)
        bias = bias.masked_fill(~key_mask, float("-inf"))
    else:
        bias = key_mask.float() * LOG2E
    bias = torch.nn.functional.pad(bias, (0, nt * block_n - Sk), value=float("-inf"))
    tiles = bias.unflatten(-1, (nt, block_n))
    kind = torch.full(tiles.shape[:-1], PARTIAL, dtype=torch.int64, device=bias.device)
    kind = kind.masked_fill((tiles == 0).all(-1), CLEAN).masked_fill((tiles == float("-inf")).all(-1), EMPTY)
    return bias, kind
