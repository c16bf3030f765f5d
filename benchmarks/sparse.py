"""Block-sparse INT8 attention against the dense INT8 call and cuDNN, at fixed fractions of skipped blocks.

    python benchmarks/sparse.py --out bench_out/sparse.json
    python benchmarks/sparse.py --shapes wan --skip 0.5 --modes int8

Each (query block, key block) pair of 128 × 128 tokens is kept or skipped; a row of the mask keeps exactly
``round((1 - skip) · blocks)`` key blocks, drawn at random (the kernel's time depends on how many, not which).
Every time is the whole call (statistics, quantization, the block lists, attention), replayed from a CUDA graph
(*graph*) or called back to back (*eager*, median of rounds of timed loops). Where the predictor
(``kernels.sparsity.predict_block_mask``) is importable, the *with predictor* column adds its pass over Q and K to
the graph: it runs before the sparse call (whose mask stays the fixed one), so its cost is in the time.
Ratios compare times of one run: ``÷ dense`` is the sparse call's time over the dense INT8 call's, ``× cuDNN``
cuDNN's time over the call's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.testing import graph_ms, realistic_qkv

try:
    from diffusion_int8.kernels.sparsity import predict_block_mask
except ImportError:  # the predictor is optional here: the kernel's rows need only a mask
    predict_block_mask = None

SHAPES = {
    "wan": (1, 12, 32760, 128),
    "cogvideox": (1, 24, 17550, 64),
    "16k": (1, 16, 16384, 128),
    "flux": (2, 24, 4608, 128),
}


def fixed_mask(B, H, Sq, Sk, skip, device, seed=0):
    """A block mask whose every row keeps round((1 - skip) · blocks) key blocks (at least one), at random."""
    nqb, nkb = -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK)
    keep = max(1, round((1 - skip) * nkb))
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(B, H, nqb, nkb, generator=g).argsort(-1)
    return (order < keep).to(device), keep / nkb


def eager_ms(fn, calls=20, rounds=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="wan,cogvideox,16k,flux")
    ap.add_argument("--skip", default="0.5,0.75", help="fractions of blocks skipped")
    ap.add_argument("--modes", default="int8,int8_fp16v")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--tau", type=float, default=0.9, help="the predictor's mass in the 'with predictor' column")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "dtype": args.dtype, "predictor": predict_block_mask is not None, "tau": args.tau}
    rows = []
    print(f"# {meta}")
    print("| shape | mode | skipped | cuDNN ms | dense ms | sparse ms (graph) | ÷ dense | × cuDNN | with predictor ÷ dense "
          "| eager ÷ dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        B, H, S, D = SHAPES[name]
        q, k, v = realistic_qkv(B, H, S, S, D, dtype=dtype, device="cuda", seed=0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v), args.reps)
        for mode in args.modes.split(","):
            dense_fn = lambda: int8_attention(q, k, v, mode=mode)  # noqa: E731
            dense, dense_eager = graph_ms(dense_fn, args.reps), eager_ms(dense_fn)
            for skip in map(float, args.skip.split(",")):
                mask, kept = fixed_mask(B, H, S, S, skip, "cuda")
                sparse_fn = lambda: int8_attention(q, k, v, mode=mode, block_mask=mask)  # noqa: E731
                sparse = graph_ms(sparse_fn, args.reps)
                sparse_eager = eager_ms(sparse_fn)
                with_pred = None
                if predict_block_mask is not None:
                    def both():
                        predict_block_mask(q, k, args.tau)
                        return sparse_fn()
                    with_pred = graph_ms(both, args.reps)
                row = dict(shape=name, B=B, H=H, S=S, D=D, mode=mode, skipped=round(1 - kept, 4), cudnn_ms=cudnn,
                           dense_ms=dense, sparse_ms=sparse, dense_eager_ms=dense_eager, sparse_eager_ms=sparse_eager,
                           with_predictor_ms=with_pred)
                rows.append(row)
                pred = f"{with_pred / dense:.3f}" if with_pred else "—"
                print(f"| {name} {(B, H, S, D)} | {mode} | {1 - kept:.0%} | {cudnn:.3f} | {dense:.3f} | {sparse:.3f} | "
                      f"{sparse / dense:.3f} | {cudnn / sparse:.2f}× | {pred} | {sparse_eager / dense_eager:.3f} |",
                      flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
