"""``diffusion-int8 eval``: FP16 and INT8 images with the same seeds, scored and shown side by side.

    diffusion-int8 eval --model PATH --prompts prompts.txt --out report/               # modes int8, int8_fp16v
    diffusion-int8 eval --model PATH --prompts p.txt --schedule calib/schedule.json --calibration calib/ --out r/
    diffusion-int8 eval --model PATH --prompts p.txt --sparsity 0.2 --refresh-every 2 --out r/   # block-sparse
    diffusion-int8 eval --generate-only ... --out imgs/         # images and timings only
    diffusion-int8 eval --score imgs/images/fp16 other/folder --out scores/              # score folders
    accelerate launch --multi_gpu --num_processes 8 -m diffusion_int8 eval ...         # prompts sharded

Writes report.json, report.md, report.html and images/<variant>/*.png to --out, all at once: an
interrupted run leaves the previous reports or none. Existing reports are kept unless --overwrite.
--schedule and --calibration are loaded, and the calibration checked against the model, before any image
is made. Images with NaN or Inf values are flagged in the reports and left out of the quality metrics.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from .. import pipelines
from ..calibration import FILE_NAME, Calibration
from ..eval import report as R
from ..eval.run import DEFAULT_MODES, OUTPUTS, check_modes, evaluate, write_report, write_report_files
from ..eval.score import Scorer, image_names, load_folder
from ..kernels import Mode, kernel_info
from ..schedule import PRESETS, PrecisionSchedule
from .common import WEIGHTS, add_model_args, check_model, check_weights, item_kwargs, items_for, load_pipeline, read_items
from .outputs import check_out, command, output_set
from .summaries import print_report
from .usage import UsageError, at_least_two, check_readable, sparsity_level, text_path, user_errors


def load_inputs(schedule: str | None, calibration: str | None) -> tuple[PrecisionSchedule | None, Calibration | None]:
    """``--schedule`` and ``--calibration``, loaded (so checked) before the model loads or any image is made."""
    if schedule and schedule not in PRESETS:
        check_readable(schedule)
    if calibration:
        check_readable(Path(calibration) / FILE_NAME if Path(calibration).is_dir() else calibration)
    with user_errors():
        schedule = PrecisionSchedule.load(schedule) if schedule else None
        calibration = Calibration.load(calibration) if calibration else None
    return schedule, calibration


def eval_command(out: Path, *, model: str = pipelines.EMBEDDED, prompts: Path | None = None,
                 class_labels: list[str] | None = None, steps: int = 20, batch_size: int = 8, seed: int = 0,
                 guidance_scale: float | None = None, device: str | None = None, overwrite: bool = False,
                 modes: Sequence[str] = DEFAULT_MODES, schedule: str | None = None, calibration: str | None = None,
                 sparsity: float | None = None, refresh_every: int | None = None, generate_only: bool = False,
                 no_speed_gate: bool = False, lpips_weights: str | None = None, fid_weights: str | None = None) -> int:
    """The command (without ``--score``) with its arguments as keywords. Returns the exit status."""
    check_out(out, OUTPUTS, overwrite)
    items = read_items(prompts, class_labels, model)
    schedule, calibration = load_inputs(schedule, calibration)
    if refresh_every is not None and sparsity is None:
        raise UsageError("--refresh-every carries the blocks --sparsity skips: give --sparsity TAU too")
    with user_errors(ValueError):
        modes = check_modes(modes)
    if not (modes or schedule or calibration or sparsity is not None):
        int8_modes = ", ".join(m.value for m in Mode if m is not Mode.FP16)
        raise UsageError(f"nothing to compare with fp16: give --modes ({int8_modes}), --schedule, --calibration or "
                         f"--sparsity")
    check_weights(lpips_weights, fid_weights)
    check_model(model)
    shards = pipelines.Shards(device)
    if shards.is_main:
        print(f"eval on {shards.device}: INT8 kernel {kernel_info(shards.device, 'int8')['backend']}"
              + ("" if shards.device.type == "cuda" else " (no GPU: the INT8 modes run the kernel's PyTorch emulation)"))
    pipe = load_pipeline(model, shards.device)
    items = items_for(model, pipe, items)
    if calibration is not None:
        with user_errors(ValueError):
            calibration.validate(pipelines.denoiser(pipe))
    report = evaluate(pipe, **item_kwargs(items), modes=modes, schedule=schedule, calibration=calibration,
                      sparsity=sparsity, refresh_every=refresh_every, steps=steps, batch_size=batch_size, seed=seed,
                      guidance_scale=guidance_scale,
                      speed_gate=not no_speed_gate, generate_only=generate_only, lpips_weights=lpips_weights,
                      fid_weights=fid_weights, model=pipelines.model_id(model), shards=shards)
    if report is None:  # another process of a launch: the main one writes
        shards.barrier()
        return 0
    with output_set(out, OUTPUTS, overwrite) as tmp:
        write_report(report, tmp)
    if generate_only:
        print(f"wrote {len(report['images'])} image sets under {out / 'images'} and {out / 'report.json'} (timings only)")
        if report["timing"]["note"]:
            print(f"  {report['timing']['note']}")
    else:
        print_report(report, out)
    shards.barrier()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.score:
        return score_folders(args)
    return eval_command(args.out, model=args.model, prompts=args.prompts, class_labels=args.class_labels,
                        steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                        guidance_scale=args.guidance_scale, device=args.device, overwrite=args.overwrite,
                        modes=args.modes, schedule=args.schedule, calibration=args.calibration,
                        sparsity=args.sparsity, refresh_every=args.refresh_every, generate_only=args.generate_only,
                        no_speed_gate=args.no_speed_gate,
                        lpips_weights=args.lpips_weights, fid_weights=args.fid_weights)


def _check_same_names(c: Path, cnames: list[str], ref_dir: Path, names: list[str]) -> None:
    if cnames != names:
        only_c, only_ref = sorted(set(cnames) - set(names)), sorted(set(names) - set(cnames))
        differ = "; ".join(f"only in {where}: {', '.join(n[:3])}{f' and {len(n) - 3} more' if len(n) > 3 else ''}"
                           for where, n in ((c, only_c), (ref_dir, only_ref)) if n)
        raise UsageError(f"{c} ({R.counted(len(cnames), 'image')}) and {ref_dir} ({len(names)}) hold different "
                         f"file names ({differ}); they are matched by name")


def score_folders(args) -> int:
    """``--score REF CAND...``: metrics of image folders made elsewhere, matched by file name."""
    check_out(args.out, R.REPORT_FILES, args.overwrite)
    ref_dir, *cands = [Path(p) for p in args.score]
    if not cands:
        raise UsageError("--score needs a reference folder and at least one folder to score")
    check_weights(args.lpips_weights, args.fid_weights)
    with user_errors():  # names first: a folder of other files is told as such, not by its images' sizes
        names = image_names(ref_dir)
        for c in cands:
            _check_same_names(c, image_names(c), ref_dir, names)
        names, ref = load_folder(ref_dir)
        folders = [(c, *load_folder(c)) for c in cands]
    for c, _, imgs in folders:
        if imgs.shape[1:] != ref.shape[1:]:
            raise UsageError(f"{c} holds {imgs.shape[3]}×{imgs.shape[2]} images and {ref_dir} {ref.shape[3]}×"
                             f"{ref.shape[2]}; they are compared pixel by pixel, so their sizes must match")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scorer = Scorer(args.lpips_weights, args.fid_weights, device)
    ref_name = Path(os.path.abspath(ref_dir)).name or str(ref_dir)  # ".": the folder's own name (links kept)
    images = {ref_name: ref}
    report = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": f"folders ({ref_dir})",
              "device": str(device), "kernel": "n/a (scoring only)", "timing": R.NO_TIMINGS, "steps": None, "seed": None,
              "num_images": len(names),
              "items": names, "baseline": {"name": ref_name, "speed": {}}, "variants": {},
              "metrics_available": scorer.availability(), "image_dirs": {ref_name: str(ref_dir)}}
    for c, _, imgs in folders:
        key = Path(os.path.abspath(c)).name or str(c)
        key = key if key not in images else str(c)
        images[key] = imgs
        report["variants"][key] = {"speed": {}, "quality": scorer.score(imgs, ref)}
        report["image_dirs"][key] = str(c)
    with output_set(args.out, R.REPORT_FILES, args.overwrite) as tmp:
        write_report_files(report, images, names, tmp)
    print_report(report, args.out)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="generate FP16 and INT8 images with the same seeds; report quality and speed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--modes", nargs="*", default=list(DEFAULT_MODES), choices=[m.value for m in Mode if m is not Mode.FP16],
                   help="constant-precision variants to compare with fp16 (default: int8 int8_fp16v)")
    p.add_argument("--schedule", type=text_path,
                   help="also a scheduled variant: a preset (balanced, …) or a schedule.json")
    p.add_argument("--calibration", type=text_path,
                   help="also a variant with static ranges from this calibration (file or directory)")
    p.add_argument("--sparsity", type=sparsity_level, metavar="TAU",
                   help="also an int8 variant at this block-sparsity level in (0, 1): the attention mass kept per "
                        "query block (docs/GUIDE.md, 'Block-sparse attention')")
    p.add_argument("--refresh-every", type=at_least_two, metavar="K",
                   help="with --sparsity: carry the skipped blocks, computing them every K-th step and forecasting "
                        "them in between, instead of dropping them")
    p.add_argument("--generate-only", action="store_true", help="write images and timings, skip the metrics")
    p.add_argument("--no-speed-gate", action="store_true",
                   help="run INT8 for every attention call the variant's mode covers, also where the speed gate would "
                        "send it to SDPA (on a GPU, by default INT8 runs only for shapes where it is faster)")
    p.add_argument("--score", nargs="+", type=text_path, metavar="FOLDER",
                   help="score image folders instead: REFERENCE then candidates")
    p.add_argument("--lpips-weights", type=text_path, help=f"{WEIGHTS['--lpips-weights']} for LPIPS")
    p.add_argument("--fid-weights", type=text_path, help=f"{WEIGHTS['--fid-weights']} for FID/KID")
    p.set_defaults(func=command(run))
