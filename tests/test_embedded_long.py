"""The long shipped model, ``embedded-long`` (4,096 tokens): its name on the command line, the error while its
weights are not installed, the training script's output loading under that name, and a small random-weight
version of it through the pipeline and INT8 attention (the kernel's emulation on the CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from diffusers import DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler
from safetensors import safe_open

from diffusion_int8 import enable, pipelines
from diffusion_int8.__main__ import build_parser
from diffusion_int8.embedded import VARIANTS, ShapesPipeline, load_pipeline, shipped, transformer_config
from diffusion_int8.embedded import train as training
from diffusion_int8.eval.metrics import psnr
from test_cli_errors import assert_usage_error, cli

LONG = VARIANTS["long"]
# the long model's geometry (64×64 pixels, one token each) at a tiny width: one layer of one head of dim 64
TINY = dict(num_attention_heads=1, attention_head_dim=64, num_layers=1)
INSTALLED = (LONG.path / "model_index.json").is_file()


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


@pytest.fixture
def long_at(monkeypatch):
    """``long_at(dir)``: the registry's long variant read from ``dir`` for the test."""

    def point(directory):
        monkeypatch.setitem(VARIANTS, "long", replace(LONG, directory=str(directory)))

    return point


def tiny_long_pipeline() -> ShapesPipeline:
    torch.manual_seed(0)
    model = DiTTransformer2DModel(**{**transformer_config("long"), **TINY}).eval()
    pipe = ShapesPipeline(model, FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=LONG.shift))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_long_variant_is_long_with_head_dim_64_and_fits_30_mb():
    cfg = transformer_config("long")
    assert LONG.tokens == (cfg["sample_size"] // cfg["patch_size"]) ** 2 >= 4096
    assert cfg["attention_head_dim"] == 64 and cfg["num_layers"] >= 4
    with torch.device("meta"):
        params = sum(p.numel() for p in DiTTransformer2DModel(**cfg).parameters())
    assert params * 2 <= 30 * 2**20  # fp16 weights
    # the same architecture as the base model but for the image size and the patch
    differ = {k for k in cfg if cfg[k] != transformer_config("base")[k]}
    assert differ == {"sample_size", "patch_size"}


def test_names_resolve_from_one_registry():
    assert shipped("embedded-long") is LONG and shipped("embedded") is VARIANTS["base"] and shipped("./embedded-long") is None
    assert pipelines.model_id("embedded-long") == "embedded-long"
    parser = build_parser()
    for command in (["eval", "--out", "r"], ["calibrate", "--out", "c"], ["demo"]):
        assert parser.parse_args(command + ["--model", "embedded-long"]).model == "embedded-long"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--model", "embedded-huge"])


def test_missing_weights_say_so_in_python_and_on_the_command_line(tmp_path, long_at, capsys):
    long_at(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"the long model's weights \(embedded-long\) are not in this install"
                                                r".*--variant long --out DIR"):
        load_pipeline(variant="long")
    with pytest.raises(FileNotFoundError, match="are not in this install"):
        pipelines.load("embedded-long", torch.device("cpu"))
    for argv in (["eval", "--model", "embedded-long", "--class-labels", "red circle", "--out", tmp_path / "r"],
                 ["demo", "--model", "embedded-long", "--out", tmp_path / "d"]):
        code, err = cli(argv, capsys)
        assert_usage_error(code, err, argv[0], "the long model's weights (embedded-long) are not in this install",
                           "python -m diffusion_int8.embedded.train --variant long")
    assert not (tmp_path / "d").exists() and not (tmp_path / "r").exists()


def test_tiny_long_model_runs_int8_attention():
    pipe = tiny_long_pipeline()

    def generate():
        gen = torch.Generator().manual_seed(0)
        return pipe(["red circle"], num_inference_steps=2, generator=gen, output_type="pt").images

    reference = generate()
    assert reference.shape == (1, 3, 64, 64) and torch.isfinite(reference).all()
    for mode in ("int8", "int8_fp16v"):
        handle = enable(pipe, mode=mode)
        try:
            images = generate()
            calls = handle.state.int8_calls
        finally:
            handle.disable()
        p = psnr(images, reference)
        print(f"{mode}: {calls} INT8 calls, PSNR {p.item():.2f} dB against exact attention")
        assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
        assert calls == 2 and not torch.equal(images, reference)  # one layer, two steps: INT8 really ran
        assert p.item() > 30, mode


def test_training_script_writes_what_loads_as_embedded_long(tmp_path, monkeypatch, long_at):
    # the layout the GPU run writes, at a tiny width and two steps; placed as the shipped directory, it loads by name
    monkeypatch.setattr(training, "transformer_config", lambda variant: {**transformer_config(variant), **TINY})
    out = tmp_path / "shapes-dit-long"
    argv = ["--variant", "long", "--out", out, "--steps", "2", "--batch", "2", "--samples", "0", "--device", "cpu"]
    assert training.main([str(a) for a in argv]) == 0
    info = json.loads((out / "training.json").read_text())
    assert (info["variant"], info["model"], info["tokens"], info["steps_done"]) == ("long", "embedded-long", 4096, 2)
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "ShapesPipeline"
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["shift"] == LONG.shift
    with safe_open(out / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    long_at(out)
    pipe = pipelines.load("embedded-long", torch.device("cpu"))
    assert pipelines.pipeline_id(pipe) == "embedded-long"
    images = pipe("blue ring", num_inference_steps=1, output_type="pt").images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()


@pytest.mark.skipif(not INSTALLED, reason="the long model's weights are not in this install")
def test_installed_long_model_is_the_long_variant():
    size = sum(p.stat().st_size for p in LONG.path.rglob("*") if p.is_file())
    assert size <= 30 * 2**20
    pipe = load_pipeline(variant="long", device="cpu")
    assert {k: pipe.transformer.config[k] for k in transformer_config("long")} == transformer_config("long")
    assert pipe.scheduler.config.shift == LONG.shift
    assert json.loads((LONG.path / "training.json").read_text())["variant"] == "long"
    images = pipe("red circle", num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
