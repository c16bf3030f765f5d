"""``diffusion-int8 calibrate``: run a pipeline in exact attention and record what INT8 would do to it.

    diffusion-int8 calibrate --model PATH --prompts prompts.txt --steps 28 --out calib/
    diffusion-int8 calibrate ... --sparsity-levels 0.99,0.97,0.95,0.9,0.8 --out calib/    # block-sparse too
    accelerate launch --multi_gpu --num_processes 8 -m diffusion_int8 calibrate ...   # prompts sharded

Writes to ``--out``: ``calibration.safetensors``, ``schedule.json`` (the cheapest mode per step within
``--budget`` and, with ``--sparsity-levels``, the sparsest level within ``--sparsity-budget``),
``summary.md``/``summary.json`` and the plots ``ranges.png``/``errors.png``, all at once: an interrupted run
leaves the previous outputs or none.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from .. import pipelines
from ..calibration import calibrate, write_outputs
from ..calibration.run import OUTPUTS
from ..schedule import (BUDGET as DEFAULT_BUDGET, CARRY_BUDGET, MIN_CARRY_STEPS,
                        SPARSITY_BUDGET as DEFAULT_SPARSITY_BUDGET, PrecisionSchedule)
from .common import add_model_args, check_model, item_kwargs, items_for, load_pipeline, read_items
from .outputs import check_out, command, output_set
from .summaries import print_calibration
from .usage import (UsageError, error_budget, percentile as percentile_arg, refresh_intervals,
                    sparsity_levels as levels_arg)


def calibrate_command(out: Path, *, model: str = pipelines.EMBEDDED, prompts: Path | None = None,
                      class_labels: list[str] | None = None, steps: int = 20, batch_size: int = 8, seed: int = 0,
                      guidance_scale: float | None = None, device: str | None = None, overwrite: bool = False,
                      percentile: float = 99.0, budget: float = DEFAULT_BUDGET, per_layer: bool = False,
                      sparsity_levels: list[float] | None = None, sparsity_budget: float | None = None,
                      refresh_every: list[int] | None = None, carry_budget: float | None = None) -> int:
    """The command with its arguments as keywords. Returns the exit status."""
    if refresh_every and not sparsity_levels:
        raise UsageError("--refresh-every carries the blocks a sparsity level skips: give --sparsity-levels too")
    if sparsity_budget is not None and not sparsity_levels:
        raise UsageError("--sparsity-budget needs --sparsity-levels: the levels to measure and choose from")
    if carry_budget is not None and (isinstance(carry_budget, bool) or not isinstance(carry_budget, (int, float))
                                     or not carry_budget > 0):
        raise UsageError(f"--carry-budget must be a number > 0, got {carry_budget!r}")
    if carry_budget is not None and not refresh_every:
        raise UsageError("--carry-budget bounds the carried settings --refresh-every measures: give --refresh-every "
                         "(and --sparsity-levels) too")
    if sparsity_levels and sparsity_budget is None:
        sparsity_budget = DEFAULT_SPARSITY_BUDGET
    check_out(out, OUTPUTS, overwrite)
    items = read_items(prompts, class_labels, model)
    check_model(model)
    shards = pipelines.Shards(device)
    pipe = load_pipeline(model, shards.device)
    items = items_for(model, pipe, items)
    if shards.is_main:
        print(f"calibrating {type(pipelines.denoiser(pipe)).__name__} from {model} on {shards.device}: {len(items.values)} "
              f"{'prompts' if items.kind == 'prompt' else 'labels'}, {steps} steps, {shards.world} process(es)")
        if refresh_every and steps < MIN_CARRY_STEPS:
            print(f"note: the carried settings are measured, but at {steps} steps the schedule will not carry them "
                  f"(it does from {MIN_CARRY_STEPS} steps: at fewer the carry budget does not hold image quality)")
    t0 = time.time()
    cal = calibrate(pipe, **item_kwargs(items), steps=steps, batch_size=batch_size, seed=seed,
                    guidance_scale=guidance_scale, percentile=percentile, sparsity_levels=sparsity_levels or (),
                    refresh_every=refresh_every or (),
                    model=pipelines.model_id(model), shards=shards)
    calibrating = time.time() - t0
    if shards.is_main:
        carry_budget = CARRY_BUDGET if carry_budget is None else carry_budget
        with warnings.catch_warnings():  # the note above said it
            warnings.filterwarnings("ignore", message=".*a schedule carries skipped blocks only from")
            schedule = PrecisionSchedule.from_calibration(cal, budget, per_layer=per_layer,
                                                          sparsity_budget=sparsity_budget, carry_budget=carry_budget)
        with output_set(out, OUTPUTS, overwrite) as tmp:
            summary = write_outputs(cal, schedule, tmp, budget)
        print_calibration(summary, schedule, out, calibrating, time.time() - t0 - calibrating, carry_budget)
    shards.barrier()
    return 0


def run(args: argparse.Namespace) -> int:
    return calibrate_command(args.out, model=args.model, prompts=args.prompts, class_labels=args.class_labels,
                             steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                             guidance_scale=args.guidance_scale, device=args.device, overwrite=args.overwrite,
                             percentile=args.percentile, budget=args.budget, per_layer=args.per_layer,
                             sparsity_levels=args.sparsity_levels, sparsity_budget=args.sparsity_budget,
                             refresh_every=args.refresh_every, carry_budget=args.carry_budget)


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="record per-layer ranges and per-precision errors over the schedule",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--percentile", type=percentile_arg, default=99.0, help="percentile of |Q| and |K| to record (default: %(default)s; their maxima are recorded too, and "
                        "static ranges use the maxima unless Calibration.ranges(clip=\"p99\"))")
    p.add_argument("--budget", type=error_budget, default=DEFAULT_BUDGET,
                   help="largest relative L1 attention error the derived schedule accepts (default: %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="derive the schedule per layer as well as per step")
    p.add_argument("--sparsity-levels", type=levels_arg, default=None, metavar="TAU,...",
                   help="block-sparse levels to measure, comma-separated in (0, 1), e.g. 0.99,0.97,0.95,0.9,0.8: the "
                        "attention mass the predictor keeps per query block; the schedule takes the sparsest within "
                        "--sparsity-budget per step (and layer)")
    p.add_argument("--refresh-every", type=refresh_intervals, default=None, metavar="K,...",
                   help="with --sparsity-levels: also measure carrying each level's skipped blocks, computed every K-th "
                        "step and forecast in between, e.g. 3,4,5; the schedule carries one level at one interval "
                        "where a setting within --carry-budget computes fewer blocks than dropping the levels within "
                        "--sparsity-budget")
    p.add_argument("--carry-budget", type=error_budget, default=None,
                   help="largest relative L1 attention error of a carried setting, averaged along the trajectory "
                        f"over the layers and the steps, each step weighted by the noise it removes; with "
                        f"--refresh-every (default: {CARRY_BUDGET}, about the 30 dB line against FP16 on the long "
                        f"shipped model at 20 and 50 steps; below {MIN_CARRY_STEPS} steps nothing is carried)")
    p.add_argument("--sparsity-budget", type=error_budget, default=None,
                   help="largest relative L1 attention error block sparsity may add, on top of --budget's "
                        f"(default with --sparsity-levels: {DEFAULT_SPARSITY_BUDGET})")
    p.set_defaults(func=command(run))
