"""Work around Triton interpreter bugs (seen in Triton 3.6) that the compiled GPU path does not have.

* fp32 -> fp8 e4m3 "RTNE" adds the rounding carry to the mantissa without propagating it into the
  exponent (127.07 -> -64 instead of -128); the GPU's cvt.rn.satfinite is correct.
* fp32 -> bf16 truncates; the GPU rounds to nearest even.
* tl.dot multiplies bf16 operands as their raw uint16 bit patterns.

Tests patch the interpreter with PyTorch's correctly rounded conversions and an fp32 matmul for
bf16 operands. Nothing outside tests/ imports this.
"""

from __future__ import annotations

import numpy as np
import torch


def _to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data)).view(dtype)


def patch_interpreter() -> None:
    from triton import language as tl
    from triton.runtime import interpreter

    original_convert = interpreter._convert_float
    if getattr(original_convert, "_diffusion_int8_patched", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in (tl.float8e4nv, tl.bfloat16):
            src = _to_torch(input.view(np.float32), torch.float32)
            if output_dtype == tl.float8e4nv:
                return src.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original_convert(input, input_dtype, output_dtype, rounding_mode)

    convert._diffusion_int8_patched = True
    interpreter._convert_float = convert

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a32 = _to_torch(a.data.view(np.int16), torch.bfloat16).float().numpy()
            b32 = _to_torch(b.data.view(np.int16), torch.bfloat16).float().numpy()
            out = np.matmul(a32, b32, dtype=np.float32) + d.data
            return interpreter.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
