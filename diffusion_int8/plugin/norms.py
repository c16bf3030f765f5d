"""Query and key RMSNorms run in one launch inside the routed copies of diffusers' processors.

Attention modules built with ``qk_norm="rms_norm"`` (HunyuanVideo, SD3, Cosmos, ...) normalize Q and K with diffusers'
``RMSNorm``, six PyTorch launches per tensor in eager mode (``kernels.rmsnorm``). A routed copy is handed the module
through ``with_fast_norms``: a view whose ``norm_q``, ``norm_k``, ``norm_added_q`` and ``norm_added_k`` that are such
norms are ``CheckedRMSNorm``s, and whose every other attribute is the module's own. ``torch.nn.RMSNorm`` (Flux, Wan,
...) is one fused PyTorch kernel already and is left alone.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.modules import module as _module

from ..kernels.rmsnorm import ORDERS, rms_norm_refusal, rms_norm_unchecked
from .checked import first_equal

NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


@functools.lru_cache(maxsize=1)
def stock_rms_norm() -> type | None:
    """The installed diffusers' ``normalization.RMSNorm``; None without one."""
    try:
        from diffusers.models.normalization import RMSNorm
    except ImportError:
        return None
    return RMSNorm


class CheckedRMSNorm:
    """A diffusers ``RMSNorm`` module and ``kernels.rmsnorm.rms_norm``: calls it takes (no bias, a contiguous input)
    run in one launch once one of its reduction orders (``kernels.rmsnorm.ORDERS``) has given the module's result bit for
    bit for their head dim, dtypes and device (``checked.first_equal``); other calls, calls torch.compile traces, and a module with hooks or a
    forward of its own run the module. Other attributes are the module's."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states):
        m, x = self.module, hidden_states
        if (torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or m.bias is not None
                or "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks
                or _module._global_forward_hooks or _module._global_forward_pre_hooks):
            return m(x)
        w = m.weight
        orders = [(o, t) for o, t in ORDERS if rms_norm_refusal(x, w, o) is None]
        if not orders:
            return m(x)
        key = (type(m).forward.__code__, x.shape[-1], x.dtype, None if w is None else w.dtype, x.device)
        twins = [lambda o=o, t=t: rms_norm_unchecked(x, w, m.eps, o, t) for o, t in orders]
        return first_equal(key, x, twins, lambda: m(x), f"{type(m).__name__} (query/key norm)",
                           f"{x.dtype} input, {None if w is None else w.dtype} weight, D={x.shape[-1]}")

    def __getattr__(self, name):
        return getattr(self.module, name)


class FastNorms:
    """An attention module as a stock processor reads it, with its diffusers-``RMSNorm`` query and key norms
    ``CheckedRMSNorm``s: every other attribute read or written is the module's."""

    __slots__ = ("_attn", *NORMS)

    def __init__(self, attn: torch.nn.Module, norms: dict[str, CheckedRMSNorm]):
        object.__setattr__(self, "_attn", attn)
        for name, norm in norms.items():
            object.__setattr__(self, name, norm)

    def __getattr__(self, name):  # only for what the slots do not hold
        return getattr(self._attn, name)

    def __setattr__(self, name, value):
        setattr(self._attn, name, value)


def with_fast_norms(attn: torch.nn.Module) -> torch.nn.Module | FastNorms:
    """``attn``, or a ``FastNorms`` view of it where one of its query/key norms is a diffusers ``RMSNorm`` whose
    forward is the installed class's."""
    stock = stock_rms_norm()
    if stock is None:
        return attn
    modules = attn._modules
    norms = {}
    for name in NORMS:
        m = modules.get(name)
        if m is not None and type(m).forward is stock.forward:
            norms[name] = CheckedRMSNorm(m)
    return FastNorms(attn, norms) if norms else attn
