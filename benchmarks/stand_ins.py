"""What the routed processors run in one launch for Q and K, against the stock code, in the same run.

diffusers' rotary embeddings, each stock function against ``rotate_pairs``. Wan's nested ``apply_rotary_emb`` at
Wan2.1's 480p × 81 frames (1, 32760, 12, 128), with its float32 tables (as ``from_pretrained`` keeps them) and bfloat16
ones (a model cast by ``.to()``); ``diffusers.models.embeddings.apply_rotary_emb`` at HunyuanVideo's 544 × 960 × 61
frames (1, 32640, 24, 128; sequence dim 1, its video tokens), CogVideoX-5b's 720 × 480 × 49 frames with CFG (2, 48,
17550, 64; sequence dim 2) and Flux's 1024² (1, 4608, 24, 128; sequence dim 1); LTX-Video's own ``apply_rotary_emb`` on
(B, S, C) tokens at 768 × 512 × 121 frames with CFG (2, 6144, 2048); Qwen-Image's ``apply_rotary_emb_qwen`` on a
complex64 table at 1328² (1, 6889, 24, 128; its stand-in, ``CheckedQwenRotary``, as the processors call it, its check
done in the warm-up); float32 tables, bfloat16 Q and K. diffusers' ``RMSNorm`` against ``rms_norm`` (in the reduction
order that gives the stock bits here) at HunyuanVideo's (1, 32896, 24, 128: video and text tokens) and SD3.5's 1024²
with CFG (2, 4429, 24, 64), bfloat16 with a bfloat16 weight; Flux's rotary and SD3.5's norms at 512² too (1, 1280, 24,
128 and 2, 1357, 24, 64), where an eager step waits on its host. The INT8 call and SDPA at Wan's shape for scale.

    python benchmarks/stand_ins.py [--out bench_out/stand_ins.json]

Times are medians of ``triton.testing.do_bench`` (L2 flushed between calls) and of ``do_bench_cudagraph``; host
time, the median over 15 rounds of the host time a Q + K pair takes in a round of 20 (synchronized between rounds
only: a round's launches fit in the launch queue, so the host never waits on the GPU), both taking turns. The
one-launch functions replay their launch from a plan after the first call, as in the stand-ins.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.rmsnorm import STRIDED, VECTORIZED, rms_norm
from diffusion_int8.kernels.rope import INTERLEAVED, WAN, rotate_pairs
from diffusion_int8.plugin.rotary import (CheckedQwenRotary, generic_rotary, stock_qwen_rotary, stock_token_rotary,
                                          stock_wan_rotary)

NORMS = [("HunyuanVideo", (1, 32896, 24, 128)), ("SD3.5", (2, 4429, 24, 64)),  # (row, Q's shape) for RMSNorm
         ("SD3.5 512²", (2, 1357, 24, 64))]
# (row, x's shape, its sequence dim) for diffusers' generic function
GENERIC = [("HunyuanVideo", (1, 32640, 24, 128), 1), ("CogVideoX-5b", (2, 48, 17550, 64), 2),
           ("Flux", (1, 4608, 24, 128), 1), ("Flux 512²", (1, 1280, 24, 128), 1)]


def cases():
    """(name, q, k, stock(x), fast(x)) for each row of the table."""
    wan_stock = stock_wan_rotary()
    if wan_stock is not None:
        q = torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16)
        angle = torch.rand(1, 32760, 1, 128, device="cuda") * 60
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            yield (f"Wan2.1, {str(dtype).removeprefix('torch.')} tables", q, torch.randn_like(q),
                   lambda x, c=cos, s=sin: wan_stock(x, c, s), lambda x, c=cos, s=sin: rotate_pairs(x, c, s, form=WAN))
    generic = generic_rotary()
    if generic is None:
        print("the installed diffusers' embeddings.apply_rotary_emb is not the one the stand-in knows: not timed")
    for name, shape, seq_dim in GENERIC if generic is not None else ():
        q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        angle = torch.rand(shape[seq_dim], shape[-1], device="cuda") * 60
        tables = (angle.cos(), angle.sin())
        shaped = [t[None, :, None] if seq_dim == 1 else t[None, None] for t in tables]
        yield (name, q, torch.randn_like(q), lambda x, t=tables, d=seq_dim: generic.stock(x, t, sequence_dim=d),
               lambda x, t=shaped: rotate_pairs(x, *t, form=INTERLEAVED))
    ltx = stock_token_rotary()
    if ltx is not None:
        q = torch.randn(2, 6144, 2048, device="cuda", dtype=torch.bfloat16)
        angle = torch.rand(2, 6144, 2048, device="cuda") * 60
        tables = (angle.cos(), angle.sin())
        yield ("LTX-Video", q, torch.randn_like(q), lambda x: ltx(x, tables),
               lambda x: rotate_pairs(x[:, :, None], *(t[:, :, None] for t in tables), form=INTERLEAVED)[:, :, 0])
    qwen = stock_qwen_rotary()
    if qwen is not None:
        q = torch.randn(1, 6889, 24, 128, device="cuda", dtype=torch.bfloat16)
        angle = torch.rand(6889, 64, device="cuda") * 60
        freqs = torch.polar(torch.ones_like(angle), angle)
        stand_in = CheckedQwenRotary(qwen)
        yield ("Qwen-Image 1328²", q, torch.randn_like(q), lambda x: qwen(x, freqs, use_real=False),
               lambda x: stand_in(x, freqs, use_real=False))
    from diffusers.models.normalization import RMSNorm

    for name, shape in NORMS:
        q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) + torch.randn(shape[-1], device="cuda")
        norm = RMSNorm(shape[-1], 1e-6).to("cuda", torch.bfloat16)
        norm.weight.data.uniform_(0.5, 1.5)
        want = norm(q)
        # the order whose sums are PyTorch's here (the plugin finds it the same way)
        order = next((o for o in (STRIDED, VECTORIZED) if torch.equal(rms_norm(q, norm.weight, 1e-6, o), want)),
                     STRIDED)
        yield (f"{name} RMSNorm", q, torch.randn_like(q), norm, lambda x, o=order: rms_norm(x, norm.weight, 1e-6, o))


def host_us(fns: dict, rounds: int = 15, calls: int = 20) -> dict:
    """Median host µs a call of each of ``fns``: over ``rounds`` rounds of ``calls`` calls, the functions taking
    turns."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": {}}
    q = torch.randn(1, 12, 32760, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    results["int8 call ms"] = triton.testing.do_bench(lambda: int8_attention(q, k, v, mode="int8"), rep=300)
    results["sdpa ms"] = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                                 rep=300)
    print(f"{results['device']}: at Wan's shape the INT8 call takes {results['int8 call ms']:.3f} ms, SDPA "
          f"{results['sdpa ms']:.3f} ms")
    print("| function | stock Q+K ms | graph | host µs | one launch Q+K ms | graph | host µs | equal bit for bit |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, q, k, stock_fn, fast_fn in cases():
        stock = lambda: (stock_fn(q), stock_fn(k))  # noqa: E731
        fast = lambda: (fast_fn(q), fast_fn(k))  # noqa: E731
        bits = torch.int16
        row = {"shape": list(q.shape), "equal": torch.equal(stock_fn(q).view(bits), fast_fn(q).view(bits)),
               "stock ms": triton.testing.do_bench(stock, rep=300),
               "one launch ms": triton.testing.do_bench(fast, rep=300)}
        with torch.cuda.stream(torch.cuda.Stream()):
            row["stock graph ms"] = triton.testing.do_bench_cudagraph(stock, rep=300)
            row["one launch graph ms"] = triton.testing.do_bench_cudagraph(fast, rep=300)
        host = host_us({"stock": stock, "one launch": fast})
        row.update({"stock host us": host["stock"], "one launch host us": host["one launch"]})
        results["rows"][name] = row
        print(f"| {name} {tuple(q.shape)} | {row['stock ms']:.3f} | {row['stock graph ms']:.3f} | "
              f"{host['stock']:.0f} | {row['one launch ms']:.3f} | {row['one launch graph ms']:.3f} | "
              f"{host['one launch']:.0f} | {row['equal']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
