"""Routing a stock diffusers processor's attention call to the INT8 op.

Every stock diffusers processor ends in ``torch.nn.functional.scaled_dot_product_attention``, called through
its module's ``F`` (``AttnProcessor2_0``, ``JointAttnProcessor2_0``, ``CogVideoXAttnProcessor2_0`` …), or in
the attention dispatcher's ``dispatch_attention_fn`` (``FluxAttnProcessor``, ``WanAttnProcessor`` …).
``routed`` copies a stock processor's ``__call__`` with those two globals pointing elsewhere (and its rotary
embedding run as one launch: ``rotary.with_fast_rotary``), so nothing is patched globally and nothing else in the
processor pays for the routing (a ``TorchFunctionMode`` around the call would intercept every torch call in it, at a
host cost per attention module; ``RouteToInt8`` does that only where torch.compile traces it away). ``int8_sdpa`` is
SDPA's signature on the INT8 op.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels import Mode, StaticRanges, int8_attention
from ..kernels.config import MAX_HEAD_DIM
from .rotary import with_fast_rotary


def routed(fn: Callable, sdpa: Callable, dispatch: Callable) -> Callable | None:
    """A copy of the stock processor's ``__call__`` ``fn`` whose module-level ``F.scaled_dot_product_attention``
    is ``sdpa`` and ``dispatch_attention_fn`` is ``dispatch``, and whose rotary embedding (Wan's nested one, or
    diffusers' ``embeddings.apply_rotary_emb`` read as a global or imported) runs in one launch: the code, globals and
    builtins ``rotary.with_fast_rotary`` gives; None when ``fn`` reaches attention through neither."""
    g = fn.__globals__
    names = {}
    if g.get("F") is F:
        routed_f = types.ModuleType(F.__name__)
        routed_f.__dict__.update(F.__dict__)
        routed_f.scaled_dot_product_attention = sdpa
        names["F"] = routed_f
    if callable(g.get("dispatch_attention_fn")):
        names["dispatch_attention_fn"] = dispatch
    if not names:
        return None
    code, rotary = with_fast_rotary(fn.__code__, g)
    return _copy(fn, code, {**g, **names, **rotary})


def rotary_only(fn: Callable) -> Callable | None:
    """A copy of the stock processor's ``__call__`` ``fn`` whose rotary embedding runs in one launch, as in ``routed``,
    and whose attention is the stock one: what a call the speed gate sends to SDPA computes, bit for bit, with fewer
    launches; None where it has no rotary embedding the stand-ins take (or is not a plain function). Like a routed
    copy, it reads its module's globals (and builtins) as they were when it was made."""
    if not isinstance(fn, types.FunctionType):
        return None
    code, rotary = with_fast_rotary(fn.__code__, fn.__globals__)
    return _copy(fn, code, {**fn.__globals__, **rotary}) if rotary else None


def _copy(fn: types.FunctionType, code: types.CodeType, globals_: dict) -> types.FunctionType:
    copy = types.FunctionType(code, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_DISPATCH_MODULE = None  # diffusers.models.attention_dispatch once a processor exists


def attention_dispatch():
    """diffusers' attention dispatcher module, imported when the first processor is made: an import inside code
    torch.compile traces is a graph break (``diffusers.models`` is a lazy module)."""
    global _DISPATCH_MODULE
    if _DISPATCH_MODULE is None:
        from diffusers.models import attention_dispatch

        _DISPATCH_MODULE = attention_dispatch
    return _DISPATCH_MODULE


def keeps_stock(backend, parallel_config) -> bool:
    """Whether a ``dispatch_attention_fn`` call goes to another attention backend than diffusers' native one
    (``backend`` None: the active one), or is split across devices (context parallelism): such calls stay stock."""
    if parallel_config is not None:
        return True
    if backend is None:
        backend = attention_dispatch()._AttentionBackendRegistry.get_active_backend()[0]
    return backend != "native"


def other_backend(inner) -> bool:
    """``keeps_stock`` for a stock processor's settings; processors without the dispatcher have none."""
    if not hasattr(inner, "_attention_backend") and getattr(inner, "_parallel_config", None) is None:
        return False
    return keeps_stock(getattr(inner, "_attention_backend", None), getattr(inner, "_parallel_config", None))


class RouteToInt8(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to ``sdpa`` for the duration of one processor call (traced by
    torch.compile); ``dispatch_attention_fn``'s native backend ends in that call."""

    def __init__(self, sdpa: Callable):
        super().__init__()
        self.sdpa = sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if func is torch.Tensor.unflatten:
            # Tensor.unflatten is Python calling super().unflatten, which dynamo cannot trace inside a
            # torch-function mode (Flux and Wan processors use it); torch.unflatten is the same op.
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


def int8_sdpa(mode, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, ranges=None, block_mask=None, qk_balance=False):
    """``scaled_dot_product_attention``'s signature (BHSD), in ``mode``; cases the kernel does not cover go to SDPA.

    ``ranges``: optional ``StaticRanges`` for ``int8_attention``, shaped (1, H), (1, H), (1, H, D), (1, H, D), (1, H, D)
    (``Calibration.ranges``; ``k_mean`` and ``qk_balance`` may be None; a balance given there replaces
    ``qk_balance``). ``block_mask`` and ``qk_balance``: as ``int8_attention``
    takes them (a block mask applies to INT8 calls only; calls that go to SDPA are dense).
    """
    mode = Mode.parse(mode)
    if mode is Mode.FP16 or not kernel_takes(query, key, attn_mask, dropout_p, is_causal, enable_gqa):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    return int8_core(mode, query, key, value, attn_mask, scale, ranges, block_mask=block_mask, qk_balance=qk_balance)


_NO_RANGES = StaticRanges()


def int8_core(mode: Mode, query, key, value, attn_mask, scale, ranges, *, block_mask=None, qk_balance=False,
              qk_rotate=False, sparsity=None, keep_kv_blocks=None, return_lse=False, return_skipped=False,
              return_block_mask=False):
    """``int8_sdpa`` for a call ``kernel_takes`` (the processor has checked it already); with ``return_lse``,
    ``return_skipped`` and/or ``return_block_mask``, also what ``int8_attention`` returns for them, in its order.
    ``qk_rotate``, ``sparsity``, ``keep_kv_blocks``: as ``int8_attention``'s (``ranges`` without Q's and K's with the
    rotation)."""
    dtype = query.dtype
    r = ranges if ranges is not None else _NO_RANGES
    v_scale = None
    if dtype not in (torch.float16, torch.bfloat16):  # fp32 models: the kernel computes in fp16
        query, key, value, r, v_scale = fp16_in_range(query, key, value, r)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(torch.float32)
    if r.qk_balance is not None:  # a calibrated balance, which the static ranges are of
        qk_balance = r.qk_balance
    out = int8_attention(query, key, value, mode=mode, layout="BHSD", attn_mask=attn_mask, scale=scale,
                         qk_balance=qk_balance, qk_rotate=qk_rotate, q_amax=r.q_amax, k_amax=r.k_amax, v_amax=r.v_amax, k_mean=r.k_mean,
                         block_mask=block_mask, sparsity=sparsity, keep_kv_blocks=keep_kv_blocks, return_lse=return_lse,
                         return_skipped=return_skipped, return_block_mask=return_block_mask)
    if not isinstance(out, tuple):
        return _restore(out, dtype, v_scale)
    out = list(out)
    for i in (0, 1 + return_lse) if return_skipped else (0,):  # the outputs, in the caller's dtype
        out[i] = _restore(out[i], dtype, v_scale)
    return tuple(out)


_FP16_SAFE = 2.0 ** 15  # inputs whose largest element is below this are converted as they are


def fp16_in_range(query, key, value, ranges: StaticRanges):
    """float32 (or float64) Q, K, V (B, H, S, D) as fp16 for the kernel, scaled by powers of two where an element
    reaches 2^15 (fp16 ends at 65504): Q times 2^e and K times 2^-e, which leaves every logit as it is and meets their
    ranges halfway (so Q and K overflow only where the product of their largest elements passes about 2^31), and V
    times 2^-f, undone on the output. Powers of two scale exactly, so a call whose inputs all lie
    within ±2^15 is converted unscaled, bit for bit as a plain cast. The factors stay on the device (no host
    synchronization; CUDA graphs and torch.compile take them). Returns the three fp16 tensors, ``ranges`` in the
    scaled units, and V's factor 2^-f (a 0-d float32 tensor)."""
    aq, ak, av = (torch.linalg.vector_norm(t.detach(), float("inf")).float() for t in (query, key, value))
    e = torch.round(0.5 * torch.log2(ak / aq))  # Q's and K's largest elements made alike
    e = torch.where((torch.maximum(aq, ak) < _FP16_SAFE) | ~e.isfinite(), 0.0, e)
    f = torch.clamp(torch.ceil(torch.log2(av / _FP16_SAFE)), min=0.0)
    f = torch.where(f.isfinite(), f, 0.0)
    sq, sv = torch.exp2(e), torch.exp2(-f)
    query, key, value = (query * sq).half(), (key / sq).half(), (value * sv).half()

    def scaled(t, by):
        return None if t is None else t * by

    ranges = StaticRanges(scaled(ranges.q_amax, sq), scaled(ranges.k_amax, 1 / sq), scaled(ranges.v_amax, sv),
                          scaled(ranges.k_mean, 1 / sq), ranges.qk_balance)
    return query, key, value, ranges, sv


def _restore(out: torch.Tensor, dtype: torch.dtype, v_scale: torch.Tensor | None) -> torch.Tensor:
    """An INT8 output (fp16 or bf16) in the caller's dtype, V's scaling undone."""
    return out.to(dtype) if v_scale is None else out.to(dtype) / v_scale.to(dtype)


def kernel_takes(query, key, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> bool:
    """Whether an SDPA call (BHSD) is one the INT8 kernel covers: 4-D, no dropout, not causal, head dim
    <= 256, Q's batch in K and V (SDPA broadcasts a batch of 1; the kernel does not), as many K/V heads as query
    heads or, with ``enable_gqa``, a divisor of them (without it SDPA refuses the call, and so does its stock
    error here), a mask that broadcasts to (B, H, Sq, Sk). Other calls stay on SDPA."""
    if is_causal or dropout_p > 0 or query.dim() != 4 or key.dim() != 4 or query.shape[-1] > MAX_HEAD_DIM:
        return False
    hq, hk = query.shape[1], key.shape[1]
    if key.shape[0] != query.shape[0] or not (hk == hq or (enable_gqa and hk > 0 and hq % hk == 0)):
        return False
    return attn_mask is None or (attn_mask.dim() <= 4 and _broadcasts(attn_mask, query, key))


def _broadcasts(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        return torch.broadcast_shapes(mask.shape, full) == torch.Size(full)
    except RuntimeError:
        return False
