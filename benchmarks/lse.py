"""What asking for the log-sum-exp (``int8_attention(..., return_lse=True)``, ring attention's merge) costs: the
whole call with and without it against SDPA's default backend, and mode fp16's flash-attention path.

    python benchmarks/lse.py [--out lse.json]

Eager calls on a CUDA GPU, ``triton.testing.do_bench`` medians after warm-up, one process; each column's ratio is
SDPA's time over the variant's, at the row's shape, from the same run. Prints a Markdown table; ``--out`` also
writes the times as JSON.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from diffusion_int8 import int8_attention
from diffusion_int8.inputs import realistic_qkv

SHAPES = {"Flux": (2, 24, 4608, 128), "16K": (1, 16, 16384, 128), "CogVideoX": (1, 24, 17550, 64)}


def variants(q, k, v):
    return {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "int8": lambda: int8_attention(q, k, v, mode="int8"),
            "int8 + lse": lambda: int8_attention(q, k, v, mode="int8", return_lse=True),
            "int8_fp16v": lambda: int8_attention(q, k, v, mode="int8_fp16v"),
            "int8_fp16v + lse": lambda: int8_attention(q, k, v, mode="int8_fp16v", return_lse=True),
            "fp16 + lse (flash)": lambda: int8_attention(q, k, v, mode="fp16", return_lse=True)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the times (ms) as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import triton

    results = {}
    for name, (B, H, N, D) in SHAPES.items():
        q, k, v = realistic_qkv(B, H, N, N, D, device="cuda")
        times = {}
        for label, fn in variants(q, k, v).items():
            for _ in range(3):
                fn()
            times[label] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        results[f"{name} {(B, H, N, D)}"] = times
    labels = list(next(iter(results.values())))
    print(f"| shape | SDPA ms | {' | '.join(labels[1:])} |")
    print("|---" * len(labels) + "|---|")
    for shape, times in results.items():
        print(f"| {shape} | {times['sdpa']:.3f} | "
              + " | ".join(f"{times['sdpa'] / times[l]:.2f}×" for l in labels[1:]) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
