"""``diffusion-int8 eval``: FP16 and INT8 images with the same seeds, scored and shown side by side.

    diffusion-int8 eval --model PATH --prompts prompts.txt --out report/               # modes int8, int8_fp16v
    diffusion-int8 eval --model PATH --prompts p.txt --schedule calib/schedule.json --calibration calib/ --out r/
    diffusion-int8 eval --generate-only ... --out imgs/         # images and timings only
    diffusion-int8 eval --score imgs/images/fp16 other/folder --out scores/              # score folders
    accelerate launch --multi_gpu --num_processes 8 -m diffusion_int8 eval ...         # prompts sharded

Writes ``report.json``, ``report.md``, ``report.html`` and ``images/<variant>/*.png`` to ``--out``;
existing reports are kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import pipelines
from ..calibration.cli import add_model_args, check_out, items_for
from ..kernels import Mode, kernel_info
from ..processor import enable
from ..schedule import PrecisionSchedule
from . import report as R
from .score import Scorer, load_folder, save_images

BASELINE = "fp16"


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


def variants(args) -> dict[str, dict]:
    """``{name: enable() kwargs}`` in report order; the baseline (stock pipeline) is not listed."""
    out = {m: {"mode": m} for m in args.modes}
    if args.schedule:
        sched = PrecisionSchedule.load(args.schedule)
        out[f"schedule:{sched.name}"] = {"schedule": sched}
    if args.calibration:
        base_name, base = list(out.items())[-1] if out else ("int8", {"mode": "int8"})
        out[f"{base_name}+static-ranges"] = {**base, "calibration": args.calibration}
    return out


def run_variant(pipe, model, items, batches, args, device, kwargs: dict | None):
    """Images (by index) and speed of one variant; ``kwargs`` None runs the stock pipeline."""
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
                                      guidance_scale=args.guidance_scale)
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


def generate_all(args, shards) -> tuple[dict, dict, dict, list, object]:
    pipe = pipelines.load(args.model, shards.device)
    items = items_for(args, pipe)
    model = pipelines.denoiser(pipe)
    batches = shards.mine(items.batches(args.batch_size))
    plan = {BASELINE: None, **variants(args)}
    results, speeds, per_step = {}, {}, {}
    for name, kwargs in tqdm(plan.items(), desc="variants", disable=not shards.is_main):
        imgs, speeds[name], per_step[name] = run_variant(pipe, model, items, batches, args, shards.device, kwargs)
        results[name] = {i: (t * 255).round().to(torch.uint8) for i, t in imgs.items()}
    return results, speeds, per_step, items, pipe


def run(args: argparse.Namespace) -> int:
    if args.score:
        return score_folders(args)
    check_out(args.out, R.REPORT_FILES + ("images",), args.overwrite)
    shards = pipelines.Shards(args.device)
    if shards.is_main:
        print(f"eval on {shards.device}: INT8 kernel {kernel_info(shards.device, 'int8')['backend']}"
              + ("" if shards.device.type == "cuda" else " (no GPU: the INT8 modes run the kernel's PyTorch emulation)"))
    results, speeds, per_step, items, pipe = generate_all(args, shards)
    gathered = shards.gather([(results, speeds)])
    if not shards.is_main:
        shards.barrier()
        return 0
    images: dict[str, torch.Tensor] = {}
    for name in results:
        merged = {}
        for res, _ in gathered:
            merged.update(res[name])
        images[name] = torch.stack([merged[i] for i in sorted(merged)]).float() / 255
    speed = {name: _merge_speed([s[name] for _, s in gathered]) for name in results}
    out = args.out
    for name, imgs in images.items():
        save_images(imgs, out / "images" / _dirname(name), list(range(len(imgs))))
    report = _report_head(args, items, shards.device)
    report["baseline"] = {"name": BASELINE, "speed": speed[BASELINE]}
    report["variants"] = {n: {"speed": speed[n]} for n in images if n != BASELINE}
    report["image_dirs"] = {n: f"images/{_dirname(n)}" for n in images}
    sched_name = next((n for n in images if n.startswith("schedule:")), None)
    if sched_name:
        report["schedule"] = {"name": sched_name.split(":", 1)[1], "per_step": per_step[sched_name],
                              "errors": _calibrated_errors(args, len(per_step[sched_name]))}
    if args.generate_only:
        report["metrics_available"] = {}
        R.write_json(report, out)
        print(f"wrote {len(images)} image sets under {out / 'images'} and {out / 'report.json'} (timings only)")
    else:
        scorer = Scorer(args.lpips_weights, args.fid_weights, shards.device)
        report["metrics_available"] = scorer.availability()
        for name in report["variants"]:
            report["variants"][name]["quality"] = scorer.score(images[name], images[BASELINE])
        _write_reports(report, images, items.values, out)
    shards.barrier()
    return 0


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


def _calibrated_errors(args, steps: int) -> dict | None:
    if not args.calibration:
        return None
    from ..calibration import Calibration

    cal = Calibration.load(args.calibration)
    if len(cal.noise) != steps:
        return None  # calibrated at another step count: the per-step errors do not line up
    return {m: [float(x) for x in cal.error(m).amax(0)] for m in cal.modes()}


def _report_head(args, items, device) -> dict:
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": pipelines.model_id(args.model),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "kernel": kernel_info(device, Mode.INT8)["backend"], "steps": args.steps, "seed": args.seed,
            "num_images": len(items.values), "items": items.values}


def _write_reports(report: dict, images: dict, labels: list, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    paths = [R.write_json(report, out), R.write_markdown(report, out), R.write_html(report, images, labels, out)]
    print("wrote " + ", ".join(str(p) for p in paths))
    for name, v in report["variants"].items():
        agg = v["quality"]["aggregate"]
        ms, base = v["speed"].get("denoiser_ms_per_step"), report["baseline"]["speed"].get("denoiser_ms_per_step")
        print(f"  {name:28s} PSNR {agg['psnr']['mean']:.2f} dB (min {agg['psnr']['min']:.2f}), "
              f"SSIM {agg['ssim']['mean']:.4f}" + (f", {base / ms:.2f}× stock step time" if ms and base else ""))
    for k, v in report["metrics_available"].items():
        if not v["available"]:
            print(f"  {k}: unavailable: {v['reason']}")


def score_folders(args) -> int:
    """``--score REF CAND...``: metrics of image folders made elsewhere, matched by file name."""
    check_out(args.out, R.REPORT_FILES, args.overwrite)
    ref_dir, *cands = [Path(p) for p in args.score]
    if not cands:
        raise SystemExit("error: --score needs a reference folder and at least one folder to score")
    names, ref = load_folder(ref_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scorer = Scorer(args.lpips_weights, args.fid_weights, device)
    images = {ref_dir.name or str(ref_dir): ref}
    report = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": f"folders ({ref_dir})",
              "device": str(device), "kernel": "n/a (scoring only)", "steps": "?", "seed": "?", "num_images": len(names),
              "items": names, "baseline": {"name": ref_dir.name, "speed": {}}, "variants": {},
              "metrics_available": scorer.availability(), "image_dirs": {ref_dir.name: str(ref_dir)}}
    for c in cands:
        cnames, imgs = load_folder(c)
        if cnames != names:
            raise SystemExit(f"error: {c} and {ref_dir} hold different file names; they are matched by name")
        key = c.name if c.name not in images else str(c)
        images[key] = imgs
        report["variants"][key] = {"speed": {}, "quality": scorer.score(imgs, ref)}
        report["image_dirs"][key] = str(c)
    _write_reports(report, images, names, args.out)
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
