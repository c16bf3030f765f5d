"""``calibrate()``: run a pipeline in exact attention and record what INT8 would do to it, from Python.

    from diffusion_int8 import PrecisionSchedule, calibrate
    cal = calibrate(pipe, class_labels=["red circle", "blue ring"], steps=20)
    schedule = PrecisionSchedule.from_calibration(cal, budget=0.02)
    cal.save("calib/")

``diffusion-int8 calibrate`` is this function, over a model loaded from ``--model``, followed by writing
the calibration, its schedule and summaries (``write_outputs``) into ``--out`` as one set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from .. import pipelines
from ..plugin.install import enable
from .collect import Collector, merge
from .file import FILE_NAME, MIN_FIT_STEPS, Calibration, warn_few_steps, weights_sample
from .summary import write_all

OUTPUTS = (FILE_NAME, "schedule.json", "summary.md", "summary.json", "ranges.png", "errors.png")


def calibrate(pipe, prompts: Sequence[str] | None = None, *, class_labels: Sequence[int | str] | None = None,
              steps: int = 20, batch_size: int = 8, seed: int = 0, guidance_scale: float | None = None,
              percentile: float = 99.0, sparsity_levels: Sequence[float] = (), refresh_every: Sequence[int] = (),
              model: str | None = None,
              shards: pipelines.Shards | None = None, progress: bool = True) -> Calibration | None:
    """Run ``pipe`` with exact (fp16) attention over the prompts or class labels and record, per attention
    layer, head and denoising step, the ranges of Q, K and V and the error INT8 would cause there.

    Args:
        pipe: a diffusers pipeline (or the shipped one, ``diffusion_int8.embedded.load_pipeline()``), on its
            device; its processors are restored when the function returns.
        prompts: text prompts, one image each; or ``class_labels`` (names or ids) for class-conditional
            pipelines. Neither: one image of each of the pipeline's ``labels`` (the shipped pipeline).
        steps: denoising steps per image.
        batch_size: images per pipeline call.
        seed: image ``i`` is generated with ``torch.Generator().manual_seed(seed + i)``.
        guidance_scale: passed to the pipeline; None keeps the pipeline's default.
        percentile: the percentile of |Q| and |K| recorded beside their maxima, in (0, 100].
        sparsity_levels: block-sparse levels tau in (0, 1) to measure at every attention call: the error of exact
            attention over the block pairs the predictor keeps at tau, against all pairs, and the fraction kept
            (``PrecisionSchedule.from_calibration(..., sparsity_budget=...)`` picks among them).
        refresh_every: refresh intervals (integers >= 2) at which to measure, for each level, the error of carrying
            the skipped blocks across steps instead of dropping them, and the blocks computed per step
            (``from_calibration`` weighs them against dropping). Each (layer, level, interval) keeps two of the
            skipped blocks' outputs while a batch runs, as the carry does at run time.
        model: the model's name recorded in the metadata (default: the pipeline's ``name_or_path``).
        shards: the process's share of the batches under ``accelerate launch`` (``pipelines.Shards``); by
            default one is made for the denoiser's device (a single process outside a launcher).
        progress: show a progress bar, one tick per denoising step of each batch.

    Returns:
        The ``Calibration`` (per layer, float32 tensors ``(H, T)`` over the ``T`` denoiser calls of a generation:
        ``steps``, or twice that where the pipeline runs classifier-free guidance as two calls a step;
        ``(H, D, T)`` for K's mean and V's channel maxima, with quadratic fits against the noise level), on
        the main process; None on the other processes of a launch. Records of several processes are summed
        in batch order, so the result does not depend on how many processes ran.

    Raises:
        ValueError: class labels the pipeline does not know, neither prompts nor labels for a pipeline
            without default labels, sparsity levels outside (0, 1), refresh intervals below 2 or without levels,
            a percentile outside (0, 100], or steps,
            batch size, seed or guidance scale out of range (``pipelines.check_run``); all before any work.
    """
    pipelines.check_run(steps, batch_size, seed, guidance_scale)
    collector = Collector(percentile=percentile, sparsity_levels=sparsity_levels, refresh_every=refresh_every)
    items = pipelines.resolve_items(pipe, prompts, class_labels)
    shards = shards or pipelines.Shards(str(pipelines.denoiser(pipe).device))
    if steps < MIN_FIT_STEPS and shards.is_main:
        warn_few_steps(steps, "a calibration over", 3)
    denoiser = pipelines.denoiser(pipe)
    records = []
    batches = shards.mine(items.batches(batch_size))
    # one tick per denoising step of each batch: with a few large batches a bar of batches would not move
    bar = tqdm(total=len(batches) * steps, desc=f"calibrate[{shards.rank}]", unit="step",
               disable=not progress or (not shards.is_main and shards.world > 1))
    handle = enable(pipe, mode="fp16", observer=collector)
    try:
        for b, batch, idx in batches:
            handle.state.reset()
            pipelines.generate(pipe, items, batch, idx, steps=steps, seed=seed,
                               guidance_scale=guidance_scale, on_step=bar.update)
            records.append(collector.record(b))
    finally:
        bar.close()
        handle.disable()
    records = shards.gather(records)
    if not shards.is_main:
        return None
    timesteps, stats = merge(records)
    import diffusers

    meta = {"model": model if model is not None else pipelines.pipeline_id(pipe), "model_class": type(denoiser).__name__,
            "pipeline_class": type(pipe).__name__, "diffusers_version": diffusers.__version__,
            "scheduler": type(pipe.scheduler).__name__, "scheduler_config": dict(pipe.scheduler.config),
            # what the denoiser's timesteps are out of: 1000 (DDPM, SD3, …) or 1 (Flux passes sigmas),
            # told by the first, highest one; the scheduler's num_train_timesteps can mislead (Flux)
            "timestep_scale": 1000.0 if timesteps[0] > 1.0 else 1.0,
            "prompts_sha256": items.sha256(), "num_items": len(items.values), "items_kind": items.kind,
            "seed": seed, "guidance_scale": guidance_scale, "percentile": percentile,
            "dtype": str(denoiser.dtype), "processes": shards.world}
    sample = weights_sample(denoiser)
    if sample is not None:
        meta["weights_sample"] = sample
    return Calibration.from_stats(meta, timesteps, stats)


def write_outputs(calibration: Calibration, schedule, dest: str | Path, budget: float | None = None, *,
                  overwrite: bool = False) -> dict:
    """Write ``OUTPUTS``: ``calibration.safetensors``, ``schedule.json``, ``summary.md``/``summary.json`` and the
    plots ``ranges.png``/``errors.png``, into the directory ``dest`` (made if missing).

    Args:
        calibration: what ``calibrate`` returned.
        schedule: a ``PrecisionSchedule``, usually ``PrecisionSchedule.from_calibration(calibration, budget)``.
        budget: the error budget drawn on ``errors.png`` (None: no line).
        overwrite: replace outputs already in ``dest``; otherwise they raise ``FileExistsError`` before any
            file is written. (The CLI writes into a fresh directory and moves the whole set into ``--out``.)

    Returns:
        The summary (``summary.json``'s content): per mode the mean and worst errors and the most sensitive
        layers and steps, how the ranges follow sigma, and the schedule's mode per step.
    """
    dest = Path(dest)
    existing = [n for n in OUTPUTS if (dest / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{dest} already holds {', '.join(existing)}; pass overwrite=True to replace them")
    dest.mkdir(parents=True, exist_ok=True)
    calibration.save(dest, overwrite=overwrite)
    schedule.save(dest / "schedule.json", overwrite=overwrite)
    return write_all(calibration, schedule, dest, budget)

