"""``diffusion-int8 demo``: the whole workflow on a shipped shapes model, ending in ``report.html``.

``--model embedded`` (the default) has 256 tokens; ``--model embedded-long`` has 4,096 (as SDXL's largest
self-attention) and is meant for a GPU: on a CPU its attention, emulated, makes the demo slow.

calibrate (exact attention, recording ranges and per-precision errors) → a schedule derived from the
measured errors → eval (FP16 against each INT8 mode, the schedule and calibrated static ranges, same
seeds). On a machine without a GPU the INT8 modes run the kernel's PyTorch emulation.

On a CPU, unless told otherwise, it generates 8 of the 16 classes in 10 steps (about a minute on two idle cores); on a
GPU all 16 in 20 steps, and the report opens with where INT8 pays on that GPU: attention calls at real models'
shapes (SDXL, SD3.5, Flux, CogVideoX, Wan, HunyuanVideo) and whole denoiser steps (the shipped models, Wan2.1 with
random weights), stock against INT8, each with the speed gate's decision. The shipped models' own attention is too
short for INT8 to pay on a GPU: the demo forces it there to show its quality.

``--out`` receives ``calibration/``, eval's reports and images, and ``prompts.txt`` (the shipped models' example
prompts, for the calibrate and eval commands the demo prints) as one set: an interrupted demo leaves the previous
outputs or none.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from .. import pipelines
from ..calibration import FILE_NAME, Calibration, calibrate, write_outputs
from ..embedded import PROMPTS
from ..embedded.shapes import CLASSES
from ..embedded.variants import NAMES, describe
from ..eval.run import OUTPUTS as EVAL_OUTPUTS, evaluate, write_report
from ..kernels import kernel_info
from ..schedule import PrecisionSchedule
from .calibrate import DEFAULT_BUDGET
from .common import add_run_args, check_model, check_weights, item_kwargs, items_for, load_pipeline, read_items
from .outputs import check_out, command, output_set
from .summaries import print_calibration, print_report
from .usage import UsageError, device_arg, error_budget, path_arg, text_path

OUTPUTS = ("calibration", "prompts.txt") + EVAL_OUTPUTS
DEMO_BUDGET = 0.015
# why the demo departs from calibrate's default budget; shown in --help and when the demo runs
BUDGET_WHY = (f"Tighter than calibrate's default {DEFAULT_BUDGET} on purpose: on the shipped model 'embedded', int8's worst-layer error runs "
              "from 0.023 at the noisiest step down to 0.010, so 0.015 keeps int8_fp16v on the 6 noisiest steps and "
              "step 18 (0.02: on the 4 noisiest only), and the demo results in the README and BENCHMARKS.md were "
              "measured with it.")


CPU_STEPS, CPU_LABELS = 10, 8  # the demo's defaults where the INT8 modes are emulated on the CPU
GPU_STEPS = 20


def sizes(args: argparse.Namespace, cpu: bool) -> tuple[list[str] | None, int]:
    """The class labels (None: every class) and steps the demo runs: as given, else fewer on a CPU (one line says
    so) and ``GPU_STEPS`` on a GPU."""
    steps, labels = args.steps, args.class_labels
    if cpu and (steps is None or labels is None):
        steps = CPU_STEPS if steps is None else steps
        labels = list(CLASSES[:CPU_LABELS]) if labels is None else labels
        print(f"on a CPU (INT8 emulated): {len(labels)} classes, {steps} steps; --class-labels and --steps run more")
    return labels, GPU_STEPS if steps is None else steps


def run(args: argparse.Namespace) -> int:
    import torch

    check_out(args.out, OUTPUTS, args.overwrite)
    check_weights(args.lpips_weights, args.fid_weights)
    check_model(args.model)
    shards = pipelines.Shards(args.device)
    if shards.world > 1:
        raise UsageError("demo runs in one process: run it without accelerate launch (calibrate and eval share their "
                         "prompts among the processes of a launch)")
    labels, steps = sizes(args, shards.device.type == "cpu")
    items = read_items(None, labels, args.model)
    gpu_speed = None
    if shards.device.type == "cuda" and not args.skip_speed:
        from ..eval.speed import measure

        print(f"[0/2] speed on this GPU ({torch.cuda.get_device_name(shards.device)}): attention at real models' "
              f"shapes and whole denoiser steps, stock against INT8 (--skip-speed leaves it out)")
        gpu_speed = measure(shards.device, progress=lambda line: print("  " + line))
    pipe = load_pipeline(args.model, shards.device)
    items = item_kwargs(items_for(args.model, pipe, items))
    run_args = dict(steps=steps, batch_size=args.batch_size, seed=args.seed, model=pipelines.model_id(args.model),
                    shards=shards)
    with output_set(args.out, OUTPUTS, args.overwrite) as tmp:
        budget = f"budget {args.budget}" + (f" (calibrate's default is {DEFAULT_BUDGET}; see demo --help)"
                                            if args.budget == DEMO_BUDGET else "")
        print(f"[1/2] calibrate {type(pipelines.denoiser(pipe)).__name__} on {shards.device}, "
              f"{len(items[next(iter(items))])} images × {steps} steps → {args.out / 'calibration'}, {budget}")
        t0 = time.time()
        cal = calibrate(pipe, **items, **run_args)
        calibrating = time.time() - t0
        schedule = PrecisionSchedule.from_calibration(cal, args.budget)
        summary = write_outputs(cal, schedule, tmp / "calibration", args.budget)
        print_calibration(summary, schedule, args.out / "calibration", calibrating, time.time() - t0 - calibrating)
        backend = kernel_info(shards.device, "int8")["backend"]
        print(f"[2/2] eval → {args.out}: INT8 kernel {backend}"
              + ("" if shards.device.type == "cuda" else " (no GPU: the INT8 modes run the kernel's PyTorch emulation)"))
        # eval reads the files just written, as the eval command would
        written = Calibration.load(tmp / "calibration")
        written.origin["path"] = str((args.out / "calibration" / FILE_NAME).resolve())  # where it is moved to
        report = evaluate(pipe, **items, **run_args, modes=["int8", "int8_fp16v"],
                          schedule=PrecisionSchedule.load(tmp / "calibration" / "schedule.json"),
                          calibration=written, lpips_weights=args.lpips_weights,
                          fid_weights=args.fid_weights,
                          # the demo shows INT8's quality: at the shipped models' 256 and 4,096 tokens of head
                          # dim 64 a GPU's speed gate would send every call to SDPA
                          speed_gate=False)
        if gpu_speed is not None:
            report["gpu_speed"] = gpu_speed
        write_report(report, tmp)
        shutil.copyfile(PROMPTS, tmp / "prompts.txt")
    print_report(report, args.out)
    if gpu_speed is not None:
        print(gpu_speed["headline"])
    print(f"open {args.out / 'report.html'}")
    model = "" if args.model == pipelines.EMBEDDED else f" --model {args.model}"
    print(f"next, the same job by hand: diffusion-int8 calibrate{model} --prompts {args.out / 'prompts.txt'} --out calib/, "
          f"then diffusion-int8 eval{model} --prompts {args.out / 'prompts.txt'} --schedule calib/schedule.json "
          "--no-speed-gate --out report/ (--no-speed-gate runs INT8 on every call, as the demo does; without it eval "
          "measures what enable() gives by default, the speed gate included)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="calibrate → schedule → eval on a shipped shapes model, ending in report.html",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=NAMES, default=pipelines.EMBEDDED,
                   help=f"the shipped model: {describe()} (default: %(default)s)")
    p.add_argument("--out", type=path_arg, default=Path("diffusion-int8-demo"),
                   help="output directory (default ./diffusion-int8-demo)")
    p.add_argument("--class-labels", nargs="+", default=None,
                   help=f"default: one image of each of the 16 classes (on a CPU, of the first {CPU_LABELS})")
    add_run_args(p, batch_size=16, steps=None, steps_default=f"{GPU_STEPS}; on a CPU, {CPU_STEPS}")
    p.add_argument("--budget", type=error_budget, default=DEMO_BUDGET,
                   help=f"error budget of the derived schedule (default: %(default)s). {BUDGET_WHY}")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cuda, cuda:N or cpu (default: the GPU if there is one, else cpu)")
    p.add_argument("--lpips-weights", type=text_path, default=None,
                   help="torchvision AlexNet weights for LPIPS (see eval --help)")
    p.add_argument("--fid-weights", type=text_path, default=None,
                   help="torch-fidelity Inception weights for FID/KID (see eval --help)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs in --out")
    p.add_argument("--skip-speed", action="store_true",
                   help="on a GPU, leave out the report's speed section (attention calls at real models' shapes and "
                        "whole denoiser steps, stock against INT8, with the speed gate's decisions: about a minute)")
    p.set_defaults(func=command(run))
