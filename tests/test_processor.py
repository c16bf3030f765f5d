"""Int8DiffusionProcessor and enable() on every attention family, and on a whole tiny pipeline."""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import diffusion_int8
from diffusion_int8 import Int8DiffusionProcessor, enable
from diffusion_int8.plugin.models import attention_modules
from tiny_models import FAMILIES, build, identity_attention, run_identity

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
    assert torch.equal(run(model, x), run(*build(family)))
    with pytest.raises(RuntimeError, match="already runs Int8DiffusionProcessor"):  # it would wrap them
        enable(model, "fp16")


def test_a_schedule_without_the_timestep_runs_exact_with_one_warning():
    """The diffusers way gives a processor no timestep, so a schedule's modes never apply: the processor runs
    exact attention and says so once, instead of silently. ``enable`` feeds the timestep: no warning there."""
    model, x = build("pixart")
    stock = run(model, x)
    model.set_attn_processor(Int8DiffusionProcessor(schedule="balanced", speed_gate=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(model, x)
        run(model, x)
    said = [w for w in caught if "precision schedule" in str(w.message)]
    assert len(said) == 1 and "enable()" in str(said[0].message) and said[0].category is RuntimeWarning
    assert torch.equal(got, stock)
    model, x = build("pixart")
    handle = enable(model, "int8", schedule="balanced", speed_gate=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, x)
    assert not [w for w in caught if "precision schedule" in str(w.message)]
    assert handle.state.timestep is not None
    handle.disable()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_timestep_is_read_where_forward_declares_it_also_positionally(family):
    """Flux, SD3, PixArt and CogVideoX take the timestep third or fourth: a positional call is read there."""
    import inspect

    model, x = build(family)
    names = list(inspect.signature(model.forward).parameters)
    given = names[: max(names.index(k) for k in x) + 1]
    args = [x.get(n) for n in given]
    handle = enable(model, "int8", record=True)
    with torch.no_grad():
        model(*args, return_dict=False)
    assert handle.state.timestep == float(x["timestep"].flatten()[0])
    handle.disable()


def test_a_forward_without_a_named_timestep_is_read_at_its_second_argument():
    from diffusion_int8.plugin.install import timestep_argument

    class Denoiser(torch.nn.Module):
        def forward(self, x, t):
            return x

    class Anything(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert timestep_argument(Denoiser()) == timestep_argument(Anything()) == ("timestep", 1)


def test_enable_refuses_twice_and_compiled():
    model, _ = build("dit")
    handle = enable(model, "int8")
    with pytest.raises(RuntimeError, match="already enabled"):
        enable(model, "int8")
    # a copy of an enabled model carries its own handle, out of its user's reach: disable() takes the model
    import copy

    stock = {n: type(p) for n, p in handle.originals.items()}
    copied = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=r"call handle.disable\(\), or diffusion_int8.disable\(\) on it, first"):
        enable(copied, "int8")
    assert diffusion_int8.disable(copied) and not diffusion_int8.disable(copied)
    assert {n: type(m.processor) for n, m in attention_modules(copied).items()} == stock
    assert all(isinstance(m.processor, Int8DiffusionProcessor) for m in attention_modules(model).values())
    enable(copied, "int8").disable()
    handle.disable()
    # enabled, then compiled (the order enable asks for), the handle dropped: disable() reaches through the wrapper
    from types import SimpleNamespace

    enable(model, "int8")
    pipe = SimpleNamespace(transformer=torch.compile(model, backend="eager"))
    with pytest.raises(RuntimeError, match=r"already enabled on the denoiser \(DiTTransformer2DModel\), compiled "):
        enable(pipe, "fp16")
    assert diffusion_int8.disable(pipe) and not diffusion_int8.disable(pipe.transformer)
    assert {n: type(m.processor) for n, m in attention_modules(model).items()} == stock
    enable(model, "int8").disable()  # fine again after disable
    with pytest.raises(RuntimeError, match="before torch.compile"):
        enable(torch.compile(model), "int8")
    with pytest.raises(TypeError, match="no denoiser"):
        enable(object(), "int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        enable(model, "int4")
    # a schedule callable: its signature and what it returns are checked at enable, not at the first step
    with pytest.raises(ValueError, match=r"returns a mode, one of .* returned 'int4' for the timestep 1000.0"):
        enable(model, schedule=lambda t: "int4")
    with pytest.raises(TypeError, match="takes one argument, the denoiser's timestep"):
        enable(model, schedule=lambda: "int8")
    with pytest.raises(ValueError, match="returned 1000 for the timestep"):
        enable(model, schedule=int)
    enable(model, schedule=lambda t: {981.0: "int8"}[t]).disable()  # raises at 1000.0: it may take only its own
    assert "_diffusion_int8_handle" not in model.__dict__


def test_enable_refuses_int8_processors_set_by_hand(tmp_path):
    """``set_attn_processor(Int8DiffusionProcessor(...))`` then ``enable()`` would nest two INT8 processors (and an
    ``fp16`` enable would not be stock): refused, and so is ``evaluate``, whose baseline runs stock, before any
    image."""
    from diffusion_int8.embedded import load_pipeline
    from diffusion_int8.eval import evaluate

    model, _ = build("unet")
    model.set_attn_processor(Int8DiffusionProcessor(mode="int8", speed_gate=False))
    with pytest.raises(RuntimeError, match=r"already runs Int8DiffusionProcessor on .* \(set with set_attn_processor"):
        enable(model, "fp16")
    assert all(isinstance(m.processor, Int8DiffusionProcessor) and m.processor.inner is None
               for m in attention_modules(model).values())  # left as they were
    pipe = load_pipeline(device="cpu")
    for module in attention_modules(pipe.transformer).values():  # a DiT has no set_attn_processor
        module.set_processor(Int8DiffusionProcessor(mode="int8"))
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(RuntimeError, match="already runs Int8DiffusionProcessor"):
        evaluate(pipe, class_labels=["red circle"], steps=2)
    assert calls == []


def test_a_pipeline_routes_each_of_its_denoising_models_sharing_one_state():
    from types import SimpleNamespace

    from diffusers.models.attention_processor import Attention

    first, x = build("wan")
    second, _ = build("wan")  # Wan 2.2's second expert, transformer_2
    encoder = torch.nn.ModuleDict({"attn": Attention(64, heads=2, dim_head=32)})  # attention, no timestep
    pipe = SimpleNamespace(transformer=first, transformer_2=second, text_encoder=encoder)
    models = (first, second, encoder)

    def processors():
        return [{n: m.processor for n, m in attention_modules(model).items()} for model in models]

    stock, before = [run(m, x) for m in (first, second)], processors()
    handle = enable(pipe, "fp16", record=True)
    assert list(handle.others) == ["transformer_2"] and handle.others["transformer_2"].state is handle.state
    now = processors()
    assert all(isinstance(p, Int8DiffusionProcessor) for d in now[:2] for p in d.values())
    assert now[2] == before[2]  # not a denoising model
    assert all(torch.equal(run(m, x), s) for m, s in zip((first, second), stock))
    assert handle.summary()["others"]["transformer_2"]["model"] == "WanTransformer3DModel"
    assert "and transformer_2:" in str(handle)
    assert repr(handle).startswith("<Int8Handle: diffusion_int8 on WanTransformer3DModel (fp16; speed gate on): ")
    with pytest.raises(RuntimeError, match=r"already enabled on the model \(WanTransformer3DModel\)"):
        enable(second, "int8")
    handle.disable()
    assert processors() == before  # both restored exactly

    handle = enable(pipe, "int8", speed_gate=False, sparsity=0.5, refresh_every=3)
    assert str(handle).startswith("diffusion_int8 on WanTransformer3DModel (int8; sparsity 0.5; skipped blocks "
                                  "carried, refresh every 3 steps; speed gate off): ")
    assert handle.summary()["others"]["transformer_2"]["settings"]["refresh_every"] == 3
    run(first, x)
    calls = handle.state.int8_calls
    run(second, x)
    assert 0 < calls < handle.state.int8_calls  # the second expert runs INT8 too, counted in the one state
    # a copy or pickle of one expert holds that expert alone (its handle, not the pipeline's others)
    import copy

    assert copy.deepcopy(first).__dict__["_diffusion_int8_handle"].others == {} and list(handle.others)
    assert len(pickle.dumps(first)) < 1.2 * len(pickle.dumps(second))
    assert diffusion_int8.disable(pipe)  # without the handle: every denoising model of the pipeline
    assert processors() == before and not diffusion_int8.disable(pipe)
    handle.disable()  # the handle, disabled that way, does nothing
    assert processors() == before

    # a calibration, an observer or a schedule with per-layer rules describes one model: the others stay stock, and
    # a warning names them
    from diffusion_int8 import PrecisionSchedule, Rule

    per_layer = PrecisionSchedule(rules=(Rule("int8", layers="blocks.0.attn1"),), default="fp16")
    typo = PrecisionSchedule(rules=(Rule("int8", layers="block.0.attn1"), Rule("int8", layers="*")), default="fp16")
    with pytest.warns(RuntimeWarning, match=r"pattern\(s\) 'block.0.attn1' match none of its attention modules"):
        enable(first, "int8", schedule=typo).disable()
    foreign = PrecisionSchedule(rules=(Rule("int8"),), balance_layers=("single_transformer_blocks.3.attn",))
    with pytest.warns(RuntimeWarning, match=r"balance_layers name 1 module\(s\) it does not have "
                                            r"\('single_transformer_blocks.3.attn'; made for another model\?\)"):
        enable(first, "int8", schedule=foreign).disable()
    for options in (dict(observer=lambda call: None), dict(schedule=per_layer)):
        with pytest.warns(RuntimeWarning, match="left transformer_2 on stock attention"):
            handle = enable(pipe, "int8", **options)
        assert handle.others == {} and processors()[1] == before[1]
        handle.disable()
        assert processors() == before

    # a ControlNet runs before its UNet at each timestep: one step, not two
    handle = enable(pipe, "fp16", record=True)
    for t in (10, 10, 9):
        run(second, dict(x, timestep=torch.tensor([t])))
        run(first, dict(x, timestep=torch.tensor([t])))
    assert handle.state.step == 2 and {s for s, *_ in handle.state.trace} == {0, 1, 2}
    handle.disable()

    # with the pipeline's scheduler: a model joining a run partway continues it (Wan 2.2's second expert, a UNet
    # after its ControlNet), and a run that starts at the level the last one stopped at, its timesteps set anew,
    # is a new generation
    scheduler = SimpleNamespace(timesteps=torch.tensor([10.0, 9.0, 8.0, 7.0]))
    handle = enable(SimpleNamespace(transformer=first, transformer_2=second, scheduler=scheduler), "fp16", record=True)
    seen = []
    for model, t in ((first, 10), (first, 10), (first, 9), (second, 8), (second, 8), (second, 7)):  # CFG: two calls
        run(model, dict(x, timestep=torch.tensor([t])))
        seen.append((handle.state.step, handle.state.generation, handle.state.steps))
    assert seen == [(step, 1, 4) for step in range(6)]
    scheduler.timesteps = torch.tensor([7.0, 6.0])  # set_timesteps at the next run
    for model in (second, first):
        run(model, dict(x, timestep=torch.tensor([7])))
        seen.append((handle.state.step, handle.state.generation, handle.state.steps))
    assert seen[-2:] == [(0, 2, 2), (0, 2, 2)]
    handle.disable()

    # a pipeline made with from_pipe and a scheduler of its own runs the shared model: the scheduler enable() reads
    # holds another run's timesteps, which is said once, and the step count is unknown rather than that run's
    scheduler = SimpleNamespace(timesteps=torch.tensor([1000.0, 750.0, 500.0, 250.0]))  # the last run's
    pipe = SimpleNamespace(transformer=first, scheduler=scheduler)
    handle = enable(pipe, "fp16", record=True)

    def generation(levels):
        counts = []
        for t in levels:
            run(first, dict(x, timestep=torch.tensor([t])))
            counts.append(handle.state.steps)
        return counts

    other_run = (1000, 833, 667, 500, 333, 167)
    with pytest.warns(RuntimeWarning, match=r"timesteps are not those of the pipeline enable\(\) was given"):
        assert generation(other_run) == [4] + [None] * 5  # its second level is not the scheduler's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generation(other_run) == [None] * 6  # the timesteps a generation ago: not set anew for this one
        scheduler.timesteps = torch.tensor([1000.0, 500.0])  # the pipeline's own run
        assert generation((1000, 500)) == [2, 2] and handle.state.generation == 3
        # a timestep that rises within a run (Lumina's and Z-Image's 1 - t/1000) ends no whole generation: no
        # warning (each step still starts a generation of its own there, the carry's refresh every step)
        scheduler.timesteps = torch.tensor([1000.0, 750.0, 500.0, 250.0])
        generation((0.0, 0.25, 0.5, 0.75))
    import copy

    twin = copy.deepcopy(pipe)  # a copied pipeline: its model reads the copy's scheduler
    twin.scheduler.timesteps = torch.tensor([1000.0, 750.0, 500.0])
    run(twin.transformer, dict(x, timestep=torch.tensor([1000])))
    assert twin.transformer.__dict__["_diffusion_int8_handle"].state.steps == 3
    back = pickle.loads(pickle.dumps(first))  # a model pickled alone runs under no pipeline: no step count
    run(back, dict(x, timestep=torch.tensor([1000])))
    assert back.__dict__["_diffusion_int8_handle"].state.steps is None
    handle.disable()

    # a model compiled before enable() stays stock, named in a warning
    compiled = SimpleNamespace(transformer=first, transformer_2=torch.compile(second))
    with pytest.warns(RuntimeWarning, match="left transformer_2 on stock attention: compiled before enable"):
        handle = enable(compiled, "int8")
    assert handle.others == {}
    handle.disable()
    # a pipeline whose denoiser has another name (Würstchen's and Stable Cascade's decoder pipelines)
    handle = enable(SimpleNamespace(decoder=first, text_encoder=encoder), "fp16")
    assert handle.model is first and handle.others == {}
    handle.disable()


def test_disable_leaves_a_processor_set_after_enable_with_a_warning():
    from diffusers.models.attention_processor import AttnProcessor

    model, _ = build("unet")
    before = {n: m.processor for n, m in attention_modules(model).items()}
    handle = enable(model, "int8")
    name, module = next(iter(attention_modules(model).items()))
    mine = AttnProcessor()  # as load_ip_adapter or set_attn_processor would install
    with pytest.warns(RuntimeWarning, match=f"{name} got AttnProcessor after enable"):
        module.set_processor(mine)
    with pytest.warns(RuntimeWarning, match=r"1 attention module\(s\) got another processor after enable"):
        handle.disable()
    after = {n: m.processor for n, m in attention_modules(model).items()}
    assert after[name] is mine and all(after[n] is p for n, p in before.items() if n != name)


def test_the_summary_counts_modules_given_another_processor_since():
    """``fuse_qkv_projections`` after ``enable`` gives every legacy module diffusers' fused processor: the summary
    stops counting them as routed and names them."""
    model, x = build("unet")
    handle = enable(model, "int8")
    n = len(handle.originals)
    assert sum(handle.summary()["routed"].values()) == n and handle.summary()["replaced"] == []
    with pytest.warns(RuntimeWarning, match="got FusedAttnProcessor2_0 after enable"):
        model.fuse_qkv_projections()
    summary = handle.summary()
    assert summary["routed"] == {} and sorted(summary["replaced"]) == sorted(handle.originals)
    assert f"{n} given another processor since enable()" in str(handle)
    with pytest.warns(RuntimeWarning, match="got another processor after enable"):
        handle.disable()
    model, _ = build("unet")
    handle = enable(model, "fp16")
    model.set_attn_processor(Int8DiffusionProcessor(mode="int8"))  # INT8, but not this handle's
    assert handle.summary()["routed"] == {} and len(handle.summary()["replaced"]) == n
    handle.disable()


@pytest.mark.parametrize("family", ["unet", "sd3"])
def test_fusing_projections_after_enable_says_once_that_int8_is_off(family, recwarn):
    """Diffusers' ``fuse_qkv_projections`` puts its stock fused processor on every module: with one warning at the
    user's call, naming the remedy; unfusing gives the INT8 processors back without one, and fusing again warns
    again; after ``disable()``, nothing is watched."""
    model, _ = build(family)
    handle = enable(model, "int8")
    n = sum(handle.summary()["routed"].values())
    model.fuse_qkv_projections()
    told = [w for w in recwarn if "after enable()" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__, [str(w.message) for w in recwarn]
    assert "run stock attention" in str(told[0].message) and "Make such calls before enable()" in str(told[0].message)
    assert handle.summary()["routed"] == {}
    recwarn.clear()
    model.unfuse_qkv_projections()  # diffusers puts back the processors it kept: enable()'s
    assert sum(handle.summary()["routed"].values()) == n
    assert not [w for w in recwarn if "diffusion_int8" in str(w.message)]
    model.fuse_qkv_projections()
    assert len([w for w in recwarn if "after enable()" in str(w.message)]) == 1
    model.unfuse_qkv_projections()
    handle.disable()
    assert not any("set_processor" in m.__dict__ for m in model.modules())
    recwarn.clear()
    model.fuse_qkv_projections()
    assert not [w for w in recwarn if "diffusion_int8" in str(w.message)]


def test_a_processor_says_what_it_runs_where_diffusers_prints_it():
    """diffusers prints processors in its errors: ``set_default_attn_processor`` (UNets) refuses any it does not
    know, INT8 ones included, and works again after ``disable()``."""
    assert repr(Int8DiffusionProcessor(mode="int8_fp16v")) == (
        "Int8DiffusionProcessor(int8_fp16v, wrapping the stock one inferred per module)")
    model, _ = build("unet")
    handle = enable(model, "int8")
    with pytest.raises(ValueError, match=r"of type Int8DiffusionProcessor\(int8, wrapping AttnProcessor2_0\)"):
        model.set_default_attn_processor()
    handle.disable()
    model.set_default_attn_processor()
    assert all(type(p).__name__ == "AttnProcessor" for p in model.attn_processors.values())


def test_an_int8_processor_set_after_enable_is_not_reported_as_stock(recwarn):
    model, _ = build("unet")
    handle = enable(model, "fp16")
    model.set_attn_processor(Int8DiffusionProcessor(mode="int8"))
    assert not [w for w in recwarn if "after enable()" in str(w.message)]
    handle.disable()


def test_data_parallel_replicas_keep_the_processors_settings():
    """``nn.DataParallel`` replicates a processor that is a module (IP-Adapter's, wrapped) through ``__new__``
    alone: the replica is the same INT8 processor, not one rebuilt with other settings."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    proc = Int8DiffusionProcessor("int8_fp16v", inner=IPAdapterAttnProcessor2_0(hidden_size=32, cross_attention_dim=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replica = proc._replicate_for_data_parallel()
    assert type(replica) is type(proc) and replica.mode is diffusion_int8.Mode.INT8_FP16V and replica.inner is proc.inner


def _ip_adapter_weights(unet, seed=3):
    """A random IP-Adapter state dict for ``unet`` (as ``load_ip_adapter`` reads one from a file)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    cad, widths = unet.config.cross_attention_dim, unet.config.block_out_channels
    sd = {"image_proj": {"proj.weight": r(4 * cad, 16), "proj.bias": torch.zeros(4 * cad),
                         "norm.weight": torch.ones(cad), "norm.bias": torch.zeros(cad)}, "ip_adapter": {}}
    cross = [n for n in unet.attn_processors if n.endswith("attn2.processor")]
    for i, name in enumerate(cross):
        block = int(name.split(".")[1]) if not name.startswith("mid_block") else -1
        width = widths[-1] if block < 0 else (widths[::-1] if name.startswith("up_blocks") else widths)[block]
        sd["ip_adapter"][f"{2 * i + 1}.to_k_ip.weight"] = r(width, cad)
        sd["ip_adapter"][f"{2 * i + 1}.to_v_ip.weight"] = r(width, cad)
    return sd


def test_an_ip_adapter_loaded_after_enable_runs_exact_with_a_warning():
    """``load_ip_adapter`` rebuilds the processors it does not adapt as ``type(processor)()``, which knows none of
    enable()'s settings: those modules get their stock processor back and a warning says so, instead of an INT8
    processor with default settings running where the user asked for fp16."""
    def run_with_adapter(enabled):
        model, x = build("unet")
        handle = enable(model, "fp16") if enabled else None
        model._load_ip_adapter_weights([_ip_adapter_weights(model)], low_cpu_mem_usage=False)
        embeds = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(5))
        x = dict(x, added_cond_kwargs={"image_embeds": [embeds]})
        return run(model, x), handle

    stock, _ = run_with_adapter(False)
    with pytest.warns(RuntimeWarning, match=r"rebuilt an INT8 attention processor by its class \(load_ip_adapter"):
        got, handle = run_with_adapter(True)
    assert torch.equal(got, stock)
    rebuilt = [m.processor for m in attention_modules(handle.model).values()
               if isinstance(m.processor, Int8DiffusionProcessor)]
    assert rebuilt and all(p.mode is diffusion_int8.Mode.FP16 for p in rebuilt)
    assert handle.summary()["routed"] == {} and len(handle.summary()["replaced"]) == len(handle.originals)
    with pytest.warns(RuntimeWarning, match="got another processor after enable"):
        handle.disable()  # the adapter's processors stay


def test_diffusers_layer_skip_applies_to_enabled_models():
    """Skip-layer guidance and PAG (``apply_layer_skip``) look a processor up by its exact class and replace
    attention by V through a torch-function mode around SDPA: both reach the processors ``enable`` installs."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip
    from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode

    config = lambda: LayerSkipConfig(indices=[0], fqn="transformer_blocks", skip_attention=False,
                                     skip_attention_scores=True, skip_ff=False)  # noqa: E731
    model, x = build("pixart")
    apply_layer_skip(model, config())
    stock = run(model, x)
    model, x = build("pixart")
    handle = enable(model, "fp16")
    apply_layer_skip(model, config())
    assert torch.equal(run(model, x), stock)
    handle.disable()

    model, x = build("pixart")
    attn = model.transformer_blocks[0].attn1
    hidden = torch.randn(1, 16, attn.query_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), AttentionScoreSkipFunctionMode():
        want = attn(hidden)
    handle = enable(model, "int8", speed_gate=False)
    with torch.no_grad(), AttentionScoreSkipFunctionMode():
        got = attn(hidden)
    assert torch.equal(got, want) and handle.state.int8_calls == 0
    with torch.no_grad():
        attn(hidden)
    assert handle.state.int8_calls == 1  # outside the mode: INT8
    handle.disable()


def test_diffusers_layer_skip_with_processors_made_without_inner():
    """A processor made the diffusers way (``set_attn_processor(Int8DiffusionProcessor(...))``, no ``inner=``) has no
    stock type of its own: layer skip takes the entry of the stock processor inferred for each module, and where
    that one has none (CogVideoX's), diffusers' own error comes at the call."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    config = lambda: LayerSkipConfig(indices=[0], fqn="transformer_blocks", skip_attention=True,
                                     skip_attention_scores=False, skip_ff=False)  # noqa: E731
    model, x = build("pixart")
    plain = run(model, x)
    apply_layer_skip(model, config())
    stock = run(model, x)
    assert not torch.equal(stock, plain)  # the skip changed the output
    model, x = build("pixart")
    with pytest.warns(RuntimeWarning, match="made without inner="):
        model.set_attn_processor(Int8DiffusionProcessor(mode="fp16"))
        apply_layer_skip(model, config())
        assert torch.equal(run(model, x), stock)

    model, x = build("cogvideox")
    with pytest.raises(ValueError, match="CogVideoXAttnProcessor2_0.* not registered"):
        apply_layer_skip(model, config())  # stock
    model, x = build("cogvideox")
    model.set_attn_processor(Int8DiffusionProcessor(mode="fp16"))
    apply_layer_skip(model, config())
    with pytest.raises(ValueError, match="CogVideoXAttnProcessor2_0.* not registered"):
        run(model, x)  # the skipped block's processor is not called: no inference, no warning


def test_a_processor_made_without_inner_declares_what_models_loaded_later_pass():
    """The declared signature follows the diffusers modules loaded so far (diffusers drops undeclared keywords)."""
    import subprocess
    import sys

    code = ("import inspect, diffusion_int8 as di\n"
            "params = lambda: inspect.signature(type(di.Int8DiffusionProcessor()).__call__).parameters\n"
            "before = 'encoder_hidden_states_mask' in params()\n"
            "import diffusers.models.transformers.transformer_qwenimage\n"
            "print(before, 'encoder_hidden_states_mask' in params())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


def test_the_diffusers_way_on_a_unet_with_added_kv_projections():
    """Kandinsky 2, IF and unCLIP UNets attend over added K/V projections (``AttnAddedKVProcessor2_0``): a
    processor made without ``inner=`` infers that stock processor for them."""
    import diffusers as d

    torch.manual_seed(0)
    model = d.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        cross_attention_dim=32, attention_head_dim=8, resnet_time_scale_shift="scale_shift").eval()
    g = torch.Generator().manual_seed(1)
    x = dict(sample=torch.randn(1, 4, 16, 16, generator=g), timestep=torch.tensor(10),
             encoder_hidden_states=torch.randn(1, 7, 32, generator=g))
    stock = run(model, x)
    model.set_attn_processor(Int8DiffusionProcessor(mode="fp16"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one warning that the stock processor is inferred
        assert torch.equal(run(model, x), stock)


def test_per_token_timesteps_are_read_at_their_highest_level():
    """Image-to-video pipelines (Wan 2.2 TI2V, LTX, Sana-Video) give each token its timestep, the conditioning
    frame's tokens 0: the step's level is the highest."""
    model, x = build("wan")
    seen = []
    handle = enable(model, "int8", schedule=lambda t: (seen.append(t), "fp16")[1])
    assert seen == [1000.0]  # the config's check of what it returns
    seen.clear()
    tokens = 2 * 4 * 4  # frames x (8 / 2) x (8 / 2) patches
    timestep = torch.full((1, tokens), 700.0)
    timestep[:, :16] = 0
    run(model, dict(x, timestep=timestep))
    assert handle.state.timestep == 700.0 and handle.state.timestep_scale == 1000.0 and set(seen) == {700.0}
    handle.disable()


def test_isinstance_answers_as_for_the_stock_processor():
    # diffusers finds processors of a kind by isinstance (Qwen-Image 2.1 builds its flex BlockMask only for
    # QwenImage21FlexAttnProcessor; the zoo runs that model); type() still says what is installed
    from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0

    proc = Int8DiffusionProcessor("int8", inner=AttnProcessor2_0())
    assert isinstance(proc, AttnProcessor2_0) and isinstance(proc, Int8DiffusionProcessor)
    assert type(proc).__name__ == "Int8DiffusionProcessor"
    again = pickle.loads(pickle.dumps(proc))
    assert isinstance(again, AttnProcessor2_0) and type(again) is type(proc)
    # a stock processor that is an nn.Module: so is the wrapper, holding its weights (next test)
    ip = Int8DiffusionProcessor("int8", inner=IPAdapterAttnProcessor2_0(64, 32))
    assert isinstance(ip, (IPAdapterAttnProcessor2_0, torch.nn.Module)) and type(ip).__name__ == "Int8DiffusionProcessor"
    assert not isinstance(proc, torch.nn.Module)


def test_a_stock_processor_with_weights_stays_registered_and_settable():
    # IP-Adapter's processors are nn.Modules holding the image K/V projections: wrapped, they stay the attention
    # module's registered "processor" (state_dict keys, .to(), offloading) and diffusers still finds and sets them
    import copy

    from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

    torch.manual_seed(0)
    attn = Attention(64, cross_attention_dim=32, heads=2, dim_head=32)
    stock_proc = IPAdapterAttnProcessor2_0(hidden_size=64, cross_attention_dim=32, num_tokens=(4,), scale=0.7)
    attn.set_processor(stock_proc)
    model = torch.nn.ModuleDict({"attn": attn})
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x, text, image = torch.randn(2, 16, 64), torch.randn(2, 8, 32), torch.randn(2, 1, 4, 32)

    def out(m=attn):
        with torch.no_grad():
            return m(x, encoder_hidden_states=(text, [image]))

    keys, stock = list(model.state_dict()), out()
    stock_proc.scale = [0.0]
    stock_off = out()
    stock_proc.scale = [0.7]
    handle = enable(model, "fp16")
    proc = attn.processor
    assert isinstance(proc, Int8DiffusionProcessor) and attn._modules["processor"] is proc
    assert list(model.state_dict()) == keys and torch.equal(out(), stock)
    assert torch.equal(out(copy.deepcopy(model)["attn"]), stock)
    found = [p for p in model.modules() if isinstance(p, IPAdapterAttnProcessor2_0)]  # as set_ip_adapter_scale looks
    assert found == [proc]
    proc.scale = [0.0]
    assert stock_proc.scale == [0.0] and torch.equal(out(), stock_off)
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in stock_proc.parameters())
    handle.disable()
    assert attn.processor is stock_proc and attn._modules["processor"] is stock_proc


def _user_processors():
    """A user's processor with weights that reads ``self.training`` (dropout on an adapter), and the same with a
    property, which keeps the wrapper from being a subclass of it."""
    import torch.nn.functional as F

    class AdapterProcessor(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.adapter = torch.nn.Linear(dim, dim)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            b = hidden_states.shape[0]
            q, k, v = (f(hidden_states).view(b, -1, attn.heads, 32).transpose(1, 2)
                       for f in (attn.to_q, attn.to_k, attn.to_v))
            o = attn.to_out[0](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, attn.heads * 32))
            return o + F.dropout(self.adapter(o), 0.5, training=self.training)

    class WithProperty(AdapterProcessor):
        @property
        def strength(self):
            return 0.5

    return AdapterProcessor, WithProperty


@pytest.mark.parametrize("which", [0, 1])
def test_a_users_processor_with_weights_keeps_them_and_follows_train_and_eval(which):
    from diffusers.models.attention_processor import Attention

    cls = _user_processors()[which]
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": Attention(64, heads=2, dim_head=32)})
    model["attn"].set_processor(cls(64))
    x = torch.randn(2, 40, 64)
    keys, params = list(model.state_dict()), sum(p.numel() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        stock = model["attn"](x)
    model.train()
    handle = enable(model, "fp16")
    model.eval()  # reaches the stock processor through the wrapper: no dropout
    with torch.no_grad():
        assert torch.equal(model["attn"](x), stock)
    assert list(model.state_dict()) == keys and sum(p.numel() for p in model.parameters()) == params
    assert isinstance(model["attn"].processor, cls) == (which == 0)  # a property keeps it from being a subclass
    model.to(torch.float64)  # the weights follow .to()
    assert model["attn"].processor.adapter.weight.dtype == torch.float64
    model.train()
    handle.disable()
    assert type(model["attn"].processor) is cls and model["attn"].processor.training


def test_a_processor_that_delegates_to_a_stock_one_runs_int8():
    # a subclass calling super().__call__, or a processor calling a stock one through its class, reaches SDPA there
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    from diffusion_int8.plugin.models import reaches_attention

    class Subclass(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return super().__call__(attn, hidden_states, *args, **kwargs)

    class Through:
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            return AttnProcessor2_0.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    class Base:  # attention in a helper method, which a subclass overrides with linear attention
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            return self.core(hidden_states)

        def core(self, x):
            return torch.nn.functional.scaled_dot_product_attention(x, x, x)

    class Linear(Base):
        def core(self, x):
            return x @ (x.transpose(-1, -2) @ x)

    assert reaches_attention(Base()) and not reaches_attention(Linear())  # the method an instance calls
    for cls in (Subclass, Through):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"attn": Attention(64, heads=2, dim_head=32)}).eval()
        model["attn"].set_processor(cls())
        x = torch.randn(2, 300, 64)
        with torch.no_grad():
            stock = model["attn"](x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = enable(model, "int8")
            with torch.no_grad():
                out = model["attn"](x)
        assert not [w for w in caught if "stock processor" in str(w.message)], cls
        assert set(handle.originals) == {"attn"}
        err = (out - stock).abs().max().item()
        assert 0 < err < 0.05, (cls, err)  # INT8 ran: close to stock, not equal
        handle.disable()


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


def tiny_clip(tmp_path):
    """A CLIP text encoder with random weights and a tokenizer whose vocabulary is written here (characters)."""
    import json

    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for c in chars:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), model_max_length=16)
    torch.manual_seed(0)
    enc = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=16, projection_dim=32,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=1))
    return tok, enc.eval()


def test_stable_diffusion_pipeline_with_tokenizer(tmp_path):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    from diffusion_int8 import PrecisionSchedule, Rule

    tok, enc = tiny_clip(tmp_path)
    unet, _ = build("unet")
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(32,), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",), norm_num_groups=32)
    pipe = StableDiffusionPipeline(unet=unet, vae=vae.eval(), text_encoder=enc, tokenizer=tok,
                                   scheduler=DDIMScheduler(num_train_timesteps=1000), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(["a red cat", "a blue dog"], num_inference_steps=5, height=16, width=16,
                    generator=torch.Generator().manual_seed(0), output_type="np").images

    stock = generate()
    # exact at high noise, INT8 below 0.6, FP16 P·V for cross-attention at low noise
    schedule = PrecisionSchedule(rules=(Rule("fp16", min_noise=0.6), Rule("int8_fp16v", max_noise=0.4, layers="*attn2*")),
                                 default="int8")
    handle = diffusion_int8.enable(pipe, schedule=schedule, record=True)
    images = generate()
    timesteps = [float(t) for t in pipe.scheduler.timesteps]
    seen = {}
    for step, t, layer, mode in handle.state.trace:
        seen.setdefault(step, {})[layer] = mode
        assert t == timesteps[step]
    assert sorted(seen) == list(range(len(timesteps)))
    for step, layers in seen.items():
        noise = timesteps[step] / 1000
        for layer, mode in layers.items():
            want = "fp16" if noise >= 0.6 else ("int8_fp16v" if noise <= 0.4 and "attn2" in layer else "int8")
            assert mode == want, (step, layer, mode)
    assert 0 < abs(images - stock).max() < 0.1
    handle.disable()
    assert (generate() == stock).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_cpu_offload(tmp_path):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    tok, enc = tiny_clip(tmp_path)
    unet, _ = build("unet")
    vae = AutoencoderKL(block_out_channels=(32,), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",), norm_num_groups=32)
    pipe = StableDiffusionPipeline(unet=unet.half(), vae=vae.eval().half(), text_encoder=enc.half(), tokenizer=tok,
                                   scheduler=DDIMScheduler(num_train_timesteps=1000), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.enable_model_cpu_offload()
    handle = diffusion_int8.enable(pipe, mode="int8", record=True, speed_gate=False)  # tiny shapes: forced
    out = pipe(["a cat"], num_inference_steps=3, height=16, width=16, output_type="np").images
    assert out.shape == (1, 16, 16, 3) and not torch.isnan(torch.from_numpy(out)).any()
    assert {m for *_, m in handle.state.trace} == {"int8"} and handle.state.int8_calls > 0
    assert next(pipe.unet.parameters()).device.type == "cpu"  # offloaded again after the call
    handle.disable()


def tiny_t5(tmp_path):
    """A T5 encoder with random weights and a word-level tokenizer built here."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "blue", "cat", "dog"]
    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    enc = T5EncoderModel(T5Config(vocab_size=len(words), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4))
    return tok, enc.eval()


def test_flux_pipeline_schedule_and_disable(tmp_path):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_tok, clip = tiny_clip(tmp_path)
    t5_tok, t5 = tiny_t5(tmp_path)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                         num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                         axes_dims_rope=(4, 6, 6)).eval()
    vae = AutoencoderKL(block_out_channels=(32,), in_channels=3, out_channels=3, latent_channels=4, shift_factor=0.0,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",), norm_num_groups=32)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe("a red cat", num_inference_steps=4, height=16, width=16, max_sequence_length=8,
                    generator=torch.Generator().manual_seed(0), output_type="np").images

    stock = generate()
    handle = diffusion_int8.enable(pipe, schedule="balanced", record=True)
    images = generate()
    sigmas = [float(s) for s in pipe.scheduler.sigmas[:-1]]
    modes = {}
    for step, t, layer, mode in handle.state.trace:
        modes.setdefault(step, set()).add(mode)
        assert t == pytest.approx(sigmas[step], abs=1e-6)  # Flux passes sigmas: the noise level itself
    want = ["int8" if s >= 0.5 else "int8_fp16v" if s >= 0.1 else "fp16" for s in sigmas]
    assert [modes[s] for s in sorted(modes)] == [{w} for w in want]
    assert 0 < abs(images - stock).max() < 0.1
    handle.disable()
    assert (generate() == stock).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_compiles_without_graph_breaks(family, dynamo_warnings):
    """torch.compile(fullgraph=True) traces every family with the INT8 processors (dynamo only: backend "eager"),
    without dynamo warning about our code."""
    model, x = build(family)
    handle = enable(model, mode="int8")
    with torch.no_grad():
        eager = run(model, x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")(**x, return_dict=False)[0]
    handle.disable()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert not [w for w in dynamo_warnings if "lru_cache" in str(w.message)]  # dynamo traced through a cache


def test_stale_handle_disable_is_a_no_op():
    model, x = build("dit")
    stock = {n: m.processor for n, m in attention_modules(model).items()}
    h1 = enable(model, "int8")
    h1.disable()
    h2 = enable(model, "int8")
    h1.disable()  # stale: must leave h2's processors and marker alone
    with pytest.raises(RuntimeError, match="already enabled"):
        enable(model, "int8")  # so a third enable cannot nest INT8 processors
    assert all(isinstance(m.processor, Int8DiffusionProcessor) for m in attention_modules(model).values())
    h2.disable()
    h2.disable()
    assert {n: m.processor for n, m in attention_modules(model).items()} == stock


def test_processor_reaching_attention_another_way_is_routed_with_a_warning():
    # a stock processor that calls torch.nn.functional.scaled_dot_product_attention by its full name is not
    # reached by the routed copy's F: the first call notices, warns once, and routes it another way
    from diffusers.models.attention_processor import AttnProcessor2_0

    calls = []

    class FullName(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
            calls.append(self)  # a side effect, as a KV cache's store: once per call, also on the first
            b = hidden_states.shape[0]
            ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            q, k, v = (t.view(b, -1, attn.heads, t.shape[-1] // attn.heads).transpose(1, 2)
                       for t in (attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2)))

    model, x = build("dit")
    stock = run(model, x)
    for m in attention_modules(model).values():
        m.set_processor(FullName())
    handle = enable(model, "int8", speed_gate=False)
    with pytest.warns(RuntimeWarning, match="torch-function mode"):
        out = run(model, x)
    assert len(calls) == len(attention_modules(model))  # each ran once
    assert handle.state.int8_calls == len(calls) and 0 < rel_l2(out, stock) <= BOUND["int8"]
    assert torch.equal(run(model, x), out)  # the first call ran INT8 as the next ones do
    handle.disable()


def test_a_first_call_without_attention_decides_nothing():
    # a call that reaches no attention (LTX-2 with every sample perturbed) says nothing about how the processor
    # reaches it: the next call that does decides, without a warning
    from diffusers.models.attention_processor import AttnProcessor2_0

    class Sometimes(AttnProcessor2_0):
        attend = False

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
            if not Sometimes.attend:
                return attn.to_out[0](hidden_states)
            b = hidden_states.shape[0]
            q, k, v = (t.view(b, -1, attn.heads, t.shape[-1] // attn.heads).transpose(1, 2)
                       for t in (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)))
            out = F.scaled_dot_product_attention(q, k, v)
            return attn.to_out[0](out.transpose(1, 2).flatten(2))

    model, x = build("dit")
    for m in attention_modules(model).values():
        m.set_processor(Sometimes())
    handle = enable(model, "int8", speed_gate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, x)
        assert handle.state.int8_calls == 0
        Sometimes.attend = True
        run(model, x)
    assert handle.state.int8_calls == len(attention_modules(model))
    assert all(type(m.processor.inner) in m.processor._routed_calls for m in attention_modules(model).values())
    handle.disable()
    # one that never reaches attention the processor can see says so, once
    Sometimes.attend = False
    handle = enable(model, "int8", speed_gate=False)
    with pytest.warns(RuntimeWarning, match="reached no attention through F") as caught:
        for _ in range(12):
            run(model, x)
    assert len([w for w in caught if "reached no attention" in str(w.message)]) == len(attention_modules(model))
    handle.disable()


# -- block-sparse attention ------------------------------------------------------------------------------------

def long_dit():
    """The tiny DiT at 576 tokens (48×48 latents in 2×2 patches): five 128-token blocks per side."""
    import diffusers as d

    torch.manual_seed(0)
    model = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                    num_layers=2, sample_size=48, patch_size=2, num_embeds_ada_norm=10).eval()
    g = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 4, 48, 48, generator=g), class_labels=torch.tensor([1, 3]))


class Spy:
    """Wraps a function, keeping the keyword arguments of every call (and, where a call returns a predicted block
    mask, that mask as ``"predicted"``)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(dict(kwargs))
        res = self.fn(*args, **kwargs)
        if kwargs.get("return_block_mask"):
            self.calls[-1]["predicted"] = res[-1]
        return res


@pytest.fixture
def kernel_calls(monkeypatch):
    from diffusion_int8.plugin import routing
    from diffusion_int8.kernels import ops

    spy = Spy(routing.int8_attention)
    monkeypatch.setattr(routing, "int8_attention", spy)
    # random weights give keys with little in common within a block: without the similarity guard, so that the
    # predictor's masks (the emulation's, on CPU) skip blocks here (the guard is tested in test_sparsity.py)
    monkeypatch.setattr(ops, "predict_block_mask", functools.partial(ops.predict_block_mask, min_similarity=None))
    return spy.calls


def at(model, x, t):
    return run(model, {**x, "timestep": torch.tensor([t, t])})


def test_sparsity_passes_predicted_masks_and_counts_skipped_blocks(kernel_calls):
    model, x = long_dit()
    dense = at(model, x, 500)
    handle = enable(model, mode="int8_fp16v", sparsity=0.5, record=True, speed_gate=False)
    out = at(model, x, 500)
    assert [c["sparsity"] for c in kernel_calls] == [0.5, 0.5]  # predicted in the call
    masks = [c["predicted"] for c in kernel_calls]
    assert len(masks) == 2 and all(m.shape == (2, 2, 5, 5) and m.dtype == torch.bool for m in masks)
    kept = sum(int(m.sum()) for m in masks)
    skipped = handle.state.skipped_blocks()
    assert skipped["steps"] == [0] and skipped["overall"] == pytest.approx(1 - kept / 200)
    assert 0 < skipped["overall"] < 1 and skipped["per_step"] == [pytest.approx(skipped["overall"])]
    handle.disable()
    print(f"skipped {skipped['overall']:.3f} of the blocks, rel L2 {rel_l2(out, dense):.4f} against stock")
    assert 0 < rel_l2(out, dense) < 0.5
    # tau 1 and no sparsity are the dense kernel call, bit for bit
    kernel_calls.clear()
    for kwargs in ({"sparsity": 1.0}, {}):
        handle = enable(model, mode="int8_fp16v", speed_gate=False, **kwargs)
        outs = at(model, x, 500)
        handle.disable()
        assert all(c["sparsity"] is None for c in kernel_calls)
        torch.testing.assert_close(outs, run_dense_int8(model, x), rtol=0, atol=0)


def run_dense_int8(model, x):
    handle = enable(model, mode="int8_fp16v", speed_gate=False)
    try:
        return at(model, x, 500)
    finally:
        handle.disable()


def test_schedule_levels_apply_per_noise_level_and_sdpa_calls_stay_dense(kernel_calls):
    from diffusion_int8 import PrecisionSchedule, Rule

    model, x = long_dit()
    schedule = PrecisionSchedule(rules=(Rule("fp16", min_noise=0.9), Rule("int8", min_noise=0.5, tau=0.5)),
                                 default="int8")
    handle = enable(model, schedule=schedule, record=True, speed_gate=False)
    for t in (950, 700, 100):  # fp16, int8 at tau 0.5, int8 dense
        at(model, x, t)
    skipped = handle.state.skipped_blocks()
    handle.disable()
    assert [c["sparsity"] for c in kernel_calls] == [0.5, 0.5, None, None]
    assert skipped["per_step"][0] == 0 and skipped["per_step"][1] > 0 and skipped["per_step"][2] == 0
    assert skipped["overall"] == pytest.approx(skipped["per_step"][1] / 3)  # every step has the same 100 pairs

    class NeverPays(diffusion_int8.plugin.speed_gate.SpeedGate):
        def pays(self, mode, q, k, attn_mask=None, balance=False, eager=None):
            return False

    kernel_calls.clear()
    handle = enable(model, mode="int8", sparsity=0.5, record=True, speed_gate=NeverPays())
    at(model, x, 700)
    assert not kernel_calls and handle.state.gated_calls == 2 and handle.state.skipped_blocks()["overall"] == 0
    handle.disable()


def test_sparsity_arguments_are_checked():
    from diffusion_int8 import PrecisionSchedule, Rule

    model, _ = long_dit()
    with pytest.raises(ValueError, match=r"sparsity must be a number in \(0, 1\]"):
        enable(model, mode="int8", sparsity=0)
    sparse = PrecisionSchedule(rules=(Rule("int8", tau=0.9),), name="mine")
    with pytest.raises(ValueError, match="schedule 'mine' sets sparsity levels of its own"):
        enable(model, schedule=sparse, sparsity=0.9)
    with pytest.raises(TypeError, match="qk_balance must be None .where the module needs it., True or False"):
        Int8DiffusionProcessor("int8", qk_balance="yes")
    with pytest.raises(TypeError, match="qk_rotate must be True or False"):
        Int8DiffusionProcessor("int8", qk_rotate=1)
    from diffusion_int8.plugin import config

    config._warn_rotation_cost.cache_clear()
    with pytest.warns(UserWarning, match="qk_rotate costs .* which the speed gate's crossover tables do not include"):
        Int8DiffusionProcessor("int8", qk_rotate=True)
    enable(model, schedule="balanced", sparsity=0.9).disable()  # no levels of its own: the constant applies


def test_qk_balance_reaches_the_op(kernel_calls):
    # 576 queries a head: too few for the balance, so the default (None) sends False and stays undecided
    model, x = long_dit()
    for balance in (True, False, None):
        handle = enable(model, mode="int8", qk_balance=balance, speed_gate=False)
        at(model, x, 500)
        status = handle.summary()["qk_balance"]
        handle.disable()
    assert [c["qk_balance"] for c in kernel_calls] == [True, True, False, False, False, False]
    assert list(status) == [
        "undecided (no INT8 call of 1,024+ queries per head so far; shorter calls are not balanced)"]


@pytest.mark.parametrize("D", [40, 96, 160, 256])
def test_the_default_balances_outlier_channels_q_or_k_carries_alone(D):
    # Held-out-style inputs: Q's and K's outlier channels drawn apart (x20-x30), with and without a sink token.
    # The default (no flag) finds them at the module's first call and balances: int8_fp16v cos >= 0.999 and
    # int8 >= 0.998 against float64, where without the balance both fall to 0.94-0.99 (emulation).
    from diffusion_int8.kernels import reference as R
    from diffusion_int8.compare import cos_l1
    from diffusion_int8.inputs import realistic_qkv

    attn = identity_attention(2, D)
    for n, gain, sink in ((3, 30.0, True), (1, 30.0, False), (3, 20.0, False)):
        q, k, v = realistic_qkv(1, 2, 1024, 1024, D, outliers="separate", n_outliers=n, outlier_gain=gain, sink=sink)
        ref = R.attention_ref(q, k, v)
        for mode, floor in (("int8_fp16v", 0.999), ("int8", 0.998)):
            attn.set_processor(Int8DiffusionProcessor(mode, speed_gate=False, name="attn"))
            cos = cos_l1(run_identity(attn, q, k, v), ref)[0]
            assert attn.processor.balance_status() == "on (outlier channels at the first call)"
            attn.set_processor(Int8DiffusionProcessor(mode, speed_gate=False, qk_balance=False))
            off = cos_l1(run_identity(attn, q, k, v), ref)[0]
            assert cos >= floor and off < 0.995, (D, n, gain, sink, mode, cos, off)


def test_the_gate_counts_the_balance_a_call_measures():
    # A table whose INT8 lead (1.08x, margin 1.05) pays for a call but not for the call plus its measured Q·Kᵀ
    # balance at 1,024 keys (speed_gate.balance_cost): the module with outlier channels of its own goes to SDPA,
    # the one without runs INT8, and one whose balance comes from nowhere (qk_balance=False) runs INT8 too
    from diffusion_int8.plugin.speed_gate import CrossoverTable, Grid, SpeedGate, balance_cost
    from diffusion_int8.inputs import realistic_qkv

    D = 64
    grids = tuple(Grid(m, D, "float32", (512,), (512,), ((1.08,),)) for m in ("int8", "int8_fp16v"))
    gate = SpeedGate(CrossoverTable("test GPU", "sm_00", grids, margin=1.05))
    assert 1.08 / (1 + balance_cost(1024)) < 1.05 <= 1.08 / (1 + balance_cost(32768))
    attn = identity_attention(2, D)
    outcomes = {}
    for outliers in ("separate", "none"):
        # no sink where there are no outliers: a sink token in a channel of extreme K bias (|bias| > 4.5σ, one
        # run in ~10⁴) is an outlier of smoothed K, which the call rightly balances
        q, k, v = realistic_qkv(1, 2, 1024, 1024, D, outliers="separate", n_outliers=3,
                                outlier_gain=30.0 if outliers == "separate" else 1.0, sink=outliers == "separate")
        for balance in (None, False):
            attn.set_processor(Int8DiffusionProcessor("int8", speed_gate=gate, qk_balance=balance, name="attn"))
            run_identity(attn, q, k, v)
            outcomes[outliers, balance] = attn.processor._outcomes[:2]
    assert outcomes == {("separate", None): [0, 1], ("separate", False): [1, 0],
                        ("none", None): [1, 0], ("none", False): [1, 0]}


def test_the_default_leaves_inputs_without_own_outlier_channels_as_they_are():
    # Q and K sharing their outlier channels, or none: the first call finds nothing to balance, and every call
    # gives what qk_balance=False gives, bit for bit
    from diffusion_int8.inputs import realistic_qkv

    attn = identity_attention(2, 64)
    for n in (2, 0):
        # without the sink token, which in a channel of extreme K bias is an outlier of smoothed K (one run in ~10⁴)
        q, k, v = realistic_qkv(1, 2, 1024, 1024, 64, n_outliers=n, sink=False)
        for mode in ("int8_fp16v", "int8"):
            attn.set_processor(Int8DiffusionProcessor(mode, speed_gate=False))
            default = run_identity(attn, q, k, v)
            assert attn.processor.balance_status() == "off (no outlier channels at the first call)"
            attn.set_processor(Int8DiffusionProcessor(mode, speed_gate=False, qk_balance=False))
            assert torch.equal(default, run_identity(attn, q, k, v))


def test_qk_rotate_reaches_the_op_and_drops_static_q_k_ranges(kernel_calls):
    # with a calibration, a rotated call measures Q's and K's ranges (the calibrated ones are of the unrotated
    # tensors) and keeps the calibrated V ranges and K mean
    from diffusion_int8.calibration import Calibration, Collector, merge

    model, x = long_dit()
    col = Collector(modes=())
    handle = enable(model, mode="fp16", observer=col)
    at(model, x, 500)
    handle.disable()
    timesteps, stats = merge([col.record(0)])
    cal = Calibration.from_stats({"model": "tiny", "model_class": type(model).__name__, "num_train_timesteps": 1000},
                                 timesteps, stats)
    for rotate in (True, False):
        handle = enable(model, mode="int8", calibration=cal, qk_rotate=rotate, speed_gate=False)
        at(model, x, 500)
        handle.disable()
    rotated = [c for c in kernel_calls if c["qk_rotate"]]
    assert 0 < len(rotated) == len(kernel_calls) // 2
    assert all(c["q_amax"] is None and c["k_amax"] is None and c["v_amax"] is not None and c["k_mean"] is not None
               for c in rotated)
    assert all(c["q_amax"] is not None for c in kernel_calls if not c["qk_rotate"])
    # a calibrated processor made by hand (set_attn_processor) must be told its module's name, and a name calibrated
    config = diffusion_int8.Int8Config("int8", calibration=cal)
    with pytest.raises(ValueError, match=r"needs its module's name \(name=\.\.\., as calibrated\)"):
        Int8DiffusionProcessor(config)
    with pytest.raises(ValueError, match="the calibration has no layer 'nope'"):
        Int8DiffusionProcessor(config, name="nope")


@pytest.mark.parametrize("family, first", [("flux", True), ("sd3", False), ("cogvideox", True)])
def test_joint_attention_always_keeps_the_text_key_blocks(monkeypatch, family, first):
    from diffusion_int8.plugin import routing

    spy = Spy(routing.int8_attention)
    monkeypatch.setattr(routing, "int8_attention", spy)
    model, x = build(family)
    g = torch.Generator().manual_seed(2)
    if family == "flux":  # 300 image tokens and 7 text tokens: three blocks, the text in the first
        x = {**x, "hidden_states": torch.randn(1, 300, 16, generator=g), "img_ids": torch.randn(300, 3, generator=g)}
    elif family == "sd3":  # 16×16 patches and 7 text tokens after them: the text in the third block
        x = {**x, "hidden_states": torch.randn(1, 4, 32, 32, generator=g)}
        model = type(model)(**{**model.config, "sample_size": 32}).eval()
    else:  # 2 latent frames of 16×16 patches after 8 text tokens
        x = {**x, "hidden_states": torch.randn(1, 2, 4, 32, 32, generator=g)}
        model = type(model)(**{**model.config, "sample_width": 32, "sample_height": 32}).eval()
    handle = enable(model, mode="int8", sparsity=0.5, speed_gate=False)
    run(model, x)
    handle.disable()
    joint = [c for c in spy.calls if c["keep_kv_blocks"] is not None]
    assert joint
    for c in joint:
        keep = c["keep_kv_blocks"]
        assert keep.dtype == torch.bool and int(keep.sum()) == 1 and bool(keep[0] if first else keep[-1])


def test_sparse_processors_compile_without_graph_breaks(kernel_calls, dynamo_warnings):
    """The predictor and the always-kept text blocks trace whole (dynamo only, backend "eager")."""
    model, x = long_dit()
    x = {**x, "timestep": torch.tensor([500, 500])}
    handle = enable(model, mode="int8", sparsity=0.5, speed_gate=False)
    with torch.no_grad():
        eager = run(model, x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")(**x, return_dict=False)[0]
    handle.disable()
    assert all(c["sparsity"] == 0.5 for c in kernel_calls)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert not [w for w in dynamo_warnings if "lru_cache" in str(w.message)]  # dynamo traced through a cache
    model, x = build("flux")
    g = torch.Generator().manual_seed(2)
    x = {**x, "hidden_states": torch.randn(1, 300, 16, generator=g), "img_ids": torch.randn(300, 3, generator=g)}
    handle = enable(model, mode="int8", sparsity=0.5, speed_gate=False)
    with torch.no_grad():
        eager = run(model, x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")(**x, return_dict=False)[0]
    handle.disable()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_set_attention_backend_reaches_the_wrapped_processor():
    # diffusers' set_attention_backend sets the backend on whatever processor a module holds: after enable() it
    # reaches the stock processor wrapped, whose calls then go to that backend (stock), and one warning says so;
    # back on native, INT8 runs
    model, x = build("wan")
    with torch.no_grad():
        model.set_attention_backend("_native_math")
        stock_math = model(**x, return_dict=False)[0]
        model.set_attention_backend("native")
        handle = enable(model, "int8")
        model.set_attention_backend("_native_math")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            assert torch.equal(model(**x, return_dict=False)[0], stock_math) and handle.state.int8_calls == 0
            model(**x, return_dict=False)
        said = [str(w.message) for w in caught if "attention backend" in str(w.message)]
        assert len(said) == 1 and "'_native_math'" in said[0] and "set_attention_backend('native')" in said[0]
        model.set_attention_backend("native")
        out = model(**x, return_dict=False)[0]
    assert handle.state.int8_calls == 2 and not torch.equal(out, stock_math)
    handle.disable()
    model, x = build("wan")  # compiled, the same warning (from outside the graph)
    handle = enable(model, "int8")
    model.set_attention_backend("_native_math")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("default")
            torch.compile(model, backend="eager")(**x, return_dict=False)
        assert len([w for w in caught if "attention backend is '_native_math'" in str(w.message)]) == 1
    finally:
        model.set_attention_backend("native")
        handle.disable()


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_ulysses_share_cuts_a_per_head_mask_to_the_devices_heads(mode):
    """Under a Ulysses split each device holds a block of the heads; a mask the stock processor made per head before
    the split (LTX-Video's (B, H, 1, Sk)) reaches it whole and is cut to that block: the second device's call equals
    the same call on heads 2-3 given their own rows of the mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g) for _ in range(3))
    mask = torch.rand(1, 4, 1, 96, generator=g) > 0.3  # a different key set per head
    proc = Int8DiffusionProcessor(mode, speed_gate=False)
    got = proc._attention(q, k, v, mask, share=(1, 2))
    want = proc._attention(q, k, v, mask[:, 2:4])
    assert torch.equal(got, want)
    assert not torch.equal(got, proc._attention(q, k, v, mask[:, 0:2]))  # the rows differ per head


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU needs Triton's interpreter "
                    "(conftest sets it where there is no GPU; on a GPU test_gpu.py runs these models)")
@pytest.mark.parametrize("family", ["dit", "flux", "wan"])
def test_models_run_the_triton_kernel(family, monkeypatch):
    """A diffusers model through the real kernel (Triton's interpreter), not the emulation the other model tests
    use: its output is the emulation's up to a small fraction of INT8's own distance from stock."""
    model, x = build(family)
    with torch.no_grad():
        stock = run(model, x)
        outs = {}
        for backend in ("emulation", "triton"):
            monkeypatch.setenv("DIFFUSION_INT8_BACKEND", backend)
            handle = enable(model, "int8", speed_gate=False)
            outs[backend] = run(model, x)
            assert handle.state.int8_calls > 0
            handle.disable()
    int8_error = rel_l2(outs["emulation"], stock)
    assert int8_error > 1e-4 and rel_l2(outs["triton"], outs["emulation"]) < 0.1 * int8_error


def test_valid_prefix_of_key_masks():
    from diffusion_int8.kernels.key_mask import valid_prefix

    pad = torch.ones(2, 300, dtype=torch.bool)
    pad[:, 250:] = False
    assert valid_prefix(pad[:, None, None, :], 2, 4, 300) == 250  # (B, 1, 1, Sk)
    assert valid_prefix(pad[:1, None, :], 2, 4, 300) == 250  # (1, 1, Sk), broadcast over the batch
    assert valid_prefix(pad, 2, 4, 300) is None  # 2-D: (Sq, Sk) to SDPA, not a key mask
    additive = torch.zeros(2, 1, 1, 300).masked_fill(~pad[:, None, None, :], float("-inf"))
    assert valid_prefix(additive, 2, 4, 300) == 250
    assert valid_prefix(additive * 0.5 + 1.0, 2, 4, 300) is None  # a bias, not a mask
    hole = pad.clone()
    hole[0, 10] = False
    assert valid_prefix(hole[:, None, None, :], 2, 4, 300) is None  # a masked key before kept ones
    ragged = pad.clone()
    ragged[1, 240:] = False
    assert valid_prefix(ragged[:, None, None, :], 2, 4, 300) is None  # the batch rows keep different keys
    assert valid_prefix(torch.ones(2, 1, 300, 300, dtype=torch.bool), 2, 4, 300) is None  # not a key mask


def test_a_padded_key_mask_runs_block_sparse_over_its_kept_keys(monkeypatch):
    """A key mask that keeps the first n keys (text padding at the end) no longer makes a sparse call dense: the call
    runs block-sparse over those n keys without the mask, the same computation, reading the mask once per mask."""
    from diffusion_int8 import int8_attention
    from diffusion_int8.inputs import local_qkv
    from diffusion_int8.kernels import key_mask
    from diffusion_int8.plugin import state as state_module

    reads = []
    monkeypatch.setattr(state_module, "valid_prefix", lambda *a: reads.append(1) or key_mask.valid_prefix(*a))
    q, k, v = local_qkv(1, 2, 640, 640, 32, seed=0)
    pad = torch.ones(1, 640, dtype=torch.bool)
    pad[:, 570:] = False
    proc = Int8DiffusionProcessor("int8", sparsity=0.5, speed_gate=False)
    proc.state.trace = []
    outs = [proc._attention(q, k, v, pad[:, None, None, :]) for _ in range(3)]  # a new view of the mask each call
    want = int8_attention(q, k[:, :, :570], v[:, :, :570], mode="int8", sparsity=0.5)
    assert all(torch.equal(o, want) for o in outs) and len(reads) == 1
    kept, total = proc.state.block_totals()[-1]
    assert kept < total  # blocks were skipped
    # a mask with a hole keeps the call dense, under its mask
    hole = pad.clone()
    hole[0, 3] = False
    dense = proc._attention(q, k, v, hole[:, None, None, :])
    assert torch.equal(dense, int8_attention(q, k, v, mode="int8", attn_mask=hole[:, None, None, :]))
    # compiled (HunyuanVideo under torch.compile): the mask is read outside the graph, and the call runs sparse
    torch._dynamo.reset()
    compiled = torch.compile(proc._attention, backend="eager")
    assert torch.equal(compiled(q, k, v, pad[:, None, None, :]), want)
    assert torch.equal(compiled(q, k, v, hole[:, None, None, :]), dense)
    torch._dynamo.reset()


def test_processors_pickle_and_observers_take_one_call():
    import pickle

    model, x = build("dit")
    handle = enable(model, "int8", speed_gate=False)
    proc = next(iter(attention_modules(model).values())).processor
    back = pickle.loads(pickle.dumps(proc))
    assert type(back) is type(proc) and back.name == proc.name and back.mode is proc.mode
    handle.disable()
    model, x = build("dit")
    with pytest.raises(TypeError, match="an observer receives one diffusion_int8.AttentionCall"):
        enable(model, "fp16", observer=lambda proc, q, k, v, mask, scale, out: None)


def test_an_observer_sees_a_padded_key_mask_cut_as_the_sparse_call_runs_it():
    from diffusion_int8.inputs import local_qkv

    seen = []
    proc = Int8DiffusionProcessor("fp16", observer=seen.append)
    q, k, v = local_qkv(1, 2, 300, 300, 32, seed=0)
    pad = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    pad[..., 260:] = False
    out = proc._attention(q, k, v, pad)
    call = seen[0]
    assert call.key.shape[2] == 260 and call.attn_mask is None and torch.equal(call.out, out)
    assert torch.equal(call.value, v[:, :, :260])


@pytest.mark.parametrize("compiled", [False, True])
def test_a_warning_inside_the_forward_points_at_the_users_line(compiled):
    # one warning, at the line that called the model, eager or compiled (where Dynamo cannot trace the frame walk)
    from diffusers.models.attention_processor import Attention

    attn = Attention(64, heads=2, dim_head=32).half()
    attn.set_processor(Int8DiffusionProcessor(mode="int8"))  # no inner=: it warns at its first call
    run = torch.compile(attn, backend="eager") if compiled else attn
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():  # with grad, INT8 also says it has no backward
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        run(torch.randn(1, 40, 64, dtype=torch.half))
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, line)], [(str(w.message)[:80], w.filename)
                                                                          for w in seen]


def test_calls_the_kernel_does_not_cover_are_stocks_own():
    """SDPA broadcasts a K/V batch of 1 and refuses fewer K/V heads without ``enable_gqa``; the kernel does
    neither, so such calls run SDPA: stock's result, or stock's error. GQA asked for runs INT8."""
    from diffusion_int8.plugin.routing import int8_sdpa, kernel_takes
    from diffusion_int8.inputs import realistic_qkv

    q, k, v = realistic_qkv(2, 4, 129, 77, 64)
    assert not kernel_takes(q, k[:1])
    assert torch.equal(int8_sdpa("int8", q, k[:1], v[:1]), F.scaled_dot_product_attention(q, k[:1], v[:1]))
    kg, vg = k[:, :2], v[:, :2]
    with pytest.raises(RuntimeError) as stock:
        F.scaled_dot_product_attention(q, kg, vg)
    with pytest.raises(RuntimeError) as ours:
        int8_sdpa("int8", q, kg, vg)
    assert str(ours.value) == str(stock.value)
    assert kernel_takes(q, kg, enable_gqa=True) and not kernel_takes(q, k[:, :3], enable_gqa=True)
    exact = F.scaled_dot_product_attention(q, kg, vg, enable_gqa=True)
    out = int8_sdpa("int8", q, kg, vg, enable_gqa=True)
    assert not torch.equal(out, exact)  # INT8 ran
    assert F.cosine_similarity(out.double().flatten(), exact.double().flatten(), 0) > 0.999


@pytest.mark.parametrize("mode", ["int8", "int8_fp16v"])
def test_a_float32_model_past_fp16s_range_stays_finite(mode):
    """float32 calls compute in fp16, scaled by powers of two where an element would pass ±65504 (Q here, and V;
    K small, as the logits of a working model require): stock's result to INT8's accuracy, not inf or NaN; and a
    call within range converts unscaled, bit for bit as the plain cast."""
    from diffusion_int8.plugin.routing import int8_sdpa
    from diffusion_int8.inputs import realistic_qkv
    from diffusion_int8.kernels import Mode, StaticRanges, int8_attention
    from diffusion_int8.plugin.routing import int8_core

    q, k, v = realistic_qkv(1, 2, 200, 200, 64, dtype=torch.float32, seed=3)
    out = int8_sdpa(mode, q, k, v)
    assert torch.equal(out, int8_attention(q.half(), k.half(), v.half(), mode=mode, layout="BHSD").float())
    q, k, v = q * 2e4, k / 2e4, v * 3e4
    assert float(q.abs().max()) > 65504 and float(v.abs().max()) > 65504
    exact = F.scaled_dot_product_attention(q, k, v)
    out = int8_sdpa(mode, q, k, v)
    assert out.dtype == torch.float32 and bool(out.isfinite().all())
    assert F.cosine_similarity(out.double().flatten(), exact.double().flatten(), 0) > 0.999
    # powers of two scale exactly: inputs moved past fp16's range give the in-range call's every output, the
    # carried blocks' output and the log-sum-exps included (what the carry and the ring path read), V's undone;
    # up to the fp16 rounding of outputs near zero, which V's scale moves
    q0, k0, v0 = ((t / t.abs().amax() * 4).half().float()  # fp16's values: each scaling below converts exactly
                  for t in realistic_qkv(1, 2, 300, 300, 64, dtype=torch.float32, seed=4))
    mask = torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(0)) > 0.5
    mask[..., 0] = True
    in_range = int8_core(Mode.parse(mode), q0, k0, v0, None, None, None, block_mask=mask, return_lse=True,
                         return_skipped=True)
    past = int8_core(Mode.parse(mode), q0 * 2 ** 14, k0 / 2 ** 14, v0 * 2 ** 16, None, None, None, block_mask=mask,
                     return_lse=True, return_skipped=True)
    assert len(past) == 4 and all(bool(t.isfinite().any()) for t in past)
    for a, b, by in zip(past, in_range, (2 ** 16, 1, 2 ** 16, 1)):  # output, its lse, the skipped blocks', their lse
        torch.testing.assert_close(a, b * by, rtol=1e-3, atol=1e-4 * by)
    # static ranges, as a calibration measured them in the model's units, scaled with the inputs (Q's and K's
    # decide; V's range and K's mean only move scales by powers of two, which the 8-bit values do not see)
    ranges = StaticRanges(q.abs().amax((2, 3)), k.abs().amax((2, 3)), v.abs().amax(2), k.mean(2))
    out = int8_sdpa(mode, q, k, v, ranges=ranges)
    assert bool(out.isfinite().all())
    assert F.cosine_similarity(out.double().flatten(), exact.double().flatten(), 0) > 0.999
