"""``diffusion-int8 eval``: FP16 and INT8 images with the same seeds, scored and shown side by side.

    diffusion-int8 eval --model PATH --prompts prompts.txt --out report/               # modes int8, int8_fp16v
    diffusion-int8 eval --model PATH --prompts p.txt --schedule calib/schedule.json --calibration calib/ --out r/
    diffusion-int8 eval --generate-only ... --out imgs/         # images and timings only
    diffusion-int8 eval --score imgs/images/fp16 other/folder --out scores/              # score folders
    accelerate launch --multi_gpu --num_processes 8 -m diffusion_int8 eval ...         # prompts sharded

Writes ``report.json``, ``report.md``, ``report.html`` and ``images/<variant>/*.png`` to ``--out``, all at
once (``outputs.output_set``); existing reports are kept unless ``--overwrite``. ``--schedule`` and
``--calibration`` are loaded, and the calibration checked against the model, before any image is made.
Images with NaN or Inf values are flagged in the reports and left out of the quality metrics.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import pipelines
from ..calibration import Calibration
from ..calibration.cli import add_model_args, items_for, load_pipeline, read_items
from ..kernels import Mode, kernel_info
from ..outputs import check_out, output_set, shown_out
from ..install import enable
from ..schedule import PrecisionSchedule
from ..usage import UsageError, user_errors
from . import report as R
from .score import Scorer, load_folder, save_images

BASELINE = "fp16"
OUTPUTS = R.REPORT_FILES + ("images",)


class StepTimer:
    """Times every denoiser forward (CUDA events on GPUs, the host clock elsewhere)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending, self.ms = [], []
        self._pre = model.register_forward_pre_hook(self._start)
        self._post = model.register_forward_hook(self._stop)

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _start(self, *_):
        self.pending.append([self._now(), None])

    def _stop(self, *_):
        self.pending[-1][1] = self._now()

    def collect(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.ms += [a.elapsed_time(b) for a, b in self.pending]
        else:
            self.ms += [(b - a) * 1e3 for a, b in self.pending]
        self.pending = []

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()


def load_inputs(args) -> tuple[PrecisionSchedule | None, Calibration | None]:
    """``--schedule`` and ``--calibration``, loaded (so checked) before the model loads or any image is made."""
    with user_errors():
        schedule = PrecisionSchedule.load(args.schedule) if args.schedule else None
        calibration = Calibration.load(args.calibration) if args.calibration else None
    return schedule, calibration


def variants(args, schedule: PrecisionSchedule | None = None, calibration: Calibration | None = None) -> dict[str, dict]:
    """``{name: enable() kwargs}`` in report order; the baseline (stock pipeline) is not listed."""
    out = {m: {"mode": m} for m in args.modes}
    if schedule is not None:
        out[f"schedule:{schedule.name}"] = {"schedule": schedule}
    if calibration is not None:
        base_name, base = list(out.items())[-1] if out else ("int8", {"mode": "int8"})
        out[f"{base_name}+static-ranges"] = {**base, "calibration": calibration}
    return out


def run_variant(pipe, model, items, batches, args, device, kwargs: dict | None, on_step=None):
    """Images (by index) and speed of one variant; ``kwargs`` None runs the stock pipeline.

    ``on_step(n)`` hears of every timed denoising step (the warm-up run is not counted)."""
    handle = enable(pipe, record=True, speed_gate=not args.no_speed_gate, **kwargs) if kwargs is not None else None
    timer = StepTimer(model, device)
    images, seconds, n_images, int8_calls, gated_calls = {}, 0.0, 0, 0, 0
    try:
        if batches:  # warm-up (Triton compilation, allocator), not timed
            b, batch, idx = batches[0]
            pipelines.generate(pipe, items, batch[:1], idx[:1], steps=2, seed=args.seed, guidance_scale=args.guidance_scale)
            timer.pending = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        per_step = []
        for b, batch, idx in batches:
            if handle is not None:
                handle.state.reset()
            t0 = time.perf_counter()
            imgs = pipelines.generate(pipe, items, batch, idx, steps=args.steps, seed=args.seed,
                                      guidance_scale=args.guidance_scale, on_step=on_step)
            seconds += time.perf_counter() - t0
            if handle is not None:
                int8_calls, gated_calls = int8_calls + handle.state.int8_calls, gated_calls + handle.state.gated_calls
            n_images += len(idx)
            images.update(zip(idx, imgs))
            if handle is not None and handle.state.trace and not per_step:
                per_step = _modes_per_step(handle.state.trace)
        timer.collect()
    finally:
        timer.remove()
        if handle is not None:
            handle.disable()
    speed = {"denoiser_ms_per_step": statistics.median(timer.ms) if timer.ms else None,
             "denoiser_calls": len(timer.ms), "seconds_per_image": seconds / max(n_images, 1),
             "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
             "int8_calls": int8_calls if handle is not None else None,
             "gated_calls": gated_calls if handle is not None else None}
    return images, speed, per_step


def _modes_per_step(trace) -> list[str]:
    """The most common mode of each denoiser call in a processor trace."""
    by_step: dict[int, list[str]] = {}
    for step, _, _, mode in trace:
        by_step.setdefault(step, []).append(mode)
    return [max(set(m), key=m.count) for _, m in sorted(by_step.items())]


def generate_all(args, shards, pipe, items, plan: dict) -> tuple[dict, dict, dict, dict]:
    """Every variant's images (uint8, by index), speed, modes per step and the indices of non-finite images."""
    model = pipelines.denoiser(pipe)
    batches = shards.mine(items.batches(args.batch_size))
    results, speeds, per_step, nonfinite = {}, {}, {}, {}
    todo = {BASELINE: None, **plan}
    # one tick per denoising step of every batch of every variant
    bar = tqdm(total=len(todo) * len(batches) * args.steps, desc="generate", unit="step", disable=not shards.is_main)
    try:
        for name, kwargs in todo.items():
            bar.set_postfix_str(name)
            imgs, speeds[name], per_step[name] = run_variant(pipe, model, items, batches, args, shards.device, kwargs,
                                                             on_step=bar.update)
            # flagged before the uint8 conversion, which would turn NaN into an ordinary (black) pixel
            nonfinite[name] = sorted(i for i, t in imgs.items() if not torch.isfinite(t).all())
            results[name] = {i: _to_uint8(t) for i, t in imgs.items()}
    finally:
        bar.close()
    return results, speeds, per_step, nonfinite


def _to_uint8(img: torch.Tensor) -> torch.Tensor:
    """[0, 1] floats as uint8; NaN as 0, ±Inf as the ends of the range (flagged separately)."""
    return (torch.nan_to_num(img, nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1) * 255).round().to(torch.uint8)


def run(args: argparse.Namespace) -> int:
    if args.score:
        return score_folders(args)
    check_out(args.out, OUTPUTS, args.overwrite)
    items = read_items(args)
    schedule, calibration = load_inputs(args)
    shards = pipelines.Shards(args.device)
    if shards.is_main:
        print(f"eval on {shards.device}: INT8 kernel {kernel_info(shards.device, 'int8')['backend']}"
              + ("" if shards.device.type == "cuda" else " (no GPU: the INT8 modes run the kernel's PyTorch emulation)"))
    pipe = load_pipeline(args, shards.device)
    items = items_for(args, pipe, items)
    if calibration is not None:
        with user_errors(ValueError):
            calibration.validate(pipelines.denoiser(pipe))
    results, speeds, per_step, nonfinite = generate_all(args, shards, pipe, items, variants(args, schedule, calibration))
    gathered = shards.gather([(results, speeds, nonfinite)])
    if not shards.is_main:
        shards.barrier()
        return 0
    images: dict[str, torch.Tensor] = {}
    for name in results:
        merged = {}
        for res, _, _ in gathered:
            merged.update(res[name])
        images[name] = torch.stack([merged[i] for i in sorted(merged)]).float() / 255
    speed = {name: _merge_speed([s[name] for _, s, _ in gathered]) for name in results}
    bad = {name: sorted({i for _, _, nf in gathered for i in nf[name]}) for name in results}
    _warn_nonfinite(bad)
    report = _report_head(args, items, shards.device)
    report["baseline"] = {"name": BASELINE, "speed": speed[BASELINE], "non_finite_images": bad[BASELINE]}
    report["variants"] = {n: {"speed": speed[n], "non_finite_images": bad[n]} for n in images if n != BASELINE}
    report["image_dirs"] = {n: f"images/{_dirname(n)}" for n in images}
    sched_name = next((n for n in images if n.startswith("schedule:")), None)
    if sched_name:
        report["schedule"] = {"name": sched_name.split(":", 1)[1], "per_step": per_step[sched_name],
                              "errors": _calibrated_errors(calibration, len(per_step[sched_name]))}
    if args.generate_only:
        report["metrics_available"] = {}
    else:
        scorer = Scorer(args.lpips_weights, args.fid_weights, shards.device)
        report["metrics_available"] = scorer.availability()
        for name in report["variants"]:
            # an image is compared only where both it and its reference are finite
            exclude = sorted(set(bad[name]) | set(bad[BASELINE]))
            report["variants"][name]["quality"] = scorer.score(images[name], images[BASELINE], exclude=exclude)
    with output_set(args.out, OUTPUTS, args.overwrite) as tmp:
        for name, imgs in images.items():
            save_images(imgs, tmp / "images" / _dirname(name), list(range(len(imgs))))
        if args.generate_only:
            R.write_json(report, tmp)
        else:
            _write_reports(report, images, items.values, tmp)
    if args.generate_only:
        out = shown_out(args)
        print(f"wrote {len(images)} image sets under {out / 'images'} and {out / 'report.json'} (timings only)")
        if report["timing"]["note"]:
            print(f"  {report['timing']['note']}")
    else:
        _print_summary(report, shown_out(args))
    shards.barrier()
    return 0


def _warn_nonfinite(bad: dict[str, list[int]]) -> None:
    """One terminal warning for every image with NaN/Inf values, by variant."""
    flagged = {n: idx for n, idx in bad.items() if idx}
    if flagged:
        print("warning: images with NaN/Inf values: " + "; ".join(f"{n} #{', #'.join(map(str, idx))}" for n, idx in flagged.items())
              + ". They are flagged in the report and left out of the quality metrics.", file=sys.stderr)


def _merge_speed(parts: list[dict]) -> dict:
    ms = [p["denoiser_ms_per_step"] for p in parts if p["denoiser_ms_per_step"] is not None]
    mem = [p["peak_memory_mib"] for p in parts if p["peak_memory_mib"] is not None]
    return {"denoiser_ms_per_step": statistics.median(ms) if ms else None,
            "denoiser_calls": sum(p["denoiser_calls"] for p in parts),
            "seconds_per_image": statistics.mean(p["seconds_per_image"] for p in parts),
            "peak_memory_mib": max(mem) if mem else None, "processes": len(parts),
            "int8_calls": None if parts[0].get("int8_calls") is None else sum(p["int8_calls"] for p in parts),
            "gated_calls": None if parts[0].get("gated_calls") is None else sum(p["gated_calls"] for p in parts)}


def _dirname(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_+." else "_" for c in name)


def _calibrated_errors(calibration: Calibration | None, steps: int) -> dict | None:
    if calibration is None or len(calibration.noise) != steps:
        return None  # none, or calibrated at another step count: the per-step errors do not line up
    return {m: [float(x) for x in calibration.error(m).amax(0)] for m in calibration.modes()}


def _report_head(args, items, device) -> dict:
    kernel = kernel_info(device, Mode.INT8)["backend"]
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": pipelines.model_id(args.model),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "kernel": kernel, "timing": R.timing(device.type, kernel), "steps": args.steps, "seed": args.seed,
            "num_images": len(items.values), "items": items.values}


def _write_reports(report: dict, images: dict, labels: list, dest: Path) -> None:
    R.write_json(report, dest)
    R.write_markdown(report, dest)
    R.write_html(report, images, labels, dest)


def _print_summary(report: dict, out: Path) -> None:
    print("wrote " + ", ".join(str(out / f) for f in R.REPORT_FILES))
    timing = R._timing(report)
    if timing["note"]:
        print(f"  {timing['note']}")
    for name, v in report["variants"].items():
        agg = v["quality"]["aggregate"]
        ms, base = v["speed"].get("denoiser_ms_per_step"), report["baseline"]["speed"].get("denoiser_ms_per_step")
        ratio = R.vs_stock(base, ms) if timing["speed"] else None
        excluded = agg["psnr"].get("excluded", 0)
        print(f"  {name:28s} PSNR {R._fmt(agg['psnr']['mean'], 2)} dB (min {R._fmt(agg['psnr']['min'], 2)}), "
              f"SSIM {R._fmt(agg['ssim']['mean'], 4)}" + (f", denoiser step {ms:.2f} ms: {ratio}" if ratio else "")
              + (f"; {excluded} non-finite image(s) left out" if excluded else ""))
    for k, v in report["metrics_available"].items():
        if not v["available"]:
            print(f"  {k}: unavailable: {v['reason']}")


def score_folders(args) -> int:
    """``--score REF CAND...``: metrics of image folders made elsewhere, matched by file name."""
    check_out(args.out, R.REPORT_FILES, args.overwrite)
    ref_dir, *cands = [Path(p) for p in args.score]
    if not cands:
        raise UsageError("--score needs a reference folder and at least one folder to score")
    with user_errors():
        names, ref = load_folder(ref_dir)
        folders = [(c, *load_folder(c)) for c in cands]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scorer = Scorer(args.lpips_weights, args.fid_weights, device)
    images = {ref_dir.name or str(ref_dir): ref}
    report = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": f"folders ({ref_dir})",
              "device": str(device), "kernel": "n/a (scoring only)", "timing": R.NO_TIMINGS, "steps": "?", "seed": "?", "num_images": len(names),
              "items": names, "baseline": {"name": ref_dir.name, "speed": {}}, "variants": {},
              "metrics_available": scorer.availability(), "image_dirs": {ref_dir.name: str(ref_dir)}}
    for c, cnames, imgs in folders:
        if cnames != names:
            raise UsageError(f"{c} and {ref_dir} hold different file names; they are matched by name")
        key = c.name if c.name not in images else str(c)
        images[key] = imgs
        report["variants"][key] = {"speed": {}, "quality": scorer.score(imgs, ref)}
        report["image_dirs"][key] = str(c)
    with output_set(args.out, R.REPORT_FILES, args.overwrite) as tmp:
        _write_reports(report, images, names, tmp)
    _print_summary(report, args.out)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="generate FP16 and INT8 images with the same seeds; report quality and speed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--modes", nargs="*", default=["int8", "int8_fp16v"], choices=[m.value for m in Mode if m is not Mode.FP16],
                   help="constant-precision variants to compare with fp16 (default: int8 int8_fp16v)")
    p.add_argument("--schedule", help="also a scheduled variant: a preset (balanced, …) or a schedule.json")
    p.add_argument("--calibration", help="also a variant with static ranges from this calibration (file or directory)")
    p.add_argument("--generate-only", action="store_true", help="write images and timings, skip the metrics")
    p.add_argument("--no-speed-gate", action="store_true",
                   help="run INT8 for every attention call the variant's mode covers, also where the speed gate would "
                        "send it to SDPA (on a GPU, by default INT8 runs only for shapes where it is faster)")
    p.add_argument("--score", nargs="+", metavar="FOLDER", help="score image folders instead: REFERENCE then candidates")
    p.add_argument("--lpips-weights", help="torchvision AlexNet weights (alexnet-owt-7be5be79.pth) for LPIPS")
    p.add_argument("--fid-weights", help="torch-fidelity Inception weights (weights-inception-2015-12-05-6726825d.pth) for FID/KID")
    p.set_defaults(func=run)
