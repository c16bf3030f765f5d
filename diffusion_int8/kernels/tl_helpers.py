"""Triton device functions shared by the quantization and attention kernels (``quantize``, ``attention``).

Both must round exactly as ``reference`` emulates: one IEEE rounding per division, round half to even.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
