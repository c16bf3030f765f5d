"""Extra GPU memory of each step of the INT8 op, against the 8-bit copies it is allowed to make.

    python benchmarks/memory.py [--shape 1,8,16384,128]
"""

from __future__ import annotations

import argparse

import torch

from diffusion_int8.kernels import quantize as tq
from diffusion_int8.kernels.attention import triton_attention
from diffusion_int8.kernels.config import PV


def peak_extra(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    keep = fn()
    torch.cuda.synchronize()
    del keep
    return torch.cuda.max_memory_allocated() - base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,8,16384,128")
    B, H, S, D = (int(x) for x in ap.parse_args().shape.split(","))
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))

    steps = {
        "kv_moments (K mean, V |max|)": lambda: tq.kv_moments(k, v),
        "quantize_qkv fp8 (with the stats)": lambda: tq.quantize_qkv(q, k, v, 0.1, PV.FP8),
        "whole op, int8 (fp8 P·V)": lambda: triton_attention(q, k, v, layout="BHSD", pv=PV.FP8, sm_scale=0.1),
        "whole op, int8_fp16v": lambda: triton_attention(q, k, v, layout="BHSD", pv=PV.FP16, sm_scale=0.1),
    }
    for fn in steps.values():  # compile first
        fn()
    allowed = 3 * B * H * S * D + q.numel() * 2  # 8-bit Q, K, V and the fp16 output
    print(f"shape {(B, H, S, D)}; 8-bit Q/K/V + output = {allowed / 2**20:.1f} MiB")
    for name, fn in steps.items():
        print(f"{name:28s} {peak_extra(fn) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
