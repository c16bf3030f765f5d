"""Where the attention loop's time goes: the kernel timed with one piece of its work removed at a time.

    python benchmarks/ablate.py [--shapes flux,cogvideox] [--out bench_out/ablate.json]

Each variant is the portable kernel compiled with one of its ablation switches on (``attention.ABLATE_*``,
constexpr bits passed through ``triton_attention``'s private ``_ablate``; the results are wrong by design, only
the time matters). With every switch off the kernel compiles as shipped, so the baseline is the shipped portable
kernel (the sm_90 Gluon kernels are not ablated and do not run here). Times are medians of
``triton.testing.do_bench`` on the whole call (the quantization prologue is the same in every variant), and every
variant is timed in the same run as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

import diffusion_int8.kernels.attention as kattn
from diffusion_int8.kernels.config import PV
from diffusion_int8.inputs import realistic_qkv

SHAPES = {"flux": (2, 24, 4608, 128), "long": (1, 16, 16384, 128), "cogvideox": (1, 24, 17550, 64), "sdxl": (2, 10, 4096, 64)}

VARIANTS = {  # name: (what is removed, ablation switches)
    "baseline": ("nothing", 0),
    "no_exp2": ("exp2 of the scores (MUFU): p = the exponent's argument", kattn.ABLATE_EXP2),
    "no_rowmax": ("the running max: m = 0 (no reduction, no alpha rescale)", kattn.ABLATE_ROWMAX),
    "no_pv_mma": ("the P·V MMA and V loads: the FP8 P row sums go into acc instead", kattn.ABLATE_PV_MMA),
    "no_fp8_cast": ("P's FP8 conversion: P·V multiplies a P derived from the scores' bits", kattn.ABLATE_FP8_CAST),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="flux,cogvideox")
    ap.add_argument("--out", default="bench_out/ablate.json")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "shapes": {}}
    for shape in args.shapes.split(","):
        B, H, N, D = SHAPES[shape]
        q, k, v = realistic_qkv(B, H, N, N, D, dtype=torch.float16, device="cuda")
        print(f"\n## {shape} (B={B}, H={H}, N={N}, D={D}), int8 (FP8 P·V)\n| variant | removed | ms | saved ms |\n|---|---|---|---|")
        rows = {}
        for n, (_, switches) in VARIANTS.items():
            fn = lambda switches=switches: kattn.triton_attention(  # noqa: E731
                q, k, v, layout="BHSD", pv=PV.FP8, sm_scale=D**-0.5, sm90=False, _ablate=switches)
            fn()
            rows[n] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        for n, ms in rows.items():
            print(f"| {n} | {VARIANTS[n][0]} | {ms:.3f} | {rows['baseline'] - ms:+.3f} |")
        results["shapes"][shape] = {"shape": [B, H, N, D], "ms": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
