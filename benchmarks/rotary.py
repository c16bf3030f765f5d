"""Wan's rotary embedding of Q and K: the stock nested function against ``rotate_pairs``, the one launch the routed
processors run it in, at Wan2.1's 480p × 81 frames (1, 32760, 12, 128) bfloat16, in the same run; with its float32
tables (as ``from_pretrained`` keeps them) and bfloat16 ones (a model cast by ``.to()``); the INT8 call and SDPA at
the same shape for scale.

    python benchmarks/rotary.py [--out bench_out/rotary.json]

Times are medians of ``triton.testing.do_bench`` (L2 flushed between calls) and of ``do_bench_cudagraph``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.rope import rotate_pairs
from diffusion_int8.plugin.rotary import stock_wan_rotary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    wan_stock = stock_wan_rotary()
    if wan_stock is None:
        raise SystemExit("the installed diffusers' WanAttnProcessor has no nested apply_rotary_emb to compare with")
    S, H, D = 32760, 12, 128
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    angle = torch.rand(1, S, 1, D, device="cuda") * 60
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shape": [1, S, H, D]}
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    results["int8 call ms"] = triton.testing.do_bench(lambda: int8_attention(qt, kt, vt, mode="int8"), rep=300)
    results["sdpa ms"] = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt), rep=300)
    print(f"{results['device']}: INT8 call {results['int8 call ms']:.3f} ms, SDPA {results['sdpa ms']:.3f} ms")
    print("| tables | stock Q+K ms | graph | rotate_pairs Q+K ms | graph | equal bit for bit |\n|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        stock = lambda: (wan_stock(q, cos, sin), wan_stock(k, cos, sin))  # noqa: E731
        fast = lambda: (rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin))  # noqa: E731
        row = {"equal": torch.equal(wan_stock(q, cos, sin).view(torch.int16), rotate_pairs(q, cos, sin).view(torch.int16)),
               "stock ms": triton.testing.do_bench(stock, rep=300), "rotate_pairs ms": triton.testing.do_bench(fast, rep=300)}
        with torch.cuda.stream(torch.cuda.Stream()):
            row["stock graph ms"] = triton.testing.do_bench_cudagraph(stock, rep=300)
            row["rotate_pairs graph ms"] = triton.testing.do_bench_cudagraph(fast, rep=300)
        results[str(dtype).removeprefix("torch.")] = row
        print(f"| {dtype} | {row['stock ms']:.3f} | {row['stock graph ms']:.3f} | {row['rotate_pairs ms']:.3f} | "
              f"{row['rotate_pairs graph ms']:.3f} | {row['equal']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
