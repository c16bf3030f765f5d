"""The worst accuracy of the smallest calls: one query row a head against a few keys, many random draws, each P·V
format.

    python benchmarks/tiny_draws.py [--draws 20000] [--keys 129] [--heads 2] [--head-dim 64] [--out tiny.json]

With one query row the whole output rests on one per-token Q scale: an outlier channel that scale must cover, over
attention peaked on a few keys, moves the row's cosine far more than at real lengths, where rows average out. The
smallest case ``tests/test_attention.py`` checks against its tiny-case bounds has this shape. A draw is one call
(B = 1, ``--heads`` heads, one query row each, inputs from ``realistic_qkv`` with the draw's own seed: its own
outlier channels, K bias and sink); its cosine and relative L1 are over the whole call's output, as the test takes
them. Runs the kernel's emulation on the CPU (bit-faithful to the kernels, so no GPU is needed), 500 draws batched
at a time, against float64 attention. Prints the worst cosine and relative L1 per format and the cosine's 0.1%
quantile.
"""

import argparse
import json

import torch

from diffusion_int8.compare import cosine, rel_l1
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.kernels import reference as R
from diffusion_int8.kernels.config import PV

CHUNK = 500


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=20000, help="draws per format, a multiple of %d" % CHUNK)
    p.add_argument("--keys", type=int, default=129)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--out", help="also write the per-format results as JSON here")
    args = p.parse_args()
    if args.draws <= 0 or args.draws % CHUNK:
        p.error(f"--draws must be a positive multiple of {CHUNK}, got {args.draws}")

    results = {pv.value: {"cos": [], "l1": []} for pv in PV}
    for chunk in range(args.draws // CHUNK):
        draws = [realistic_qkv(1, args.heads, 1, args.keys, args.head_dim, seed=chunk * CHUNK + i)
                 for i in range(CHUNK)]
        q, k, v = (torch.cat(t) for t in zip(*draws))
        ref = R.attention_ref(q, k, v)  # float64
        for pv in PV:
            out = R.emulate_attention(q, k, v, pv=pv)  # per batch element: K's smoothing and scales, as alone
            results[pv.value]["cos"] += cosine(out, ref, start_dim=1).tolist()
            results[pv.value]["l1"] += rel_l1(out, ref, start_dim=1).tolist()
        done = (chunk + 1) * CHUNK
        if done % 5000 == 0 or done == args.draws:
            print(f"  {done:,} / {args.draws:,} draws", flush=True)

    print(f"\n{args.draws:,} draws of 1 query row x {args.keys} keys a head ({args.heads} heads, D = {args.head_dim}), "
          "the emulation against float64\n")
    print("| P·V | worst cos | 0.1% quantile cos | worst rel L1 |")
    print("|---|---|---|---|")
    summary = {}
    for pv, r in results.items():
        cos = torch.tensor(r["cos"])
        summary[pv] = {"worst_cos": cos.min().item(), "q001_cos": cos.quantile(0.001).item(),
                       "worst_l1": max(r["l1"]), "worst_draw": int(cos.argmin())}
        s = summary[pv]
        print(f"| {pv} | {s['worst_cos']:.5f} | {s['q001_cos']:.5f} | {s['worst_l1']:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"draws": args.draws, "keys": args.keys, "heads": args.heads, "head_dim": args.head_dim,
                       "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
