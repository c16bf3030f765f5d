"""Launch options of the portable kernel's head-dim-64 FP8 loops, timed against the shipped ones: the register caps
(``attention.launch_options``), how K and V tiles arrive (``attention.tma_tiles``: TMA or cp.async) and the
pipeline's stages (``config.tile_config``'s ``num_stages``).

    python benchmarks/loop_options.py [--shape 1,24,17550,64] [--skip 0.8] [--rounds 9] [--out bench_out/loops.json]
    python benchmarks/loop_options.py --tiles shipped --caps shipped --stages 2,3,4

The attention launch alone (``attention.attend``, on inputs quantized beforehand) in each of its loops: dense,
block-listed (a block mask skipping ``--skip`` of the key blocks) and the refresh (the split lists of
``return_skipped``), each compiled with tiles by TMA and by cp.async, and for each uncapped, at 128 and at 168
registers a thread and as shipped (``--tiles``, ``--caps``: a subset); with ``--stages``, each loop as shipped at
those stage counts too. Every variant is replayed from a CUDA graph, all taking turns
(``timing.interleaved_rounds``), and given as its time over the shipped variant's of the same loop within each round
(median and range over rounds). No option changes the arithmetic: every variant's output is checked bit for bit
against the shipped one's first.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch
import triton

from diffusion_int8.kernels import attention as kattn
from diffusion_int8.kernels import quantize as tq
from diffusion_int8.kernels.config import PV, is_sm90
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import interleaved_rounds, median, paired_ratio
from sparse import fixed_mask

CAPS = {"shipped": "shipped", "uncapped": None, "128": 128, "168": 168}
TILES = {"shipped": "shipped", "tma": True, "cp.async": False}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,24,17550,64", help="B,H,N,D (head dims 33-64 run the capped loops)")
    ap.add_argument("--skip", type=float, default=0.8, help="fraction of key blocks the block mask skips")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=20, help="graph replays a round")
    ap.add_argument("--tiles", default=",".join(TILES), help=f"tile sources to time, a subset of {list(TILES)}")
    ap.add_argument("--caps", default=",".join(CAPS), help=f"register caps to time, a subset of {list(CAPS)}")
    ap.add_argument("--stages", default="", help="also these pipeline stage counts, with the shipped tiles and caps")
    ap.add_argument("--out", default="bench_out/loops.json")
    args = ap.parse_args()
    tiles_timed, caps_timed = args.tiles.split(","), args.caps.split(",")
    for name, chosen, known in (("--tiles", tiles_timed, TILES), ("--caps", caps_timed, CAPS)):
        if unknown := [c for c in chosen if c not in known]:
            ap.error(f"{name}: unknown {unknown}; accepted: {', '.join(known)}")
    stages = [n for n in args.stages.split(",") if n]
    if not all(n.isdigit() and int(n) >= 1 for n in stages):
        ap.error(f"--stages takes comma-separated integers >= 1, got {args.stages!r}")
    stages = [int(n) for n in stages]
    B, H, N, D = map(int, args.shape.split(","))
    if not torch.cuda.is_available() or not is_sm90(torch.device("cuda")):
        raise SystemExit("these options apply on sm_90 GPUs only (attention.launch_options, tma_tiles)")

    q, k, v = realistic_qkv(B, H, N, N, D, device="cuda", seed=0)
    quantized = tq.quantize_qkv(q, k, v, D**-0.5, PV.FP8)
    out = torch.empty_like(q)
    skipped = (torch.empty_like(q), torch.empty(B, H, N, device="cuda"))
    mask, _ = fixed_mask(B, H, N, N, args.skip, "cuda")
    lists = {"block-listed": kattn.block_lists(mask, B, H, N, N), "refresh": kattn.block_lists(mask, B, H, N, N, split=True)}
    shipped_caps, shipped_tiles, shipped_config = kattn.launch_options, kattn.tma_tiles, kattn.tile_config

    def variant(loop, tiles, cap, n_stages=None):
        def run():  # all read at launch, so a graph captures the variant
            if tiles != "shipped":
                kattn.tma_tiles = lambda *_: tiles
            if cap != "shipped":
                kattn.launch_options = lambda *_: {} if cap is None else dict(maxnreg=cap)
            if n_stages is not None:  # the key tile and K groups, which quantize_qkv used, stay as shipped
                kattn.tile_config = lambda *a: replace(shipped_config(*a), num_stages=n_stages)
            try:
                kattn.attend(quantized, v, out, pv=PV.FP8, blocks=lists.get(loop),
                             skipped=skipped if loop == "refresh" else None)
            finally:
                kattn.launch_options, kattn.tma_tiles, kattn.tile_config = shipped_caps, shipped_tiles, shipped_config
            return out
        return run

    names = [("shipped", "shipped")] + [(t, c) for t in tiles_timed if t != "shipped" for c in caps_timed]
    fns = {}
    for loop in ("dense", "block-listed", "refresh"):
        for tiles, cap in names:
            fns[loop, f"{tiles}, {cap}" if tiles != "shipped" else "shipped"] = variant(loop, TILES[tiles], CAPS[cap])
        for n in stages:
            fns[loop, f"{n} stages"] = variant(loop, "shipped", "shipped", n)
    for (loop, name), fn in fns.items():  # the outputs poisoned, then compared bit for bit (the refresh's both)
        for t in (out, *skipped):
            t.fill_(float("nan"))
        fn()
        written = (out, *skipped) if loop == "refresh" else (out,)
        if name == "shipped":
            expected = [t.clone() for t in written]
        elif not all(torch.equal(a, b) for a, b in zip(written, expected)):
            raise SystemExit(f"{loop}, {name}: output differs from the shipped kernel's")
    rounds = interleaved_rounds({f"{loop} {name}": fn for (loop, name), fn in fns.items()}, args.reps, args.rounds)

    flops = 4 * B * H * N * N * D
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                shape=(B, H, N, D), skip=args.skip, rounds=args.rounds)
    rows = []
    print(f"# {meta}\n| loop | tiles, cap | ms | TOPS (dense-equivalent) | ÷ shipped (range) |\n|---|---|---|---|---|")
    for (loop, name) in fns:
        times = rounds[f"{loop} {name}"]
        ratio = paired_ratio(times, rounds[f"{loop} shipped"])
        rows.append(dict(loop=loop, variant=name, ms=median(times), over_shipped=ratio))
        print(f"| {loop} | {name} | {median(times):.4f} | {flops / median(times) / 1e9:.0f} | "
              f"{ratio[0]:.3f} ({ratio[1]:.3f}–{ratio[2]:.3f}) |")
    refresh = paired_ratio(rounds["refresh shipped"], rounds["dense shipped"])
    print(f"refresh ÷ dense, both shipped: {refresh[0]:.3f} ({refresh[1]:.3f}–{refresh[2]:.3f})")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, refresh_over_dense=refresh), f, indent=1)


if __name__ == "__main__":
    main()
