"""Host time of one eager attention call, and of one diffusers attention module, at a small shape where the GPU
waits on the host; SDPA and the stock processor are timed in the same run, and a cProfile of the INT8 calls
shows where the time goes.

    python benchmarks/host_overhead.py --out bench_out/host.txt [--json bench_out/host.json]

"host" is the wall time of issuing ``--calls`` calls (the GPU trails behind: host-bound), "host+GPU" adds
the final synchronization. The processor's own cost is the module call with ``Int8DiffusionProcessor``
(INT8 forced: no speed gate) minus the stock module call, less the op's own difference to SDPA.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from diffusion_int8 import Int8DiffusionProcessor, int8_attention


def host_us(calls: dict, n: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per call, µs: the median over ``rounds`` of the host time of issuing ``n`` calls, and of that plus the final
    synchronization. The calls take turns round by round, so a change in the host's speed during the run (the
    device's CPU is shared) reaches every row alike instead of whichever ran then."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            samples[name].append((host / n * 1e6, (time.perf_counter() - t0) / n * 1e6))
    return {name: (statistics.median(h for h, _ in s), statistics.median(w for _, w in s)) for name, s in samples.items()}


def main() -> None:
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    B, H, S, D = 2, 4, 256, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    attn = Attention(query_dim=H * D, heads=H, dim_head=D).cuda().half().eval()
    x = torch.randn(B, S, H * D, device="cuda", dtype=torch.float16)

    def module(processor):  # a module object per processor, so the rows can take turns
        m = copy.deepcopy(attn)
        m.set_processor(processor)
        return lambda: m(x)

    calls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
    calls.update({f"int8_attention {m}": (lambda m=m: int8_attention(q, k, v, mode=m)) for m in ("fp16", "int8_fp16v", "int8")})
    calls["module, stock AttnProcessor2_0"] = module(AttnProcessor2_0())
    for m in ("int8_fp16v", "int8"):
        calls[f"module, Int8DiffusionProcessor {m}"] = module(Int8DiffusionProcessor(m, speed_gate=False))
    calls["module, Int8DiffusionProcessor int8, speed gate on (SDPA here)"] = module(Int8DiffusionProcessor("int8"))
    results, lines = {}, [f"({B}, {H}, {S}, {D}) fp16, median of {args.rounds} rounds of {args.calls} eager calls each, "
                          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
                          "| call | host µs | host+GPU µs | host, × SDPA |", "|---|---|---|---|"]
    with torch.no_grad():
        timed = host_us(calls, args.calls, args.rounds)
        for name, (host, wall) in timed.items():
            results[name] = {"host_us": host, "wall_us": wall}
            lines.append(f"| {name} | {host:.1f} | {wall:.1f} | {host / timed['sdpa'][0]:.2f} |")
        for m in ("int8_fp16v", "int8"):
            own = (results[f"module, Int8DiffusionProcessor {m}"]["host_us"] - results["module, stock AttnProcessor2_0"]["host_us"]
                   - (results[f"int8_attention {m}"]["host_us"] - results["sdpa"]["host_us"]))
            results[f"processor's own cost, {m}"] = {"host_us": own}
            lines.append(f"| processor's own cost beyond the op, {m} | {own:.1f} | |")
        for name in ("int8_attention int8", "module, Int8DiffusionProcessor int8"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                calls[name]()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
            lines += ["", f"cProfile of {name} (200 calls):", s.getvalue()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, H, S, D],
                       "date": time.strftime("%Y-%m-%d"), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
