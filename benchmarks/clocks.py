"""Why ratios move with the GPU's power state: SDPA's cuDNN backend in fp16 and the ``int8`` call each run back to
back for a few seconds while ``nvidia-smi`` samples the SM clock, the power draw and the throttle reasons.

    python benchmarks/clocks.py [--shape 2,24,4608,128] [--seconds 4] [--out clocks.json]

The two take turns (cuDNN, int8, cuDNN, int8) in one process, each call replayed from a CUDA graph, so the host
does not pace the GPU; each turn runs 0.5 s before its counting and sampling start, so the clock has left the
previous turn's. Prints a Markdown table of calls a second (the mean of the turns), the median and lowest SM clock,
the median power and the throttle reasons seen while each ran; ``--out`` also writes every sample as JSON.
"""

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusion_int8 import int8_attention
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import graphed

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
# NVML's clock event reasons (nvmlClocksEventReason*)
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "HW slowdown", 0x10: "sync boost",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "power brake", 0x100: "display clocks"}


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        return None  # "[N/A]" or a field cut short


def sample(seconds: float, fn, interval_ms: int = 50) -> tuple[float, list[tuple]]:
    """Run ``fn`` back to back for ``seconds`` while nvidia-smi samples, after 0.5 s of the same unsampled; calls a
    second and (MHz, W, reason bits) per sample, None where a field could not be read."""
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
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
        if len(parts) == 4:
            rows.append((_number(parts[1]), _number(parts[2]), _number(parts[3], lambda t: int(t, 16))))
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

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    fns = {"cuDNN fp16": graphed(cudnn), "int8": graphed(lambda: int8_attention(q, k, v, mode="int8"))}
    results = {label: {"calls_per_s": [], "samples": []} for label in fns}
    for label in list(fns) * 2:
        rate, rows = sample(args.seconds, fns[label])
        results[label]["calls_per_s"].append(rate)
        results[label]["samples"].extend(rows)

    print(f"{torch.cuda.get_device_name()}, shape {(B, H, N, D)}, {args.seconds:g} s a turn, two turns each\n")
    print("| variant | calls/s | SM MHz median (lowest) | W median | throttle reasons seen |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        mhz = [s[0] for s in r["samples"] if s[0] is not None] or [float("nan")]
        watts = [s[1] for s in r["samples"] if s[1] is not None] or [float("nan")]
        bits = [s[2] for s in r["samples"] if s[2] is not None]
        seen = sorted({name for b in bits for bit, name in REASONS.items() if b & bit})
        seen = ", ".join(seen) if seen else "none" if bits else "not reported"
        print(f"| {label} | {statistics.mean(r['calls_per_s']):.0f} | {statistics.median(mhz):.0f} ({min(mhz):.0f}) "
              f"| {statistics.median(watts):.0f} | {seen} |")
    base, cand = (statistics.mean(results[label]["calls_per_s"]) for label in fns)
    print(f"\nint8 ÷ cuDNN, calls a second: {cand / base:.2f}×")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [B, H, N, D], "seconds": args.seconds,
                       "fields": QUERY, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
