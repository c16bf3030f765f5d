"""Block-sparse INT8 attention against the dense INT8 call and cuDNN, at fixed fractions of skipped blocks.

    python benchmarks/sparse.py --out bench_out/sparse.json
    python benchmarks/sparse.py --shapes wan --skip 0.5 --modes int8
    python benchmarks/sparse.py --shapes wan,cogvideox --skip 0.8 --modes int8 --refresh-every 2

Each (query block, key block) pair of 128 × 128 tokens is kept or skipped; a row of the mask keeps exactly
``round((1 - skip) · blocks)`` key blocks, drawn at random (the kernel's time depends on how many, not which).
Every time is the whole call (statistics, quantization, the block lists, attention), replayed from a CUDA graph
(*graph*: every call of a shape and mode captured first, then timed in rounds that take turns, the order reversed
every other round; the median of the rounds' medians) or called back to back (*eager*, median of rounds of timed
loops).

*Predicted*: the mask predicted inside the call (``int8_attention(..., sparsity=tau)``), on inputs whose attention
is local in the sequence (``inputs.local_qkv``, wavelengths scaled with the length), at the level tau that skips
about the same fraction over the whole call (found by bisection beforehand); against the dense call on the same
inputs, and against the same call given the predicted mask (``mask given``). Their difference, the predictor's cost,
is smaller than the rows' noise at long shapes; time its launches alone to measure it.

*Carried* (``--refresh-every k``, ``carry.BlockCarry``): the skipped blocks computed every k-th step and forecast
in between. A refresh is one call over every block that writes the skipped blocks' result on the way
(``return_skipped``); ``refresh as two calls`` times what it replaced, the mask's call and its complement's, each
with its log-sum-exp, merged. A step between is the mask's call merged with the complement's forecast from two
earlier refreshes. ``per step`` is their mean
over k steps, (refresh + (k − 1) · between) / k, over the dense call.
Ratios compare times of one run: ``÷ dense`` is the sparse call's time over the dense INT8 call's, taken within
each graph round (the two timed side by side) and given as the median over rounds with their range; ``× cuDNN``
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
from diffusion_int8.kernels.merge import merge_forecast
from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.kernels.sparsity import predict_block_mask
from diffusion_int8.inputs import local_qkv, realistic_qkv
from diffusion_int8.timing import back_to_back, graph_ms, interleaved_rounds, median, paired_ratio

SHAPES = {
    "wan": (1, 12, 32760, 128),
    "cogvideox": (1, 24, 17550, 64),
    "ltx": (2, 32, 6272, 64),
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


def tau_for(q, k, skip, steps=16):
    """The level tau whose predicted mask skips about ``skip`` of the blocks (bisection: fewer skipped as tau grows),
    and the fraction it skips."""
    lo, hi = 1e-4, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if 1 - predict_block_mask(q, k, mid).float().mean().item() > skip:
            lo = mid
        else:
            hi = mid
    return hi, 1 - predict_block_mask(q, k, hi).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="wan,cogvideox,16k,flux")
    ap.add_argument("--skip", default="0.5,0.75", help="fractions of blocks skipped")
    ap.add_argument("--modes", default="int8,int8_fp16v")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the graph timings, the variants taking turns")
    ap.add_argument("--refresh-every", type=int, default=None, help="also the carried call at this interval (>= 2)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.refresh_every is not None and args.refresh_every < 2:
        ap.error(f"--refresh-every must be an integer >= 2, got {args.refresh_every}")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "dtype": args.dtype}
    rows = []
    print(f"# {meta}")
    print("| shape | mode | skipped | cuDNN ms | dense ms | sparse ms (graph) | ÷ dense (range) | × cuDNN "
          "| eager ÷ dense | predicted: tau, skipped | predicted ÷ dense (range) | mask given ÷ dense "
          "| predicted, eager ÷ dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        B, H, S, D = SHAPES[name]
        q, k, v = realistic_qkv(B, H, S, S, D, dtype=dtype, device="cuda", seed=0)
        lq, lk, lv = local_qkv(B, H, S, S, D, dtype=dtype, device="cuda", seed=0, wavelength=0.075 * S)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v), args.reps)
        for mode in args.modes.split(","):
            for skip in map(float, args.skip.split(",")):
                mask, kept = fixed_mask(B, H, S, S, skip, "cuda")
                tau, pred_skip = tau_for(lq, lk, skip)
                pred_mask = int8_attention(lq, lk, lv, mode=mode, sparsity=tau, return_block_mask=True)[1]
                fns = dict(
                    dense=lambda: int8_attention(q, k, v, mode=mode),
                    sparse=lambda: int8_attention(q, k, v, mode=mode, block_mask=mask),
                    local_dense=lambda: int8_attention(lq, lk, lv, mode=mode),
                    predicted=lambda: int8_attention(lq, lk, lv, mode=mode, sparsity=tau),
                    mask_given=lambda: int8_attention(lq, lk, lv, mode=mode, block_mask=pred_mask),
                )
                every = args.refresh_every
                if every:
                    def partial(m):
                        return int8_attention(q, k, v, mode=mode, block_mask=m, return_lse=True)

                    before, last = partial(~mask), partial(~mask)  # two refreshes' complements to forecast from
                    fns["refresh"] = lambda: int8_attention(q, k, v, mode=mode, block_mask=mask, return_skipped=True)
                    fns["refresh_two_calls"] = lambda: merge_forecast(*partial(mask), *partial(~mask))
                    fns["between"] = lambda: merge_forecast(*partial(mask), *last, *before, 0.5)
                # ratios within each round (the variants side by side), then their median and range over rounds
                per_round = interleaved_rounds(fns, args.reps, args.rounds)
                t = {n: median(x) for n, x in per_round.items()}
                sparse_r = paired_ratio(per_round["sparse"], per_round["dense"])
                pred_r = paired_ratio(per_round["predicted"], per_round["local_dense"])
                given_r = paired_ratio(per_round["mask_given"], per_round["local_dense"])
                eager = {name: median([back_to_back(fns[name], calls=20) for _ in range(5)])
                         for name in ("dense", "sparse", "local_dense", "predicted")}
                row = dict(shape=name, B=B, H=H, S=S, D=D, mode=mode, skipped=round(1 - kept, 4), cudnn_ms=cudnn,
                           tau=tau, predicted_skipped=round(pred_skip, 4), **{f"{n}_ms": v for n, v in t.items()},
                           **{f"{n}_eager_ms": v for n, v in eager.items()}, sparse_over_dense=sparse_r,
                           predicted_over_dense=pred_r, mask_given_over_dense=given_r, rounds=args.rounds)
                if every:
                    carried = [(r + (every - 1) * b) / (every * d) for r, b, d in
                               zip(per_round["refresh"], per_round["between"], per_round["dense"])]
                    row.update(refresh_every=every,
                               refresh_over_dense=paired_ratio(per_round["refresh"], per_round["dense"]),
                               two_calls_over_dense=paired_ratio(per_round["refresh_two_calls"], per_round["dense"]),
                               between_over_dense=paired_ratio(per_round["between"], per_round["dense"]),
                               carried_over_dense=(median(carried), min(carried), max(carried)))
                    c = row["carried_over_dense"]
                    print(f"  carried every {every}: refresh ÷ dense {row['refresh_over_dense'][0]:.3f} "
                          f"({row['refresh_over_dense'][1]:.3f}–{row['refresh_over_dense'][2]:.3f}; as two calls "
                          f"{row['two_calls_over_dense'][0]:.3f}), between ÷ "
                          f"dense {row['between_over_dense'][0]:.3f}, per step ÷ dense {c[0]:.3f} "
                          f"({c[1]:.3f}–{c[2]:.3f})", flush=True)
                rows.append(row)
                print(f"| {name} {(B, H, S, D)} | {mode} | {1 - kept:.0%} | {cudnn:.3f} | {t['dense']:.3f} | "
                      f"{t['sparse']:.3f} | {sparse_r[0]:.3f} ({sparse_r[1]:.3f}–{sparse_r[2]:.3f}) | "
                      f"{cudnn / t['sparse']:.2f}× | {eager['sparse'] / eager['dense']:.3f} | "
                      f"{tau:.4f}, {pred_skip:.1%} | "
                      f"{pred_r[0]:.3f} ({pred_r[1]:.3f}–{pred_r[2]:.3f}) | {given_r[0]:.3f} | "
                      f"{eager['predicted'] / eager['local_dense']:.3f} |", flush=True)
        del q, k, v, lq, lk, lv
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
