"""Static calibrated ranges against measured ones in a pipeline: eager denoiser steps of a shipped model, the
variants taking turns round by round (the host of a shared machine moves eager steps by tens of percent between
runs, so only rounds side by side compare).

    python benchmarks/static_ranges.py --out bench_out/static_ranges.json [--model embedded] [--rounds 4]

Per round and variant: the median ms of a denoising step over one generation of ``--images`` images (``eval``'s
``run_variant``: a warm-up generation on the same schedule first, CUDA-event-timed steps). Variants: the schedule
``calibrate`` derives at ``--budget`` and ``int8``, each with measured ranges and with the calibration's static
ones. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from diffusion_int8 import Int8Config, pipelines
from diffusion_int8.calibration.run import calibrate
from diffusion_int8.eval.run import run_variant
from diffusion_int8.plugin.models import denoiser
from diffusion_int8.schedule import PrecisionSchedule


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget", type=float, default=0.015, help="the schedule's error budget (the demo's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    pipe = pipelines.load(args.model, dev)
    items = pipelines.resolve_items(pipe)
    items = pipelines.Items(items.values[:args.images], items.kind)
    cal = calibrate(pipe, steps=args.steps, batch_size=args.images, progress=False)
    schedule = PrecisionSchedule.from_calibration(cal, budget=args.budget)
    batches = items.batches(args.images)
    model = denoiser(pipe)
    variants = {"schedule, measured": Int8Config(schedule=schedule, speed_gate=False),
                "int8, measured": Int8Config("int8", speed_gate=False)}
    variants = {**variants, "schedule, static": variants["schedule, measured"].replace(calibration=cal),
                "int8, static": variants["int8, measured"].replace(calibration=cal)}
    ms = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, config in variants.items():
            _, speed, _ = run_variant(pipe, model, items, batches, dev, config, steps=args.steps, seed=0)
            ms[name].append(speed["denoiser_ms_per_step"])
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in ms.items()), flush=True)
    print(f"\n{torch.cuda.get_device_name(dev)}, {args.model}, {args.images} images x {args.steps} steps, ms a step")
    print("| variant | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " | fastest |")
    print("|---|" + "---|" * (args.rounds + 1))
    for name, v in ms.items():
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in v) + f" | {min(v):.2f} |")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "model": args.model, "images": args.images,
                   "steps": args.steps, "ms_per_step": ms}, f, indent=1)


if __name__ == "__main__":
    main()
