"""Does a block mask's structure, or the sparse path itself, cost anything? The half-sparse call against the dense
one, for masks that keep the same fraction in different patterns.

    python benchmarks/sparse_masks.py
    python benchmarks/sparse_masks.py --shape 16k --mode int8_fp16v

On ``inputs.realistic_qkv`` inputs: every block kept through the sparse path, half of each row's key blocks at
random, each row's first half, every other block, and a random quarter. Each is timed as the whole call
(``int8_attention(..., block_mask=...)``: quantization, block lists, attention) and as the attention launch alone
on inputs quantized beforehand (``kernels.attention.attend``), all replayed from CUDA graphs and taking turns in
rounds; ratios to the dense call (or dense launch) are taken within each round, and given as the median over
rounds with their range.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffusion_int8 import int8_attention
from diffusion_int8.kernels import quantize as tq
from diffusion_int8.kernels.attention import attend, block_lists
from diffusion_int8.kernels.config import Mode, SPARSE_BLOCK, pv_for_mode
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import interleaved_rounds, median, paired_ratio

from sparse import SHAPES, fixed_mask


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="wan", choices=list(SHAPES))
    ap.add_argument("--mode", default="int8", choices=["int8", "int8_fp16v"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    B, H, S, D = SHAPES[args.shape]
    q, k, v = realistic_qkv(B, H, S, S, D, device="cuda", seed=0)
    nb = -(-S // SPARSE_BLOCK)
    blocks = torch.arange(nb, device="cuda")
    masks = {"every block": torch.ones(B, H, nb, nb, dtype=torch.bool, device="cuda"),
             "random half": fixed_mask(B, H, S, S, 0.5, "cuda")[0],
             "first half": (blocks < nb // 2).expand(B, H, nb, nb).contiguous(),
             "every other": (blocks % 2 == 0).expand(B, H, nb, nb).contiguous(),
             "random quarter": fixed_mask(B, H, S, S, 0.75, "cuda")[0]}
    pv = pv_for_mode(Mode(args.mode), q.device)
    quantized = tq.quantize_qkv(q, k, v, D**-0.5, pv)
    out = torch.empty_like(q)
    lists = {name: block_lists(m, B, H, S, S) for name, m in masks.items()}
    fns = {"dense": lambda: int8_attention(q, k, v, mode=args.mode),
           "dense launch": lambda: attend(quantized, v, out, pv=pv)}
    for name, m in masks.items():
        fns[name] = lambda m=m: int8_attention(q, k, v, mode=args.mode, block_mask=m)
        fns[name + " launch"] = lambda b=lists[name]: attend(quantized, v, out, pv=pv, blocks=b)
    rounds = interleaved_rounds(fns, args.reps, args.rounds)
    med = {name: median(t) for name, t in rounds.items()}
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "shape": (B, H, S, D), "mode": args.mode, "rounds": args.rounds}
    print(f"# {meta}\n# dense call {med['dense']:.3f} ms, dense launch {med['dense launch']:.3f} ms")
    print("| mask | kept | call ms | ÷ dense call (range) | launch ms | ÷ dense launch (range) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, m in masks.items():
        call, launch = paired_ratio(rounds[name], rounds["dense"]), paired_ratio(rounds[name + " launch"],
                                                                                  rounds["dense launch"])
        kept = m.float().mean().item()
        rows.append(dict(mask=name, kept=kept, call_ms=med[name], call_over_dense=call,
                         launch_ms=med[name + " launch"], launch_over_dense=launch))
        print(f"| {name} | {kept:.0%} | {med[name]:.3f} | {call[0]:.3f} ({call[1]:.3f}–{call[2]:.3f}) | "
              f"{med[name + ' launch']:.3f} | {launch[0]:.3f} ({launch[1]:.3f}–{launch[2]:.3f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "dense_ms": med["dense"], "dense_launch_ms": med["dense launch"], "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
