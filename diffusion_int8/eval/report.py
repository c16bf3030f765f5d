"""Writing an evaluation as ``report.json``, ``report.md`` and a self-contained ``report.html``.

The HTML embeds every picture as a data URI (side-by-side grids, difference heat maps, the schedule
plot), so it can be mailed or archived as one file. A few lines of script record, in ``data-`` attributes
of ``<body>``, how many images decoded and any script error, which the tests read in headless Chromium.
Images with NaN/Inf values (``non_finite_images`` of each variant) are listed in all three reports and
marked in the HTML grid; the quality metrics leave them out. Where a variant skipped attention blocks (block-sparse
attention), the reports show the fraction skipped overall and per denoising step.

Times are a speed measurement only on a GPU that runs the kernel (``timing``): elsewhere the INT8 modes
run the kernel's PyTorch emulation, and the reports say so and show no ratio to stock. Where they are, the
ratio reads "N× faster than stock" or "N× slower than stock" (``vs_stock``) in every report and on the
terminal. The HTML fits a 1280-pixel-wide window: the image grid is split into tables of as many variants
as fit (``GRID_WIDTH``), and long variant names wrap.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .. import jsonfile

# the plots show names as given: a "$" in a schedule's or a layer's name is text, not the start of TeX
PLAIN_TEXT = {"text.usetex": False, "text.parse_math": False}

REPORT_FILES = ("report.json", "report.md", "report.html")


def fmt(x, digits=3) -> str:
    """A metric as the reports print it: a number to ``digits`` places, or its text ("n/a", "inf", ...)."""
    if isinstance(x, str):
        return x
    if x is None:
        return "–"
    if math.isnan(x):
        return "n/a"
    return f"{x:.{digits}f}" if math.isfinite(x) else ("∞" if x > 0 else "−∞")


def _png_uri(arr: np.ndarray, scale: int = 1) -> str:
    img = Image.fromarray(arr)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _to_uint8(img: torch.Tensor) -> np.ndarray:
    return (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def heatmap(diff: torch.Tensor, vmax: float) -> np.ndarray:
    """|difference| (H, W) as an RGB heat map (black → red → yellow → white) with ``vmax`` at white."""
    t = (diff / max(vmax, 1e-12)).clamp(0, 1).numpy()
    rgb = np.stack([np.clip(3 * t, 0, 1), np.clip(3 * t - 1, 0, 1), np.clip(3 * t - 2, 0, 1)], -1)
    return (rgb * 255).round().astype(np.uint8)


def _quality_cells(q: dict) -> list[str]:
    agg = q.get("aggregate", {})
    cells = []
    for k in ("psnr", "ssim", "lpips"):
        a = agg.get(k, {})
        if a.get("available") is False:
            cells.append("n/a")
        elif a.get("n") == 0:
            cells.append("– (no finite image)")
        elif "mean" in a:
            cells.append(f"{fmt(a['mean'], 2 if k == 'psnr' else 4)} ± {fmt(a['std'], 2 if k == 'psnr' else 4)} "
                         f"(min {fmt(a['min'] if k != 'lpips' else a['max'], 2 if k == 'psnr' else 4)})")
        else:
            cells.append("–")
    for k in ("fid", "kid"):
        a = agg.get(k, {})
        cells.append("n/a" if a.get("available") is False else fmt(a.get("value", a.get("mean")), 4) if a else "–")
    excluded = agg.get("psnr", {}).get("excluded")
    if excluded:
        cells[0] += f" [{excluded} non-finite excluded]"
    return cells


def timing(device_type: str, kernel: str) -> dict:
    """Whether an eval's times measure speed (``speed``), and if not, why (``note``): only a GPU running the
    kernel gives speed; on a CPU, or with the emulation forced, the INT8 modes run a PyTorch emulation."""
    if device_type == "cuda" and kernel != "emulation":
        return {"speed": True, "note": None}
    where = "CPU run" if device_type != "cuda" else "GPU run with the emulation forced (DIFFUSION_INT8_BACKEND)"
    return {"speed": False, "note": f"Timings are not a speed measurement ({where}): the INT8 modes run the kernel's "
                                    f"PyTorch emulation, so no speed-up is shown; time INT8 on a GPU."}


NO_TIMINGS = {"speed": False, "note": "Scored only: the images were made elsewhere, so there are no timings."}


def timing_of(report: dict) -> dict:
    """``report``'s ``timing`` (``timing``'s dict), also for reports written before the field."""
    if "timing" in report:
        return report["timing"]
    # reports written before the field: a GPU's name, or "cpu"
    return timing("cpu" if report.get("device") in ("cpu", None) else "cuda", report.get("kernel", ""))


def vs_stock(stock_ms: float | None, ms: float | None) -> str | None:
    """The one wording of a step time against stock's: "1.64× faster than stock" or "1.22× slower than stock"."""
    if not stock_ms or not ms:
        return None
    ratio = stock_ms / ms
    return f"{ratio:.2f}× faster than stock" if ratio >= 1 else f"{1 / ratio:.2f}× slower than stock"


def sparse_variants(report: dict) -> dict[str, dict]:
    """``{variant: its sparsity}`` for the variants that skipped any (query block, key block) pair."""
    return {n: v["sparsity"] for n, v in report.get("variants", {}).items()
            if v.get("sparsity") and v["sparsity"]["overall"] > 0}


def header(report: dict) -> list[str]:
    cols = ["variant", "PSNR dB (min)", "SSIM (min)", "LPIPS (max)", "FID", "KID", "denoiser ms/step"]
    return (cols + (["vs stock"] if timing_of(report)["speed"] else []) + ["s/image", "peak MiB"]
            + (["GPU J/image"] if _has_energy(report) else []) + ["INT8 / gated calls"]
            + (["blocks skipped"] if sparse_variants(report) else []))


def _has_energy(report: dict) -> bool:
    return report["baseline"].get("speed", {}).get("joules_per_image") is not None


def _peak(report: dict, speed: dict) -> str:
    if speed.get("peak_memory_mib") is not None:
        return fmt(speed["peak_memory_mib"], 0)
    if speed and report.get("device") == "cpu":
        return "n/a (CPU run)"  # GPU memory is all it measures
    return "–"


def _rows(report: dict) -> list[list[str]]:
    base = report["baseline"]["speed"]
    show_ratio = timing_of(report)["speed"]
    show_sparsity = bool(sparse_variants(report))
    show_energy = _has_energy(report)
    rows = []
    for name, v in [(report["baseline"]["name"], report["baseline"]), *report["variants"].items()]:
        sp = v.get("speed", {})
        ms = sp.get("denoiser_ms_per_step")
        ratio = ["stock" if v is report["baseline"] else (vs_stock(base.get("denoiser_ms_per_step"), ms) or "–")]
        rows.append([name, *(_quality_cells(v["quality"]) if "quality" in v else ["reference"] + ["–"] * 4),
                     fmt(ms, 2), *(ratio if show_ratio else []), fmt(sp.get("seconds_per_image"), 3),
                     _peak(report, sp), *([fmt(sp.get("joules_per_image"), 1)] if show_energy else []), _calls(sp)]
                    + ([_skipped(v.get("sparsity"))] if show_sparsity else []))
    return rows


def _skipped(sparsity: dict | None) -> str:
    return "–" if not sparsity else f"{sparsity['overall']:.1%}"


BALANCE_NOTE = ("Q·Kᵀ balance (against outlier channels that Q or K carries alone), per variant: what its "
                "attention modules did.")


def balance_lines(report: dict) -> list[tuple[str, str]]:
    """(variant, "on (…): N modules; off (…): M modules") for the variants whose modules reported the balance."""
    out = []
    for name, v in report["variants"].items():
        counts = v["speed"].get("qk_balance")
        if counts:
            out.append((name, "; ".join(f"{status}: {n} module{'s' if n != 1 else ''}"
                                        for status, n in counts.items())))
    return out


def sparsity_lines(report: dict) -> list[tuple[str, str]]:
    """Per sparse variant: its name and the fraction of blocks skipped at each step, e.g. ``0% 0% 41% 44%``."""
    return [(n, " ".join(f"{x:.0%}" for x in s["per_step"])) for n, s in sparse_variants(report).items()]


SPARSITY_NOTE = ("Blocks skipped: the fraction of (query block, key block) pairs of 128 tokens that block-sparse "
                 "attention did not compute, over every attention call of the run (dense calls count whole).")


def _calls(speed: dict) -> str:
    """Attention calls that ran INT8 / that the speed gate sent to SDPA."""
    if speed.get("int8_calls") is None:
        return "–"
    return f"{speed['int8_calls']} / {speed['gated_calls']}"


def non_finite(report: dict) -> dict[str, list[int]]:
    """``{variant: indices}`` of the images with NaN/Inf values, baseline first; only variants that have some."""
    entries = [(report["baseline"]["name"], report["baseline"]), *report["variants"].items()]
    return {name: v["non_finite_images"] for name, v in entries if v.get("non_finite_images")}


def _non_finite_note(report: dict) -> tuple[str, list[str]] | None:
    """The reports' paragraph on non-finite images and one line per variant, or None when there are none."""
    bad = non_finite(report)
    if not bad:
        return None
    items = report.get("items") or []
    label = lambda i: f"#{i}" + (f" ({items[i]})" if i < len(items) else "")  # noqa: E731
    lines = [f"{name}: {', '.join(label(i) for i in idx)}" for name, idx in bad.items()]
    return (f"Images with NaN/Inf values. They are not scored: each variant's PSNR, SSIM, LPIPS, FID and KID "
            f"leave out its own non-finite images and those of the reference ({report['baseline']['name']}); "
            f"the saved PNGs show NaN as black.", lines)


def write_json(report: dict, out: Path) -> Path:
    path = out / "report.json"
    jsonfile.write(path, report)
    return path


READING_NOTE = ("Reading the table: against the stock images, a PSNR above about 35 dB is hard to tell apart by "
                "eye and one below about 25 dB visibly different; SSIM near 1 (above about 0.98) keeps the "
                "structure; LPIPS near 0 (below about 0.05) looks the same (common rules of thumb, not thresholds "
                "of this tool). INT8 / gated calls: attention calls that ran the INT8 kernel / calls the speed gate "
                "kept on SDPA because INT8 would not be faster at their shape on this device.")
ENERGY_NOTE = ("GPU J/image: the energy the GPU drew per image over the timed generations (NVML's counter: the whole "
               "GPU's, so other work on it counts too).")


FORCED_NOTE = ("The speed gate was off for these rows (INT8 in every call a variant's mode covers), so they show "
               "INT8's quality and its speed at this model's shapes; with enable()'s default gate, calls where INT8 "
               "would not be faster on this GPU run SDPA at stock speed.")


def reading_note(report: dict) -> str:
    """The note under the quality table: how to read it, the energy column where there is one, and on a GPU run
    made with the speed gate off (``evaluate(speed_gate=False)``, the demo's) that its INT8 rows were forced."""
    forced = report.get("speed_gate") is False and timing_of(report)["speed"]
    return READING_NOTE + (" " + ENERGY_NOTE if _has_energy(report) else "") + (" " + FORCED_NOTE if forced else "")


def counted(n, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def run_parts(report: dict) -> list[str]:
    """What the reports say of the run: images, steps and seeds (where known: folders scored with ``--score`` were
    made elsewhere)."""
    parts = [counted(report["num_images"], "image")]
    if isinstance(report.get("steps"), int):
        parts.append(counted(report["steps"], "step"))
    if isinstance(report.get("seed"), int):
        parts.append(f"seeds {report['seed']}+i")
    if report.get("dtype"):
        parts.append(f"the model in {report['dtype']}")
    return parts


def calibration_line(c: dict) -> str:
    """Where the static-ranges variant's calibration came from (``Calibration.provenance``)."""
    where = f"from {c['path']}" if c.get("path") else "made in memory"
    checksum = f" (checksum stored in it {c['sha256'][:16]}…)" if c.get("sha256") else ""
    over = [counted(c["steps"], "denoiser call") if isinstance(c.get("steps"), int) else "",
            counted(c["num_items"], {"class_labels": "class label"}.get(c.get("items_kind"), "prompt"))
            if isinstance(c.get("num_items"), int) else ""]
    over = " and ".join(p for p in over if p)
    of = f", of {c['model']}" if c.get("model") else ""
    return f"Static ranges: calibration {where}{checksum}{of}" + (f", measured over {over}" if over else "") + "."


def write_markdown(report: dict, out: Path) -> Path:
    lines = [f"# INT8 attention evaluation: {report['model']}", "",
             f"{', '.join(run_parts(report))}, on {report['device']} (INT8 kernel: {report['kernel']}).", ""]
    if report.get("gpu_speed"):
        lines += speed_markdown(report["gpu_speed"]) + ["", "## Quality and speed of the demo's model", ""]
    note = timing_of(report)["note"]
    lines += [f"**{note}**", ""] if note else []
    cols = header(report)
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(report)]
    lines += ["", reading_note(report)]
    na = {k: v["reason"] for k, v in report["metrics_available"].items() if not v["available"]}
    if na:
        lines += ["", "Unavailable metrics:", ""] + [f"- **{k}**: {r}" for k, r in na.items()]
    note = _non_finite_note(report)
    if note:
        lines += ["", f"**{note[0]}**", ""] + [f"- {ln}" for ln in note[1]]
    if report.get("schedule"):
        s = report["schedule"]
        lines += ["", f"Schedule `{s['name']}` per step: {' '.join(s['per_step'])}"]
    if report.get("calibration"):
        lines += ["", calibration_line(report["calibration"])]
    balance = balance_lines(report)
    if balance:
        lines += ["", BALANCE_NOTE, ""] + [f"- `{name}`: {text}" for name, text in balance]
    if sparse_variants(report):
        lines += ["", SPARSITY_NOTE + " Per denoising step:", ""]
        lines += [f"- `{name}`: {steps}" for name, steps in sparsity_lines(report)]
    lines += ["", "Images: " + ", ".join(f"`{p}`" for p in report["image_dirs"].values()), ""]
    path = out / "report.md"
    jsonfile.write_bytes(path, "\n".join(lines).encode())
    return path


def schedule_plot(report: dict) -> str | None:
    """PNG data URI: the mode of each step and, when calibrated, the measured error per step; None without matplotlib."""
    s = report.get("schedule")
    if not s:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    with matplotlib.rc_context(PLAIN_TEXT):
        order = ["int8", "int8_fp16v", "fp16"]
        fig, ax = plt.subplots(figsize=(7, 2.8))
        steps = list(range(len(s["per_step"])))
        ax.step(steps, [order.index(m) for m in s["per_step"]], where="mid", color="C0", lw=2, label="mode")
        ax.set_yticks(range(3), order)
        ax.set_xlabel("denoising step")
        if s.get("errors"):
            ax2 = ax.twinx()
            for i, (mode, errs) in enumerate(s["errors"].items()):
                ax2.plot(range(len(errs)), errs, ls="--", marker=".", color=f"C{i + 1}", label=f"{mode} error (calibrated)")
            ax2.set_ylabel("attention rel. L1, worst layer")
            ax2.legend(fontsize=7, loc="upper right")
        ax.set_title(f"schedule {s['name']}")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


GRID_WIDTH = 1180  # pixels the image grid may take: a 1280-pixel window less the page's margins and a scrollbar
LABEL_WIDTH = 96  # the label column; longer labels wrap
MAX_IMAGE_WIDTH = 256  # larger images are shown at this width (the PNG keeps every pixel)


def grid_pages(names: list[str], shown: int) -> list[list[str]]:
    """The variants (not the reference, ``names[0]``) split into tables that fit ``GRID_WIDTH``: each table
    shows the label, the reference and, per variant, its image and its heat map, ``shown`` pixels each."""
    cell = shown + 8  # padding and borders
    per_table = max(1, (GRID_WIDTH - LABEL_WIDTH - cell) // (2 * cell))
    variants = names[1:]
    return [variants[i:i + per_table] for i in range(0, len(variants), per_table)] or [[]]


def write_html(report: dict, images: dict[str, torch.Tensor], labels: list[str], out: Path, max_rows: int = 32) -> Path:
    """``images``: {variant: (N, 3, H, W)} with the baseline first."""
    e = html.escape
    names = list(images)
    ref = images[names[0]]
    scale = max(1, 128 // ref.shape[-1])
    shown = min(ref.shape[-1] * scale, MAX_IMAGE_WIDTH)
    diffs = {n: (images[n] - ref).abs().mean(1) for n in names[1:]}
    vmax = 0.1  # a tenth of the range at white: small differences stay visible, larger ones saturate
    bad = {n: set(idx) for n, idx in non_finite(report).items()}
    uri = {}  # each picture encoded once, whichever tables repeat it

    def img(key, make, alt):
        if key not in uri:
            uri[key] = make()
        return f"<img src='{uri[key]}' width={shown} alt='{e(alt)}'>"

    def cell(n, i):
        flag = i in bad.get(n, ())
        out = [f"<td{' class=nonfinite' if flag else ''}>"
               + img(("img", n, i), lambda: _png_uri(_to_uint8(images[n][i]), scale), f"{n} {i}")
               + ("<div>NaN/Inf</div>" if flag else "") + "</td>"]
        if n in diffs:
            out.append("<td>" + img(("diff", n, i), lambda: _png_uri(heatmap(diffs[n][i], vmax), scale), f"diff {n} {i}")
                       + "</td>")
        return out

    pages = grid_pages(names, shown)
    tables = []
    for k, page_names in enumerate(pages):
        shown_names = [names[0], *page_names]
        head = "".join(f"<th>{e(n)}</th>" + (f"<th>|{e(n)} − {e(names[0])}|</th>" if n in diffs else "")
                       for n in shown_names)
        body = []
        for i in range(min(len(ref), max_rows)):
            cells = [f"<td class=label>{e(str(labels[i]))}</td>"] + [c for n in shown_names for c in cell(n, i)]
            body.append("<tr>" + "".join(cells) + "</tr>")
        first = 1 + sum(len(p) for p in pages[:k])
        last = first + len(page_names) - 1
        span = f"Variant {first}" if last == first else f"Variants {first}–{last}"
        caption = f"<h3>{span} of {len(names) - 1}</h3>" if len(pages) > 1 else ""
        tables.append(f'{caption}<table class="grid"><tr><th></th>{head}</tr>{"".join(body)}</table>')
    timing_note = timing_of(report)["note"]
    per_step = ("median over steps after a warm-up run; a variant that carries skipped blocks, the mean, as its "
                "refresh steps cost more than the others")
    speed_note = (f"Speed: denoiser time per step ({per_step}), and how much faster or slower than stock "
                  f"({e(names[0])}) it is." if timing_of(report)["speed"] else
                  f"Times: denoiser time per step ({per_step}) and seconds per image.")
    table = "".join(f"<th>{e(h)}</th>" for h in header(report))
    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in _rows(report))
    na = [f"<li><b>{e(k)}</b>: {e(v['reason'])}</li>" for k, v in report["metrics_available"].items() if not v["available"]]
    plot = schedule_plot(report)
    sparsity_html = ""
    if sparse_variants(report):
        sparsity_html = (f'<h2>Block sparsity</h2><p class="note">{e(SPARSITY_NOTE)}</p><table class="metrics">'
                         "<tr><th>variant</th><th>overall</th><th>per denoising step</th></tr>"
                         + "".join(f"<tr><td>{e(n)}</td><td>{_skipped(sparse_variants(report)[n])}</td>"
                                   f"<td style='text-align:left'>{e(steps)}</td></tr>"
                                   for n, steps in sparsity_lines(report)) + "</table>")
    balance = balance_lines(report)
    balance_html = (f'<p class="note">{e(BALANCE_NOTE)}</p><ul class="note">'
                    + "".join(f"<li><code>{e(n)}</code>: {e(t)}</li>" for n, t in balance) + "</ul>") if balance else ""
    note = _non_finite_note(report)
    note_html = (f'<p class="warn">{e(note[0])}</p><ul class="warn">' + "".join(f"<li>{e(ln)}</li>" for ln in note[1])
                 + "</ul>") if note else ""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>INT8 attention evaluation — {e(report['model'])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:24px;color:#222}} table{{border-collapse:collapse}}
.metrics td,.metrics th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} .metrics td:first-child{{text-align:left}}
.grid td{{padding:2px;text-align:center}} .grid img{{image-rendering:pixelated;display:block}}
.grid th{{font-size:12px;font-weight:600;max-width:{shown}px;overflow-wrap:anywhere;vertical-align:bottom}}
.label{{font-size:12px;text-align:right;max-width:{LABEL_WIDTH}px;overflow-wrap:anywhere}}
.note{{color:#555;font-size:13px}} .warn{{color:#a00;font-weight:600}}
.nonfinite{{outline:2px solid #d00}} .nonfinite div{{color:#d00;font-size:11px}}
</style></head>
<body data-images-ok="pending" data-errors="" data-scroll-width="" data-window-width="">
<h1>INT8 attention evaluation</h1>
<p>Model <code>{e(report['model'])}</code> · {' · '.join(e(p) for p in run_parts(report))} ·
device {e(report['device'])} · INT8 kernel: {e(report['kernel'])} · {e(report['created'])}</p>
{speed_html(report['gpu_speed']) if report.get('gpu_speed') else ''}
<h2>Metrics against {e(names[0])}</h2>
{f'<p class="warn">{e(timing_note)}</p>' if timing_note else ''}
<table class="metrics"><tr>{table}</tr>{rows}</table>
<p class="note">Mean ± std over images; PSNR and SSIM show the worst image in brackets, LPIPS the worst (largest).
{speed_note}</p>
<p class="note">{e(reading_note(report))}</p>
{'<ul class="note">' + ''.join(na) + '</ul>' if na else ''}
{balance_html}
{note_html}
{f'<p class="note">{e(calibration_line(report["calibration"]))}</p>' if report.get("calibration") else ''}
{f'<h2>Schedule</h2><img src="{plot}" alt="schedule" style="max-width:100%">' if plot else ''}
{sparsity_html}
<h2>Images</h2>
<p class="note">Heat maps: mean absolute difference over channels, black = 0, white ≥ {vmax} (of the [0, 1] range).</p>
{''.join(tables)}
<script>
window.addEventListener("error", ev => {{ document.body.dataset.errors += ev.message + ";"; }});
window.addEventListener("load", () => {{
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.imagesOk = ok + "/" + imgs.length;
  document.body.dataset.scrollWidth = document.documentElement.scrollWidth;
  document.body.dataset.windowWidth = window.innerWidth;
}});
</script>
</body></html>
"""
    path = out / "report.html"
    jsonfile.write_bytes(path, page.encode())
    return path


def _gate_words(row: dict) -> str:
    """The gate's decision on a call of the speed section: INT8, SDPA, or SDPA in eager calls alone."""
    if row["gate_int8"]:
        return "INT8"
    return "SDPA eager, INT8 in CUDA graphs" if row.get("gate_int8_graphs") else "SDPA"


def speed_markdown(section: dict) -> list[str]:
    """``speed.measure``'s section as Markdown lines: the headline, the calls' table and the steps' table."""
    lines = ["## Speed on this GPU", "", f"**{section['headline']}**", "",
             f"Measured on {section['device']}, {section['date']}. Attention calls replayed from CUDA graphs, each INT8 "
             f"mode against SDPA in the same rounds (× = SDPA's time over the mode's); \"you get\" is what `enable()` "
             f"does by default in an eager call (`int8` where the speed gate lets it, SDPA elsewhere).", "",
             "| model | call (B, H, S, D) | SDPA ms | int8_fp16v | int8 | the gate | you get |", "|---|---|---|---|---|---|---|"]
    for r in section["calls"]:
        mask = f", {r['masked_text']} text tokens, a quarter padded" if r["masked_text"] else ""
        lines.append(f"| {r['model']} ({r['what']}) | {tuple(r['shape'])} {r['dtype']}{mask} | {r['sdpa_ms']:.2f} | "
                     f"{r['int8_fp16v_speedup']:.2f}× | {r['int8_speedup']:.2f}× | "
                     f"{_gate_words(r)} | {r['you_get']:.2f}× |")
    if section["steps"]:
        lines += ["", "Whole denoiser steps, eager, stock against `enable()`'s defaults, taking turns over 3 rounds "
                  "(each the median of 5 steps after warm-up; × the median of the rounds' ratios):", "",
                  "| model | stock ms | INT8 ms | × | INT8 / gated calls |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['stock_ms']:.1f} | {r['int8_ms']:.1f} | {r['speedup']:.2f}× | "
                  f"{r['int8_calls']} / {r['gated_calls']} |" for r in section["steps"]]
    return lines




def speed_html(section: dict) -> str:
    """The section as HTML: ``speed_markdown``'s content, its tables as tables."""
    escape = html.escape

    out, table = [], []

    def flush():
        if table:
            head, *body = table
            cells = lambda row, tag: "".join(f"<{tag}>{escape(c)}</{tag}>" for c in row)  # noqa: E731
            out.append(f'<table class="metrics"><tr>{cells(head, "th")}</tr>'
                       + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in body) + "</table>")
            table.clear()

    for line in speed_markdown(section):
        if line.startswith("|"):
            if not line.startswith("|---"):
                table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h2>{escape(line[3:])}</h2>")
        elif line.startswith("**"):
            out.append(f"<p><strong>{escape(line.strip('*'))}</strong></p>")
        elif line:
            out.append(f'<p class="note">{escape(line.replace("`", ""))}</p>')
    flush()
    return "\n".join(out)
