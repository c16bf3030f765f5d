"""What ``calibrate``, ``eval`` and ``demo`` print when they finish: the files written and the figures in them."""

from __future__ import annotations

from pathlib import Path

from ..calibration import FILE_NAME
from ..eval import report as R
from ..schedule import MIN_CARRY_STEPS


def _r2(value: float | None) -> str:
    return "n/a (3 steps or fewer)" if value is None else f"{value:.2f}"


def print_calibration(summary: dict, schedule, out: Path, calibrating: float, writing: float,
                      carry_budget: float | None = None) -> None:
    """A calibration's outputs (``write_outputs``' summary and the derived ``schedule``, made with
    ``carry_budget``) written to ``out``, in ``calibrating`` and ``writing`` seconds."""
    print(f"wrote {out / FILE_NAME}, {out / 'schedule.json'} and {out / 'summary.md'}: calibrated in "
          f"{calibrating:.1f} s, written in {writing:.1f} s")
    for m, e in summary["errors"].items():
        print(f"  {m:11s} rel L1 mean {e['mean_rel_l1']:.4f}, worst {e['max_rel_l1']:.4f} "
              f"({e['most_sensitive'][0]['layer']} at step {e['most_sensitive'][0]['step']})")
    fit = summary["ranges_vs_sigma"]
    print("  ranges vs sigma, median R² proportional/quadratic: "
          + ", ".join(f"{k} {v['r2_proportional']:.2f}/{_r2(v['r2_quadratic'])}" for k, v in fit.items()))
    for tau, e in summary["sparsity"].items():
        print(f"  tau {tau:9s} skips {e['skipped']:.1%} of the blocks, rel L1 mean {e['mean_rel_l1']:.4f}, "
              f"worst {e['max_rel_l1']:.4f}")
    print(f"  schedule {schedule.name}: {' '.join(summary['schedule']['per_step'])}")
    for e in summary.get("carried", {}).values():
        print(f"  tau {e['tau']:<9g} carried, refresh every {e['refresh_every']}: skips {e['skipped']:.1%} of the "
              f"blocks, rel L1 along the trajectory {e['trajectory_rel_l1']:.4f}, mean {e['mean_rel_l1']:.4f}, "
              f"worst {e['max_rel_l1']:.4f}")
    if "tau_per_step" in summary["schedule"]:
        every = summary["schedule"].get("refresh_every")
        print("  levels per step: " + " ".join("dense" if t is None else t if isinstance(t, str) else f"{t:g}"
                                                for t in summary["schedule"]["tau_per_step"])
              + (f" (skipped blocks carried, refresh every {every} steps)" if every else ""))
        if summary.get("carried") and carry_budget is not None:
            if every:
                print(f"  what this costs in images depends on the model (the carry budget's 30 dB line is the long "
                      f"shipped model's): compare with `diffusion-int8 eval --schedule {out / 'schedule.json'}`")
            elif (schedule.calibrated_steps or 0) < MIN_CARRY_STEPS:
                print(f"  no carried setting: calibrated over {schedule.calibrated_steps} steps, and a schedule "
                      f"carries only from {MIN_CARRY_STEPS}")
            else:
                print(f"  no carried setting: none above is within --carry-budget {carry_budget:g} along the INT8 "
                      f"steps while computing fewer blocks than dropping the levels; a larger budget or a shorter "
                      f"--refresh-every admits more")


def print_report(report: dict, out: Path) -> None:
    """An evaluation's report written to ``out``: each variant's quality, speed and skipped blocks."""
    print("wrote " + ", ".join(str(out / f) for f in R.REPORT_FILES))
    timing = R.timing_of(report)
    if timing["note"]:
        print(f"  {timing['note']}")
    sparse = R.sparse_variants(report)
    for name, v in report["variants"].items():
        agg = v["quality"]["aggregate"]
        ms, base = v["speed"].get("denoiser_ms_per_step"), report["baseline"]["speed"].get("denoiser_ms_per_step")
        ratio = R.vs_stock(base, ms) if timing["speed"] else None
        excluded = agg["psnr"].get("excluded", 0)
        print(f"  {name:28s} PSNR {R.fmt(agg['psnr']['mean'], 2)} dB (min {R.fmt(agg['psnr']['min'], 2)}), "
              f"SSIM {R.fmt(agg['ssim']['mean'], 4)}" + (f", denoiser step {ms:.2f} ms: {ratio}" if ratio else "")
              + (f"; {excluded} non-finite image(s) left out" if excluded else "")
              + (f"; {v['sparsity']['overall']:.1%} of attention blocks skipped" if name in sparse else ""))
    for name, steps in R.sparsity_lines(report):
        print(f"  {name}: blocks skipped per step {steps}")
    for k, v in report["metrics_available"].items():
        if not v["available"]:
            print(f"  {k}: unavailable: {v['reason']}")
