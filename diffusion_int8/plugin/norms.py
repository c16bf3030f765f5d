"""Query and key RMSNorms run in one launch where the processor runs diffusers' processors: routed or gated calls.

Attention modules built with ``qk_norm="rms_norm"`` (HunyuanVideo, SD3, Cosmos, ...) normalize Q and K with diffusers'
``RMSNorm``, six PyTorch launches per tensor in eager mode (``kernels.rmsnorm``). A stock processor is handed the module
through ``with_fast_norms``: a view whose ``norm_q``, ``norm_k``, ``norm_added_q`` and ``norm_added_k`` that are such
norms are ``CheckedRMSNorm``s, and whose every other attribute is the module's own. ``torch.nn.RMSNorm`` (Flux, Wan,
...) is one fused PyTorch kernel already and is left alone.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.modules import module as _module

from ..kernels.config import triton_unavailable
from ..kernels.rmsnorm import ORDERS, STRIDED, VECTORIZED, covers, rms_norm_refusal, rms_norm_unchecked
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


# (RMSNorm.forward's code, D, device) -> the (order, tree) whose sums are PyTorch's there, or None where no single one
# is: found once per process, as a kernel is compiled once
_ORDER: dict[tuple, tuple[int, int] | None] = {}
_PROBE_ROWS = 256


def probed_order(d: int, device: torch.device) -> tuple[int, int] | None:
    """The one (order, tree) of ``kernels.rmsnorm.ORDERS`` whose result equals the installed ``RMSNorm``'s, bit for
    bit, on a float32 probe of D channels on ``device``, or None (none does, or more than one: the probe cannot tell
    them apart), with one warning. Float32 rows of widely spread values without a weight, so that a sum in another
    order shows in the result (in 16 bits most of them round to the same output, and the first real call alone could
    not tell the orders apart). Not while a CUDA graph is captured: None then, and the question stays open."""
    stock = stock_rms_norm()
    key = (stock.forward.__code__, d, device)
    if key in _ORDER:
        return _ORDER[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(_PROBE_ROWS, d, generator=g).mul(3).exp2()
    probe = (torch.randn(_PROBE_ROWS, d, generator=g) * spread).to(device)
    want = stock_probe(probe)
    found = []
    try:
        for order, tree in ORDERS:
            if rms_norm_refusal(probe, None, order) is None and torch.equal(
                    rms_norm_unchecked(probe, None, 1e-6, order, tree), want):
                found.append((order, tree))
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: stock, as promised
        found = []
        warnings.warn(f"diffusion_int8: the one-launch RMSNorm failed ({type(exc).__name__}: {exc}); query/key "
                      f"RMSNorms run as they are", RuntimeWarning, stacklevel=3)
    else:
        if len(found) != 1:
            warnings.warn(f"diffusion_int8: {len(found)} reduction orders of the one-launch RMSNorm give PyTorch's "
                          f"bits at D={d} on {device}, where one should; query/key RMSNorms of that size run as they "
                          f"are", RuntimeWarning, stacklevel=3)
    _ORDER[key] = found[0] if len(found) == 1 else None
    return _ORDER[key]


def stock_probe(probe: torch.Tensor) -> torch.Tensor:
    """The installed ``RMSNorm``'s result on ``probe`` (float32, without a weight)."""
    with torch.no_grad():
        return stock_rms_norm()(probe.shape[-1], 1e-6, elementwise_affine=False)(probe)


class CheckedRMSNorm:
    """A diffusers ``RMSNorm`` module and ``kernels.rmsnorm.rms_norm``: calls it takes (no bias, rows that tile one
    block of memory) run in one launch in the order the probe found for their head dim (``probed_order``), once that
    has also given the module's result bit for bit on a real call of their dtypes, layout and device
    (``checked.first_equal``); other calls, calls torch.compile traces, and a module with hooks or a forward of its own
    run the module. Other attributes are the module's."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states):
        m, x = self.module, hidden_states
        if (torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or x.dim() < 1 or m.bias is not None
                or "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks
                or _module._global_forward_hooks or _module._global_forward_pre_hooks):
            return m(x)
        w, d = m.weight, x.shape[-1]
        taken = [o for o in (STRIDED, VECTORIZED) if covers(o, d)]
        # asked before the probe: inputs no order takes are not probed (nor warned of); the orders' refusals differ
        # only in the head dims they cover
        if not taken or rms_norm_refusal(x, w, taken[0]) is not None:
            return m(x)
        order = probed_order(d, x.device)
        if order is None or order[0] not in taken:
            return m(x)
        key = (type(m).forward.__code__, order, d, x.dtype, None if w is None else w.dtype, x.device,
               x.is_contiguous())
        return first_equal(key, x, (lambda: rms_norm_unchecked(x, w, m.eps, *order),), lambda: m(x),
                           f"{type(m).__name__} (query/key norm)",
                           lambda: f"{x.dtype} input, {None if w is None else w.dtype} weight, D={d}")

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


def with_fast_norms(attn: torch.nn.Module, device: torch.device) -> torch.nn.Module | FastNorms:
    """``attn``, or a ``FastNorms`` view of it where one of its query/key norms is a diffusers ``RMSNorm`` whose
    forward is the installed class's and the Triton kernels run on ``device`` (the call's: elsewhere the view would
    only add its checks to every norm)."""
    stock = stock_rms_norm()
    if stock is None:
        return attn
    modules = attn._modules
    norms = {}
    for name in NORMS:
        m = modules.get(name)
        if m is not None and type(m).forward is stock.forward:
            norms[name] = CheckedRMSNorm(m)
    # the device asked last: most modules (no such norm) return above, at every call
    return FastNorms(attn, norms) if norms and triton_unavailable(device) is None else attn
