"""What asking for the log-sum-exp (``int8_attention(..., return_lse=True)``, ring attention's merge) costs: the
whole call with and without it against SDPA's default backend, and mode fp16's flash-attention path.

    python benchmarks/lse.py

Eager calls, ``triton.testing.do_bench`` medians, one process; ratios are SDPA's time over the row's.
"""

import torch, triton
from diffusion_int8 import int8_attention
from diffusion_int8.inputs import realistic_qkv
import torch.nn.functional as F
for name, (B, H, N, D) in {"flux": (2, 24, 4608, 128), "16k": (1, 16, 16384, 128), "cogvideox": (1, 24, 17550, 64)}.items():
    q, k, v = realistic_qkv(B, H, N, N, D, device="cuda")
    rows = {}
    for label, fn in [("sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
                      ("int8", lambda: int8_attention(q, k, v, mode="int8")),
                      ("int8 +lse", lambda: int8_attention(q, k, v, mode="int8", return_lse=True)),
                      ("int8_fp16v", lambda: int8_attention(q, k, v, mode="int8_fp16v")),
                      ("int8_fp16v +lse", lambda: int8_attention(q, k, v, mode="int8_fp16v", return_lse=True)),
                      ("fp16 +lse (flash)", lambda: int8_attention(q, k, v, mode="fp16", return_lse=True))]:
        for _ in range(3): fn()
        rows[label] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    print(name, " | ".join(f"{k} {v:.3f} ms ({rows['sdpa'] / v:.2f}x)" for k, v in rows.items()), flush=True)
