"""Triton device functions shared by the quantization and attention kernels (``quantize``, ``attention``).

Both must round exactly as ``reference`` emulates: one IEEE rounding per division, round half to even; and
both must agree on where FP8 V keeps its keys (``layout.v8_key_order``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout

# layout.fp8_v_keys_permuted, callable on a kernel's constexprs
v8_keys_permuted = triton.constexpr_function(layout.fp8_v_keys_permuted)


@triton.jit
def rdiv(c, x):
    """c / x with one IEEE rounding (tl.math.div_rn), for a constant c and a tensor or scalar x."""
    return tl.math.div_rn(x * 0.0 + c, x)


@triton.jit
def round_to_int8(y):
    """y (already clamped to |y| <= 127) rounded half to even, as int8."""
    # y is clamped to |y| <= 127, so adding 1.5·2²³ leaves no fractional bits: the fp32 add rounds
    # half to even, and the integer is read from the sum's low mantissa bits (no F2I conversion, which
    # runs on the quarter-rate pipe exp2 needs). The clamp before it keeps the compiler from fusing the
    # scale multiply into an FMA.
    return ((y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)


@triton.jit
def keys_to_v8_order(y, DP: tl.constexpr):
    """A (128, N) tile's rows, keys in natural order, moved to ``layout.v8_key_order`` at padded head dim ``DP``:
    key 8i + 2t + e to 32t + 2i + e (128), key 32c + 16h + 8j + 2t + e to 32c + 16h + 4t + 2j + e (≤ 64)."""
    if DP == 128:
        return tl.reshape(tl.permute(tl.reshape(y, [y.shape[0] // 8, 4, 2, y.shape[1]]), (1, 0, 2, 3)), y.shape)
    else:
        return tl.reshape(tl.permute(tl.reshape(y, [y.shape[0] // 16, 2, 4, 2, y.shape[1]]), (0, 2, 1, 3, 4)),
                          y.shape)


@triton.jit
def columns_to_v8_order(p, DP: tl.constexpr):
    """An (M, 128) tile's columns (keys) moved to ``layout.v8_key_order``, as ``keys_to_v8_order`` moves rows: P's
    columns in the order of FP8 V's keys."""
    if DP == 128:
        return tl.reshape(tl.permute(tl.reshape(p, [p.shape[0], p.shape[1] // 8, 4, 2]), (0, 2, 1, 3)), p.shape)
    else:
        return tl.reshape(tl.permute(tl.reshape(p, [p.shape[0], p.shape[1] // 16, 2, 4, 2]), (0, 1, 3, 2, 4)),
                          p.shape)
