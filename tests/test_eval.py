"""Evaluation: metrics per image and per set, offline-weights messages, reports, the HTML in Chromium, the CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import types

import pytest
import torch

from diffusion_int8.eval import metrics as M
from diffusion_int8.eval.score import Scorer, load_folder, save_images
from test_calibration import cli_env


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
    assert "pip install lpips" in M.lpips_model().reason
    # the scorer reports them unavailable and still computes PSNR and SSIM
    scorer = Scorer()
    x = torch.rand(4, 3, 16, 16)
    out = scorer.score(x * 0.9, x)
    assert out["aggregate"]["lpips"]["available"] is False and out["aggregate"]["fid"]["available"] is False
    assert len(out["per_image"]["psnr"]) == 4 and "lpips" not in out["per_image"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def check_html_in_chromium(path):
    exe = chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (`apt-get install chromium`; .ci/run installs it)")
    res = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", path.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    import re

    body = re.search(r"<body[^>]*>", res.stdout).group(0)
    ok = re.search(r'data-images-ok="(\d+)/(\d+)"', body)
    assert ok, body
    loaded, total = map(int, ok.groups())
    assert total > 0 and loaded == total, body
    assert 'data-errors=""' in body, body


def run_eval(args, cwd):
    return subprocess.run([sys.executable, "-m", "diffusion_int8", "eval", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=900)


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
    one = run_eval(args + ["--out", "one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517", "-m", "diffusion_int8", "eval"]
    two = subprocess.run(launcher + args + ["--out", "two"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
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
    from diffusion_int8.eval import cli as eval_cli

    real = eval_cli.run_variant

    def run_variant(pipe, model, items, batches, args, device, kwargs):
        images, speed, per_step = real(pipe, model, items, batches, args, device, kwargs)
        if kwargs is None:
            images[2][0, 3, 4] = float("inf")
        elif kwargs.get("mode") == "int8":
            images[1][:, :5] = float("nan")
        return images, speed, per_step

    monkeypatch.setattr(eval_cli, "run_variant", run_variant)
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
    if chromium():
        check_html_in_chromium(tmp_path / "rep" / "report.html")
    # the saved PNGs are images all the same: NaN is black
    _, imgs = load_folder(tmp_path / "rep" / "images" / "int8")
    assert (imgs[1, :, :5] == 0).all()
