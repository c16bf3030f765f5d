"""Does a model admit block sparsity? The predictor's masks against an oracle's, on the long shipped model.

    python benchmarks/sparse_quality.py --levels 0.99,0.95,0.9,0.8 --out bench_out/sparse_quality.json
    python benchmarks/sparse_quality.py --levels 0.8,0.6,0.4 --from-steps 0,10,14,17   # sparse from step s on
    python benchmarks/sparse_quality.py --levels 0.3,0.2,0.1 --refresh-every 2,3        # skipped blocks carried
    python benchmarks/sparse_quality.py --steps 50 --levels 0.2 --refresh-every 3,5      # at a video loop's 50 steps
    python benchmarks/sparse_quality.py --steps 50 --levels 0.2 --refresh-every 5 --forecast-gains 0.5,1,1.5
    python benchmarks/sparse_quality.py --steps 50 --levels 0.05 --refresh-every 4 --seeds-on cpu   # eval's images
    python benchmarks/sparse_quality.py --steps 28 --levels 0.05 --refresh-every 3 --model-alone  # no step count

For each level τ, the images of ``enable(pipe, "int8", sparsity=τ)`` (INT8 forced) against FP16 from the same
seeds: PSNR and the fraction of blocks skipped, with the masks the calls predict (``int8_attention(...,
sparsity=τ)``) and with an oracle's: the true block mass of the call (exact attention in float32), the smallest set
of key blocks per query block holding τ of it. Where the oracle loses as much quality as the predictor at the same fraction
skipped, the model's attention, not the predictor, sets the limit. With ``--from-steps``, each level also runs
from a later denoising step on (dense INT8 before it: a ``PrecisionSchedule`` rule over the lower noise levels),
to show which steps tolerate sparsity. With ``--refresh-every``, each level also runs with its skipped blocks
carried instead of dropped (``enable(..., refresh_every=k)``, the predictor's masks), at each of
``--forecast-gains``. ``--model-alone`` adds each carried setting enabled on the denoiser instead of the pipeline:
without the scheduler's step count, a refresh every k-th step from the first even where that falls on the last
step (``BlockCarry.refreshes``).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import diffusion_int8
import diffusion_int8.plugin.processor as P
from diffusion_int8.embedded import load_pipeline
from diffusion_int8.eval.metrics import psnr
from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.plugin.carry import BlockCarry
from diffusion_int8.schedule import PrecisionSchedule, Rule


def oracle_mask(query, key, scale, tau):
    """The block mask at level ``tau`` from the call's true attention (BHSD query and key)."""
    p = ((query.float() @ key.float().transpose(-1, -2)) * (scale or query.shape[-1] ** -0.5)).softmax(-1)
    B, H, Sq, Sk = p.shape
    nq, nk = -(-Sq // SPARSE_BLOCK), -(-Sk // SPARSE_BLOCK)
    p = F.pad(p, (0, nk * SPARSE_BLOCK - Sk, 0, nq * SPARSE_BLOCK - Sq))
    mass = p.view(B, H, nq, SPARSE_BLOCK, nk, SPARSE_BLOCK).sum((3, 5)) / SPARSE_BLOCK
    ordered, order = mass.sort(-1, descending=True)
    keep = ~((ordered.cumsum(-1) - ordered) >= tau)
    return torch.empty_like(keep).scatter_(-1, order, keep)


def oracle_core(core):
    """``routing.int8_core`` with the oracle's masks where a call would predict its own."""
    def run(mode, query, key, value, attn_mask, scale, ranges, *, sparsity=None, keep_kv_blocks=None,
            return_block_mask=False, **kwargs):
        if sparsity is None:
            return core(mode, query, key, value, attn_mask, scale, ranges, **kwargs)
        mask = oracle_mask(query, key, scale, sparsity)
        if keep_kv_blocks is not None:
            mask = mask | keep_kv_blocks
        out = core(mode, query, key, value, attn_mask, scale, ranges, block_mask=mask, **kwargs)
        return (out, mask) if return_block_mask else out
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="0.99,0.95,0.9,0.8")
    ap.add_argument("--classes", type=int, default=16, help="images: class i seeded with i")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--from-steps", default="0", help="denoising steps (0-based) from which each level applies")
    ap.add_argument("--refresh-every", default="", help="also each level with its skipped blocks carried, refreshed "
                                                        "every k steps: comma-separated k >= 2")
    ap.add_argument("--forecast-gains", default=str(BlockCarry.gain),
                    help="with --refresh-every, each interval at these gains of the forecast's step "
                         "(BlockCarry.gain): comma-separated, >= 0")
    ap.add_argument("--model-alone", action="store_true",
                    help="with --refresh-every, each carried setting also enabled on the denoiser alone (no step "
                         "count: the last step's refresh is not moved)")
    ap.add_argument("--seeds-on", choices=("device", "cpu"), default="device",
                    help="where each image's generator draws its noise: on --device, or on the CPU as `diffusion-int8 "
                         "eval` draws it (the same seeds, other images)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if any(not 0 <= int(s) < args.steps for s in args.from_steps.split(",")):
        ap.error(f"--from-steps must be steps in 0..{args.steps - 1}, got {args.from_steps}")
    if any(int(k) < 2 for k in args.refresh_every.split(",") if k):
        ap.error(f"--refresh-every takes intervals >= 2, got {args.refresh_every}")
    try:
        gains = [float(g) for g in args.forecast_gains.split(",")]
    except ValueError:
        gains = []
    if not gains or not all(math.isfinite(g) and g >= 0 for g in gains):
        ap.error(f"--forecast-gains takes comma-separated finite numbers >= 0, got {args.forecast_gains}")
    for flag, given in (("--forecast-gains", args.forecast_gains != ap.get_default("forecast_gains")),
                        ("--model-alone", args.model_alone)):
        if given and not args.refresh_every:
            ap.error(f"{flag} applies to the carried runs: give --refresh-every too")
    pipe = load_pipeline(variant="long", device=args.device)
    labels = [i % len(pipe.labels) for i in range(args.classes)]

    def generate():
        gens = [torch.Generator(args.device if args.seeds_on == "device" else "cpu").manual_seed(i)
                for i in range(len(labels))]
        return pipe(class_labels=labels, num_inference_steps=args.steps, generator=gens, output_type="pt").images

    ref = generate()
    rows = []
    handle = diffusion_int8.enable(pipe, "int8", speed_gate=False)
    p = psnr(generate(), ref)
    handle.disable()
    rows.append(dict(masks="dense", tau=1.0, from_step=0, psnr_mean=p.mean().item(), psnr_min=p.min().item(),
                     skipped=0.0))
    timesteps = pipe.scheduler.timesteps.tolist()  # of the last generation: every one has the same

    def sparse_from(tau: float, step: int) -> dict:
        """``enable``'s arguments for level ``tau`` at denoising steps ``step`` and later."""
        if step == 0:
            return dict(sparsity=tau)
        below = (timesteps[step - 1] + timesteps[step]) / 2 / pipe.scheduler.config.num_train_timesteps
        return dict(schedule=PrecisionSchedule((Rule("int8", 0.0, below, "*", tau),), default="int8",
                                               name=f"tau {tau} from step {step}"))

    predictor = P.int8_core
    try:
        for masks, fn in (("predictor", predictor), ("oracle", oracle_core(predictor))):
            P.int8_core = fn
            for step in map(int, args.from_steps.split(",")):
                for tau in map(float, args.levels.split(",")):
                    handle = diffusion_int8.enable(pipe, "int8", speed_gate=False, record=True,
                                                   **sparse_from(tau, step))
                    p = psnr(generate(), ref)
                    skipped = handle.state.skipped_blocks()["overall"]
                    handle.disable()
                    rows.append(dict(masks=masks, tau=tau, from_step=step, psnr_mean=p.mean().item(),
                                     psnr_min=p.min().item(), skipped=skipped))
    finally:
        P.int8_core = predictor
    default_gain = BlockCarry.gain
    try:
        for gain in gains:
            BlockCarry.gain = gain
            for every in [int(k) for k in args.refresh_every.split(",") if k]:
                for tau in map(float, args.levels.split(",")):
                    for target, alone in [(pipe, False)] + ([(pipe.transformer, True)] if args.model_alone else []):
                        handle = diffusion_int8.enable(target, "int8", speed_gate=False, record=True, sparsity=tau,
                                                       refresh_every=every)
                        p = psnr(generate(), ref)
                        skipped = handle.state.skipped_blocks()
                        handle.disable()
                        rows.append(dict(masks=f"predictor, carried every {every}, gain {gain:g}"
                                               + (", model alone" if alone else ""),
                                         tau=tau, from_step=0, refresh_every=every, gain=gain, model_alone=alone,
                                         steps_skipping_none=[i for i, f in enumerate(skipped["per_step"]) if f == 0],
                                         psnr_mean=p.mean().item(), psnr_min=p.min().item(),
                                         skipped=skipped["overall"]))
    finally:
        BlockCarry.gain = default_gain
    print("| masks | τ | from step | PSNR mean (min) dB | skipped |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['masks']} | {r['tau']} | {r['from_step']} | {r['psnr_mean']:.2f} ({r['psnr_min']:.2f}) "
              f"| {r['skipped']:.1%} |")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "date": time.strftime("%Y-%m-%d"), "classes": args.classes, "steps": args.steps,
                "seeds_on": args.seeds_on}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
