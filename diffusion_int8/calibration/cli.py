"""``diffusion-int8 calibrate``: run a pipeline in exact attention and record what INT8 would do to it.

    diffusion-int8 calibrate --model PATH --prompts prompts.txt --steps 28 --out calib/
    accelerate launch --multi_gpu --num_processes 8 -m diffusion_int8 calibrate ...   # prompts sharded

Writes to ``--out``: ``calibration.safetensors``, ``schedule.json`` (the cheapest mode per step within
``--budget``), ``summary.md``/``summary.json`` and the plots ``ranges.png``/``errors.png``, all at once
(``outputs.output_set``): an interrupted run leaves the previous outputs or none.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from .. import pipelines
from ..outputs import check_out, output_set, shown_out
from ..install import enable
from ..schedule import PrecisionSchedule
from ..usage import UsageError, nonnegative_float, nonnegative_int, percentile, positive_float, positive_int, user_errors
from .collect import Collector, merge
from .file import FILE_NAME, Calibration
from .summary import write_all

DEFAULT_BUDGET = 0.02
OUTPUTS = (FILE_NAME, "schedule.json", "summary.md", "summary.json", "ranges.png", "errors.png")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared with ``eval``."""
    p.add_argument("--model", default=pipelines.EMBEDDED,
                   help=f"local diffusers pipeline directory, or '{pipelines.EMBEDDED}' (the shipped shapes model; default)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", type=Path, help="text file, one prompt per line")
    src.add_argument("--class-labels", nargs="+", help="class names or ids, for class-conditional pipelines")
    p.add_argument("--steps", type=positive_int, default=20, help="denoising steps (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="images per pipeline call (default: %(default)s)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="image i is seeded with seed + i (default: %(default)s)")
    p.add_argument("--guidance-scale", type=nonnegative_float, default=None, help="default: the pipeline's")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: the process's GPU, else cpu)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs in --out")


def read_items(args) -> pipelines.Items | None:
    """``--prompts`` or ``--class-labels``, read before the model loads (None: the pipeline's default)."""
    if args.prompts is None and args.class_labels is None:
        return None
    with user_errors():
        return pipelines.read_items(args.prompts, args.class_labels)


def items_for(args, pipe, items: pipelines.Items | None) -> pipelines.Items:
    """``items``, or the pipeline's default; class labels checked against the pipeline."""
    if items is None:
        if not (hasattr(pipe, "labels") and isinstance(pipe.labels, (list, tuple))):
            raise UsageError(f"{args.model} has no default labels: give --prompts FILE or --class-labels ...")
        items = pipelines.default_items(pipe)
    with user_errors(ValueError):
        pipelines.check_labels(pipe, items)
    return items


def load_pipeline(args, device):
    """``--model`` on ``device``; a directory that is not a pipeline is the user's error."""
    with user_errors(FileNotFoundError):
        return pipelines.load(args.model, device)


def run(args: argparse.Namespace) -> int:
    check_out(args.out, OUTPUTS, args.overwrite)
    items = read_items(args)
    shards = pipelines.Shards(args.device)
    pipe = load_pipeline(args, shards.device)
    items = items_for(args, pipe, items)
    model = pipelines.denoiser(pipe)
    if shards.is_main:
        print(f"calibrating {type(model).__name__} from {args.model} on {shards.device}: {len(items.values)} "
              f"{'prompts' if items.kind == 'prompt' else 'labels'}, {args.steps} steps, {shards.world} process(es)")
    collector = Collector(percentile=args.percentile)
    handle = enable(pipe, mode="fp16", observer=collector)
    records, t0 = [], time.time()
    batches = shards.mine(items.batches(args.batch_size))
    # one tick per denoising step of each batch: with a few large batches a bar of batches would not move
    bar = tqdm(total=len(batches) * args.steps, desc=f"calibrate[{shards.rank}]", unit="step",
               disable=not shards.is_main and shards.world > 1)
    try:
        for b, batch, idx in batches:
            handle.state.reset()
            pipelines.generate(pipe, items, batch, idx, steps=args.steps, seed=args.seed,
                               guidance_scale=args.guidance_scale, on_step=bar.update)
            records.append(collector.record(b))
    finally:
        bar.close()
        handle.disable()
    records = shards.gather(records)
    if shards.is_main:
        timesteps, stats = merge(records)
        import diffusers

        meta = {"model": pipelines.model_id(args.model), "model_class": type(model).__name__,
                "pipeline_class": type(pipe).__name__, "diffusers_version": diffusers.__version__,
                "scheduler": type(pipe.scheduler).__name__, "scheduler_config": dict(pipe.scheduler.config),
                # what the denoiser's timesteps are out of: 1000 (DDPM, SD3, …) or 1 (Flux passes sigmas),
                # told by the first, highest one; the scheduler's num_train_timesteps can mislead (Flux)
                "timestep_scale": 1000.0 if timesteps[0] > 1.0 else 1.0,
                "prompts_sha256": items.sha256(), "num_items": len(items.values), "items_kind": items.kind,
                "seed": args.seed, "guidance_scale": args.guidance_scale, "percentile": args.percentile,
                "dtype": str(model.dtype), "processes": shards.world}
        cal = Calibration.from_stats(meta, timesteps, stats)
        schedule = PrecisionSchedule.from_calibration(cal, args.budget, per_layer=args.per_layer)
        with output_set(args.out, OUTPUTS, args.overwrite) as tmp:
            cal.save(tmp)
            schedule.save(tmp / "schedule.json")
            summary = write_all(cal, schedule, tmp, args.budget)
        out = shown_out(args)
        print(f"wrote {out / FILE_NAME}, {out / 'schedule.json'} and {out / 'summary.md'} in {time.time() - t0:.0f} s")
        for m, e in summary["errors"].items():
            print(f"  {m:11s} rel L1 mean {e['mean_rel_l1']:.4f}, worst {e['max_rel_l1']:.4f} "
                  f"({e['most_sensitive'][0]['layer']} at step {e['most_sensitive'][0]['step']})")
        fit = summary["ranges_vs_sigma"]
        print("  ranges vs sigma, median R² proportional/quadratic: "
              + ", ".join(f"{k} {v['r2_proportional']:.2f}/{v['r2_quadratic']:.2f}" for k, v in fit.items()))
        print(f"  schedule {schedule.name}: {' '.join(summary['schedule']['per_step'])}")
    shards.barrier()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="record per-layer ranges and per-precision errors over the schedule",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--percentile", type=percentile, default=99.0, help="percentile of |Q| and |K| to record (default: %(default)s; their maxima are recorded too, and "
                        "static ranges use the maxima unless Calibration.ranges(clip=\"p99\"))")
    p.add_argument("--budget", type=positive_float, default=DEFAULT_BUDGET,
                   help="largest relative L1 attention error the derived schedule accepts (default: %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="derive the schedule per layer as well as per step")
    p.set_defaults(func=run)

