"""Accuracy on inputs with outlier channels: the balance turned off, the default, and the Hadamard rotation.

    python benchmarks/outliers.py --out bench_out/outliers.json             # the kernels, on a GPU
    python benchmarks/outliers.py --device cpu --lengths 1024               # the emulation, on the CPU

Inputs are ``inputs.realistic_qkv`` (K channel bias, sink token) with ``--gain`` (20) times larger channels:
``separate`` gives Q and K outlier channels of their own (each channel ``gain`` times larger), ``shared`` the
same channels in both (each sqrt(gain), so their product is ``gain`` times larger), and ``shared, both ×gain``
the extreme of each ``gain`` times larger in the same channels (products ``gain``² larger). Every cell is the
worst cosine against float64 attention over the seeds. *Default* is what ``enable(pipe)`` does without a flag:
the Q·Kᵀ balance where the module's first call finds a channel it moves (``reference.needs_balance``), else
none; *off* is ``qk_balance=False``. ``--static`` adds static per-head ranges (a calibration's kind, here the
maxima of the same inputs), off and with the calibration's balance (``Calibration.ranges(..., balance=True)``'s,
from the channel maxima: the default with a calibration). On the GPU the last rows time the whole call at
Flux's and SDXL's shapes, on inputs without outlier channels of their own (shared ones) and with them
(separate, 3 channels), off, by default and with the rotation, replayed from CUDA graphs in one run, the
variants taking turns in every round (``--timing-only`` skips the accuracy grid).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.reference import attention_ref, balance_from_ranges, needs_balance, token_mean
from diffusion_int8.compare import cosine
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import interleaved_ms

KINDS = {"separate": dict(outliers="separate"), "shared": dict(outliers="shared"),
         "shared, both ×gain": dict(outliers="shared", square=True)}


def static_inputs(q, k, v, balance):
    """Static ranges as a calibration gives them, here the maxima of the inputs themselves: per head for Q and K,
    per channel for V, K's token mean; with ``balance``, the balance of the channel maxima and ranges of the
    balanced Q and K (what ``Calibration.ranges(..., balance=True)`` makes of recorded maxima)."""
    mean = token_mean(k)
    qf, kf = q.float(), k.float() - mean[:, :, None]
    static = dict(v_amax=v.float().abs().amax(2), k_mean=mean)
    if balance:
        bal = balance_from_ranges(qf.abs().amax(2), kf.abs().amax(2))
        qf, kf = qf / bal[:, :, None], kf * bal[:, :, None]
        static["qk_balance"] = bal
    return dict(static, q_amax=qf.abs().amax((2, 3)), k_amax=kf.abs().amax((2, 3)))


def worst_cos(device, D, S, n, kind, gain, mode, how, seeds, static=False):
    opts = dict(KINDS[kind])
    square = opts.pop("square", False)
    worst = 1.0
    for seed in range(seeds):
        q, k, v = realistic_qkv(1, 2, S, S, D, device=device, seed=seed * 1000 + D + S + n,
                                outlier_gain=gain**2 if square else gain, n_outliers=n, **opts)
        ref = attention_ref(q, k, v)
        if static:
            kw = static_inputs(q, k, v, how == "default")
        else:
            kw = dict(qk_balance=how == "default" and needs_balance(q, k), qk_rotate=how == "rotation")
        out = int8_attention(q, k, v, mode=mode, **kw)
        worst = min(worst, cosine(out, ref).item())
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--head-dims", default="40,64,128,160")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--outliers", default="1,3", help="outlier channels per tensor")
    ap.add_argument("--gain", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--timing-only", action="store_true", help="only the timing rows (GPU)")
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds, the variants taking turns in each")
    ap.add_argument("--static", action="store_true", help="also static ranges, with and without a given balance")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    dev = torch.device(args.device)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (emulation)",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "gain": args.gain, "seeds": args.seeds}
    rows = []
    grid = itertools.product(KINDS, [int(d) for d in args.head_dims.split(",")],
                             [int(s) for s in args.lengths.split(",")], [int(n) for n in args.outliers.split(",")])
    for kind, D, S, n in [] if args.timing_only else grid:
        row = dict(kind=kind, D=D, S=S, n=n)
        for static, mode, how in itertools.product((False, True) if args.static else (False,),
                                                   ("int8_fp16v", "int8"), ("off", "default", "rotation")):
            if static and how == "rotation":  # the rotation measures Q's and K's ranges
                continue
            label = f"{mode}{', static' if static else ''}, {how}"
            row[label] = worst_cos(dev, D, S, n, kind, args.gain, mode, how, args.seeds, static)
        rows.append(row)
        print(row, flush=True)
    if rows:
        cols = [c for c in rows[0] if c not in ("kind", "D", "S", "n")]
        print(f"\nworst cosine against float64, {meta['device']}, {meta['date']}, gain {args.gain:g}, {args.seeds} seeds\n")
        print("| outliers | D | tokens | n | " + " | ".join(cols) + " |")
        print("|---|---|---|---|" + "---|" * len(cols))
        for r in rows:
            print(f"| {r['kind']} | {r['D']} | {r['S']} | {r['n']} | " + " | ".join(f"{r[c]:.5f}" for c in cols) + " |")
        for kind in KINDS:
            sel = [r for r in rows if r["kind"] == kind]
            print(f"worst over {kind}: " + ", ".join(f"{c} {min(r[c] for r in sel):.5f}" for c in cols))
    timing = {}
    if dev.type == "cuda":  # what the default and the rotation cost: the whole call, graph-replayed, in turns
        for shape_name, shape in (("flux", (2, 24, 4608, 128)), ("sdxl", (2, 10, 4096, 64))):
            B, H, N, D = shape
            fns = {}
            for inputs, opts in (("without", {}), ("with", dict(outliers="separate", n_outliers=3))):
                q, k, v = realistic_qkv(B, H, N, N, D, device=dev, outlier_gain=args.gain, **opts)
                balance = needs_balance(q, k)  # the module's first call: once, not timed
                for mode, how in itertools.product(("int8_fp16v", "int8"), ("off", "default", "rotation")):
                    fns[f"{inputs}, {mode}, {how}"] = (lambda q=q, k=k, v=v, mode=mode, how=how, b=balance: int8_attention(
                        q, k, v, mode=mode, qk_balance=how == "default" and b, qk_rotate=how == "rotation"))
                timing.setdefault("balanced", {})[f"{shape_name}, {inputs}"] = balance
            times = timing[shape_name] = interleaved_ms(fns, 50, rounds=args.rounds)
            print(f"\n{shape_name} {shape}, whole call replayed from a CUDA graph, median of {args.rounds} rounds "
                  "taking turns:")
            for inputs in ("without", "with"):
                for mode in ("int8_fp16v", "int8"):
                    off = times[f"{inputs}, {mode}, off"]
                    for how in ("default", "rotation"):
                        on = times[f"{inputs}, {mode}, {how}"]
                        print(f"  {inputs} outlier channels of their own, {mode}: {on:.3f} ms {how}, {off:.3f} ms "
                              f"off: {on / off - 1:+.1%}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "timing_ms": timing}, f, indent=1)


if __name__ == "__main__":
    main()
