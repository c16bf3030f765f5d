"""Evaluation: metrics per image and per set, offline-weights messages, reports, the HTML in Chromium, the CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import types
import warnings

import pytest
import torch

from diffusion_int8.eval import metrics as M
from diffusion_int8.eval.score import Scorer, load_folder, save_images
from processes import ONE_THREAD, accelerate_launch, cli_env


def test_psnr_and_ssim_are_per_image_float64():
    ref = torch.rand(3, 3, 32, 32)
    x = (ref + 0.05 * torch.randn_like(ref)).clamp(0, 1)
    p, s = M.psnr(x, ref), M.ssim(x, ref)
    assert p.shape == s.shape == (3,) and p.dtype == s.dtype == torch.float64
    assert math.isinf(float(M.psnr(ref, ref)[0]))
    torch.testing.assert_close(M.ssim(ref, ref), torch.ones(3, dtype=torch.float64))
    # each image scored alone gives its own score: no mixing across the batch
    torch.testing.assert_close(M.ssim(x[1:2], ref[1:2]), s[1:2])
    torch.testing.assert_close(M.psnr(x[1:2], ref[1:2]), p[1:2])
    noisy = (ref + 0.2 * torch.randn_like(ref)).clamp(0, 1)
    assert (M.ssim(noisy, ref) < s).all() and (M.psnr(noisy, ref) < p).all()
    # images smaller than the 11-pixel window still get a score; under 3 pixels, NaN
    assert torch.isfinite(M.ssim(x[:, :, :7, :9], ref[:, :, :7, :9])).all()
    assert torch.isnan(M.ssim(x[:, :, :2, :2], ref[:, :, :2, :2])).all()


def test_equal_images_aggregate_to_inf_without_spread_and_nan_prints_as_na():
    from diffusion_int8.eval.report import fmt

    ref = torch.rand(3, 3, 16, 16)
    same = M.aggregate(M.psnr(ref, ref))  # the speed gate sent every call to SDPA: the images equal FP16's
    assert same["mean"] == math.inf and same["std"] == 0.0 and same["n_finite"] == 0
    mixed = M.aggregate(torch.tensor([30.0, math.inf]))
    assert mixed["mean"] == math.inf and math.isnan(mixed["std"])
    assert (fmt(same["mean"]), fmt(same["std"]), fmt(mixed["std"]), fmt(-math.inf)) == ("∞", "0.000", "n/a", "−∞")


def test_variants_refuse_a_refresh_without_sparsity_and_speed_counts_images_not_processes():
    from diffusion_int8.eval.run import _merge_speed, variants

    with pytest.raises(ValueError, match="refresh_every=2 carries the blocks sparsity skips"):
        variants(refresh_every=2)
    part = lambda images, s, j: {"denoiser_ms_per_step": 10.0 if images else None, "denoiser_calls": 3 * images,  # noqa: E731
                                 "images": images, "seconds_per_image": s, "peak_memory_mib": None,
                                 "joules_per_image": j, "int8_calls": None, "gated_calls": None, "blocks": None,
                                 "qk_balance": None}
    # a launch with more processes than batches: the idle ones made no image and count for nothing
    merged = _merge_speed([part(2, 2.0, 50.0), part(6, 1.0, 10.0), part(0, 0.0, 0.0), part(0, 0.0, 0.0)])
    assert merged["seconds_per_image"] == pytest.approx((2 * 2.0 + 6 * 1.0) / 8)
    assert merged["joules_per_image"] == pytest.approx((2 * 50.0 + 6 * 10.0) / 8)
    assert merged["images"] == 8 and merged["denoiser_ms_per_step"] == 10.0
    assert _merge_speed([part(1, 3.0, None)])["joules_per_image"] is None


class RandomFeatures(torch.nn.Module):
    """A feature network built here with random weights, in place of Inception."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g))

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 2).flatten(1)


def test_fid_and_kid():
    net = RandomFeatures()
    imgs = torch.rand(64, 3, 16, 16)
    shifted = (imgs * 0.5 + 0.4).clamp(0, 1)
    fid_same, kid_same = M.fid_kid(net, imgs, imgs, kid_subset_size=32, kid_subsets=10)
    fid, kid = M.fid_kid(net, shifted, imgs, kid_subset_size=32, kid_subsets=10)
    assert abs(fid_same["value"]) < 1e-4 and fid["value"] > 1.0 and fid["n"] == 64
    assert abs(kid_same["mean"]) < 0.05 * kid["mean"] and kid["std"] > 0 and kid["n"] == 64
    # KID's subsets are drawn from its seed, and the caller's random stream is left alone
    state = torch.get_rng_state()
    assert M.fid_kid(net, shifted, imgs, kid_subset_size=32, kid_subsets=10)[1] == kid
    assert torch.equal(torch.get_rng_state(), state)
    # subsets larger than the sets are cut to the sets; fewer than 2 images are reported, not computed
    assert M.fid_kid(net, shifted[:8], imgs[:8])[1]["n"] == 8
    one = M.fid_kid(net, shifted[:1], imgs[:1])
    assert one[0]["available"] is False and "at least 2 images" in one[1]["reason"]


def test_offline_weights_are_reported_not_invented(tmp_path, monkeypatch):
    import torchmetrics  # noqa: F401 - imported before torchvision is faked below (it looks torchvision up on import)

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    # with the packages importable (faked here) the message names the weights and how to give them
    monkeypatch.setitem(sys.modules, "lpips", types.ModuleType("lpips"))
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    un = M.lpips_model()
    assert isinstance(un, M.Unavailable)
    assert M.ALEXNET_FILE in un.reason and "--lpips-weights" in un.reason and str(tmp_path / "empty") in un.reason
    fake_fid = types.ModuleType("torch_fidelity.feature_extractor_inceptionv3")
    fake_fid.FeatureExtractorInceptionV3 = object
    monkeypatch.setitem(sys.modules, "torch_fidelity", types.ModuleType("torch_fidelity"))
    monkeypatch.setitem(sys.modules, "torch_fidelity.feature_extractor_inceptionv3", fake_fid)
    un = M.inception_model()
    assert isinstance(un, M.Unavailable) and "--fid-weights" in un.reason and M.INCEPTION_FILE in un.reason
    # without the packages the reason says what to install
    monkeypatch.setitem(sys.modules, "lpips", None)
    assert "pip install --no-deps lpips torch-fidelity" in M.lpips_model().reason
    # the scorer reports them unavailable and still computes PSNR and SSIM
    scorer = Scorer()
    x = torch.rand(4, 3, 16, 16)
    out = scorer.score(x * 0.9, x)
    assert out["aggregate"]["lpips"]["available"] is False and out["aggregate"]["fid"]["available"] is False
    assert len(out["per_image"]["psnr"]) == 4 and "lpips" not in out["per_image"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


WINDOW = (1280, 900)


def chromium_body(path) -> str:
    """The ``<body>`` tag of ``path`` after its scripts ran, in headless Chromium with a 1280×900 window."""
    import re
    import tempfile

    exe = chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (`apt-get install chromium`; .ci/run installs it)")
    with tempfile.TemporaryDirectory() as profile:
        res = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                              "--no-first-run", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                              f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=5000",
                              "--dump-dom", path.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    body = re.search(r"<body[^>]*>", res.stdout)
    assert body, f"Chromium printed no <body> tag: {res.stdout[:500]!r} {res.stderr[-2000:]}"
    return body.group(0)


def page_width(body: str) -> int:
    """The page's scroll width that the report's script wrote, after checking the window was 1280 wide."""
    import re

    window = re.search(r'data-window-width="(\d+)"', body)
    assert window and int(window.group(1)) == WINDOW[0], body
    return int(re.search(r'data-scroll-width="(\d+)"', body).group(1))


def check_html_static(path):
    """What needs no browser: the page parses with every element closed, and every image it shows is a file
    beside it (or inline data)."""
    from html.parser import HTMLParser

    void = {"img", "br", "meta", "link", "input", "hr", "col", "source", "wbr"}

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.open, self.images, self.errors = [], [], []

        def handle_starttag(self, tag, attrs):
            if tag == "img":
                self.images.append(dict(attrs).get("src", ""))
            elif tag not in void:
                self.open.append(tag)

        def handle_endtag(self, tag):
            if tag in void:
                return
            if not self.open or self.open[-1] != tag:
                self.errors.append(f"</{tag}> closes {self.open[-1] if self.open else 'nothing'}")
            else:
                self.open.pop()

    page = Page()
    page.feed(path.read_text())
    page.close()
    assert not page.errors and not page.open, (page.errors[:3], page.open[-3:])
    assert page.images, "no images"
    for src in page.images:
        assert src.startswith("data:image/") or (path.parent / src).is_file(), src


def check_html_in_chromium(path):
    """``check_html_static``, then, where Chromium is installed (CI installs it), the page as it renders: every
    image loaded, no script error, no sideways scrolling in a 1280-pixel window. Without Chromium the rendered
    checks are left out with a warning, and the caller's test goes on."""
    import re

    check_html_static(path)
    if chromium() is None:
        warnings.warn(f"Chromium is not installed: {path.name} was checked without rendering it", UserWarning)
        return
    body = chromium_body(path)
    ok = re.search(r'data-images-ok="(\d+)/(\d+)"', body)
    assert ok, body
    loaded, total = map(int, ok.groups())
    assert total > 0 and loaded == total, body
    assert 'data-errors=""' in body, body
    assert page_width(body) <= WINDOW[0], body  # no horizontal scrolling in a 1280-pixel window


def run_eval(args, cwd, launcher=(sys.executable,), **env):
    """The eval CLI in ``cwd`` (under ``launcher``), with no metric weights (an empty ``TORCH_HOME``) whatever this
    machine caches; ``env``: more environment variables."""
    return subprocess.run([*launcher, "-m", "diffusion_int8", "eval", *args], cwd=cwd,
                          env=cli_env(TORCH_HOME=str(cwd / "torch-home"), **env), capture_output=True, text=True,
                          timeout=900)


def test_eval_cli_end_to_end(tmp_path):
    args = ["--model", "embedded", "--class-labels", "red circle", "yellow square", "blue ring",
            "--steps", "3", "--batch-size", "2", "--schedule", "balanced", "--out", "rep"]
    res = run_eval(args, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "rep"
    report = json.loads((out / "report.json").read_text())
    assert set(report["variants"]) == {"int8", "int8_fp16v", "schedule:balanced"}
    for v in report["variants"].values():
        psnr = v["quality"]["aggregate"]["psnr"]
        assert psnr["n"] == 3 and 15 < psnr["mean"] and v["speed"]["denoiser_ms_per_step"] > 0
        assert v["quality"]["aggregate"]["lpips"]["available"] is False  # no weights here: said, not made up
    assert report["schedule"]["per_step"] and len(report["schedule"]["per_step"]) == 3
    assert "| int8 |" in (out / "report.md").read_text()
    assert len(list((out / "images" / "fp16").glob("*.png"))) == 3
    check_html_in_chromium(out / "report.html")

    again = run_eval(args, tmp_path)
    assert again.returncode != 0 and "--overwrite" in again.stderr

    # scoring folders made elsewhere: the same numbers as the full run
    res = run_eval(["--score", "rep/images/fp16", "rep/images/int8", "--out", "scores"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    scored = json.loads((tmp_path / "scores" / "report.json").read_text())
    assert scored["variants"]["int8"]["quality"]["per_image"]["psnr"] == pytest.approx(
        report["variants"]["int8"]["quality"]["per_image"]["psnr"], rel=1e-6)
    check_html_in_chromium(tmp_path / "scores" / "report.html")


def test_generate_only_then_score(tmp_path):
    res = run_eval(["--model", "embedded", "--class-labels", "0", "5", "--steps", "2", "--modes", "int8",
                    "--generate-only", "--out", "gen"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "gen" / "report.html").exists()
    names, imgs = load_folder(tmp_path / "gen" / "images" / "int8")
    assert names == ["00000.png", "00001.png"] and imgs.shape == (2, 3, 32, 32)


def test_folder_round_trip_and_mismatch(tmp_path):
    x = torch.rand(3, 3, 8, 8)
    save_images(x, tmp_path / "a", [0, 1, 2])
    names, back = load_folder(tmp_path / "a")
    assert names == ["00000.png", "00001.png", "00002.png"]
    assert (back - x).abs().max() <= 0.5 / 255 + 1e-6
    with pytest.raises(FileNotFoundError, match="no images"):
        load_folder(tmp_path)


def test_eval_sharded_across_two_processes_matches_one(tmp_path):
    args = ["--model", "embedded", "--class-labels", "0", "5", "10", "--steps", "2", "--batch-size", "1", "--modes", "int8"]
    # every process one thread, as accelerate gives each: only the sharding differs
    one = run_eval(args + ["--out", "one"], tmp_path, **ONE_THREAD)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_eval(args + ["--out", "two"], tmp_path, accelerate_launch(2), **ONE_THREAD)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    assert b["baseline"]["speed"]["processes"] == 2
    assert a["variants"]["int8"]["quality"]["per_image"] == b["variants"]["int8"]["quality"]["per_image"]
    for i in range(3):
        assert (tmp_path / "one/images/int8" / f"{i:05d}.png").read_bytes() == (tmp_path / "two/images/int8" / f"{i:05d}.png").read_bytes()


def test_non_finite_images_are_flagged_and_not_scored(tmp_path, monkeypatch, capsys):
    """An int8 image with NaN and a reference image with Inf: flagged in the three reports, one terminal
    warning, and left out of the metrics (int8 scores 1 image of 3, int8_fp16v 2)."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from diffusion_int8.__main__ import main
    from diffusion_int8.eval import run as eval_run

    real = eval_run.run_variant

    def run_variant(pipe, model, items, batches, device, config, **kw):
        images, speed, per_step = real(pipe, model, items, batches, device, config, **kw)
        if config is None:
            images[2][0, 3, 4] = float("inf")
        elif config.mode.value == "int8" and config.schedule is None:
            images[1][:, :5] = float("nan")
        return images, speed, per_step

    monkeypatch.setattr(eval_run, "run_variant", run_variant)
    labels = ["red circle", "yellow square", "blue ring"]
    assert main(["eval", "--class-labels", *labels, "--steps", "2", "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "NaN/Inf" in ln]
    assert warnings == ["warning: images with NaN/Inf values: fp16 #2; int8 #1. They are flagged in the report "
                        "and left out of the quality metrics."], err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["baseline"]["non_finite_images"] == [2]
    int8, fp16v = report["variants"]["int8"], report["variants"]["int8_fp16v"]
    assert int8["non_finite_images"] == [1] and fp16v["non_finite_images"] == []
    assert int8["quality"]["excluded"] == [1, 2] and fp16v["quality"]["excluded"] == [2]
    psnr = int8["quality"]["per_image"]["psnr"]
    assert psnr[1] is None and psnr[2] is None and math.isfinite(psnr[0])
    agg = int8["quality"]["aggregate"]
    assert agg["psnr"]["n"] == 1 and agg["psnr"]["excluded"] == 2 and agg["psnr"]["mean"] == pytest.approx(psnr[0])
    assert agg["ssim"]["n"] == 1 and fp16v["quality"]["aggregate"]["psnr"]["n"] == 2
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Images with NaN/Inf values. They are not scored" in md
    assert "- fp16: #2 (blue ring)" in md and "- int8: #1 (yellow square)" in md
    assert "[2 non-finite excluded]" in md and "[1 non-finite excluded]" in md
    page = (tmp_path / "rep" / "report.html").read_text()
    assert page.count("class=nonfinite") == 2 and "int8: #1 (yellow square)" in page
    check_html_in_chromium(tmp_path / "rep" / "report.html")
    # the saved PNGs are images all the same: NaN is black
    _, imgs = load_folder(tmp_path / "rep" / "images" / "int8")
    assert (imgs[1, :, :5] == 0).all()


def test_eval_progress_counts_denoising_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from diffusion_int8.__main__ import main
    from diffusion_int8.eval import run as eval_run
    from test_calibration import RecordingBar

    RecordingBar.made = []
    monkeypatch.setattr(eval_run, "tqdm", RecordingBar)
    assert main(["eval", "--class-labels", "red circle", "blue ring", "green triangle", "--steps", "2",
                 "--batch-size", "2", "--modes", "int8", "--generate-only", "--out", str(tmp_path / "gen")]) == 0
    (bar,) = RecordingBar.made
    # 2 variants (fp16, int8) × 2 batches × 2 steps, one tick per step; the warm-up run is not counted
    assert bar.total == 8 and bar.updates == [1] * 8 and bar.postfix == ["fp16", "int8"]


LONG_NAMES = ["fp16", "int8", "int8_fp16v", "schedule:calibrated(rel_l1<=0.015)",
              "schedule:calibrated(rel_l1<=0.015)+static-ranges"]


def synthetic_report(tmp_path, size: int, device: str = "cpu", kernel: str = "emulation"):
    """A report of four variants with long names over four ``size``-pixel images, written by report.py."""
    from diffusion_int8.eval import report as R

    g = torch.Generator().manual_seed(0)
    ref = torch.rand(4, 3, size, size, generator=g)
    images = {n: (ref + 0.02 * i * torch.randn(ref.shape, generator=g)).clamp(0, 1) for i, n in enumerate(LONG_NAMES)}
    speed = lambda ms: {"denoiser_ms_per_step": ms, "denoiser_calls": 3, "images": 4, "seconds_per_image": 0.5,  # noqa: E731
                        "peak_memory_mib": 812.0 if device == "cuda" else None, "int8_calls": 6, "gated_calls": 0,
                        "joules_per_image": 12.34 if device == "cuda" else None}
    report = {"created": "2026-11-25T00:00:00+00:00", "model": "embedded", "device": "NVIDIA H100" if device == "cuda" else "cpu",
              "kernel": kernel, "timing": R.timing(device, kernel), "steps": 3, "seed": 0, "num_images": 4,
              "items": ["yellow square with a long label"] * 4, "baseline": {"name": "fp16", "speed": speed(10.0)},
              "variants": {n: {"speed": speed(ms), "quality": Scorer().score(images[n], ref)}
                           for n, ms in zip(LONG_NAMES[1:], (8.0, 12.5, 10.0, 20.0))},
              "metrics_available": {}, "image_dirs": {n: f"images/{n}" for n in LONG_NAMES}}
    out = tmp_path / f"{device}-{size}"
    out.mkdir()
    R.write_markdown(report, out)
    R.write_html(report, images, report["items"], out)
    return out


@pytest.mark.parametrize("size, tables", [(32, 2), (96, 1), (512, 4)])  # 32 px are shown at 128, 512 at 256
def test_report_fits_a_1280px_window(tmp_path, size, tables):
    """Four variants with long names (the calibrated schedule with static ranges among them): the grid splits
    into tables, names wrap, and the page never scrolls sideways; a page wider than the window does."""
    out = synthetic_report(tmp_path, size)
    page = (out / "report.html").read_text()
    check_html_static(out / "report.html")
    assert page.count('<table class="grid">') == tables and (" of 4</h3>" in page) == (tables > 1)
    assert "4–4" not in page and ("<h3>Variant 4 of 4</h3>" in page or tables < 4)  # one variant: not a range
    assert "schedule:calibrated(rel_l1&lt;=0.015)+static-ranges" in page  # every variant is still shown
    if chromium() is None:
        pytest.skip("the page width needs Chromium (`apt-get install chromium`; .ci/run installs it)")
    check_html_in_chromium(out / "report.html")
    wide = tmp_path / "wide.html"  # the measurement itself: a page that does not fit reads wider than 1280
    wide.write_text(page.replace("<h1>", '<div style="width:2000px">x</div><h1>', 1))
    assert page_width(chromium_body(wide)) > WINDOW[0]


def test_cpu_timings_are_not_called_speed_and_gpu_ratios_have_one_wording(tmp_path):
    from diffusion_int8.eval import report as R

    assert R.vs_stock(10.0, 8.0) == "1.25× faster than stock" and R.vs_stock(10.0, 12.5) == "1.25× slower than stock"
    assert R.vs_stock(None, 8.0) is None
    cpu = synthetic_report(tmp_path, 32)
    for name in ("report.md", "report.html"):
        text = (cpu / name).read_text()
        assert "not a speed measurement (CPU run)" in text and "emulation" in text, name
        assert "faster than stock" not in text and "slower than stock" not in text and "speed-up</th>" not in text
        assert "vs stock" not in text and "n/a (CPU run)" in text  # peak memory says why it is missing
        assert "J/image" not in text  # no energy counter: no column
    gpu = synthetic_report(tmp_path, 32, device="cuda", kernel="triton")
    md = (gpu / "report.md").read_text()
    assert "not a speed measurement" not in md and "| vs stock |" in md
    assert "| int8 |" in md and "1.25× faster than stock" in md and "1.25× slower than stock" in md and "2.00× slower" in md
    assert "| 812 | 12.3 |" in md and "| GPU J/image |" in md and "GPU J/image: the energy" in md
    assert "1.25× faster than stock" in (gpu / "report.html").read_text()
    # a GPU run that forces the emulation is no speed measurement either
    assert R.timing("cuda", "emulation")["speed"] is False and R.timing("cuda", "triton")["speed"] is True


def test_a_gpu_report_made_with_the_gate_off_says_its_int8_rows_were_forced(tmp_path):
    # the demo evaluates with the speed gate off (its model's shapes would all go to SDPA on a GPU): its rows' "slower
    # than stock" is INT8 forced, which the note under the table says; with the gate on, or on a CPU, it says nothing
    from diffusion_int8.eval import report as R

    def note(device, kernel, gate):
        report = {"timing": R.timing(device, kernel), "speed_gate": gate, "baseline": {"speed": {}}, "variants": {}}
        return R.reading_note(report)

    assert R.FORCED_NOTE in note("cuda", "triton", False)
    assert R.FORCED_NOTE not in note("cuda", "triton", True) and R.FORCED_NOTE not in note("cpu", "emulation", False)
    assert R.FORCED_NOTE not in note("cuda", "triton", None)  # scored folders (--score): not known
    gpu = synthetic_report(tmp_path, 32, device="cuda", kernel="triton")
    assert R.FORCED_NOTE not in (gpu / "report.md").read_text()


def test_the_speed_section_says_where_int8_pays():
    # speed.headline and the report's section from measured rows (made up here; a GPU run makes them): the calls
    # the gate runs in INT8 are named with their speed-up, the others as staying on SDPA, and the video step
    from diffusion_int8.eval import report as R
    from diffusion_int8.eval.speed import headline

    def call(model, gate, x, graphs=None):
        return {"model": model, "what": "w", "shape": [1, 12, 32760, 128], "dtype": "bfloat16", "masked_text": 0,
                "sdpa_ms": 10.0, "int8_fp16v_ms": 10 / x, "int8_fp16v_speedup": x, "int8_ms": 10 / x,
                "int8_speedup": x, "gate_int8": gate, "gate_int8_graphs": gate if graphs is None else graphs,
                "you_get": x if gate else 1.0}

    calls = [call("SDXL", False, 0.8), call("Flux.1", False, 1.01), call("Wan2.1", True, 1.52)]
    steps = [{"model": "shipped embedded, 256 tokens", "stock_ms": 5.0, "int8_ms": 5.1, "speedup": 0.98,
              "int8_calls": 0, "gated_calls": 12},
             {"model": "Wan2.1-T2V-1.3B, 480p×49 frames", "stock_ms": 300.0, "int8_ms": 250.0, "speedup": 1.2,
              "int8_calls": 30, "gated_calls": 30}]
    text = headline(calls, steps, {"64": None, "128": 9000})
    assert text.startswith("On this GPU INT8 attention pays from about 9,000 tokens at head dim 128. That is in GPU "
                           "time: an eager call must also save 0.1 ms of it, for the host time INT8 adds.")
    assert "Wan2.1's attention runs 1.52× faster" in text and "SDXL, Flux.1 stay on SDPA" in text
    assert "Wan2.1-T2V-1.3B: a whole denoiser step runs 1.20× stock." in text and "shipped" not in text
    assert "padding mask" not in text and "padding mask" not in headline(calls, steps, {"64": None, "128": 9000},
                                                                         {"64": None, "128": 9000})
    masked = headline(calls, steps, {"64": None, "128": 9000}, {"64": 1448, "128": 2048})
    assert masked.startswith(text.split(".")[0] + ". With a text padding mask, which slows SDPA down, it pays from "
                             "about 1,448 tokens at head dim 64 and about 2,048 tokens at head dim 128. That is in "
                             "GPU time")
    both = headline(calls, steps, {"64": None, "128": 9000}, {"64": 1448, "128": 2048}, {"64": 2240, "128": None})
    assert both.startswith(text.split(".")[0] + ". At lengths that leave a partial 128-key tile, where SDPA slows "
                           "down, it pays from about 2,240 tokens at head dim 64. With a text padding mask")
    # a call the gate runs INT8 only where no host time is spent on it (CUDA graphs, compiled models)
    graphs = headline([call("SD3.5 Large", False, 1.22, graphs=True)] + calls, steps, {"64": None, "128": 9000})
    assert ("SD3.5 Large's (1.22×) runs INT8 in CUDA graphs and compiled models only: an eager call saves less than "
            "that. SDXL, Flux.1 stay on SDPA") in graphs
    md = "\n".join(R.speed_markdown({"device": "d", "date": "t", "steps": [], "headline": graphs,
                                     "calls": [call("SD3.5 Large", False, 1.22, graphs=True)]}))
    assert "| SDPA eager, INT8 in CUDA graphs | 1.00× |" in md
    section = {"device": "NVIDIA H100", "date": "2026-11-27", "calls": calls, "steps": steps,
               "pays_from": {"64": None, "128": 9000}, "headline": text}
    md = "\n".join(R.speed_markdown(section))
    assert md.count("\n| ") == len(calls) + len(steps) + 2 and "| Wan2.1 (w) |" in md and "| INT8 | 1.52× |" in md
    page = R.speed_html(section)
    assert page.count("<table") == 2 and page.count("<tr>") == len(calls) + len(steps) + 2 and "<h2>Speed on this GPU" in page


def test_steps_take_turns_and_the_ratio_is_the_rounds_median(monkeypatch):
    # the eager step rows time stock and enable()'s defaults taking turns (reversed every other round), so a drift of
    # the host's speed reaches both alike, and report the median of the rounds' ratios
    from diffusion_int8 import timing
    from diffusion_int8.eval import speed

    order = []
    assert timing.take_turns(("a", "b", "c"), lambda n: order.append(n) or len(order), 3) == {
        "a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]

    # a warm-up step, then stock, int8; int8, stock; stock, int8, the host slowing down in the second round
    drift = iter([99.0, 10.0, 11.0, 33.0, 30.0, 10.0, 12.5])
    monkeypatch.setattr(speed, "_step_ms", lambda model, x, steps: next(drift))
    monkeypatch.setattr(speed, "_wan", lambda device: (lambda **inputs: None, {}))
    monkeypatch.setattr("diffusion_int8.embedded.load_pipeline", lambda **kw: (_ for _ in ()).throw(
        FileNotFoundError("no weights here")))
    counted = []
    monkeypatch.setattr(speed, "enable", lambda model: counted.append(model) or type("H", (), {
        "state": type("S", (), {"int8_calls": 3, "gated_calls": 1, "reset": lambda self: None})(),
        "disable": lambda self: None})())
    rows = speed.step_rows(torch.device("cpu"), progress=lambda line: None, steps=5, rounds=3)
    assert len(rows) == 1 and (rows[0]["int8_calls"], rows[0]["gated_calls"]) == (3, 1)
    # per round 10/11, 30/33, 10/12.5: the median ratio 10/11, where the medians' ratio (10/12.5) would mix rounds
    assert rows[0]["speedup"] == pytest.approx(10 / 11) and rows[0]["stock_ms"] == 10.0 and rows[0]["int8_ms"] == 12.5
    assert len(counted) == 1 + 3  # the calls counted once, then each round's INT8 turn


def test_no_energy_counter_off_nvidia_gpus():
    from diffusion_int8.eval.energy import EnergyCounter

    assert EnergyCounter.open(torch.device("cpu")) is None


def test_sparse_schedule_reports_skipped_blocks_per_step(tmp_path, monkeypatch, capsys):
    """A schedule with a sparsity level below the noise level 0.5 only: its variant reports the fraction of blocks
    skipped per step (none at the dense steps) and overall, in the three reports and on the terminal; dense
    variants report none skipped and the tables gain no column for them."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from diffusion_int8 import PrecisionSchedule, Rule, evaluate
    from diffusion_int8.cli.summaries import print_report
    from diffusion_int8.embedded import load_pipeline
    from diffusion_int8.eval.run import write_report

    pipe = load_pipeline(device="cpu")  # 256 tokens: two blocks of queries and of keys
    schedule = PrecisionSchedule(rules=(Rule("int8", max_noise=0.5, tau=0.5),), default="int8", name="half")
    report = evaluate(pipe, class_labels=["red circle", "blue ring"], steps=4, modes=["int8"], schedule=schedule,
                      progress=False)
    dense, sparse = report["variants"]["int8"]["sparsity"], report["variants"]["schedule:half"]["sparsity"]
    assert dense["overall"] == 0 and dense["per_step"] == [0.0] * 4
    noise = [float(t) / 1000 for t in pipe.scheduler.timesteps]
    assert sparse["steps"] == [0, 1, 2, 3] and 0 < sparse["overall"] < 1
    assert [x > 0 for x in sparse["per_step"]] == [n <= 0.5 for n in noise] and any(n > 0.5 for n in noise)
    assert sparse["overall"] == pytest.approx(sum(sparse["per_step"]) / 4)  # every step has the same pairs
    write_report(report, tmp_path)
    print_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["variants"]["schedule:half"]["sparsity"] == sparse and "blocks" not in data["baseline"]["speed"]
    md = (tmp_path / "report.md").read_text()
    shown = " ".join(f"{x:.0%}" for x in sparse["per_step"])
    sparsity_section = md.split("Per denoising step:")[1].split("Images:")[0]
    assert "| blocks skipped |" in md and f"- `schedule:half`: {shown}" in md and "`int8`:" not in sparsity_section
    assert f"| {sparse['overall']:.1%} |" in md
    page = (tmp_path / "report.html").read_text()
    assert "<h2>Block sparsity</h2>" in page and shown in page
    check_html_in_chromium(tmp_path / "report.html")
    out = capsys.readouterr().out
    assert f"{sparse['overall']:.1%} of attention blocks skipped" in out and f"blocks skipped per step {shown}" in out
    # another report over this one: refused unless asked, and then none of this one's images stay beside it
    (tmp_path / "notes.txt").write_text("the user's")
    smaller = dict(report, images={n: imgs[:1] for n, imgs in report["images"].items()}, items=report["items"][:1])
    with pytest.raises(FileExistsError, match=r"already holds report.json, report.md, report.html, images; pass "
                                              r"overwrite=True"):
        write_report(smaller, tmp_path)
    assert len(list((tmp_path / "images" / "int8").iterdir())) == 2
    write_report(smaller, tmp_path, overwrite=True)
    assert {d.name: sorted(f.name for f in d.iterdir()) for d in (tmp_path / "images").iterdir()} == {
        d: ["00000.png"] for d in ("fp16", "int8", "schedule_half")}
    assert (tmp_path / "notes.txt").read_text() == "the user's"
    with pytest.raises(NotADirectoryError, match="notes.txt is a file; write_report writes into a directory"):
        write_report(smaller, tmp_path / "notes.txt", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def test_demo_end_to_end(tmp_path):
    """The first command a user runs, at a small size: calibration, the schedule derived from it, and the report of
    every variant (each INT8 mode, the schedule, calibrated static ranges) with finite scores and the page."""
    res = subprocess.run([sys.executable, "-m", "diffusion_int8", "demo", "--class-labels", "red circle", "blue ring",
                          "--steps", "3", "--batch-size", "2", "--out", "demo"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "demo"
    from diffusion_int8 import PrecisionSchedule
    from diffusion_int8.calibration import Calibration

    cal = Calibration.load(out / "calibration")
    assert cal.meta["steps"] == 3 and cal.meta["num_items"] == 2
    schedule = PrecisionSchedule.load(out / "calibration" / "schedule.json")
    report = json.loads((out / "report.json").read_text())
    names = set(report["variants"])
    assert {"int8", "int8_fp16v", f"schedule:{schedule.name}"} <= names and any("static-ranges" in n for n in names)
    for name, v in report["variants"].items():
        psnr = v["quality"]["aggregate"]["psnr"]
        assert psnr["n"] == 2 and math.isfinite(psnr["mean"]) and psnr["mean"] > 15, (name, psnr)
    assert len(list((out / "images" / "fp16").glob("*.png"))) == 2
    check_html_in_chromium(out / "report.html")
    assert "report.html" in res.stdout  # the command names what to open
    from diffusion_int8.embedded import PROMPTS

    # the shipped example prompts, for the commands it prints next
    assert (out / "prompts.txt").read_text() == PROMPTS.read_text()
    assert "calibrate --prompts demo/prompts.txt --out calib/" in res.stdout
    md = (out / "report.md").read_text()
    assert "Reading the table: " in md  # what a good PSNR is, what gated calls are
    assert report["speed_gate"] is False  # INT8 forced, to show its quality (on a GPU the note under the table says so)
    assert "--schedule calib/schedule.json --no-speed-gate --out report/" in res.stdout  # the same job, forced too
    assert report["dtype"] == "float32" and "the model in float32" in md  # a CPU run's baseline is not fp16
    # what each variant's modules did about the Q·Kᵀ balance: 256 queries are too few for it (undecided), and the
    # static variant takes the calibration's decision
    modules = {sum(v["speed"]["qk_balance"].values()) for v in report["variants"].values()}
    assert len(modules) == 1 and modules.pop() > 0
    assert report["variants"]["int8"]["speed"]["qk_balance"] == {
        "undecided (no INT8 call of 1,024+ queries per head so far; shorter calls are not balanced)": len(cal.layers)}
    static = next(v for n, v in report["variants"].items() if "static-ranges" in n)["speed"]["qk_balance"]
    assert set(static) <= {"on (calibration)", "off (calibration: no outlier channels)"}
    assert "Q·Kᵀ balance (against outlier channels" in md and "- `int8`: undecided" in md
    # which calibration the static variant used: the file where the demo left it, by its checksum
    assert report["calibration"] == {**{k: cal.meta[k] for k in ("model", "steps", "items_kind", "num_items",
                                                                   "prompts_sha256", "seed", "schema_version")},
                                     **cal.origin}
    assert report["calibration"]["path"] == str((out / "calibration" / "calibration.safetensors").resolve())
    assert (f"Static ranges: calibration from {report['calibration']['path']} (checksum stored in it "
            f"{cal.origin['sha256'][:16]}…), of embedded, measured over 3 denoiser calls and 2 class labels.") in md


from diffusion_int8.embedded.shapes import CLASSES  # noqa: E402


def test_the_shipped_prompts_name_each_class_once():
    from diffusion_int8.cli.common import read_items
    from diffusion_int8.embedded import PROMPTS
    from diffusion_int8.embedded.shapes import label_ids

    for model in ("embedded", "embedded-long"):
        items = read_items(PROMPTS, None, model)
        assert items.kind == "prompt" and sorted(label_ids(items.values)) == list(range(len(CLASSES)))


@pytest.mark.parametrize("argv, labels, steps", [
    ([], list(CLASSES[:8]), 10),  # on a CPU: 8 of the 16 classes, 10 steps, said in one line
    (["--steps", "4"], list(CLASSES[:8]), 4),
    (["--class-labels", "3", "5"], ["3", "5"], 10),
    (["--class-labels", "3", "--steps", "20"], ["3"], 20),
])
def test_demo_on_a_cpu_runs_fewer_images_and_steps_unless_told(tmp_path, capsys, argv, labels, steps):
    from diffusion_int8.__main__ import build_parser
    from diffusion_int8.cli import demo

    args = build_parser().parse_args(["demo", "--out", str(tmp_path / "d"), *argv])
    assert demo.sizes(args, cpu=True) == (labels, steps)
    notice = "on a CPU (INT8 emulated)" in capsys.readouterr().out
    assert notice == (len(argv) < 4)
    # on a GPU: what was given, else every class in GPU_STEPS steps, with no notice
    assert demo.sizes(args, cpu=False) == (args.class_labels, args.steps or demo.GPU_STEPS)
    assert "on a CPU" not in capsys.readouterr().out


def test_variant_folder_names_are_one_short_safe_path_component():
    from diffusion_int8.eval.run import _dirname

    assert _dirname("schedule:balanced") == "schedule_balanced"
    long = ["schedule:my schedule " + "x" * 300, "schedule:my schedule " + "x" * 299 + "y", "schedule:" + "é" * 200]
    names = [_dirname(n) for n in long]
    assert len(set(names)) == 3 and all(len(n.encode()) <= 80 and "/" not in n for n in names), names
