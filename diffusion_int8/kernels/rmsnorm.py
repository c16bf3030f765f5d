"""diffusers' ``RMSNorm`` in one launch, equal to the stock module on CUDA bit for bit.

``normalization.RMSNorm.forward`` normalizes Q and K with six PyTorch launches per tensor (an upcast copy, a square, a
mean, a product by the reciprocal square root in float32, a downcast, the weight's product): about 34 bytes moved per
element where one pass moves 4. In eager mode that is a tenth of a HunyuanVideo block at 544p. ``rms_norm`` reads
each row, sums its squares in the order PyTorch's CUDA reduction sums them (``order``), and writes the row once; each
product is rounded to the dtype PyTorch computes it in, and the kernel is compiled without fused multiply-adds.

The reduction's order, from ``aten/src/ATen/native/cuda/Reduce.cuh`` for a contiguous row of D float32 squares and
at least 16 rows (so a block is 32 threads wide, one warp per row):

- ``STRIDED`` (D ≤ 128, not vectorized): thread t adds the squares of x[t], x[t + 32], x[t + 64], x[t + 96] in turn.
- ``VECTORIZED`` (D a multiple of 128, with loads of four floats: D > 128, or D ≥ 128 in some releases): thread t
  keeps four sums, sum v adding x[128k + 4t + v] for k = 0, 1, ... in turn, then adds the four: ((s0 + s1) + s2) + s3.

Then the warp's shuffle-down tree (``tree``): offsets 16, 8, 4, 2, 1 (``HALVES``, PyTorch's CUDA builds since it
changed them to match Triton's order), or 1, 2, 4, 8, 16 (``PAIRS``: lane pairs (0, 1), (2, 3), ..., then pairs of
pairs; earlier releases, ROCm). The mean is that sum times float32(rows) / float32(rows · D). Which order and tree a
PyTorch build uses is found by trying: ``plugin.norms`` keeps the pair that gives the stock bits on a real call.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .cache import signature
from .config import triton_unavailable
from .launch import plan_or_run

STRIDED, VECTORIZED = 0, 1  # the orders of a thread's sums: see the module docstring
HALVES, PAIRS = 0, 1  # the warp's trees: see the module docstring
ORDERS = [(STRIDED, HALVES), (VECTORIZED, HALVES), (STRIDED, PAIRS), (VECTORIZED, PAIRS)]  # (order, tree)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ROWS = 32  # rows a program normalizes


@triton.jit
def _warp_tree(s, ROWS: tl.constexpr, TREE: tl.constexpr):
    """The (ROWS, 32) lanes' sums added as a warp's shuffle-down tree adds them (a sum of two is one addition, in
    either order): offsets 16, 8, 4, 2, 1 (``HALVES``: lane l adds lane l + 16, ...) or 1, 2, 4, 8, 16 (``PAIRS``:
    lanes (0, 1), (2, 3), ..., then pairs of those); (ROWS,)."""
    if TREE == 0:
        s = tl.sum(tl.reshape(s, [ROWS, 2, 16]), axis=1)
        s = tl.sum(tl.reshape(s, [ROWS, 2, 8]), axis=1)
        s = tl.sum(tl.reshape(s, [ROWS, 2, 4]), axis=1)
        s = tl.sum(tl.reshape(s, [ROWS, 2, 2]), axis=1)
    else:
        s = tl.sum(tl.reshape(s, [ROWS, 16, 2]), axis=2)
        s = tl.sum(tl.reshape(s, [ROWS, 8, 2]), axis=2)
        s = tl.sum(tl.reshape(s, [ROWS, 4, 2]), axis=2)
        s = tl.sum(tl.reshape(s, [ROWS, 2, 2]), axis=2)
    return tl.sum(s, axis=1)


@triton.jit
def _rms_norm_kernel(
    X, W, OUT, R, D, factor, eps,
    ROWS: tl.constexpr, ORDER: tl.constexpr, TREE: tl.constexpr, CHUNKS: tl.constexpr, WIDTH: tl.constexpr,
    HAS_W: tl.constexpr, W_ROUND: tl.constexpr,
):
    # rows r of the contiguous (R, D) input: pass 1 sums the squares chunk by chunk in the reduction's order, pass 2
    # reads the row again (from cache) and writes it normalized, WIDTH columns at a time
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = (r < R)[:, None]
    x_row = X + r.to(tl.int64)[:, None] * D
    o_row = OUT + r.to(tl.int64)[:, None] * D
    if ORDER == 0:
        lane = tl.arange(0, 32)[None, :]
        s = tl.zeros([ROWS, 32], tl.float32)
        for i in tl.static_range(CHUNKS):  # x[t + 32 i], i = 0..3: thread t's four accumulators, added in turn
            col = lane + 32 * i
            v = tl.load(x_row + col, mask=live & (col < D), other=0.0).to(tl.float32)
            s = s + v * v
    else:
        col = tl.arange(0, 128)[None, :]
        acc = tl.zeros([ROWS, 128], tl.float32)
        for k in range(CHUNKS):  # lane t's four sums of x[128 k + 4 t + v], k in turn
            v = tl.load(x_row + 128 * k + col, mask=live, other=0.0).to(tl.float32)
            acc = acc + v * v
        quad = tl.reshape(acc, [ROWS, 32, 2, 2])  # (t, v // 2, v % 2)
        even, odd = tl.split(quad)  # v in (0, 2) and (1, 3)
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        s = ((s0 + s1) + s2) + s3
    mean = _warp_tree(s, ROWS, TREE) * factor
    inv = tl.math.rsqrt(mean + eps)[:, None]
    for c in range(0, D, WIDTH):
        cols = c + tl.arange(0, WIDTH)[None, :]
        ok = live & (cols < D)
        y = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * inv
        if HAS_W:
            if W_ROUND == 1:  # a 16-bit weight: the normalized row is cast to its dtype first
                y = y.to(tl.bfloat16).to(tl.float32)
            elif W_ROUND == 2:
                y = y.to(tl.float16).to(tl.float32)
            y = y * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(o_row + cols, y.to(OUT.dtype.element_ty), mask=ok)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _dense_rows(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (its last dim) are contiguous and tile one block of memory, in some order of the other dims
    (a contiguous tensor, or a transpose of one such as SD3's (B, H, S, D) view of (B, S, H·D))."""
    if x.is_contiguous():
        return True
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        return False
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(x.shape, x.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def covers(order: int, d: int) -> bool:
    """Whether ``order``'s reduction is PyTorch's kind for rows of ``d`` channels: 32 ≤ D ≤ 128 for ``STRIDED``, a
    multiple of 128 below 8192 for ``VECTORIZED`` (from there PyTorch splits a row across warps)."""
    return 32 <= d <= 128 if order == STRIDED else order == VECTORIZED and 128 <= d < 8192 and d % 128 == 0


def rms_norm_refusal(x: torch.Tensor, weight: torch.Tensor | None, order: int) -> str | None:
    """Why ``rms_norm`` does not run these inputs in ``order``, or None where it does: a float16, bfloat16 or float32
    ``x`` whose rows tile one block of memory (``_dense_rows``: contiguous, or transposed in the dims before the last),
    at least 16 rows of D (32 ≤ D ≤ 128 for ``STRIDED``, a multiple of 128 below 8192 for ``VECTORIZED``: from there
    PyTorch splits a row across warps), a contiguous weight of D elements on its device or none, no gradient to keep,
    and a device the Triton kernels run on."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.dtype not in _DTYPES or not _dense_rows(x):
        return "x must be a float16, bfloat16 or float32 tensor whose rows tile one block of memory"
    if order not in (STRIDED, VECTORIZED):
        return f"order must be rmsnorm.STRIDED or rmsnorm.VECTORIZED, got {order!r}"
    d = x.shape[-1]
    if not covers(order, d):
        return f"its last dim ({d}) is not one the order's reduction covers"
    if x.numel() // d < 16:
        return "fewer than 16 rows (PyTorch's reduction then spans more threads a row)"
    if weight is not None and (weight.dtype not in _DTYPES or weight.shape != (d,) or weight.device != x.device
                               or weight.stride(0) != 1):
        return f"the weight must be a contiguous ({d},) float16, bfloat16 or float32 tensor on x's device"
    if torch.is_grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad):
        return "it has no backward: call it without gradients (torch.no_grad())"
    return triton_unavailable(x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, order: int = STRIDED,
             tree: int = HALVES) -> torch.Tensor:
    """``diffusers.models.normalization.RMSNorm(D, eps)(x)`` without bias, with ``weight`` (or none), in one launch,
    summing each row's squares in ``order`` (``STRIDED`` or ``VECTORIZED``) and ``tree`` (``HALVES`` or ``PAIRS``):
    the module docstring.

    x: (..., D) float16/bfloat16/float32, its rows tiling one block of memory. weight: (D,) or None. Returns x's shape
    and layout in the stock module's dtype: x's without a weight, else the weight's. Inputs ``rms_norm_refusal`` refuses
    raise ``ValueError``."""
    reason = rms_norm_refusal(x, weight, order)
    if reason is not None:
        raise ValueError(f"rms_norm does not run these inputs: {reason}")
    if tree not in (HALVES, PAIRS):
        raise ValueError(f"tree must be rmsnorm.HALVES or rmsnorm.PAIRS, got {tree!r}")
    return rms_norm_unchecked(x, weight, eps, order, tree)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor | None, eps: float, order: int,
                       tree: int = HALVES) -> torch.Tensor:
    """``rms_norm`` for inputs ``rms_norm_refusal`` has accepted, without checking them again."""
    if x.is_cuda and torch.cuda.current_device() != x.device.index:
        with torch.cuda.device(x.device):  # Triton launches on the current device
            return rms_norm_unchecked(x, weight, eps, order, tree)
    # laid out as x (the stock module's result is): the kernel reads and writes rows in memory order
    out = torch.empty_like(x, dtype=x.dtype if weight is None else weight.dtype)

    def record(runner):
        d = x.shape[-1]
        rows = x.numel() // d
        # PyTorch's mean: the sum times float32(outputs) / float32(inputs), a float32 division
        factor = _f32(_f32(rows) / _f32(x.numel()))
        strided = order == STRIDED
        runner.launch(_rms_norm_kernel, (triton.cdiv(rows, _ROWS),), (
            x, weight if weight is not None else x, out, rows, d, factor, _f32(eps),
            _ROWS, order, tree, triton.cdiv(d, 32) if strided else d // 128,
            triton.next_power_of_2(d) if strided else 128, weight is not None,
            _ROUND[weight.dtype] if weight is not None else 0), dict(enable_fp_fusion=False))

    # later calls of the signature replay the launch
    plan_or_run(("rmsnorm", order, tree, eps, signature(x), signature(weight)), [x, weight, out], record)
    return out
