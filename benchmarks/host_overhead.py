"""Host time of one ``int8_attention`` call, and where it goes (cProfile), at a small shape where the GPU waits.

    python benchmarks/host_overhead.py --out bench_out/host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from diffusion_int8 import int8_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    lines = []
    calls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
    calls.update({m: (lambda m=m: int8_attention(q, k, v, mode=m)) for m in ("fp16", "int8_fp16v", "int8")})
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.calls * 1e6
        lines.append(f"{name}: host {host:.1f} us/call, host+GPU {wall:.1f} us/call")
        if name in ("sdpa", "fp16"):
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
