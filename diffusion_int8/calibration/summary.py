"""What a person reads after calibrating: sensitive layers and steps, how ranges move with sigma, plots."""

from __future__ import annotations

from pathlib import Path

from .. import jsonfile
from .file import Calibration

# the plots show names as given: a "$" in a schedule's or a layer's name is text, not the start of TeX
PLAIN_TEXT = {"text.usetex": False, "text.parse_math": False}


def summarize(cal: Calibration, schedule=None, top: int = 8) -> dict:
    names = list(cal.layers)
    noise = [round(float(n), 4) for n in cal.noise]
    modes = cal.modes()
    per_mode = {}
    for m in modes:
        e = cal.error(m)  # (L, T)
        flat = [(float(e[i, t]), names[i], t) for i in range(len(names)) for t in range(len(noise))]
        flat.sort(reverse=True)
        per_mode[m] = {
            "mean_rel_l1": float(e.mean()),
            "max_rel_l1": float(e.max()),
            "per_step_max_rel_l1": [float(x) for x in e.amax(0)],
            "per_layer_mean_rel_l1": {n: float(e[i].mean()) for i, n in enumerate(names)},
            "most_sensitive": [{"layer": n, "step": t, "noise": noise[t], "rel_l1": v} for v, n, t in flat[:top]],
        }
    sparsity = {}
    for tau in cal.sparsity_levels():
        e, skipped = cal.sparse_error(tau), 1 - cal.kept(tau)  # (L, T)
        sparsity[str(tau)] = {
            "mean_rel_l1": float(e.mean()), "max_rel_l1": float(e.max()),
            "per_step_max_rel_l1": [float(x) for x in e.amax(0)],
            "skipped": float(skipped.mean()), "per_step_skipped": [float(x) for x in skipped.mean(0)],
        }
    carried = {}
    for tau, every in cal.carry_settings():
        e, skipped = cal.carry_error(tau, every), 1 - cal.carry_kept(tau, every)
        carried[f"{tau}/{every}"] = {
            "tau": tau, "refresh_every": every, "mean_rel_l1": float(e.mean()), "max_rel_l1": float(e.max()),
            # what from_calibration's carry_budget bounds where every step runs INT8
            "trajectory_rel_l1": cal.carry_trajectory_error(tau, every),
            "per_step_max_rel_l1": [float(x) for x in e.amax(0)],
            "skipped": float(skipped.mean()), "per_step_skipped": [float(x) for x in skipped.mean(0)],
        }
    out = {"model": cal.meta.get("model"), "model_class": cal.meta.get("model_class"), "steps": len(noise),
           "noise": noise, "layers": len(names), "errors": per_mode, "sparsity": sparsity, "carried": carried,
           "ranges_vs_sigma": cal.fit_report(),
           # layers whose Q or K carries outlier channels of its own (None: no channel maxima, before schema 4)
           "qk_balance_layers": cal.balanced_layers() if cal.has_channel_ranges() else None}
    if schedule is not None:
        scale, layers = cal.meta.get("timestep_scale"), names or [None]
        out["schedule"] = {"name": schedule.name, "per_step": [
            _across_layers([schedule.mode_for(float(t), n, scale).value for n in layers]) for t in cal.timesteps]}
        if getattr(schedule, "sparse", False):
            out["schedule"]["tau_per_step"] = [_across_layers([schedule.tau_for(float(t), n, scale) for n in layers])
                                               for t in cal.timesteps]
            out["schedule"]["refresh_every"] = getattr(schedule, "refresh_every", None)
    return out


def _across_layers(values: list):
    """What a step's layers take: the value all of them take, else each value with its count of layers, as text
    ("int8×12+int8_fp16v×4"; a level None as "dense")."""
    if len(set(values)) == 1:
        return values[0]
    counts = {v: values.count(v) for v in values}
    return "+".join(f"{'dense' if v is None else format(v, 'g') if isinstance(v, float) else v}×{c}"
                    for v, c in counts.items())


def write_markdown(summary: dict, path: Path) -> None:
    lines = [f"# Calibration of {summary['model']} ({summary['model_class']})", "",
             f"{summary['layers']} attention layers, {summary['steps']} steps, noise levels "
             f"{summary['noise'][0]} → {summary['noise'][-1]}.", "", "## Error of each precision (relative L1 of the attention output)", "",
             "| mode | mean | worst layer·step |", "|---|---|---|"]
    for m, e in summary["errors"].items():
        lines.append(f"| {m} | {e['mean_rel_l1']:.4f} | {e['max_rel_l1']:.4f} |")
    for m, e in summary["errors"].items():
        lines += ["", f"Most sensitive (layer, step) in `{m}`:", "", "| layer | step | noise | rel L1 |", "|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['step']} | {r['noise']:.3f} | {r['rel_l1']:.4f} |" for r in e["most_sensitive"]]
    if summary.get("sparsity"):
        lines += ["", "## Error of each sparsity level (relative L1 of exact attention over the kept blocks)", "",
                  "Block pairs skipped by the predictor at each level, and the error that costs against all pairs, "
                  "both averaged over heads, images and steps.", "",
                  "| tau | blocks skipped | mean rel L1 | worst layer·step |", "|---|---|---|---|"]
        for tau, e in summary["sparsity"].items():
            lines.append(f"| {tau} | {e['skipped']:.1%} | {e['mean_rel_l1']:.4f} | {e['max_rel_l1']:.4f} |")
    if summary.get("carried"):
        lines += ["", "## Error of each level with its skipped blocks carried", "",
                  "The skipped blocks computed every K-th step and forecast in between (`refresh_every=K`): the blocks "
                  "skipped over the steps (none at a refresh) and the error against all pairs; *along the trajectory* "
                  "weighs each step by the noise it removes (what `--carry-budget` bounds where every step runs "
                  "INT8).", "",
                  "| tau | refresh every | blocks skipped | along the trajectory | mean rel L1 | worst layer·step |",
                  "|---|---|---|---|---|---|"]
        for e in summary["carried"].values():
            lines.append(f"| {e['tau']} | {e['refresh_every']} | {e['skipped']:.1%} | {e['trajectory_rel_l1']:.4f} | "
                         f"{e['mean_rel_l1']:.4f} | {e['max_rel_l1']:.4f} |")
    lines += ["", "## How ranges move with sigma", "",
              "R² of a model where ranges scale in proportion to sigma (range = c·σ) against the stored quadratic fit, "
              "median over (layer, head); `max/min` is the median ratio of a head's largest to smallest range over the schedule.",
              "", "| range | R² proportional | R² quadratic | max/min |", "|---|---|---|---|"]
    for stat, r in summary["ranges_vs_sigma"].items():
        quadratic = "n/a (3 steps or fewer)" if r["r2_quadratic"] is None else f"{r['r2_quadratic']:.3f}"
        lines.append(f"| {stat} | {r['r2_proportional']:.3f} | {quadratic} | {r['max_over_min']:.2f} |")
    balanced = summary.get("qk_balance_layers")
    if balanced is not None:
        lines += ["", "## Outlier channels", "",
                  f"Layers whose Q or K carries outlier channels of its own, where the Q·Kᵀ balance applies: "
                  f"{len(balanced)} of {summary['layers']}" + (f" ({', '.join(balanced)})." if balanced else ".")]
    if "schedule" in summary:
        s = summary["schedule"]
        if "tau_per_step" in s:
            lines += ["", f"## Schedule `{s['name']}`", "", "| step | noise | mode | tau |", "|---|---|---|---|"]
            lines += [f"| {i} | {n:.3f} | {m} | {'dense' if t is None else t} |"
                      for i, (n, m, t) in enumerate(zip(summary["noise"], s["per_step"], s["tau_per_step"]))]
        else:
            lines += ["", f"## Schedule `{s['name']}`", "", "| step | noise | mode |", "|---|---|---|"]
            lines += [f"| {i} | {n:.3f} | {m} |" for i, (n, m) in enumerate(zip(summary["noise"], s["per_step"]))]
    lines += ["", "Plots: `ranges.png` (Q, K and V ranges against the noise level, one line per layer, coloured by "
              "depth) and `errors.png` (error per step and mode), both with the noise level falling from left to "
              "right, as denoising proceeds" + ("; with carried settings, `errors.png` shows each one's error per step "
              "beside the modes'." if summary.get("carried") else "."), ""]
    jsonfile.write_bytes(path, "\n".join(lines).encode())


def plot(cal: Calibration, out_dir: Path, budget: float | None = None,
         carried: tuple[float, int] | None = None) -> list[Path]:
    """``ranges.png`` and ``errors.png``; nothing (and no error) without matplotlib. Where ``cal`` measured carrying,
    ``errors.png`` has a second panel: each carried setting's error per step, ``carried`` (level, interval), the
    schedule's choice, drawn thick."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    with matplotlib.rc_context(PLAIN_TEXT):
        noise = cal.noise.numpy()
        names = list(cal.layers)
        # colour by depth, and name at most 8 evenly spaced layers (first and last among them) in the legend
        cmap = plt.get_cmap("viridis")
        named = {round(i * (len(names) - 1) / 7) for i in range(8)} if len(names) > 8 else set(range(len(names)))
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        for ax, stat, title in zip(axes, ("q_p99", "k_p99", "v_amax"), ("|Q| p99", "|K − mean| p99", "|V| max")):
            for i, (name, st) in enumerate(cal.layers.items()):
                y = st[stat].float()
                y = y.mean(0) if y.dim() == 2 else y.mean((0, 1))
                ax.plot(noise, y.numpy(), lw=1, alpha=0.8, color=cmap(i / max(len(names) - 1, 1)),
                        label=name if i in named else None)
            ax.set_xlabel("noise level σ (denoising runs left to right)")
            ax.set_title(f"{title}, mean over heads")
            ax.invert_xaxis()  # as in errors.png: high noise first, as denoising proceeds
        handles, labels = axes[0].get_legend_handles_labels()
        title = "layer" + (f" ({len(names)}, colour = depth; {len(named)} named)" if len(named) < len(names) else "")
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, title=title,
                   title_fontsize=8)
        fig.tight_layout()
        ranges = out_dir / "ranges.png"
        fig.savefig(ranges, dpi=110, bbox_inches="tight")
        plt.close(fig)

        settings = cal.carry_settings()
        fig, axes = plt.subplots(1, 2 if settings else 1, figsize=(12 if settings else 6.5, 3.6), squeeze=False)
        ax = axes[0, 0]
        for i, m in enumerate(cal.modes()):
            e = cal.error(m)
            ax.plot(noise, e.amax(0).numpy(), marker="o", ms=3, color=f"C{i}", label=f"{m} (worst layer)")
            ax.plot(noise, e.mean(0).numpy(), ls="--", color=f"C{i}", label=f"{m} (mean over layers)")
        if budget is not None:
            ax.axhline(budget, color="k", lw=0.8, ls=":", label=f"budget {budget}")
        ax.set_xlabel("noise level σ (denoising runs left to right)")
        ax.set_ylabel("relative L1 of attention output")
        ax.invert_xaxis()  # the same direction as ranges.png
        ax.legend(fontsize=8)
        if settings:
            ax = axes[0, 1]
            levels = sorted({tau for tau, _ in settings})
            styles = ["-", "--", ":", "-."]
            for tau, every in settings:
                e = cal.carry_error(tau, every).mean(0)
                chosen = (tau, every) == carried
                ax.plot(noise, e.numpy(), lw=2.4 if chosen else 1, color=f"C{levels.index(tau) % 10}",
                        ls="-" if chosen else styles[every % len(styles)],
                        label=f"τ {tau:g} every {every}: {cal.carry_trajectory_error(tau, every):.3f}"
                              + (" (the schedule's)" if chosen else ""))
            ax.set_xlabel("noise level σ (denoising runs left to right)")
            ax.set_title("carried: error per step, mean over layers (legend: along the trajectory)", fontsize=9)
            ax.invert_xaxis()
            ax.legend(fontsize=7, ncol=2 if len(settings) > 12 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        errors = out_dir / "errors.png"
        fig.savefig(errors, dpi=110, bbox_inches="tight")
        plt.close(fig)
    return [ranges, errors]


def write_all(cal: Calibration, schedule, out_dir: Path, budget: float | None) -> dict:
    summary = summarize(cal, schedule)
    jsonfile.write(out_dir / "summary.json", summary)
    write_markdown(summary, out_dir / "summary.md")
    every = getattr(schedule, "refresh_every", None)
    plot(cal, out_dir, budget, carried=None if every is None else (schedule.carried_tau(), every))
    return summary
