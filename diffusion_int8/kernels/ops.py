"""PyTorch custom op around the kernels, so ``torch.compile`` and tracers see one opaque node.

In plain eager mode ``dispatch`` calls the implementation directly: the custom-op layers (autograd
and backend dispatch in Python) cost host time on every call and do nothing there. Under ``torch.compile``, ``make_fx``/export,
fake tensors or any other Python dispatch mode the op itself runs, so graphs record it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .config import PV, SPARSE_BLOCK, Backend
from .layout import output_like, to_bhsd
from .reference import emulate_attention
from .sparsity import predict_block_mask


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
    keep_kv_blocks: Optional[torch.Tensor],
    layout: str,
    pv: str,
    sm_scale: float,
    smooth_k: bool,
    qk_balance: bool,
    qk_rotate: bool,
    sparsity: Optional[float],
    backend: str,
    return_lse: bool,
    return_skipped: bool,
    return_block_mask: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT8 Q·Kᵀ attention on validated inputs; ``backend`` is a ``Backend`` value, ``pv`` a ``PV`` value.
    ``balance``: a given Q·Kᵀ balance (``int8_attention``'s ``qk_balance`` tensor), else None and ``qk_balance``
    says whether to measure one. Returns the output, with ``return_lse`` each query row's log-sum-exp (float32
    (B, H, Sq)), with ``return_skipped`` the skipped blocks' output and log-sum-exp, and with ``return_block_mask``
    the mask ``sparsity`` predicted (bool (B, H, nQB, nKB)); each empty when not asked for."""
    kwargs = dict(
        layout=layout, pv=PV(pv), sm_scale=sm_scale, smooth_k=smooth_k,
        qk_balance=qk_balance if balance is None else balance, qk_rotate=qk_rotate,
        attn_mask=attn_mask, block_mask=block_mask, q_amax=q_amax, k_amax=k_amax, v_amax=v_amax, k_mean=k_mean,
        return_lse=return_lse,
    )

    def empty(dtype=torch.float32):  # one a slot: the op's outputs may not alias each other
        return q.new_empty(0, dtype=dtype)

    if backend == Backend.TRITON.value:
        from .attention import triton_attention  # imports triton lazily: CPU-only installs never need it

        res = triton_attention(q, k, v, sparsity=sparsity, keep_kv_blocks=keep_kv_blocks,
                               return_skipped=return_skipped, return_block_mask=return_block_mask, **kwargs)
        res = list(res) if isinstance(res, tuple) else [res]
        mask = res.pop() if return_block_mask else empty(torch.bool)
        lse = res.pop(1) if return_lse else empty()
        skipped = res[1:] if return_skipped else (empty(), empty())
        return res[0], lse, *skipped, mask
    mask = None
    if sparsity is not None:  # the emulation predicts with the standalone predictor
        mask = kwargs["block_mask"] = predict_block_mask(q, k, sparsity, layout=layout, sm_scale=sm_scale,
                                                         keep_kv_blocks=keep_kv_blocks)
    skipped = (empty(), empty())
    if return_skipped:  # the skipped blocks as a call of their own, then every block
        skipped = emulate_attention(q, k, v, **{**kwargs, "block_mask": ~block_mask, "return_lse": True})
        kwargs["block_mask"] = None
    res = emulate_attention(q, k, v, **kwargs)
    out, lse = res if return_lse else (res, empty())
    return out, lse, *skipped, mask if return_block_mask else empty(torch.bool)


quantized_attention = torch.library.custom_op("diffusion_int8::quantized_attention", mutates_args=())(_quantized_attention)


@quantized_attention.register_fake
def _(q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, balance, keep_kv_blocks, layout, pv, sm_scale,
      smooth_k, qk_balance, qk_rotate, sparsity, backend, return_lse, return_skipped, return_block_mask):
    B, H, Sq = to_bhsd(q, layout).shape[:3]
    Sk = to_bhsd(k, layout).shape[2]
    lse = q.new_empty((B, H, Sq) if return_lse else (0,), dtype=torch.float32)
    skipped = (output_like(q), q.new_empty((B, H, Sq), dtype=torch.float32)) if return_skipped else (
        q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32))
    nb = (B, H, -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK)) if return_block_mask else (0,)
    return output_like(q), lse, *skipped, q.new_empty(nb, dtype=torch.bool)


def dispatch(q: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantized_attention(q, *args)``: the op when something may be tracing, the implementation otherwise."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or is_fake(q):
        return quantized_attention(q, *args)
    return _quantized_attention(q, *args)
