"""``int8_attention``: the public attention entry point, in three steps: validate (once per call signature), plan, run."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from ..caller import warn_user
from .config import (ENV_BACKEND, ENV_PV8, MAX_HEAD_DIM, PV, SPARSE_BLOCK, Backend, Kernel, Mode, padded_head_dim,
                     pv_for_mode, select_backend, triton_unavailable)
from . import cache
from .cache import signature
from .layout import check_rotation, output_like, to_bhsd
from .ops import dispatch
from .sparsity import check_keep, check_tau, predict_block_mask

_DTYPES = (torch.float16, torch.bfloat16)
_LAYOUTS = ("BHSD", "BSHD")


def int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str | Mode = "int8_fp16v",
    layout: str = "BHSD",
    attn_mask: torch.Tensor | None = None,
    block_mask: torch.Tensor | None = None,
    scale: float | None = None,
    smooth_k: bool = True,
    qk_balance: bool | torch.Tensor = False,
    qk_rotate: bool = False,
    q_amax: torch.Tensor | None = None,
    k_amax: torch.Tensor | None = None,
    v_amax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    sparsity: float | None = None,
    keep_kv_blocks: torch.Tensor | None = None,
    check_finite: bool = False,
    return_lse: bool = False,
    return_skipped: bool = False,
    return_block_mask: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention with Q·Kᵀ on INT8 tensor cores.

    Args:
        q: (B, Hq, Sq, D) for ``layout="BHSD"`` or (B, Sq, Hq, D) for ``"BSHD"``; fp16 or bf16.
            Read through its strides: transposed views need no copy.
        k, v: (B, Hkv, Sk, D) or (B, Sk, Hkv, D), same dtype and device as ``q``. ``Hq`` must be a
            multiple of ``Hkv`` (GQA/MQA). Any Sq, Sk >= 0 (B = 0, Sq = 0 or Sk = 0 give zeros: a row without
            keys is 0, as a fully masked row is); any D from 1 to 256 (padded inside).
        mode: ``"int8_fp16v"`` (Q·Kᵀ INT8, P·V in the input's 16-bit type), ``"int8"`` (Q·Kᵀ INT8,
            P·V in FP8 e4m3 on sm89+ and INT8 before that) or ``"fp16"`` (exact, through
            ``torch.nn.functional.scaled_dot_product_attention``).
        attn_mask: bool (True = attend) or additive float mask, broadcastable to (B, Hq, Sq, Sk),
            e.g. a key-padding mask of shape (B, 1, 1, Sk). Rows with every key masked give 0.
        block_mask: block-sparse attention: a bool tensor broadcastable to (B, Hq, ceil(Sq / 128), ceil(Sk / 128)),
            one entry per 128 queries × 128 keys (``config.SPARSE_BLOCK``); False skips that block: the kernels
            never load its K and V, so the call's time follows the kept fraction. ``kernels.sparsity`` predicts
            one from Q and K. Query rows whose block keeps no key block give 0; a mask that keeps every block
            gives the dense result bit for bit. Mode ``fp16`` applies it as an element mask (exact, not faster).
        sparsity: block-sparse attention with the mask predicted in the call: the level tau in (0, 1] of
            ``kernels.sparsity.predict_block_mask`` (per query block, the key blocks holding the pooled attention
            mass tau; 1 keeps every block). On a GPU the quantization launch sums Q's and K's blocks as it reads
            them, and two small launches turn the sums into the block lists: no pass of its own over Q and K
            (``predict_block_mask`` then ``block_mask=`` reads them twice more). Its masks equal
            ``predict_block_mask``'s up to the order of float32 sums (a block at the threshold may fall either
            way). Not with ``block_mask`` or ``attn_mask`` (the predictor does not see the mask).
        keep_kv_blocks: with ``sparsity``: bool, broadcastable to (B, Hq, nQB, nKB), pairs always kept (e.g.
            ``(nKB,)`` True where key blocks hold text tokens).
        scale: softmax scale; default ``D ** -0.5``.
        smooth_k: subtract K's token mean per (batch, head) before quantizing (softmax is invariant
            to it; it removes the channel bias that breaks naive INT8 K).
        qk_balance: scale Q's channels down and K's up (or the reverse) by powers of two, per (batch, K/V head,
            channel), from their measured ranges: Q·Kᵀ is unchanged exactly, and a channel large in Q or in K
            alone (an outlier channel) no longer sets the range every other channel of its token is quantized
            with. It costs a quarter read of Q in the statistics pass, so this function leaves it off
            (``enable`` turns it on per module where the first call shows outlier channels). Applies where no static ``q_amax``, ``k_amax`` or ``k_mean`` is given and a K/V head has
            at least 1,024 queries (fewer give no reliable channel ranges). A tensor instead is a given balance,
            broadcastable to (B, Hkv, D), finite and positive (powers of two keep Q·Kᵀ exact), e.g. a calibrated
            one (``Calibration.ranges(..., balance=True)``): then nothing is measured for it, and ``q_amax`` and
            ``k_amax``, if given, are ranges of the balanced Q and K.
        qk_rotate: multiply Q's and K's rows (K after smoothing) by a ±1 Hadamard matrix before quantizing them:
            Q·Kᵀ is unchanged up to rounding (exactly DP times it, divided out in Q's scale), and every channel
            is spread over all of them, so outlier channels no longer set a token's range, including channels
            that Q and K share, which the balance cannot move. With ``qk_balance`` too, the balance applies
            first: together they cover both kinds of outlier channels. It costs two INT8 MMAs per tile in the
            quantization launch (BENCHMARKS.md has the accuracy and the cost), so it is off by default. Needs Q's and K's ranges measured (no ``q_amax``/``k_amax``).
        q_amax, k_amax: static quantization ranges broadcastable to (B, Hq) / (B, Hkv), e.g. per-head
            calibrated ranges (``Calibration.ranges``; ``k_amax`` is of the smoothed K). Values beyond
            are clipped. Ranges must be finite and positive: on CPU tensors (and with ``check_finite``)
            anything else raises ``ValueError``; on a GPU without the check, the rows an invalid range
            reaches come out NaN (the emulation does the same).
        v_amax: static per-channel range of V, broadcastable to (B, Hkv, D).
        k_mean: static smoothing vector, broadcastable to (B, Hkv, D), subtracted from every key instead
            of K's measured token mean (exact for any vector: softmax is invariant to it; it only sets
            what ``k_amax`` is a range of). With ``k_mean`` and ``v_amax`` given (``v_amax`` is not
            needed for ``int8_fp16v``), no statistics pass over K and V runs.
        check_finite: raise ``ValueError`` on NaN/Inf inputs. This costs a host synchronization, so it
            is off by default; then a NaN/Inf in a row of Q makes that output row NaN, and one in K or V
            makes the rows that attend to its quantization block NaN. Non-finite values are never
            silently replaced.
        return_lse: also return each query row's log-sum-exp of its scaled (and masked) logits, as the INT8
            modes computed them (their quantized scores, K's smoothing added back): what ring attention merges
            partial results with. Every kernel writes it in its epilogue; adding the smoothing back reads K and Q
            once more. Mode ``fp16`` computes it exactly (flash attention's on
            a GPU, else a float32 Q·Kᵀ).
        return_skipped: with ``block_mask``: compute every block (the output is the dense call's up to rounding:
            the blocks run in another order, and with 8-bit P·V, P is rounded against another running max) and
            also return the attention over the blocks the mask skips: its output and
            log-sum-exp, as ``block_mask=~block_mask, return_lse=True`` would give them (rows whose every block
            is kept: 0 and -inf). The INT8 kernels visit the skipped blocks first and write their result on the
            way, in the one launch: what a refresh of carried blocks (``plugin.carry``) needs.
        return_block_mask: with ``sparsity``, also return the mask it predicted: bool (B, Hq, nQB, nKB), True =
            computed (e.g. to count the skipped blocks).

    Returns:
        Attention output shaped like ``q``, in ``q``'s dtype, dense in the memory order of ``q``'s dims (a BHSD
        view of (B, S, H, D) memory gets (B, S, H, D) memory, as SDPA's output does); with ``return_lse``, the
        pair (output, log-sum-exp) where the log-sum-exp is float32 (B, Hq, Sq) in natural-log units, -inf for a
        row without keys (in either layout, as ``torch.nn.functional.scaled_dot_product_attention``'s kernels
        give it); with ``return_skipped``, the skipped blocks' output and log-sum-exp after those; with
        ``return_block_mask``, the predicted mask last.

    The INT8 modes have no backward: in eager mode inputs that require grad are read as detached, and a warning
    says so (under ``torch.compile`` the op refuses them); mode ``fp16`` is SDPA, gradients included.
    """
    # 1. Validate, once per call signature: a signature seen before skips every check and choice (the hot path)
    key, call = _checked_call(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance, qk_rotate,
                              q_amax, k_amax, v_amax, k_mean, sparsity, keep_kv_blocks, return_lse, return_skipped,
                              return_block_mask)
    given_bal = qk_balance if isinstance(qk_balance, torch.Tensor) else None
    _check_values(q, k, v, q_amax, k_amax, v_amax, k_mean, given_bal, check_finite)
    # 2. Plan: exact attention, an empty call, or the INT8 kernels on the backend and P·V format the checks chose
    if call.mode is Mode.FP16:
        return _exact(q, k, v, call, layout, attn_mask, block_mask, sparsity, keep_kv_blocks, return_lse,
                      return_skipped, return_block_mask)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad) \
            and not torch.compiler.is_compiling():  # compiled, the op's missing autograd formula is the error
        _warn_no_backward()
        q, k, v = q.detach(), k.detach(), v.detach()
    if call.empty:
        return _empty(q, k, layout, return_lse, return_skipped, return_block_mask)
    # 3. Run: plain eager tensors go straight to the launch plan of their signature (the custom op's dispatch
    # layers do nothing there but cost host time); anything that may be tracing goes through the op
    if key is not None and call.backend is Backend.TRITON and not _dispatch_mode():
        from .attention import triton_attention

        return triton_attention(q, k, v, layout=layout, pv=call.pv, sm_scale=call.scale, smooth_k=smooth_k,
                                qk_balance=qk_balance, qk_rotate=qk_rotate, attn_mask=attn_mask, block_mask=block_mask,
                                q_amax=q_amax, k_amax=k_amax, v_amax=v_amax, k_mean=k_mean, sparsity=sparsity,
                                keep_kv_blocks=keep_kv_blocks, return_lse=return_lse, return_skipped=return_skipped,
                                return_block_mask=return_block_mask, key=key)
    out, lse, skipped_out, skipped_lse, mask = dispatch(
        q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, given_bal, keep_kv_blocks, layout,
        call.pv.value, call.scale, smooth_k, qk_balance is True, qk_rotate, sparsity, call.backend.value,
        bool(return_lse), bool(return_skipped), bool(return_block_mask),
    )
    return _results(out, *((lse,) if return_lse else ()), *((skipped_out, skipped_lse) if return_skipped else ()),
                    *((mask,) if return_block_mask else ()))


def _warn_no_backward() -> None:
    warn_user("diffusion_int8: the INT8 modes have no backward: their output carries no gradient to q, k and v (run "
              "inference under torch.no_grad() or torch.inference_mode(); mode 'fp16' is SDPA, with its gradients)")


def _checked_call(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance, qk_rotate, q_amax, k_amax,
                  v_amax, k_mean, sparsity, keep_kv_blocks, return_lse, return_skipped,
                  return_block_mask) -> tuple[tuple | None, "_Call"]:
    """The call's signature (None where it has none: traced, or not plain tensors) and what its checks decided,
    from the cache where the signature was seen; raises on bad arguments."""
    try:
        plain = type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
        key = None if torch.compiler.is_compiling() or not plain else (  # no data_ptr() to trace
            "call", mode, layout, balance_key(scale), balance_key(smooth_k), balance_key(qk_balance),
            balance_key(qk_rotate), balance_key(return_lse),
            balance_key(return_skipped), balance_key(sparsity), balance_key(return_block_mask),
            os.environ.get(ENV_BACKEND), os.environ.get(ENV_PV8), signature(q), signature(k), signature(v), signature(attn_mask),
            signature(block_mask), signature(q_amax), signature(k_amax), signature(v_amax), signature(k_mean),
            signature(keep_kv_blocks))
        call = cache.ENTRIES.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, tensors without storage, unhashable options
        key, call = None, None
    if call is None:
        call = _prepare(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance, qk_rotate, q_amax,
                        k_amax, v_amax, k_mean, sparsity, keep_kv_blocks, return_lse, return_skipped, return_block_mask)
        if key is not None:
            cache.remember(key, call)
    return key, call


def _check_values(q, k, v, q_amax, k_amax, v_amax, k_mean, given_bal, check_finite: bool) -> None:
    """The checks that read tensor values: the inputs with ``check_finite``, the static ranges on CPU tensors or with
    ``check_finite`` (on a GPU reading them synchronizes with it)."""
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf")
    if check_finite or q.device.type == "cpu":
        _check_range_values(q_amax, k_amax, v_amax, k_mean, given_bal)


def _exact(q, k, v, call: "_Call", layout, attn_mask, block_mask, sparsity, keep_kv_blocks, return_lse: bool,
           return_skipped: bool, return_block_mask: bool):
    """Mode ``fp16``: SDPA (block-sparse as an element mask), with the exact log-sum-exp if asked for."""
    if return_skipped:  # every block, and the skipped ones' attention as a call of their own gives it
        skipped = _exact(q, k, v, call, layout, attn_mask, ~block_mask, None, None, True, False, False)
        dense = _exact(q, k, v, call, layout, attn_mask, None, None, None, return_lse, False, False)
        return _results(*(dense if return_lse else (dense,)), *skipped)
    qb, kb, vb = (t if layout == "BHSD" else t.transpose(1, 2) for t in (q, k, v))
    if attn_mask is not None:
        attn_mask = _sdpa_mask(attn_mask, qb.dtype)
    if sparsity is not None:
        block_mask = predict_block_mask(qb, kb, sparsity, sm_scale=call.scale, keep_kv_blocks=keep_kv_blocks)
    if block_mask is not None:
        out = _sdpa_block_sparse(qb, kb, vb, attn_mask, block_mask, call, layout)
        lse = (exact_lse(qb, kb, attn_mask, block_mask, call.scale),) if return_lse else ()
        return _results(out, *lse, *((block_mask,) if return_block_mask else ()))
    if return_lse:
        out, lse = sdpa_with_lse(qb, kb, vb, attn_mask, call.scale)
        return (out if layout == "BHSD" else out.transpose(1, 2)), lse
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attn_mask, scale=call.scale, enable_gqa=call.gqa)
    return out if layout == "BHSD" else out.transpose(1, 2)


def _sdpa_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask the INT8 modes take as SDPA takes it: at least 2-D, and an additive one in float32 unless it has the
    query's dtype (SDPA refuses float64, and bfloat16 beside float16 queries)."""
    if mask.dim() < 2:
        mask = mask.reshape(1, -1)
    if mask.is_floating_point() and mask.dtype not in (torch.float32, dtype):
        mask = mask.float()
    return mask


def _empty(q, k, layout, return_lse: bool, return_skipped: bool, return_block_mask: bool):
    """No batch, queries or keys: no work, and rows without keys are 0 (as fully masked rows are)."""
    B, H, Sq = to_bhsd(q, layout).shape[:3]
    Sk = to_bhsd(k, layout).shape[2]
    out = output_like(q, zero=True)
    lse = (torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device),) if return_lse else ()
    mask = torch.ones((B, H, -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK)), dtype=torch.bool, device=q.device)
    skipped = ()
    if return_skipped:
        skipped = (output_like(q, zero=True), torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device))
    return _results(out, *lse, *skipped, *((mask,) if return_block_mask else ()))


def _results(out: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The output alone, or with what was asked for: log-sum-exp, skipped blocks' output and log-sum-exp, block
    mask, in that order."""
    return (out, *extra) if extra else out


class _Call(NamedTuple):
    """What the checks of one call signature decided."""

    mode: Mode
    scale: float
    gqa: bool  # query heads grouped over fewer key/value heads
    empty: bool  # no batch, queries or keys
    backend: Backend | None  # None for fp16
    pv: PV | None


def _prepare(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance, qk_rotate, q_amax, k_amax,
             v_amax, k_mean, sparsity, keep_kv_blocks, return_lse, return_skipped, return_block_mask) -> _Call:
    """Check a call and choose its backend and P·V format (raises on bad arguments)."""
    mode, scale, gqa, empty = _check_call(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance,
                                          qk_rotate, q_amax, k_amax, v_amax, k_mean)
    _check_sparsity(q, k, layout, attn_mask, block_mask, sparsity, keep_kv_blocks, return_block_mask)
    for name, flag in (("return_skipped", return_skipped), ("return_lse", return_lse), ("smooth_k", smooth_k)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__}")
    if return_skipped and block_mask is None:
        raise ValueError("return_skipped needs a block_mask (the blocks it skips are returned apart); with sparsity=, "
                         "predict the mask first (kernels.sparsity.predict_block_mask) and give it as block_mask")
    if mode is Mode.FP16:
        return _Call(mode, scale, gqa, empty, None, None)
    return _Call(mode, scale, gqa, empty, select_backend(q.device), pv_for_mode(mode, q.device))


def _check_call(q, k, v, mode, layout, attn_mask, block_mask, scale, smooth_k, qk_balance, qk_rotate, q_amax, k_amax,
                v_amax, k_mean):
    """Every check of ``int8_attention``'s arguments; returns (mode, scale, grouped heads, empty) or raises."""
    mode = Mode.parse(mode)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    _check_qkv(q, k, v, layout)
    s_ax = 2 if layout == "BHSD" else 1
    B, Hq, Sq, D = q.shape[0], q.shape[3 - s_ax], q.shape[s_ax], q.shape[3]
    Hkv, Sk = k.shape[3 - s_ax], k.shape[s_ax]
    if attn_mask is not None:
        _check_mask(attn_mask, q, (B, Hq, Sq, Sk))
    if block_mask is not None:
        _check_block_mask(block_mask, q, (B, Hq, -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK)))
    if scale is None:
        scale = D**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number (None: D ** -0.5), got {scale!r}")
    given_bal = isinstance(qk_balance, torch.Tensor)
    if not (isinstance(qk_balance, bool) or given_bal):
        raise TypeError(f"qk_balance must be True, False or a tensor of balance scales broadcastable to (B, Hkv, D) = "
                        f"{(B, Hkv, D)}, got {type(qk_balance).__name__}")
    if not isinstance(qk_rotate, bool):
        raise TypeError(f"qk_rotate must be True or False, got {type(qk_rotate).__name__}")
    if mode is Mode.FP16:
        if any(t is not None for t in (q_amax, k_amax, v_amax, k_mean)) or given_bal:
            raise ValueError("static quantization inputs (q_amax/k_amax/v_amax/k_mean, a qk_balance tensor) do not "
                             "apply to mode 'fp16'")
        return mode, float(scale), True if Hq != Hkv else False, False  # a bool, not a SymBool, for SDPA
    if given_bal:
        _check_amax("qk_balance", qk_balance, q, (B, Hkv, D))
    check_rotation(qk_rotate, q_amax, k_amax)
    _check_amax("q_amax", q_amax, q, (B, Hq))
    _check_amax("k_amax", k_amax, q, (B, Hkv))
    _check_amax("v_amax", v_amax, q, (B, Hkv, D))
    _check_amax("k_mean", k_mean, q, (B, Hkv, D))
    if k_mean is not None and not smooth_k:
        raise ValueError("k_mean is a smoothing vector: it needs smooth_k=True")
    return mode, float(scale), True if Hq != Hkv else False, 0 in (B, Sq, Sk)


def kernel_info(device: torch.device | str, mode: str | Mode = "int8", head_dim: int = 128) -> dict:
    """Which implementation ``int8_attention`` runs on ``device`` for ``mode``, without running it.

    Returns a dict: ``mode``; ``backend`` (``"triton"``, ``"emulation"`` or ``"sdpa"`` for ``fp16``); ``pv``
    (the P·V format); ``kernel``, the kernel an unmasked call at ``head_dim`` runs (``"sm90_gluon"``,
    ``"triton"``, ``"emulation"`` or ``"sdpa"``); and ``reason``: why the sm_90 Gluon kernel does not run
    where it would apply (e.g. this Triton's Gluon API is not supported) or why the emulation runs, else None.
    """
    device = torch.device(device)
    mode = Mode.parse(mode)
    if mode is Mode.FP16:
        return {"mode": mode.value, "backend": "sdpa", "pv": None, "kernel": Kernel.SDPA.value, "reason": None}
    backend, pv = select_backend(device, warn=False), pv_for_mode(mode, device)
    info = {"mode": mode.value, "backend": backend.value, "pv": pv.value, "kernel": Kernel(backend.value).value,
            "reason": triton_unavailable(device) if backend is Backend.EMULATION else None}
    if backend is Backend.TRITON and device.type == "cuda":
        from . import attention  # imports triton: only where the Triton backend runs

        kernel, info["reason"] = attention.planned_kernel(device, pv, padded_head_dim(head_dim))
        info["kernel"] = kernel.value
    return info


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: torch.float16, torch.bfloat16")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D ({'B, H, S, D' if layout == 'BHSD' else 'B, S, H, D'} for layout "
                f"{layout!r}), got shape {tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    s_ax = 2 if layout == "BHSD" else 1
    h_ax = 3 - s_ax
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims differ: q has {q.shape[3]}, k/v have {k.shape[3]}")
    D = q.shape[3]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} is not supported; accepted: 1 to {MAX_HEAD_DIM}")
    hq, hkv = q.shape[h_ax], k.shape[h_ax]
    if hkv == 0 or hq == 0:
        raise ValueError(f"q has {hq} heads and k/v have {hkv}: attention needs at least one head of each (check the "
                         f"layout: {layout!r} puts heads on dim {h_ax})")
    if hq % hkv:
        raise ValueError(
            f"q has {hq} heads and k/v have {hkv}: the query heads must be a multiple of the key/value "
            f"heads (check the layout: {layout!r} puts heads on dim {h_ax})"
        )


def _check_mask(mask: torch.Tensor, q: torch.Tensor, full: tuple[int, int, int, int]) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask has dtype {mask.dtype}; accepted: torch.bool (True = attend) or a float dtype (additive)")
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device}, q on {q.device}")
    try:
        torch.broadcast_shapes(mask.shape, full)
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk) = {full}; "
            f"a key-padding mask is (B, 1, 1, Sk)"
        )


def _check_block_mask(mask: torch.Tensor, q: torch.Tensor, full: tuple[int, int, int, int]) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"block_mask has dtype {mask.dtype}; accepted: torch.bool (True = compute the block)")
    if mask.device != q.device:
        raise ValueError(f"block_mask is on {mask.device}, q on {q.device}")
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"block_mask of shape {tuple(mask.shape)} does not broadcast to (B, H, ceil(Sq / {SPARSE_BLOCK}), "
            f"ceil(Sk / {SPARSE_BLOCK})) = {full}"
        )


def _check_sparsity(q, k, layout, attn_mask, block_mask, sparsity, keep_kv_blocks, return_block_mask) -> None:
    if sparsity is None:
        if keep_kv_blocks is not None or return_block_mask is not False:
            name = "keep_kv_blocks" if keep_kv_blocks is not None else "return_block_mask"
            raise ValueError(f"{name} goes with sparsity=tau (a predicted block mask); give sparsity too")
        return
    check_tau(sparsity, "sparsity")
    if block_mask is not None:
        raise ValueError("give block_mask (a mask of your own) or sparsity (a predicted one), not both")
    if attn_mask is not None:
        raise ValueError("sparsity does not take an attn_mask: the predictor does not see it, and could keep only masked "
                         "blocks; give a block_mask made with the attn_mask in mind instead")
    if not isinstance(return_block_mask, bool):
        raise TypeError(f"return_block_mask must be True or False, got {type(return_block_mask).__name__}")
    q_b, k_b = to_bhsd(q, layout), to_bhsd(k, layout)
    full = (q_b.shape[0], q_b.shape[1], -(-q_b.shape[2] // SPARSE_BLOCK), -(-k_b.shape[2] // SPARSE_BLOCK))
    if keep_kv_blocks is not None:
        check_keep(keep_kv_blocks, q, full)


def full_block_mask(block_mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """A block mask broadcastable to (..., ceil(sq / 128), ceil(sk / 128)) as a view of at least 2 dims whose last
    two, where of size 1, are expanded to those sizes (stride 0); longer ones are left for the caller to cut."""
    m = block_mask.reshape((1,) * (2 - block_mask.dim()) + tuple(block_mask.shape)) if block_mask.dim() < 2 \
        else block_mask
    nq, nk = m.shape[-2:]
    return m.expand(*m.shape[:-2], -(-sq // SPARSE_BLOCK) if nq == 1 else nq, -(-sk // SPARSE_BLOCK) if nk == 1 else nk)


def expand_block_mask(block_mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """A block mask broadcastable to (..., ceil(sq / 128), ceil(sk / 128)) as the element mask (..., sq, sk) it
    stands for."""
    rows = full_block_mask(block_mask, sq, sk).repeat_interleave(SPARSE_BLOCK, dim=-2)[..., :sq, :]
    return rows.repeat_interleave(SPARSE_BLOCK, dim=-1)[..., :sk]


def _sdpa_block_sparse(qb, kb, vb, attn_mask, block_mask, call: _Call, layout: str) -> torch.Tensor:
    """Mode fp16 with a block mask: SDPA with the element mask it stands for; rows it leaves no key give 0."""
    Sq, Sk = qb.shape[2], kb.shape[2]
    keep = expand_block_mask(block_mask, Sq, Sk)
    if attn_mask is None:
        mask = keep
    elif attn_mask.dtype == torch.bool:
        mask = keep & attn_mask
    else:
        mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=call.scale, enable_gqa=call.gqa)
    row_empty = ~full_block_mask(block_mask, Sq, Sk).any(-1, keepdim=True).repeat_interleave(SPARSE_BLOCK, dim=-2)
    row_empty = row_empty[..., :Sq, :]
    out = out.masked_fill(row_empty, 0.0)
    return out if layout == "BHSD" else out.transpose(1, 2)


def sdpa_with_lse(qb, kb, vb, attn_mask=None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention and its log-sum-exp from BHSD views: SDPA's output (B, H, Sq, D) and float32 (B, H, Sq).
    On a GPU, unmasked 16-bit calls with as many K/V heads as query heads take both from one flash-attention
    kernel (``aten._scaled_dot_product_flash_attention``); other calls run SDPA and ``exact_lse``."""
    if (qb.is_cuda and attn_mask is None and qb.dtype in _DTYPES and qb.shape[1] == kb.shape[1]
            and qb.shape[-1] <= MAX_HEAD_DIM and qb.shape[-1] % 8 == 0 and qb.shape[2] > 0 and kb.shape[2] > 0):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, False, False,
                                                                        scale=scale)[:2]
            return out, lse
        except RuntimeError:  # a shape or GPU flash attention does not take: the general path below
            pass
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attn_mask, scale=scale,
                                         enable_gqa=True if qb.shape[1] != kb.shape[1] else False)
    return out, exact_lse(qb, kb, attn_mask, scale=scale)


def exact_lse(qb, kb, attn_mask=None, block_mask=None, scale: float | None = None) -> torch.Tensor:
    """The exact log-sum-exp of attention's scaled, masked logits (mode fp16's): float32 (B, H, Sq) from BHSD ``qb``
    (B, H, Sq, D) and ``kb`` (B, Hkv, Sk, D) of any float dtype, -inf for rows without keys; in float32 Q·Kᵀ chunks
    of about 2^26 scores (at least one query row each), so its memory stays bounded (a ``block_mask`` is expanded
    to the element mask it stands for)."""
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    B, H, Sq, _ = qb.shape
    Sk = kb.shape[2]
    kb = kb.repeat_interleave(H // kb.shape[1], dim=1).float()
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=qb.device)
    step = max(1, (1 << 26) // max(B * H * Sk, 1))
    for i in range(0, Sq, step):
        s = (qb[:, :, i : i + step].float() @ kb.transpose(-1, -2)) * scale
        if attn_mask is not None:
            m = attn_mask.expand(B, H, Sq, Sk)[:, :, i : i + step]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
        if block_mask is not None:
            keep = expand_block_mask(block_mask, Sq, Sk).expand(B, H, Sq, Sk)[:, :, i : i + step]
            s = s.masked_fill(~keep, float("-inf"))
        lse[:, :, i : i + step] = torch.logsumexp(s, dim=-1)
    return lse


def balance_key(qk_balance):
    """``qk_balance`` as part of a call's signature: a given balance tensor's ``signature``, else the value with its
    type (so that 1, which equals True, does not reuse a checked True call's entry and skip the type check)."""
    return signature(qk_balance) if isinstance(qk_balance, torch.Tensor) else (type(qk_balance), qk_balance)


def _check_range_values(q_amax, k_amax, v_amax, k_mean, balance=None) -> None:
    """Static ranges and a given balance must be finite and positive, a static K mean finite (the kernels turn an
    invalid one into NaN outputs; here it is an error before any work)."""
    for name, t in (("q_amax", q_amax), ("k_amax", k_amax), ("v_amax", v_amax), ("qk_balance", balance)):
        if t is not None and not bool(((t > 0) & torch.isfinite(t)).all()):
            bad = t[~((t > 0) & torch.isfinite(t))].flatten()[0].item()
            raise ValueError(f"{name} must be finite and positive everywhere; it holds {bad!r}")
    if k_mean is not None and not bool(torch.isfinite(k_mean).all()):
        raise ValueError("k_mean must be finite everywhere; it holds NaN or Inf")


def _check_amax(name: str, amax: torch.Tensor | None, q: torch.Tensor, full: tuple[int, ...]) -> None:
    if amax is None:
        return
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        raise TypeError(f"{name} must be a float tensor broadcastable to {full}")
    if amax.device != q.device:
        raise ValueError(f"{name} is on {amax.device}, q on {q.device}")
    try:
        ok = torch.broadcast_shapes(amax.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(amax.shape)} does not broadcast to {full}")
