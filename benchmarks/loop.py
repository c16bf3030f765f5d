"""Whole denoising loops of video DiTs at real configurations (random weights, no download): the wall time of a
flow-matching loop with the timestep moving, as a user runs it, stock against INT8 variants.

    python benchmarks/loop.py --out bench_out/loop.json [--models wan,hunyuanvideo] [--steps 50]
        [--carried 0.05:4,0.2:5] [--compile | --compiled-only] [--no-int8] [--resolution 720p]
        [--blocks wan=6,hunyuanvideo=1+2] [--bound]

- **Wan2.1-T2V-1.3B** at 480p × 81 frames: all 30 blocks, 21 × 60 × 104 latents (32,760 tokens), CFG as
  diffusers' ``WanPipeline`` runs it: two denoiser calls a step (prompt, negative prompt), guidance 5.
- **HunyuanVideo** at 544 × 960 × 61 frames (32,640 video tokens + 256 text, 76 of them padding): 2 of its 20
  double and 4 of its 40 single blocks (every block has the full model's attention shape; the full model's step
  adds the other blocks; ``--blocks hunyuanvideo=20+40`` runs them all, 13B parameters), guidance-distilled: one
  call a step.

``--resolution 720p`` runs both at 1280 × 720, the published sparse-attention results' setting: Wan × 81 frames
(21 × 90 × 160 latents, 75,600 tokens), HunyuanVideo × 129 frames (33 × 90 × 160, 118,800 video tokens).
``--blocks`` sets how many of its blocks a model runs (Wan: N of 30; HunyuanVideo: D+S double and single blocks, up
to the full 20+40), each block with the full model's shapes: fewer keep the long runs short, and the ratio then
counts the embeddings and the output layer a little more than the full model does.

The timesteps come from diffusers' ``FlowMatchEulerDiscreteScheduler`` (shift 3 for Wan, 7 for HunyuanVideo), so
a schedule or a carried variant sees them move as in the pipelines, and ``enable`` is given the scheduler with the
denoiser, as a pipeline gives it (the carry's step count). Variants: stock; ``int8`` (``enable()``'s
defaults: the speed gate, the Q·Kᵀ balance where a module needs it); ``int8`` with block sparsity whose skipped
blocks are carried, one variant per ``--carried tau:k`` (sparsity level tau, a refresh every k steps; by default
0.05:4 and 0.2:5, which hold about 33.3 and 30.3 dB on the long shipped model at 50 steps, BENCHMARKS.md "Skipped
blocks carried"). Each variant runs a 3-step warm-up loop, then the timed loop (host clock,
synchronized at both ends). ``--compile`` adds each variant with ``torch.compile(model)`` after ``enable`` (the
warm-up compiles; a carried variant's bookkeeping runs eagerly between graphs). ``--bound`` adds *no attention*:
the stock model with every SDPA call returning its query unread, so the loop keeps everything but attention (the
projections, norms, rotary embeddings, feed-forward layers): the ceiling of any method that speeds up attention
alone. Ratios compare variants of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from types import SimpleNamespace
from unittest import mock

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from pipeline import cast, models, to_dtype

import diffusion_int8

CONFIGS = {  # model -> (guidance scale or None for guidance-distilled, scheduler shift)
    "wan": (5.0, 3.0),
    "hunyuanvideo": (None, 7.0),
}
LATENTS = {  # (model, resolution) -> latent (frames, height, width)
    ("wan", "480p"): (21, 60, 104),
    ("wan", "720p"): (21, 90, 160),
    ("hunyuanvideo", "544p"): (16, 68, 120),
    ("hunyuanvideo", "720p"): (33, 90, 160),
}
DEFAULT_RESOLUTION = {"wan": "480p", "hunyuanvideo": "544p"}


FULL_BLOCKS = {"wan": (30,), "hunyuanvideo": (20, 40)}  # Wan's blocks; HunyuanVideo's double and single blocks


def build(builder, name: str, blocks: str | None):
    """``name``'s model and inputs with ``blocks`` of its blocks (``N`` of Wan's, ``D+S`` double and single of
    HunyuanVideo's; None: the benchmark's default), and what it holds. Built on the GPU: the full HunyuanVideo's 13B
    parameters take minutes to initialize on the CPU."""
    counts = tuple(int(n) for n in blocks.split("+")) if blocks else None
    if counts is not None and not all(1 <= n <= full for n, full in zip(counts, FULL_BLOCKS[name])):
        raise SystemExit(f"--blocks {name}={blocks}: takes 1 to {'+'.join(map(str, FULL_BLOCKS[name]))}")
    with torch.device("cuda"):
        if name == "hunyuanvideo" and counts is not None:
            return builder(*counts)
        model, x, dtype, what = builder()
    if counts is not None:  # Wan is built whole: keep its first N blocks
        model.blocks = model.blocks[:counts[0]]
        what = f"{counts[0]} of 30 blocks"
    return model, x, dtype, what


NO_ATTENTION = "no attention (bound)"


def no_attention():
    """``torch.nn.functional.scaled_dot_product_attention`` returning its query, (B, H, Sq, D) as attention's output:
    what a loop costs with attention free. K and V are touched (one element each), or a compiled model would drop
    their projections, norms and rotary embeddings as dead code."""
    def attend(query, key, value, *args, **kwargs):
        return query + 0 * (key[..., :1, :1] + value[..., :1, :1])

    return mock.patch("torch.nn.functional.scaled_dot_product_attention", attend)


def loop(model, scheduler, x: dict, negative: dict | None, steps: int, guidance: float | None) -> float:
    """Seconds of a ``steps``-step Euler flow-matching loop over ``model`` from ``x``'s latents."""
    scheduler.set_timesteps(steps, device="cuda")
    latents = x["hidden_states"].clone()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in scheduler.timesteps:
            step = {**x, "hidden_states": latents, "timestep": t.expand(latents.shape[0])}
            pred = model(**step, return_dict=False)[0]
            if guidance is not None:
                uncond = model(**{**step, **negative}, return_dict=False)[0]
                pred = uncond + guidance * (pred - uncond)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="wan,hunyuanvideo")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--carried", default="0.05:4,0.2:5", help="carried settings, tau:k[,tau:k...] ('' for none)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compiled-only", action="store_true", help="only the compiled rows (implies --compile)")
    p.add_argument("--resolution", choices=("default", "720p"), default="default",
                   help="default: Wan 480p, HunyuanVideo 544p; 720p: both at 1280 x 720")
    p.add_argument("--blocks", default="", help="model=blocks[,...]: wan=N (at most 30; default 30), "
                   "hunyuanvideo=D+S (at most 20+40; default 2+4)")
    p.add_argument("--bound", action="store_true", help="add the stock model with attention taking no time")
    p.add_argument("--no-int8", action="store_true", help="leave out the dense int8 variant (to keep a long compiled "
                   "run within a time limit)")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    try:
        carried = [(float(t), int(k)) for t, k in (c.split(":") for c in args.carried.split(",") if c)]
    except ValueError:
        p.error(f"--carried takes tau:k pairs separated by commas (e.g. 0.2:2,0.2:3), got {args.carried!r}")
    blocks = dict(b.split("=", 1) for b in args.blocks.split(",") if "=" in b)
    pattern = {"wan": r"\d+", "hunyuanvideo": r"\d+\+\d+"}
    if len(blocks) != len([b for b in args.blocks.split(",") if b]) or not all(
            re.fullmatch(pattern.get(n, "$^"), v) for n, v in blocks.items()):
        p.error(f"--blocks takes wan=N and hunyuanvideo=D+S, got {args.blocks!r}")
    builders = models()
    results = {"device": torch.cuda.get_device_name(), "steps": args.steps, "models": {}}
    for name in args.models.split(","):
        guidance, shift = CONFIGS[name]
        resolution = DEFAULT_RESOLUTION[name] if args.resolution == "default" else args.resolution
        frames, height, width = LATENTS[name, resolution]
        model, x, dtype, what = build(builders[name], name, blocks.get(name))
        x["hidden_states"] = torch.randn(*x["hidden_states"].shape[:2], frames, height, width)
        what += f"; {resolution}, {frames} x {height} x {width} latents"
        model, x = to_dtype(model, dtype, "cuda").eval(), cast(x, dtype)
        negative = {"encoder_hidden_states": torch.randn_like(x["encoder_hidden_states"])} if guidance else None
        variants = {"stock": None} if args.no_int8 else {"stock": None, "int8": diffusion_int8.Int8Config("int8")}
        for tau, every in carried:
            variants[f"int8 sparsity {tau:g} carried (refresh every {every})"] = diffusion_int8.Int8Config(
                "int8", sparsity=tau, refresh_every=every)
        if args.bound:
            variants[NO_ATTENTION] = None
        runs = [] if args.compiled_only else [(n, c, False) for n, c in variants.items()]
        if args.compile or args.compiled_only:
            runs += [(f"{n}, compiled", c, True) for n, c in variants.items()]
        rows = {}
        # what enable() is given of a pipeline: the denoiser, and the scheduler that tells the carry its step count
        pipe = SimpleNamespace(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift))
        for label, config, compiled in runs:
            handle = diffusion_int8.enable(pipe, config, record=True) if config is not None else None
            run = torch.compile(model) if compiled else model
            with no_attention() if label.startswith(NO_ATTENTION) else contextlib.nullcontext():
                loop(run, pipe.scheduler, x, negative, 3, guidance)  # warm-up: kernels, plans, compilation
                if handle is not None:
                    handle.state.reset()
                seconds = loop(run, pipe.scheduler, x, negative, args.steps, guidance)
            row = {"seconds": seconds}
            if handle is not None:  # eager runs count the calls and blocks; compiled graphs do not
                skipped = handle.state.skipped_blocks()
                if not compiled:
                    row.update(int8_calls=handle.state.int8_calls, gated_calls=handle.state.gated_calls,
                               skipped=None if skipped is None else skipped["overall"])
                handle.disable()
            rows[label] = row
            torch._dynamo.reset()
            print(f"{name} {label}: {seconds:.1f} s", flush=True)
        stock = {False: rows.get("stock", {}).get("seconds"), True: rows.get("stock, compiled", {}).get("seconds")}
        for label, row in rows.items():
            row["speedup"] = stock["compiled" in label] / row["seconds"]
        results["models"][name] = {"what": what, "resolution": resolution, "guidance": guidance, "rows": rows}
        print(f"\n{name} ({what}), {args.steps} steps, {torch.cuda.get_device_name()}")
        print("| variant | s | × stock | INT8 / gated calls | blocks skipped |\n|---|---|---|---|---|")
        for label, row in rows.items():
            calls = f"{row['int8_calls']} / {row['gated_calls']}" if "int8_calls" in row else "–"
            skipped = f"{row['skipped']:.0%}" if row.get("skipped") is not None else "–"
            print(f"| {label} | {row['seconds']:.1f} | {row['speedup']:.2f}× | {calls} | {skipped} |")
        del model, x
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
