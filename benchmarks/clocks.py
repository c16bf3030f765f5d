"""Why ratios move with the GPU's power state: cuDNN's fp16 attention and the ``int8`` call each run back to back
for a few seconds while ``nvidia-smi`` samples the SM clock, the power draw and the throttle reasons.

    python benchmarks/clocks.py [--shape 2,24,4608,128] [--seconds 4] [--out clocks.json]

The two take turns (cuDNN, int8, cuDNN, int8) in one process, each call replayed from a CUDA graph, so the host
does not pace the GPU. Prints a Markdown table of calls a second and the median (and lowest) SM clock, median
power and the throttle reasons seen while each ran; ``--out`` also writes every sample as JSON.
"""

import argparse
import json
import subprocess
import time

import torch
import torch.nn.functional as F

from diffusion_int8 import int8_attention
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import graphed, median

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
REASONS = {0x4: "power cap", 0x20: "SW thermal", 0x40: "HW thermal", 0x8: "HW slowdown", 0x80: "power brake"}


def sample(seconds: float, fn, interval_ms: int = 50) -> tuple[float, list[tuple[float, float, int]]]:
    """Run ``fn`` back to back for ``seconds`` while nvidia-smi samples; calls a second and (MHz, W, reasons)."""
    index = torch.cuda.current_device()
    smi = subprocess.Popen(["nvidia-smi", "-i", str(index), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                            f"-lms={interval_ms}"], stdout=subprocess.PIPE, text=True)
    try:
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            n += 10
            if n % 100 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        rate = n / (time.perf_counter() - t0)
    finally:
        smi.terminate()
    rows = []
    for line in smi.communicate()[0].splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except (IndexError, ValueError):
            continue  # a line cut by terminate, or a field the GPU does not report
    return rate, rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="2,24,4608,128", help="B,H,N,D (default: Flux's, %(default)s)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds each variant runs per turn")
    p.add_argument("--out", help="also write every sample as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    B, H, N, D = (int(x) for x in args.shape.split(","))
    q, k, v = realistic_qkv(B, H, N, N, D, device="cuda")
    fns = {"cuDNN fp16": graphed(lambda: F.scaled_dot_product_attention(q, k, v)),
           "int8": graphed(lambda: int8_attention(q, k, v, mode="int8"))}
    results = {label: {"calls_per_s": [], "samples": []} for label in fns}
    for label in list(fns) * 2:
        rate, rows = sample(args.seconds, fns[label])
        results[label]["calls_per_s"].append(rate)
        results[label]["samples"].extend(rows)

    print(f"{torch.cuda.get_device_name()}, shape {(B, H, N, D)}, {args.seconds:g} s a turn, two turns each\n")
    print("| variant | calls/s | SM MHz median (lowest) | W median | throttle reasons seen |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        mhz = [s[0] for s in r["samples"]] or [float("nan")]
        watts = [s[1] for s in r["samples"]] or [float("nan")]
        seen = sorted({name for s in r["samples"] for bit, name in REASONS.items() if s[2] & bit}) or ["none"]
        print(f"| {label} | {median(r['calls_per_s']):.0f} | {median(mhz):.0f} ({min(mhz):.0f}) | {median(watts):.0f} "
              f"| {', '.join(seen)} |")
    base, cand = (median(results[l]["calls_per_s"]) for l in fns)
    print(f"\nint8 ÷ cuDNN, calls a second: {cand / base:.2f}×")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [B, H, N, D], "seconds": args.seconds,
                       "fields": QUERY, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
