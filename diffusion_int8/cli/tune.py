"""``diffusion-int8 tune``: measure this GPU's crossover table for the speed gate (``speed_gate.measure``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..kernels.config import MAX_HEAD_DIM
from ..speed_gate import _DTYPES, cache_path, measure


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure where INT8 attention beats SDPA on this GPU (the speed gate's table)",
                       description=measure.__doc__)
    p.add_argument("--out", default=None, help="table file to write (default: this GPU's cache file, see cache_path)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims to measure (default 64,128)")
    p.add_argument("--dtypes", default="float16,bfloat16", help="float16 and/or bfloat16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing table file")
    p.set_defaults(func=run)


def run(args) -> int:
    if not torch.cuda.is_available():
        print("diffusion-int8 tune: needs a CUDA GPU (the gate only decides for CUDA devices)", file=sys.stderr)
        return 2
    try:
        head_dims = tuple(int(x) for x in args.head_dims.split(","))
        dtypes = tuple(args.dtypes.split(","))
    except ValueError:
        print(f"diffusion-int8 tune: --head-dims takes integers, got {args.head_dims!r}", file=sys.stderr)
        return 2
    bad = [d for d in head_dims if not 1 <= d <= MAX_HEAD_DIM] + [t for t in dtypes if t not in _DTYPES]
    if bad:
        print(f"diffusion-int8 tune: not accepted: {bad} (head dims 1..{MAX_HEAD_DIM}; dtypes {sorted(_DTYPES)})",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out) if args.out else cache_path(device)
    if out.exists() and not args.overwrite:
        print(f"diffusion-int8 tune: {out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    table = measure(device, head_dims=head_dims, dtypes=dtypes, progress=lambda s: print(s, flush=True))
    table.save(out)
    print(f"wrote {out}")
    return 0
