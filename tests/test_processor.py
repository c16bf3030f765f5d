"""Int8DiffusionProcessor and enable() on every attention family, and on a whole tiny pipeline."""

from __future__ import annotations

import warnings

import pytest
import torch

import diffusion_int8
from diffusion_int8 import Int8DiffusionProcessor, enable
from diffusion_int8.processor import attention_modules
from tiny_models import FAMILIES, build

# Relative L2 error of the denoiser output against stock, measured on these tiny models
# (≤ 0.0005 for int8_fp16v and ≤ 0.005 for int8), with a 4x margin.
BOUND = {"int8_fp16v": 0.002, "int8": 0.02}


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    # The kernels' equivalence with the emulation is tested in test_attention.py; integration tests
    # run the emulation, which computes the same numbers much faster than the interpreter.
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(model, x):
    with torch.no_grad():
        return model(**x, return_dict=False)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_enable_per_family(family):
    model, x = build(family)
    stock = run(model, x)
    procs = {n: m.processor for n, m in attention_modules(model).items()}
    assert procs, "no attention modules found"

    handle = enable(model, "fp16")
    assert torch.equal(run(model, x), stock)  # fp16 mode is the stock processor, bit for bit
    handle.disable()
    for mode, bound in BOUND.items():
        handle = enable(model, mode, record=True)
        out = run(model, x)
        handle.disable()
        assert rel_l2(out, stock) <= bound, (mode, rel_l2(out, stock))
        assert rel_l2(out, stock) > 0  # the INT8 path really ran
        assert {layer for _, _, layer, _ in handle.state.trace} == set(procs)
    assert {n: m.processor for n, m in attention_modules(model).items()} == procs  # restored exactly
    assert torch.equal(run(model, x), stock)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "dit"])
def test_set_attn_processor_the_diffusers_way(family):
    model, x = build(family)
    handle = enable(model, "int8")
    want = run(model, x)
    handle.disable()
    model.set_attn_processor(Int8DiffusionProcessor(mode="int8"))  # one shared instance, stock inferred per module
    assert torch.equal(run(model, x), want)
    model.set_attn_processor(Int8DiffusionProcessor(mode="fp16"))
    handle = enable(model, "fp16")  # wraps the shared instance: still exact
    assert torch.equal(run(model, x), run(*build(family)))
    handle.disable()


def test_enable_refuses_twice_and_compiled():
    model, _ = build("dit")
    handle = enable(model, "int8")
    with pytest.raises(RuntimeError, match="already enabled"):
        enable(model, "int8")
    handle.disable()
    enable(model, "int8").disable()  # fine again after disable
    with pytest.raises(RuntimeError, match="before torch.compile"):
        enable(torch.compile(model), "int8")
    with pytest.raises(TypeError, match="no denoiser"):
        enable(object(), "int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        enable(model, "int4")


def test_unsupported_head_dims_are_left_alone_with_one_warning():
    from diffusers.models.attention_processor import Attention

    model = torch.nn.ModuleDict({"vae_attn": Attention(512, heads=1, dim_head=512), "ok": Attention(64, heads=2, dim_head=32)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable(model, "int8")
    msgs = [str(w.message) for w in caught if "stock processor" in str(w.message)]
    assert len(msgs) == 1 and "vae_attn (head dim 512 > 256)" in msgs[0]
    assert set(handle.originals) == {"ok"}
    x = torch.randn(1, 10, 512)
    with torch.no_grad():
        model["vae_attn"](x)  # runs, untouched


def test_dit_pipeline_schedule_trace_and_disable():
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline

    transformer, _ = build("dit")
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(32,), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",), norm_num_groups=32)
    pipe = DiTPipeline(transformer=transformer, vae=vae.eval(), scheduler=DDIMScheduler(num_train_timesteps=1000),
                       id2label={1: "one", 3: "three"})

    def generate():
        return pipe(class_labels=[1, 3], num_inference_steps=4, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(0), output_type="np").images

    stock = generate()
    handle = diffusion_int8.enable(pipe, schedule=lambda t: "fp16" if t >= 500 else "int8", record=True)
    images = generate()
    per_step = {}
    for step, t, layer, mode in handle.state.trace:
        per_step.setdefault((step, t), set()).add(mode)
    timesteps = [float(t) for t in pipe.scheduler.timesteps]
    assert [t for _, t in sorted(per_step)] == timesteps
    assert [per_step[k] for k in sorted(per_step)] == [{"fp16" if t >= 500 else "int8"} for t in timesteps]
    assert {"fp16"} in per_step.values() and {"int8"} in per_step.values()
    assert 0 < abs(images - stock).max() < 0.1
    handle.disable()
    assert (generate() == stock).all()  # bit-identical after disable
