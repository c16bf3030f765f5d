"""What an observer (the calibration's collector) is given of each attention call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a routed module, as the processor is about to run it.

    ``layer``: the module's name (``enable`` names them as ``named_modules`` does); ``step``: the denoiser call
    this one belongs to, from 0 since the generation began, ``timestep`` what the denoiser was given and ``noise``
    its noise level in [0, 1] (``schedule.noise_level``; both None before the first). ``query``, ``key``,
    ``value``: (B, H, S, D) as the kernel sees them, after the model's norms and RoPE; ``attn_mask`` and ``scale``
    as SDPA gets them; ``out``: SDPA's exact output (B, H, Sq, D); ``keep_kv_blocks``: (nKB,) bool, the key blocks
    a block-sparse call always keeps (text tokens in joint attention), or None; ``steps`` (keyword): the
    generation's step count where the pipeline's scheduler tells it (``Int8State.steps``), else None.
    """

    layer: str | None
    step: int
    timestep: float | None
    noise: float | None
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    scale: float | None
    out: torch.Tensor
    keep_kv_blocks: torch.Tensor | None
    _predict: Callable = field(repr=False, compare=False)
    steps: int | None = field(default=None, kw_only=True)

    def block_mask(self, tau: float) -> torch.Tensor | None:
        """The block mask the processor's INT8 call would predict at sparsity level ``tau``: bool (B, H, nQB, nKB),
        or None where it would run dense (no level below 1, an ``attn_mask``, or one key block)."""
        return self._predict(self.query, self.key, self.attn_mask, self.scale, tau)


class Observer(Protocol):
    """``enable(..., observer=...)``: called with every attention call of the routed modules."""

    def __call__(self, call: AttentionCall) -> None: ...
