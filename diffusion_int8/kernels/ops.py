"""PyTorch custom op around the kernels, so ``torch.compile`` and tracers see one opaque node.

In plain eager mode ``dispatch`` calls the implementation directly: the custom-op layers (autograd
and backend dispatch in Python) cost 100–180 µs of host time per call on the H100 machine, a quarter of
the op's host time at small shapes, and do nothing there. Under ``torch.compile``, ``make_fx``/export,
fake tensors or any other Python dispatch mode the op itself runs, so graphs record it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .config import PV, Backend
from .layout import to_bhsd
from .reference import emulate_attention


def _quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    block_mask: Optional[torch.Tensor],
    q_amax: Optional[torch.Tensor],
    k_amax: Optional[torch.Tensor],
    v_amax: Optional[torch.Tensor],
    k_mean: Optional[torch.Tensor],
    balance: Optional[torch.Tensor],
    layout: str,
    pv: str,
    sm_scale: float,
    smooth_k: bool,
    qk_balance: bool,
    qk_rotate: bool,
    backend: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 Q·Kᵀ attention on validated inputs; ``backend`` is a ``Backend`` value, ``pv`` a ``PV`` value.
    ``balance``: a given Q·Kᵀ balance (``int8_attention``'s ``qk_balance`` tensor), else None and ``qk_balance``
    says whether to measure one. Returns the output and, with ``return_lse``, each query row's log-sum-exp
    (float32 (B, H, Sq); else empty)."""
    kwargs = dict(
        layout=layout, pv=PV(pv), sm_scale=sm_scale, smooth_k=smooth_k,
        qk_balance=qk_balance if balance is None else balance, qk_rotate=qk_rotate,
        attn_mask=attn_mask, block_mask=block_mask, q_amax=q_amax, k_amax=k_amax, v_amax=v_amax, k_mean=k_mean,
        return_lse=return_lse,
    )
    if backend == Backend.TRITON.value:
        from .attention import triton_attention  # imports triton lazily: CPU-only installs never need it

        res = triton_attention(q, k, v, **kwargs)
    else:
        res = emulate_attention(q, k, v, **kwargs)
    return res if return_lse else (res, q.new_empty(0, dtype=torch.float32))


quantized_attention = torch.library.custom_op("diffusion_int8::quantized_attention", mutates_args=())(_quantized_attention)


@quantized_attention.register_fake
def _(q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, balance, layout, pv, sm_scale, smooth_k, qk_balance,
      qk_rotate, backend, return_lse):
    B, H, Sq = to_bhsd(q, layout).shape[:3]
    lse = q.new_empty((B, H, Sq) if return_lse else (0,), dtype=torch.float32)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse


def dispatch(q: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantized_attention(q, *args)``: the op when something may be tracing, the implementation otherwise."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or is_fake(q):
        return quantized_attention(q, *args)
    return _quantized_attention(q, *args)
