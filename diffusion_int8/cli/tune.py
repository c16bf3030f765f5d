"""``diffusion-int8 tune``: measure this GPU's crossover table for the speed gate (``speed_gate.measure``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..kernels.config import MAX_HEAD_DIM
from ..plugin.speed_gate import DTYPES, KINDS, cache_path, measure
from .outputs import check_out_file, command
from .usage import UsageError, text_path, user_errors


DESCRIPTION = """diffusion-int8 tune: measure where INT8 attention beats SDPA on this GPU. Needs a CUDA GPU.

Times SDPA and each INT8 mode over a grid of sequence lengths (1,024 to 32,768 keys) and query rows, for each
head dim and dtype asked for: at whole 128-key tiles, past them (head dims that pad to 64) and with a key mask (a padded
prompt's). It writes the table the speed gate reads to decide, per attention call, whether INT8 pays: by default
to this GPU's cache file, which enable() then finds. On a fresh H200 the whole-tile and key-mask cells took 263 s
(compiling the kernels included), the cells past whole tiles 111 s more (then at both head dims). A GPU
diffusion-int8 ships a table for (the H200, and any sm_90 GPU through the H100's) uses that one until it has its
own.

    diffusion-int8 tune                                   # this GPU's table, into the cache
    diffusion-int8 tune --head-dims 128 --dtypes bfloat16 --out table.json"""


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure where INT8 attention beats SDPA on this GPU (the speed gate's table)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=text_path, default=None,
                   help="table file to write (default: this GPU's cache file, see cache_path)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims to measure (default 64,128)")
    p.add_argument("--dtypes", default="float16,bfloat16", help="float16 and/or bfloat16")
    p.add_argument("--kinds", default="plain,tail,key",
                   help="kinds of call to time: plain (lengths of whole 128-key tiles), and unless left out tail (a "
                        "partial last tile; head dims that pad to 64) and key (a key mask); default all three")
    p.add_argument("--overwrite", action="store_true", help="replace an existing table file")
    p.set_defaults(func=command(run))


def run(args) -> int:
    try:
        head_dims = tuple(int(x) for x in args.head_dims.split(","))
    except ValueError:
        raise UsageError(f"--head-dims takes comma-separated integers, got {args.head_dims!r}") from None
    # each once, in the order given: a grid measured twice would make a file that does not load
    head_dims, dtypes, kinds = (tuple(dict.fromkeys(x)) for x in (head_dims, args.dtypes.split(","),
                                                                  args.kinds.split(",")))
    bad = ([d for d in head_dims if not 1 <= d <= MAX_HEAD_DIM] + [t for t in dtypes if t not in DTYPES]
           + [k for k in kinds if k not in KINDS])
    if bad:
        raise UsageError(f"not accepted: {bad} (head dims 1..{MAX_HEAD_DIM}; dtypes {sorted(DTYPES)}; kinds "
                         f"{list(KINDS)})")
    if "plain" not in kinds:
        raise UsageError(f"--kinds must include plain (the other kinds fall back on those cells), got "
                         f"{args.kinds!r}")
    if args.out:
        check_out_file(args.out, "--out", args.overwrite, make_parents=True)
    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (the speed gate only decides for CUDA devices)")
    device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out) if args.out else cache_path(device)
    check_out_file(out, "--out" if args.out else "the cached table (no --out given)", args.overwrite, make_parents=True)
    table = measure(device, head_dims=head_dims, dtypes=dtypes, kinds=kinds, progress=lambda s: print(s, flush=True))
    with user_errors(OSError):  # save removes its temporary file on any failure
        table.save(out)
    print(f"wrote {out}")
    return 0
