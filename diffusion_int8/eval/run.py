"""``evaluate()``: FP16 and INT8 images from the same seeds, scored and timed, from Python.

    from diffusion_int8 import evaluate, write_report
    report = evaluate(pipe, class_labels=["red circle", "blue ring"], steps=20, schedule="balanced")
    report["variants"]["int8"]["quality"]["aggregate"]["psnr"]["mean"]
    write_report(report, "report/")             # report.json, report.md, report.html, images/<variant>/*.png

``diffusion-int8 eval`` is this function, over a model loaded from ``--model``, followed by ``write_report``
into ``--out`` as one set.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .. import pipelines
from ..calibration import Calibration
from ..plugin.config import Int8Config
from ..plugin.install import check_enableable, enable
from ..kernels import Mode, kernel_info
from ..plugin.state import skipped_fractions
from ..schedule import PrecisionSchedule
from ..plugin.speed_gate import SpeedGate
from . import report as R
from .energy import EnergyCounter
from .metrics import missing_package
from .score import IMAGE_FILE, Scorer, save_images

BASELINE = "fp16"
DEFAULT_MODES = ("int8", "int8_fp16v")
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


def check_modes(modes: Sequence[str]) -> list[str]:
    """``modes`` as a list of distinct INT8 mode names, or ``ValueError`` naming the one that is not (``fp16`` is
    the stock baseline every report has, not a variant)."""
    int8_modes = ", ".join(m.value for m in Mode if m is not Mode.FP16)
    if isinstance(modes, str) or not all(isinstance(m, (str, Mode)) for m in modes):
        raise ValueError(f"modes must be a list of INT8 mode names ({int8_modes}), got {modes!r}")
    names = [Mode.parse(m).value for m in modes]
    if BASELINE in names:
        raise ValueError(f"modes lists {BASELINE!r}, the stock pipeline every report compares with: give INT8 modes "
                         f"({int8_modes})")
    if len(set(names)) != len(names):
        raise ValueError(f"modes lists a mode twice: {names}")
    return names


def variants(modes: Sequence[str] = DEFAULT_MODES, schedule: PrecisionSchedule | None = None,
             calibration: Calibration | None = None, sparsity: float | None = None,
             refresh_every: int | None = None, speed_gate: bool = True) -> dict[str, Int8Config]:
    """``{name: config}`` in report order, one speed gate shared (``speed_gate`` False: INT8 forced); the baseline
    (stock pipeline) is not listed. The configs are checked as they are made, before any image."""
    if refresh_every is not None and sparsity is None:
        raise ValueError(f"refresh_every={refresh_every} carries the blocks sparsity skips: give sparsity too")
    gate = SpeedGate() if speed_gate else False
    out = {m: Int8Config(m, speed_gate=gate) for m in modes}
    if schedule is not None:
        out[f"schedule:{schedule.name}"] = Int8Config(schedule=schedule, speed_gate=gate)
    if calibration is not None:
        base_name, base = list(out.items())[-1] if out else ("int8", Int8Config("int8", speed_gate=gate))
        out[f"{base_name}+static-ranges"] = base.replace(calibration=calibration)
    if sparsity is not None:
        name = f"int8+sparsity{sparsity:g}" + (f"+refresh{refresh_every}" if refresh_every else "")
        out[name] = Int8Config("int8", sparsity=sparsity, refresh_every=refresh_every, speed_gate=gate)
    return out


def run_variant(pipe, model, items, batches, device, config: Int8Config | None, *, steps: int, seed: int,
                guidance_scale: float | None = None, on_step=None):
    """Images (by index) and speed of one variant; ``config`` None runs the stock pipeline.

    ``on_step(n)`` hears of every timed denoising step (the warm-up run is not counted)."""
    handle = enable(pipe, config, record=True) if config is not None else None
    timer = StepTimer(model, device)
    images, seconds, n_images, int8_calls, gated_calls = {}, 0.0, 0, 0, 0
    blocks: dict[int, list] = {}  # step -> [block pairs computed, all pairs], over the batches
    try:
        if batches:  # warm-up (Triton compilation, allocator, calibrated ranges per timestep), not timed
            b, batch, idx = batches[0]
            # on a GPU the whole schedule: its timesteps' static ranges are evaluated once, at the first generation;
            # on a CPU (no speed measurement) two steps compile what there is to compile
            pipelines.generate(pipe, items, batch[:1], idx[:1], steps=steps if device.type == "cuda" else 2,
                               seed=seed, guidance_scale=guidance_scale)
            timer.pending = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        energy = EnergyCounter.open(device)
        joules = 0.0
        per_step = []
        for b, batch, idx in batches:
            if handle is not None:
                handle.state.reset()
            t0, j0 = time.perf_counter(), energy.joules() if energy else 0.0
            imgs = pipelines.generate(pipe, items, batch, idx, steps=steps, seed=seed,
                                      guidance_scale=guidance_scale, on_step=on_step)  # images on the CPU: synced
            seconds += time.perf_counter() - t0
            joules += energy.joules() - j0 if energy else 0.0
            if handle is not None:
                int8_calls, gated_calls = int8_calls + handle.state.int8_calls, gated_calls + handle.state.gated_calls
                _add_blocks(blocks, handle.state.block_totals())
            n_images += len(idx)
            images.update(zip(idx, imgs))
            if handle is not None and handle.state.trace and not per_step:
                per_step = _modes_per_step(handle.state.trace)
        timer.collect()
        # what each module did about the Q·Kᵀ balance: {status: modules}
        balance = None if handle is None else {k: len(v) for k, v in handle.summary()["qk_balance"].items()}
    finally:
        timer.remove()
        if handle is not None:
            handle.disable()
    # carried blocks alternate dearer refresh steps with cheaper ones: their mean, not the median of either kind
    per_step_ms = statistics.mean if config is not None and config.refresh_every else statistics.median
    speed = {"denoiser_ms_per_step": per_step_ms(timer.ms) if timer.ms else None,
             "denoiser_calls": len(timer.ms), "images": n_images, "seconds_per_image": seconds / max(n_images, 1),
             "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
             "joules_per_image": joules / max(n_images, 1) if energy else None,
             "int8_calls": int8_calls if handle is not None else None,
             "gated_calls": gated_calls if handle is not None else None,
             "blocks": blocks if handle is not None else None, "qk_balance": balance}
    return images, speed, per_step


def _add_blocks(into: dict, totals: dict) -> None:
    """Add ``Int8State.block_totals`` (or another process's sums) to ``into``, step by step."""
    for step, (kept, total) in totals.items():
        entry = into.setdefault(int(step), [0.0, 0])
        entry[0] += kept
        entry[1] += total


def _modes_per_step(trace) -> list[str]:
    """The most common mode of each denoiser call in a processor trace."""
    by_step: dict[int, list[str]] = {}
    for step, _, _, mode in trace:
        by_step.setdefault(step, []).append(mode)
    return [max(set(m), key=m.count) for _, m in sorted(by_step.items())]


def generate_all(pipe, items, plan: dict[str, Int8Config], shards, *, batch_size: int, steps: int, seed: int,
                 guidance_scale: float | None = None, progress: bool = True) -> tuple[dict, dict, dict, dict]:
    """Every variant's images (uint8, by index), speed, modes per step and the indices of non-finite images."""
    model = pipelines.denoiser(pipe)
    batches = shards.mine(items.batches(batch_size))
    results, speeds, per_step, nonfinite = {}, {}, {}, {}
    todo = {BASELINE: None, **plan}
    # one tick per denoising step of every batch of every variant
    bar = tqdm(total=len(todo) * len(batches) * steps, desc="generate", unit="step",
               disable=not progress or not shards.is_main)
    try:
        for name, config in todo.items():
            bar.set_postfix_str(name)
            imgs, speeds[name], per_step[name] = run_variant(
                pipe, model, items, batches, shards.device, config, steps=steps, seed=seed,
                guidance_scale=guidance_scale, on_step=bar.update)
            # flagged before the uint8 conversion, which would turn NaN into an ordinary (black) pixel
            nonfinite[name] = sorted(i for i, t in imgs.items() if not torch.isfinite(t).all())
            results[name] = {i: _to_uint8(t) for i, t in imgs.items()}
    finally:
        bar.close()
    return results, speeds, per_step, nonfinite


def _to_uint8(img: torch.Tensor) -> torch.Tensor:
    """[0, 1] floats as uint8; NaN as 0, ±Inf as the ends of the range (flagged separately)."""
    return (torch.nan_to_num(img, nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1) * 255).round().to(torch.uint8)


def evaluate(pipe, prompts: Sequence[str] | None = None, *, class_labels: Sequence[int | str] | None = None,
             modes: Sequence[str] = DEFAULT_MODES, schedule: PrecisionSchedule | str | Path | None = None,
             calibration: Calibration | str | Path | None = None, sparsity: float | None = None,
             refresh_every: int | None = None, steps: int = 20, batch_size: int = 8,
             seed: int = 0, guidance_scale: float | None = None, speed_gate: bool = True,
             generate_only: bool = False, lpips_weights: str | None = None, fid_weights: str | None = None,
             model: str | None = None, shards: pipelines.Shards | None = None, progress: bool = True) -> dict | None:
    """Generate the stock pipeline's (FP16) images and each INT8 variant's from the same seeds, time the
    denoiser, and score every variant's images against the stock ones.

    Args:
        pipe: a diffusers pipeline (or the shipped one), on its device; its processors are restored after
            each variant.
        prompts: text prompts, one image each; or ``class_labels`` (names or ids) for class-conditional
            pipelines. Neither: one image of each of the pipeline's ``labels`` (the shipped pipeline).
        modes: constant-precision INT8 variants (``int8``, ``int8_fp16v``), in report order; the stock
            pipeline's images are the baseline of every report.
        schedule: also a scheduled variant: a ``PrecisionSchedule``, a preset name or a schedule JSON file.
        calibration: also a variant with static ranges (the last variant's settings plus this
            calibration): a ``Calibration`` or its file or directory; checked against the model first.
        sparsity, refresh_every: also an ``int8`` variant at this constant sparsity level, its skipped blocks
            dropped or, with ``refresh_every``, carried (``enable``'s arguments; checked first).
        steps, batch_size, seed, guidance_scale: as in ``calibrate``; image ``i`` is seeded with ``seed + i``
            in every variant.
        speed_gate: False runs INT8 for every call a variant's mode covers (``enable(speed_gate=False)``).
        generate_only: images and timings only, no quality metrics.
        lpips_weights, fid_weights: local weight files for LPIPS and FID/KID (else those metrics say they are
            unavailable and why).
        model: the model's name in the report (default: the pipeline's ``name_or_path``).
        shards: the process's share of the batches under ``accelerate launch`` (``pipelines.Shards``); by
            default one is made for the denoiser's device.
        progress: show a progress bar, one tick per timed denoising step.

    Returns:
        On the main process, the report (what ``report.json`` holds, plus ``images``): ``baseline`` and
        ``variants`` (per variant ``speed``: ``denoiser_ms_per_step`` (the median; the mean where skipped
        blocks are carried), ``images``, ``seconds_per_image``,
        ``peak_memory_mib``, ``joules_per_image`` (the GPU's energy over the timed generations, NVML; None
        elsewhere), ``int8_calls``, ``gated_calls``; ``quality``: per-image and aggregate PSNR,
        SSIM, LPIPS, FID, KID, unless ``generate_only``; ``non_finite_images``: indices of images with
        NaN/Inf, left out of the scores; ``sparsity``: the fraction of (query block, key block) pairs skipped,
        ``{"steps", "per_step", "overall"}`` over every attention call), ``schedule`` (its mode per step), ``timing`` (whether the times
        are a speed measurement), ``metrics_available``, and ``images``: ``{variant: (N, 3, H, W) float32
        tensor in [0, 1]}`` on the CPU, the baseline ``fp16`` first. None on the other processes of a launch.

    Raises:
        ValueError: class labels the pipeline does not know, a mode that is not one, steps, batch size, seed or
            guidance scale out of range, a calibration of another model, or an invalid schedule or calibration
            file (``FileNotFoundError`` where it, or a weights file given, is missing); all before any image.
        RuntimeError: a pipeline ``enable`` would refuse (already enabled, compiled, or with
            ``Int8DiffusionProcessor`` set by hand: its baseline would not be stock); before any image.
    """
    pipelines.check_run(steps, batch_size, seed, guidance_scale)
    modes = check_modes(modes)
    for what, path, metric in (("lpips_weights", lpips_weights, "lpips"), ("fid_weights", fid_weights, "fid")):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{what}: no file at {path} (leave it out to report the metric unavailable)")
        missing = None if path is None or generate_only else missing_package(metric)
        if missing is not None:  # weights given for a metric that cannot run: said now, not after every image
            raise ValueError(f"{what} was given, but {missing.reason}")
    items = pipelines.resolve_items(pipe, prompts, class_labels)
    check_enableable(pipe)  # the baseline runs stock: not on a pipeline whose attention is already INT8
    if schedule is not None and not isinstance(schedule, PrecisionSchedule):
        schedule = PrecisionSchedule.load(schedule)
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = Calibration.load(calibration)
    if calibration is not None:
        calibration.validate(pipelines.denoiser(pipe))
    plan = variants(modes, schedule, calibration, sparsity, refresh_every, speed_gate)
    if not plan:
        raise ValueError(f"nothing to compare with {BASELINE}: give modes ({', '.join(DEFAULT_MODES)}), a schedule, "
                         f"a calibration or sparsity")
    shards = shards or pipelines.Shards(str(pipelines.denoiser(pipe).device))
    results, speeds, per_step, nonfinite = generate_all(
        pipe, items, plan, shards, batch_size=batch_size, steps=steps, seed=seed, guidance_scale=guidance_scale,
        progress=progress)
    gathered = shards.gather([(results, speeds, nonfinite)])
    if not shards.is_main:
        return None
    images: dict[str, torch.Tensor] = {}
    for name in results:
        merged = {}
        for res, _, _ in gathered:
            merged.update(res[name])
        images[name] = torch.stack([merged[i] for i in sorted(merged)]).float() / 255
    speed = {name: _merge_speed([s[name] for _, s, _ in gathered]) for name in results}
    sparsity = {name: skipped_fractions(speed[name].pop("blocks") or {}) for name in results}
    bad = {name: sorted({i for _, _, nf in gathered for i in nf[name]}) for name in results}
    _warn_nonfinite(bad)
    model = model if model is not None else pipelines.pipeline_id(pipe)
    report = _report_head(model, items, shards.device, steps, seed)
    # the stock baseline's precision: fp16 on a GPU by default, float32 on a CPU (INT8 attention computes in fp16)
    report["dtype"] = str(next(pipelines.denoiser(pipe).parameters()).dtype).removeprefix("torch.")
    report["speed_gate"] = speed_gate
    if calibration is not None:  # the static-ranges variant's source
        report["calibration"] = calibration.provenance()
    report["baseline"] = {"name": BASELINE, "speed": speed[BASELINE], "non_finite_images": bad[BASELINE]}
    report["variants"] = {n: {"speed": speed[n], "non_finite_images": bad[n]} for n in images if n != BASELINE}
    for n, v in report["variants"].items():
        v["sparsity"] = sparsity[n]
    report["image_dirs"] = {n: f"images/{_dirname(n)}" for n in images}
    sched_name = next((n for n in images if n.startswith("schedule:")), None)
    if sched_name:
        report["schedule"] = {"name": sched_name.split(":", 1)[1], "per_step": per_step[sched_name],
                              "errors": _calibrated_errors(calibration, len(per_step[sched_name]))}
    if generate_only:
        report["metrics_available"] = {}
    else:
        scorer = Scorer(lpips_weights, fid_weights, shards.device)
        report["metrics_available"] = scorer.availability()
        for name in report["variants"]:
            # an image is compared only where both it and its reference are finite
            exclude = sorted(set(bad[name]) | set(bad[BASELINE]))
            report["variants"][name]["quality"] = scorer.score(images[name], images[BASELINE], exclude=exclude)
    report["images"] = images
    return report


def write_report(report: dict, dest: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Write what ``evaluate`` returned into the directory ``dest`` (made if missing): ``images/<variant>/00000.png``…
    and ``report.json``, plus ``report.md`` and ``report.html`` unless it was made with ``generate_only`` (no
    quality metrics). Returns the report files written. ``FileExistsError`` where ``dest`` holds a report's outputs
    (``OUTPUTS``), unless ``overwrite``: then the images the previous report lists go too, so that no image of it
    stays beside the new ones."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"{dest} is a file; write_report writes into a directory (new, or one holding a "
                                 f"report to replace with overwrite=True)")
    existing = [n for n in OUTPUTS if (dest / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{dest} already holds {', '.join(existing)}; pass overwrite=True to replace that "
                              f"report (its images go with it), or write to another directory")
    if existing:
        _remove_report_images(dest)
    dest.mkdir(parents=True, exist_ok=True)
    images = report["images"]
    head = {k: v for k, v in report.items() if k != "images"}
    for name, imgs in images.items():
        save_images(imgs, dest / "images" / _dirname(name), list(range(len(imgs))))
    if not head["metrics_available"]:  # made with generate_only: timings, no scores
        return [R.write_json(head, dest)]
    return write_report_files(head, images, head["items"], dest)


def _remove_report_images(dest: Path) -> None:
    """The images (``save_images``' names) in the folders ``dest/report.json`` lists, and those folders once empty;
    nothing where it cannot be read."""
    try:
        dirs = json.loads((dest / "report.json").read_text(encoding="utf-8")).get("image_dirs", {}).values()
    except (OSError, ValueError, AttributeError):
        return
    root = (dest / "images").resolve()
    for d in dirs:
        folder = (dest / str(d)).resolve()
        if folder.parent != root or not folder.is_dir():  # only images/<variant>, as write_report names them
            continue
        for f in folder.iterdir():
            if IMAGE_FILE.fullmatch(f.name) and f.is_file():
                f.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def write_report_files(report: dict, images: dict, labels: list, dest: Path) -> list[Path]:
    """``report.json``, ``report.md`` and ``report.html`` (its image grids from ``images``) in ``dest``."""
    return [R.write_json(report, dest), R.write_markdown(report, dest), R.write_html(report, images, labels, dest)]


def _warn_nonfinite(bad: dict[str, list[int]]) -> None:
    """One terminal warning for every image with NaN/Inf values, by variant."""
    flagged = {n: idx for n, idx in bad.items() if idx}
    if flagged:
        print("warning: images with NaN/Inf values: " + "; ".join(f"{n} #{', #'.join(map(str, idx))}" for n, idx in flagged.items())
              + ". They are flagged in the report and left out of the quality metrics.", file=sys.stderr)


def _merge_speed(parts: list[dict]) -> dict:
    """The processes' speed records as one: per image over all their images (a process given none, as a launch
    with more processes than batches has, counts for nothing), the median of their step times."""
    ms = [p["denoiser_ms_per_step"] for p in parts if p["denoiser_ms_per_step"] is not None]
    mem = [p["peak_memory_mib"] for p in parts if p["peak_memory_mib"] is not None]
    return {"denoiser_ms_per_step": statistics.median(ms) if ms else None,
            "denoiser_calls": sum(p["denoiser_calls"] for p in parts), "images": sum(p["images"] for p in parts),
            "seconds_per_image": _per_image(parts, "seconds_per_image"),
            "peak_memory_mib": max(mem) if mem else None, "processes": len(parts),
            "joules_per_image": _per_image(parts, "joules_per_image"),
            "int8_calls": None if parts[0].get("int8_calls") is None else sum(p["int8_calls"] for p in parts),
            "gated_calls": None if parts[0].get("gated_calls") is None else sum(p["gated_calls"] for p in parts),
            "blocks": None if parts[0].get("blocks") is None else _summed_blocks(p["blocks"] for p in parts),
            "qk_balance": _merged_balance([p.get("qk_balance") for p in parts])}


def _per_image(parts: list[dict], key: str) -> float | None:
    """``key`` (a quantity per image) over the images of every process that made some and measured it."""
    known = [(p[key], p["images"]) for p in parts if p.get(key) is not None and p["images"]]
    n = sum(n for _, n in known)
    return sum(v * n for v, n in known) / n if n else None


def _merged_balance(parts: list) -> dict | None:
    """The processes' balance counts: one process's where all agree; else each process's, named (a module decides at
    its first call, on that process's first images)."""
    if all(p == parts[0] for p in parts):
        return parts[0]
    return {f"{status} on process {i}": n for i, p in enumerate(parts) for status, n in (p or {}).items()}


def _summed_blocks(parts) -> dict:
    total: dict[int, list] = {}
    for part in parts:
        _add_blocks(total, part)
    return total


def _dirname(name: str) -> str:
    """A variant's name as one folder name: other characters than letters, digits and ``-_+.`` as ``_``; past 80
    bytes (a schedule's name can be any length; file systems take 255) its first 64 and a hash of the whole."""
    safe = "".join(c if c.isalnum() or c in "-_+." else "_" for c in name)
    if len(safe.encode()) > 80:
        safe = f"{safe.encode()[:64].decode(errors='ignore')}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    return safe


def _calibrated_errors(calibration: Calibration | None, steps: int) -> dict | None:
    if calibration is None or len(calibration.noise) != steps:
        return None  # none, or calibrated at another step count: the per-step errors do not line up
    return {m: [float(x) for x in calibration.error(m).amax(0)] for m in calibration.modes()}


def _report_head(model: str, items, device, steps: int, seed: int) -> dict:
    kernel = kernel_info(device, Mode.INT8)["backend"]
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "kernel": kernel, "timing": R.timing(device.type, kernel), "steps": steps, "seed": seed,
            "num_images": len(items.values), "items": items.values}
