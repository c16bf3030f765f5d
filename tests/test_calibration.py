"""Calibration: statistics against direct computations, the file, validation, schedules, merging, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from diffusion_int8 import Int8Config, Mode, PrecisionSchedule, Rule, enable
from diffusion_int8 import schedule as schedule_module
from diffusion_int8.calibration import Calibration, Collector, merge
from diffusion_int8.calibration.file import evaluate_fit, fit_quadratic
from diffusion_int8.calibration.stats import input_stats, quantile_lastdim
from diffusion_int8.compare import rel_l1
from processes import accelerate_launch, cli_env, one_thread_env
from tiny_models import build


SCHEMA_4 = ("q_cmax", "k_cmax", "fit.qc", "fit.kc")  # the per-channel Q/K maxima, since schema 4


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4099])
def test_quantile_matches_torch(n):
    x = torch.randn(3, n) * torch.rand(3, 1) * 10
    for q in (0.0, 0.5, 0.99, 1.0):
        torch.testing.assert_close(quantile_lastdim(x, q), torch.quantile(x, q, dim=-1), rtol=1e-6, atol=1e-6)


def test_input_stats_direct():
    q, k, v = torch.randn(2, 3, 37, 16), torch.randn(2, 3, 37, 16) + 5 * torch.randn(1, 3, 1, 16), torch.randn(2, 3, 37, 16)
    q[0, 1, 5, 2] = 80.0  # an outlier
    st = input_stats(q, k, v)
    for b in range(2):
        for h in range(3):
            assert st["q_p99"][b, h] == pytest.approx(float(torch.quantile(q[b, h].abs().flatten(), 0.99)), rel=1e-5)
            ks = k[b, h] - k[b, h].mean(0)
            assert st["k_p99"][b, h] == pytest.approx(float(torch.quantile(ks.abs().flatten(), 0.99)), rel=1e-5)
            torch.testing.assert_close(st["k_mean"][b, h], k[b, h].mean(0))
            assert st["q_max"][b, h] == q[b, h].abs().max() and st["k_max"][b, h] == pytest.approx(float(ks.abs().max()))
            torch.testing.assert_close(st["v_amax"][b, h], v[b, h].abs().amax(0))
            torch.testing.assert_close(st["q_cmax"][b, h], q[b, h].abs().amax(0))
            torch.testing.assert_close(st["k_cmax"][b, h], ks.abs().amax(0))


def collect_dit(batches=2, steps=3, record_inputs=None):
    """Run a tiny DiT denoiser through a fake schedule of ``steps`` timesteps per batch, collecting."""
    model, x = build("dit")
    col = Collector()

    def observer(call):
        if record_inputs is not None:
            record_inputs.append((call.step, call.layer, call.query.clone(), call.key.clone(), call.value.clone()))
        col(call)

    handle = enable(model, mode="fp16", observer=observer)
    records = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in range(batches):
            handle.state.reset()
            for t in torch.linspace(900, 100, steps).round().long():
                xb = dict(x, hidden_states=torch.randn(x["hidden_states"].shape, generator=g), timestep=t.expand(2))
                model(**xb)
            records.append(col.record(b))
    handle.disable()
    return model, records


def test_collected_percentiles_equal_direct_computation():
    seen = []
    model, records = collect_dit(batches=2, steps=3, record_inputs=seen)
    timesteps, stats = merge(records)
    assert timesteps == [900.0, 500.0, 100.0]
    for layer, st in stats.items():
        for step in range(3):
            inputs = [(q, k, v) for s, n, q, k, v in seen if n == layer and s == step]
            assert len(inputs) == 2  # one call per batch
            direct = [float(torch.quantile(q[b, h].float().abs().flatten(), 0.99))
                      for q, _, _ in inputs for b in range(q.shape[0]) for h in range(q.shape[1])]
            per_head = torch.tensor(direct).view(-1, inputs[0][0].shape[1]).mean(0)
            torch.testing.assert_close(st["q_p99"][:, step], per_head, rtol=1e-5, atol=1e-6)
            vmax = torch.stack([v.float().abs().amax(2).amax(0) for _, _, v in inputs]).amax(0)
            torch.testing.assert_close(st["v_amax"][..., step], vmax)
            kmean = torch.cat([k.float().mean(2) for _, k, _ in inputs]).mean(0)  # over every image
            torch.testing.assert_close(st["k_mean"][..., step], kmean, rtol=1e-5, atol=1e-6)
            for mode in ("int8", "int8_fp16v"):
                e = st[f"err.{mode}.rel_l1"][:, step]
                assert (e > 0).all() and (e < 0.1).all()
            assert (st["err.int8.rel_l1"] >= st["err.int8_fp16v.rel_l1"] * 0.5).all()


def test_merge_is_independent_of_the_split():
    _, records = collect_dit(batches=3, steps=2)
    _, whole = merge(records)
    _, shuffled = merge([records[2], records[0], records[1]])
    for layer in whole:
        for key in whole[layer]:
            assert torch.equal(whole[layer][key], shuffled[layer][key])


def make_calibration(records=None):
    model, records = collect_dit() if records is None else (None, records)
    timesteps, stats = merge(records)
    meta = {"model": "tiny-dit", "model_class": "DiTTransformer2DModel", "num_train_timesteps": 1000}
    return model, Calibration.from_stats(meta, timesteps, stats)


def test_file_round_trip_and_no_overwrite(tmp_path):
    _, cal = make_calibration()
    path = cal.save(tmp_path)
    with pytest.raises(FileExistsError, match="overwrite"):
        cal.save(tmp_path)
    back = Calibration.load(tmp_path)
    assert back.meta == json.loads(json.dumps(cal.meta))
    assert torch.equal(back.noise, cal.noise) and torch.equal(back.timesteps, cal.timesteps)
    assert back.layers.keys() == cal.layers.keys()
    for layer in cal.layers:
        for key, t in cal.layers[layer].items():
            assert torch.equal(back.layers[layer][key], t), (layer, key)
    # where it came from, for reports: the file and the checksum stored in it; nothing for one made in memory
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        stored = f.metadata()["diffusion_int8.sha256"]
    assert back.provenance()["path"] == str(path.resolve()) and back.provenance()["sha256"] == stored
    assert cal.provenance()["path"] is None and cal.provenance()["sha256"] is None
    assert back.provenance()["steps"] == cal.meta["steps"]
    # not a calibration: a plain safetensors file, and a file of another schema
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a diffusion-int8 calibration"):
        Calibration.load(tmp_path / "plain.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "v9.safetensors"), metadata={"diffusion_int8": json.dumps({"schema_version": 9})})
    with pytest.raises(ValueError, match="schema 9"):
        Calibration.load(tmp_path / "v9.safetensors")
    for schema in (True, 1.0):  # equal to 1 in Python, not a schema number
        save_file({"x": torch.zeros(1)}, str(tmp_path / "odd.safetensors"),
                  metadata={"diffusion_int8": json.dumps({"schema_version": schema})})
        with pytest.raises(ValueError, match=f"has calibration schema {schema}"):
            Calibration.load(tmp_path / "odd.safetensors")
    assert path.name == "calibration.safetensors"


def test_schema_1_file_loads_without_k_mean(tmp_path):
    # files written before K's mean and the Q/K maxima were recorded: p99 ranges, measured smoothing
    _, cal = make_calibration()
    schema_2 = ("q_max", "k_max", "k_mean", "fit.qmax", "fit.kmax", "fit.m", *SCHEMA_4)
    old = Calibration({**cal.meta, "schema_version": 1}, cal.timesteps, cal.noise,
                      {n: {k: t for k, t in st.items() if k not in schema_2} for n, st in cal.layers.items()})
    with pytest.warns(UserWarning, match="schema 1 calibration: it has no Q/K maxima"):
        back = Calibration.load(old.save(tmp_path / "v1.safetensors"))
    layer = next(iter(cal.layers))
    *ranges, k_mean, balance = back.ranges(layer, 500.0)
    assert k_mean is None and balance is None
    for got, want in zip(ranges, cal.ranges(layer, 500.0, clip="p99")[:3]):
        assert torch.equal(got, want)
    # asking for the maxima a schema 1 file does not have is an error, not a silent fallback
    with pytest.raises(ValueError, match="has no Q/K maxima"):
        back.ranges(layer, 500.0, clip="max")


def test_validation_against_models():
    model, cal = make_calibration()
    cal.validate(model)  # the model it was made on
    import diffusers

    wider = diffusers.DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                            num_layers=2, sample_size=16, patch_size=2, num_embeds_ada_norm=10)
    with pytest.raises(ValueError, match="4 heads of dim 16"):
        cal.validate(wider)
    deeper = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                             num_layers=3, sample_size=16, patch_size=2, num_embeds_ada_norm=10)
    with pytest.raises(ValueError, match="not calibrated: transformer_blocks.2"):
        cal.validate(deeper)
    unet, _ = build("unet")
    with pytest.raises(ValueError, match="model class is UNet2DConditionModel"):
        cal.validate(unet)
    with pytest.raises(ValueError, match="does not match"):
        enable(deeper, mode="int8", calibration=cal)

    # the same layers with other weights (another checkpoint): one warning, however many times it is validated
    import copy
    import warnings

    from diffusion_int8.calibration.file import weights_sample

    cal.meta["weights_sample"] = weights_sample(model)
    other = copy.deepcopy(model)
    torch.nn.init.normal_(other.get_parameter(cal.meta["weights_sample"]["param"]), std=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.validate(model)
        cal.validate(copy.deepcopy(model).to(torch.bfloat16))  # a cast moves each value by under 0.4%
        stored = copy.deepcopy(model)  # weights stored in FP8, as diffusers' layerwise casting keeps them
        for p in stored.parameters():
            p.data = p.data.to(torch.float8_e4m3fn).float()
        cal.validate(stored)
    with pytest.warns(RuntimeWarning, match=r"made with other weights than this DiTTransformer2DModel's \(\d+ of 64 "
                                            r"values of transformer_blocks.0.attn1.to_q.weight differ by over 5% of the largest\)"):
        cal.validate(other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.validate(other)


def test_fit_recovers_a_quadratic_and_ranges_follow_it():
    n = torch.linspace(0, 1, 7, dtype=torch.float64)
    vals = torch.stack([1 + 2 * n - 0.5 * n**2, 3 - n])  # (2, 7)
    coef = fit_quadratic(n, vals)
    torch.testing.assert_close(coef, torch.tensor([[1, 2, -0.5], [3, -1, 0]], dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(evaluate_fit(coef, 0.25)[..., 0], torch.tensor([1.46875, 2.75], dtype=torch.float64))

    _, cal = make_calibration()
    layer = next(iter(cal.layers))
    qa, ka, va, km, balance = cal.ranges(layer, 500.0)
    assert balance is None  # asked for with balance=True
    H, D = cal.meta["layers"][layer]["heads"], cal.meta["layers"][layer]["head_dim"]
    assert qa.shape == (1, H) and ka.shape == (1, H) and va.shape == (1, H, D) and km.shape == (1, H, D)
    # three steps, a quadratic through them: exact at the calibrated noise levels
    st = cal.layers[layer]
    for got, stat in zip((qa, ka, va, km), ("q_max", "k_max", "v_amax", "k_mean")):
        torch.testing.assert_close(got[0], st[stat][..., 1], rtol=1e-4, atol=1e-5)
    qp, kp, *_ = cal.ranges(layer, 500.0, clip="p99")
    torch.testing.assert_close(qp[0], st["q_p99"][:, 1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kp[0], st["k_p99"][:, 1], rtol=1e-4, atol=1e-5)
    assert (qp < qa).all() and (kp < ka).all()
    with pytest.raises(ValueError, match="'max' or 'p99'"):
        cal.ranges(layer, 500.0, clip="p90")


def test_static_ranges_reach_the_kernel(monkeypatch):
    model, cal = make_calibration()
    _, x = build("dit")
    import diffusion_int8.plugin.routing as P

    seen = []
    real = P.int8_attention
    monkeypatch.setattr(P, "int8_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    inputs = dict(x, timestep=torch.tensor([500, 500]))
    with torch.no_grad():
        exact = model(**inputs).sample
        handle = enable(model, mode="int8")
        dynamic = model(**inputs).sample
        handle.disable()
        seen.clear()
        handle = enable(model, mode="int8", calibration=cal)
        static = model(**inputs).sample
        handle.disable()
    assert seen and all(kw[n] is not None for kw in seen for n in ("q_amax", "k_amax", "v_amax", "k_mean"))
    layer = next(iter(cal.layers))
    for name, want in zip(("q_amax", "k_amax", "v_amax", "k_mean"), cal.ranges(layer, 500.0)):
        torch.testing.assert_close(seen[0][name], want)
    # the calibrated ranges and K mean do about as well as measuring them at every call
    err = {n: rel_l1(o, exact).item() for n, o in (("static", static), ("dynamic", dynamic))}
    assert 0 < err["static"] < max(2 * err["dynamic"], 1e-3), err


def test_static_balance_from_channel_maxima(tmp_path):
    # schema 4 records per-channel Q/K maxima; ranges(balance=True) makes the balance of their fits (powers of two,
    # as the measured balance is made) and moves Q's and K's ranges as the balance moves their largest channel.
    # Without the maxima (a schema 3 file) asking for it is an error, and the processor warns and runs unbalanced.
    from diffusion_int8.kernels.reference import balance_from_ranges

    _, cal = make_calibration()
    layer = next(iter(cal.layers))
    st = cal.layers[layer]
    assert st["q_cmax"].shape == st["k_cmax"].shape == st["k_mean"].shape
    plain = cal.ranges(layer, 500.0)
    qa, ka, va, km, bal = cal.ranges(layer, 500.0, balance=True)
    qc, kc = st["q_cmax"][..., 1], st["k_cmax"][..., 1]  # the fits are exact at the calibrated steps
    want = balance_from_ranges(qc, kc)
    torch.testing.assert_close(bal[0], want)
    assert ((bal.log2() - bal.log2().round()) == 0).all()
    torch.testing.assert_close(qa, plain.q_amax * (qc / bal[0]).amax(-1) / qc.amax(-1), rtol=1e-4, atol=0)
    torch.testing.assert_close(ka, plain.k_amax * (kc * bal[0]).amax(-1) / kc.amax(-1), rtol=1e-4, atol=0)
    assert torch.equal(va, plain.v_amax) and torch.equal(km, plain.k_mean)
    with pytest.raises(ValueError, match="ranges from the maxima"):
        cal.ranges(layer, 500.0, clip="p99", balance=True)
    # a K channel that was zero at every step (its fit floored for the ranges) is left alone, as a measured one is:
    # channel 0, first made an outlier of Q's so that its balance moves (a fresh Calibration each time: ranges are
    # kept per timestep)
    st["q_cmax"][:, 0] *= 64.0
    st["fit.qc"] = fit_quadratic(cal.noise.double(), st["q_cmax"]).float()
    cal = Calibration(cal.meta, cal.timesteps, cal.noise, cal.layers)
    assert (cal.ranges(layer, 500.0, balance=True).qk_balance[..., 0] != 1).all()
    st["k_cmax"][:, 0] = 0.0
    st["fit.kc"] = fit_quadratic(cal.noise.double(), st["k_cmax"]).float()
    cal = Calibration(cal.meta, cal.timesteps, cal.noise, cal.layers)
    assert (cal.ranges(layer, 500.0, balance=True).qk_balance[..., 0] == 1).all()
    old = Calibration({**cal.meta, "schema_version": 3}, cal.timesteps, cal.noise,
                      {n: {k: t for k, t in s.items() if k not in SCHEMA_4} for n, s in cal.layers.items()})
    old = Calibration.load(old.save(tmp_path / "v3.safetensors"))
    assert not old.has_channel_ranges() and cal.has_channel_ranges()
    with pytest.raises(ValueError, match="schema 3.*no per-channel Q/K maxima"):
        old.ranges(layer, 500.0, balance=True)
    model, _ = build("dit")
    with pytest.warns(UserWarning, match="schema 3 calibration.*without the Q·Kᵀ balance"):
        enable(model, mode="int8", calibration=old, qk_balance=True).disable()


def test_ranges_at_evaluates_layers_together_as_each_alone():
    # ranges_at stacks layers of one shape: each layer's ranges equal those of a calibration holding that layer
    # alone, for a mix of shapes (2 heads and 1) and of balanced and unbalanced layers under balance=None; the
    # second call at a timestep is the memo's
    _, cal = make_calibration()
    layers = dict(cal.layers)
    first = next(iter(layers))
    narrow = {k: t[:1] for k, t in layers[first].items()}  # the same layer with one of its heads
    narrow["q_cmax"] = narrow["q_cmax"].clone()
    narrow["q_cmax"][:, 5] *= 64.0  # an outlier channel of Q's: a balanced layer
    narrow["fit.qc"] = fit_quadratic(cal.noise.double(), narrow["q_cmax"]).float()
    layers["narrow"] = narrow
    wide = dict(layers[first], q_cmax=layers[first]["q_cmax"] * 1.0)  # a balanced layer of the first one's shape
    wide["q_cmax"][:, 5] *= 64.0
    wide["fit.qc"] = fit_quadratic(cal.noise.double(), wide["q_cmax"]).float()
    layers["wide"] = wide
    head_dim = cal.meta["layers"][first]["head_dim"]
    meta = {**cal.meta, "layers": {**cal.meta["layers"], "narrow": {"heads": 1, "head_dim": head_dim},
                                   "wide": cal.meta["layers"][first]}}
    mixed = Calibration(meta, cal.timesteps, cal.noise, layers)
    assert {"narrow", "wide"} <= set(mixed.balanced_layers()) and first not in mixed.balanced_layers()
    assert [len(group) for group, _ in mixed._stacked()] == [len(layers) - 1, 1]
    for t in (500.0, 137.5):
        for balance in (False, True, None):
            together = mixed.ranges_at(t, balance=balance)
            assert mixed.ranges_at(t, balance=balance) is together
            for name, st in layers.items():
                alone = Calibration(meta, cal.timesteps, cal.noise, {name: st})
                want = alone.ranges(name, t, balance=balance or (balance is None and name in mixed.balanced_layers()))
                for got, ref in zip(together[name], want):
                    assert (got is None) == (ref is None)
                    if got is not None:
                        assert torch.equal(got, ref), (name, t, balance)


def test_static_balance_reaches_the_kernel_and_helps_outlier_channels(monkeypatch):
    # A model whose Q carries outlier channels K does not: with qk_balance=True and a schema 4 calibration the op
    # gets the calibrated balance with ranges of the balanced Q and K, and the static run gets closer to exact
    # attention than the static run without it.
    model, _ = build("dit")
    _, x = build("dit")
    for blk in model.transformer_blocks:  # channels 3 and 11 of every query head 20x larger (the query weights' rows)
        w = blk.attn1.to_q.weight.data
        w.view(2, 32, -1)[:, [3, 11]] *= 20.0
    col = Collector()
    inputs = dict(x, timestep=torch.tensor([500, 500]))
    with torch.no_grad():
        handle = enable(model, mode="fp16", observer=col)
        handle.state.reset()
        exact = model(**inputs).sample
        handle.disable()
    timesteps, stats = merge([col.record(0)])
    cal = Calibration.from_stats({"model": "tiny-dit", "model_class": type(model).__name__,
                                  "num_train_timesteps": 1000}, timesteps, stats)
    import diffusion_int8.plugin.routing as P

    seen, real = [], P.int8_attention
    monkeypatch.setattr(P, "int8_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    outs, status = {}, {}
    with torch.no_grad():
        for balance in (False, True, None):
            handle = enable(model, mode="int8_fp16v", calibration=cal, qk_balance=balance, speed_gate=False)
            handle.state.reset()
            outs[balance] = model(**inputs).sample
            status[balance] = handle.summary()["qk_balance"]
            handle.disable()
    balanced = [kw for kw in seen if isinstance(kw["qk_balance"], torch.Tensor)]
    assert len(balanced) == 2 * len(seen) // 3 > 0  # True and the default (None): the calibration's balance
    assert torch.equal(outs[None], outs[True])
    assert cal.balanced_layers() == list(cal.layers)  # every layer's Q carries the outlier channels
    from diffusion_int8.calibration.summary import summarize

    assert summarize(cal)["qk_balance_layers"] == list(cal.layers)
    assert status[None] == status[True] == {"on (calibration)": list(cal.layers)}
    assert status[False] == {"off (asked)": list(cal.layers)}
    layer = next(iter(cal.layers))
    want = cal.ranges(layer, 500.0, balance=True)
    for name in ("q_amax", "k_amax", "qk_balance"):
        torch.testing.assert_close(balanced[0][name], getattr(want, name))
    assert (want.qk_balance != 1).any()
    err = {b: rel_l1(o, exact).item() for b, o in outs.items()}
    assert err[True] < 0.8 * err[False], err  # measured 0.00127 against 0.00174
    # a schedule made from the calibration names the layers, where a run with it and without the calibration
    # measures the balance per call (in calls of 1,024+ queries per head)
    schedule = PrecisionSchedule.from_calibration(cal, budget=1.0)
    assert schedule.balance_layers == tuple(cal.layers)
    assert PrecisionSchedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    handle = enable(model, schedule=schedule, speed_gate=False)
    assert handle.summary()["qk_balance"] == {"on (schedule)": list(cal.layers)}
    handle.disable()


def crafted(errors_int8, errors_fp16v, noise):
    """A calibration with given (L, T) errors and nothing else of interest."""
    L = len(errors_int8)
    layers = {}
    for i in range(L):
        layers[f"blocks.{i}.attn"] = {
            "err.int8.rel_l1": torch.tensor(errors_int8[i]).repeat(2, 1).float(),
            "err.int8_fp16v.rel_l1": torch.tensor(errors_fp16v[i]).repeat(2, 1).float(),
        }
    return Calibration({"num_train_timesteps": 1000}, torch.tensor(noise) * 1000, torch.tensor(noise), layers)


def test_schedule_from_crafted_calibration():
    noise = [1.0, 0.75, 0.5, 0.25, 0.0]
    cal = crafted([[0.08, 0.03, 0.01, 0.01, 0.04], [0.02, 0.01, 0.01, 0.03, 0.01]],
                  [[0.02, 0.005, 0.003, 0.003, 0.004], [0.004, 0.003, 0.002, 0.003, 0.002]], noise)
    s = PrecisionSchedule.from_calibration(cal, budget=0.025)
    # worst layer per step: int8 errors 0.08 0.03 0.01 0.03 0.04 -> fp16v, fp16v, int8, fp16v, fp16v
    assert [s.mode_for(t * 1000).value for t in noise] == ["int8_fp16v", "int8_fp16v", "int8", "int8_fp16v", "int8_fp16v"]
    tight = PrecisionSchedule.from_calibration(cal, budget=0.01)
    assert [tight.mode_for(t * 1000).value for t in noise] == ["fp16", "int8_fp16v", "int8", "int8_fp16v", "int8_fp16v"]
    # between calibrated steps the nearer one decides; any step count works
    assert s.mode_for(560.0) is Mode.INT8 and s.mode_for(700.0) is Mode.INT8_FP16V
    per_layer = PrecisionSchedule.from_calibration(cal, budget=0.025, per_layer=True)
    assert [per_layer.mode_for(t * 1000, "blocks.1.attn").value for t in noise] == ["int8", "int8", "int8", "int8_fp16v", "int8"]
    assert [per_layer.mode_for(t * 1000, "blocks.0.attn").value for t in noise] == ["int8_fp16v", "int8_fp16v", "int8", "int8", "int8_fp16v"]
    back = PrecisionSchedule.from_dict(json.loads(json.dumps(per_layer.to_dict())))
    assert back == per_layer


def test_schedule_from_calibration_decides_a_step_by_its_worst_call(carry_at_any_step_count):
    # CFG as two calls a step (Wan, Qwen-Image): calibrated calls 2k and 2k+1 share a noise level, and at run time
    # both take that level's rule, so the worse call decides it, whichever of the two it is
    noise = [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]
    for bad in (0, 1):
        int8 = [[0.09 if t % 2 == bad else 0.01 for t in range(6)]]
        s = PrecisionSchedule.from_calibration(crafted(int8, [[0.005] * 6], noise), budget=0.02)
        assert [s.mode_for(t * 1000).value for t in (1.0, 0.75, 0.5, 0.25, 0.0)] == ["int8_fp16v"] * 5
        assert len(s.rules) == 1 and (s.rules[0].min_noise, s.rules[0].max_noise) == (0.0, 1.0)
    # one bad call at the middle level only: that level alone, half-way to its neighbours
    s = PrecisionSchedule.from_calibration(crafted([[0.01, 0.01, 0.01, 0.09, 0.01, 0.01]], [[0.005] * 6], noise),
                                           budget=0.02)
    assert [s.mode_for(t * 1000).value for t in (1.0, 0.8, 0.7, 0.5, 0.3, 0.2, 0.0)] == [
        "int8", "int8", "int8_fp16v", "int8_fp16v", "int8_fp16v", "int8", "int8"]
    # the sparsity level too: the second call's sparse error is over the budget at every level
    cal = crafted_sparse({0.8: [[0.01, 0.2] * 3]}, {0.8: [[0.3] * 6]}, noise)
    sparse = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=None)
    assert [sparse.tau_for(t * 1000) for t in (1.0, 0.5)] == [None, None]
    # and carrying is weighed against what the schedule drops: 0.95 (60% kept) at each step, which 0.8 carried
    # every 2 steps (50% kept) beats, though 0.8 alone is within budget at every other call
    cal = crafted_sparse({0.8: [[0.01, 0.2] * 3], 0.95: [[0.01] * 6]}, {0.8: [[0.3] * 6], 0.95: [[0.6] * 6]}, noise)
    for st in cal.layers.values():
        st["carry.rel_l1@0.8/2"] = torch.tensor([0.02] * 6).repeat(2, 1).float()
        st["carry.kept@0.8/2"] = torch.tensor([0.5] * 6).repeat(2, 1).float()
    cal.meta["carry"] = [[0.8, 2]]
    carried = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=0.1)
    assert carried.refresh_every == 2 and [carried.tau_for(t * 1000) for t in (1.0, 0.5)] == [0.8, 0.8]


def test_summary_of_a_per_layer_schedule_counts_every_layer():
    from diffusion_int8.calibration.summary import summarize

    _, cal = make_calibration()
    first, *rest = cal.layers
    assert rest
    # every layer int8 down to noise 0.5, below it the first layer alone
    per_layer = PrecisionSchedule(rules=(Rule("int8", 0.5, 1.0), Rule("int8", layers=first)), default=Mode.INT8_FP16V)
    steps = summarize(cal, per_layer)["schedule"]["per_step"]
    low = f"int8×1+int8_fp16v×{len(rest)}"
    assert steps == ["int8" if n >= 0.5 else low for n in cal.noise.tolist()] and low in steps
    assert summarize(cal, PrecisionSchedule(default=Mode.INT8))["schedule"]["per_step"] == ["int8"] * len(cal.noise)


def run_cli(args, tmp_path, launcher=None, timeout=600, check=True, env=None):
    cmd = (launcher or [sys.executable, "-m"]) + ["diffusion_int8", *args]
    res = subprocess.run(cmd, cwd=tmp_path, env=env or cli_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 or not check, res.stdout[-3000:] + res.stderr[-3000:]
    return res


CLI_ARGS = ["calibrate", "--model", "embedded", "--class-labels", "red circle", "blue ring", "3", "green triangle",
            "--steps", "3", "--batch-size", "1"]


def test_calibrate_cli_end_to_end(tmp_path):
    res = run_cli(CLI_ARGS + ["--out", "cal"], tmp_path)
    out = tmp_path / "cal"
    for name in ("calibration.safetensors", "schedule.json", "summary.md", "summary.json", "ranges.png", "errors.png"):
        assert (out / name).is_file(), name
    assert "ranges vs sigma" in res.stdout
    cal = Calibration.load(out)
    assert cal.meta["model_class"] == "DiTTransformer2DModel" and cal.meta["steps"] == 3
    from diffusion_int8.embedded import load_pipeline

    cal.validate(load_pipeline(device="cpu").transformer)
    schedule = PrecisionSchedule.load(out / "schedule.json")
    # flow matching: float timesteps are sigma·1000, whatever the scheduler's num_train_timesteps
    assert cal.meta["timestep_scale"] == 1000 and schedule.num_train_timesteps == 1000
    assert cal.timesteps[-1] == pytest.approx(1.0) and cal.noise[-1] == pytest.approx(0.001)  # t = 1 is the last step
    assert "Most sensitive" in (out / "summary.md").read_text()
    # the outputs are kept unless --overwrite
    again = subprocess.run([sys.executable, "-m", "diffusion_int8", *CLI_ARGS, "--out", "cal"], cwd=tmp_path,
                           env=cli_env(), capture_output=True, text=True)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_two_processes_merge_exactly(tmp_path):
    """``accelerate launch`` with 2 CPU processes (gloo) gives the single-process calibration, bit for bit."""
    env = one_thread_env()  # what differs is the sharding alone
    run_cli(CLI_ARGS + ["--out", "single"], tmp_path, env=env)
    res = run_cli(CLI_ARGS + ["--out", "double"], tmp_path, launcher=accelerate_launch(2) + ["-m"], env=env)
    assert "2 process(es)" in res.stdout
    one, two = Calibration.load(tmp_path / "single"), Calibration.load(tmp_path / "double")
    assert two.meta.pop("processes") == 2 and one.meta.pop("processes") == 1
    assert one.meta == two.meta
    for layer in one.layers:
        for key, t in one.layers[layer].items():
            assert torch.equal(t, two.layers[layer][key]), (layer, key)


def _file_parts(path):
    """The tensors and metadata of a safetensors file, to write altered copies."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _write(path, tensors, meta=None, raw_meta=None, checksum=True):
    """A calibration file of these parts with a checksum that fits them (as ``save`` writes it), so that its
    contents are what is checked; ``checksum=False``: none, as files written before checksums."""
    from safetensors.torch import save_file

    from diffusion_int8.calibration.file import file_sha256

    raw = raw_meta if raw_meta is not None else json.dumps(meta)
    header = {"diffusion_int8": raw}
    if checksum:
        header["diffusion_int8.sha256"] = file_sha256(raw, tensors)
    save_file(tensors, str(path), metadata=header)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid calibration file, its tensors and metadata."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFUSION_INT8_BACKEND", "emulation")  # as the function-scoped fixture does
        _, cal = make_calibration()
    path = cal.save(tmp_path_factory.mktemp("cal"))
    tensors, header = _file_parts(path)
    return path, tensors, json.loads(header["diffusion_int8"])


def test_a_scheduler_config_with_inf_saves_and_loads(saved, tmp_path):
    # DPMSolver's config holds lambda_min_clipped = -inf, which JSON cannot hold: saved as text, so the file loads;
    # files that earlier versions wrote with -Infinity in it load too
    from diffusers import DPMSolverMultistepScheduler

    config = dict(DPMSolverMultistepScheduler().config)
    assert config["lambda_min_clipped"] == float("-inf")
    _, cal = make_calibration()
    cal.meta["scheduler_config"] = config
    back = Calibration.load(cal.save(tmp_path / "new.safetensors"))
    assert back.meta["scheduler_config"]["lambda_min_clipped"] == "-inf"
    _, tensors, meta = saved
    old = _write(tmp_path / "old.safetensors", tensors, {**meta, "scheduler_config": config})
    assert "-Infinity" in _file_parts(old)[1]["diffusion_int8"]
    assert Calibration.load(old).meta["scheduler_config"]["lambda_min_clipped"] == "-inf"
    # nowhere else: no calibration writes one
    odd = _write(tmp_path / "odd.safetensors", tensors, {**meta, "model": float("nan")})
    with pytest.raises(ValueError, match="metadata field model holds NaN or Infinity"):
        Calibration.load(odd)


def test_save_into_a_folder_named_with_a_slash_and_atomically(tmp_path, monkeypatch):
    _, cal = make_calibration()
    path = cal.save(f"{tmp_path}/calib/")  # the folder is made, as write_outputs makes its own
    assert path == tmp_path / "calib" / "calibration.safetensors" and Calibration.load(tmp_path / "calib")
    assert cal.save(f"{tmp_path}/sub/.") == tmp_path / "sub" / "calibration.safetensors"
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder to save calibration.safetensors in"):
        cal.save(f"{tmp_path}/a_file/")
    before = path.read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import diffusion_int8.jsonfile as jsonfile

    monkeypatch.setattr(jsonfile.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cal.save(path, overwrite=True)
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == [path.name]


def _damaged(saved, what):
    _, tensors, meta = saved
    tensors, meta = dict(tensors), json.loads(json.dumps(meta))
    layer = "transformer_blocks.0.attn1"
    if what == "missing fit":
        del tensors[f"{layer}::fit.q"]
    elif what == "wrong shape":
        tensors[f"{layer}::q_max"] = tensors[f"{layer}::q_max"][:1]
    elif what == "missing noise":
        del tensors["noise"]
    elif what == "unknown tensor":
        tensors[f"{layer}::q_p90"] = tensors[f"{layer}::q_p99"].clone()
    elif what == "layers differ":
        meta["layers"]["transformer_blocks.9.attn1"] = meta["layers"][layer]
    elif what == "bad heads":
        meta["layers"][layer]["heads"] = "2"
    elif what == "bad scale":
        meta["num_train_timesteps"] = 0
    elif what == "steps disagree":
        meta["steps"] = 5
    return tensors, meta


@pytest.mark.parametrize("what, message", [
    ("missing fit", "layer 'transformer_blocks.0.attn1' lacks tensor transformer_blocks.0.attn1::fit.q"),
    ("wrong shape", "tensor transformer_blocks.0.attn1::q_max has shape (1, 3)"),
    ("missing noise", "tensor 'noise' is missing"),
    ("unknown tensor", "tensor transformer_blocks.0.attn1::q_p90 is not a calibration statistic"),
    ("layers differ", "metadata field layers and the tensors name different layers: transformer_blocks.9.attn1"),
    ("bad heads", "metadata field layers['transformer_blocks.0.attn1'] must be"),
    ("bad scale", "metadata field num_train_timesteps must be null or a number > 0"),
    ("steps disagree", "metadata field steps disagree"),
])
def test_invalid_calibration_files_fail_at_load_naming_file_and_field(saved, tmp_path, what, message):
    tensors, meta = _damaged(saved, what)
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(ValueError) as err:
        Calibration.load(path)
    assert str(err.value).startswith(f"{path}") and message in str(err.value), str(err.value)


def test_unreadable_calibration_files_fail_naming_the_file(saved, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file") as err:
        Calibration.load(garbage)
    assert str(garbage) in str(err.value)
    tensors, _ = _damaged(saved, None)
    bad_json = _write(tmp_path / "json.safetensors", tensors, raw_meta="{schema")
    with pytest.raises(ValueError, match="metadata 'diffusion_int8': not valid JSON") as err:
        Calibration.load(bad_json)
    assert str(bad_json) in str(err.value)
    as_list = _write(tmp_path / "list.safetensors", tensors, raw_meta="[2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        Calibration.load(as_list)
    v9 = _write(tmp_path / "v9.safetensors", tensors, {"schema_version": 9})
    with pytest.raises(ValueError, match="schema 9 .metadata field schema_version") as err:
        Calibration.load(v9)
    assert str(v9) in str(err.value)


def test_checksum_covers_metadata_and_tensors_and_is_required_from_schema_3(saved, tmp_path):
    path, tensors, meta = saved
    _, header = _file_parts(path)
    from safetensors.torch import save_file

    from diffusion_int8.calibration.file import file_sha256

    assert header["diffusion_int8.sha256"] == file_sha256(header["diffusion_int8"], tensors)
    # one flipped bit in the last tensor's data, which sits at the end of the file
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match the checksum") as err:
        Calibration.load(flipped)
    assert str(flipped) in str(err.value)
    # a tensor rewritten with the old checksum kept
    edited = dict(tensors)
    key = next(k for k in edited if k.endswith("::fit.v"))
    edited[key] = edited[key] * 1.01
    save_file(edited, str(tmp_path / "edited.safetensors"), metadata=header)
    with pytest.raises(ValueError, match="metadata or tensors do not match the checksum"):
        Calibration.load(tmp_path / "edited.safetensors")
    # a metadata field changed (a valid value: only the checksum can tell), the checksum kept
    changed = {**header, "diffusion_int8": json.dumps({**meta, "timestep_scale": 1.0})}
    save_file(tensors, str(tmp_path / "meta.safetensors"), metadata=changed)
    with pytest.raises(ValueError, match="metadata or tensors do not match the checksum"):
        Calibration.load(tmp_path / "meta.safetensors")
    # the checksum removed, or renamed, and a tensor changed
    for name, extra in (("removed", {}), ("renamed", {"diffusion_int8.sha256_": header["diffusion_int8.sha256"]})):
        save_file(edited, str(tmp_path / f"{name}.safetensors"), metadata={"diffusion_int8": header["diffusion_int8"], **extra})
        with pytest.raises(ValueError, match="without its checksum" if name == "removed" else "is not part of a calibration"):
            Calibration.load(tmp_path / f"{name}.safetensors")
    # schema 2 files were written before checksums: they load without one
    schema_2 = ("sparsity_levels",)
    old_meta = {**{k: v for k, v in meta.items() if k not in schema_2}, "schema_version": 2}
    old_tensors = {k: t for k, t in tensors.items() if not k.endswith(tuple(f"::{s}" for s in SCHEMA_4))
                   and "::sparse." not in k}
    Calibration.load(_write(tmp_path / "old.safetensors", old_tensors, old_meta, checksum=False))


@pytest.mark.parametrize("change, message", [
    (lambda m, t: m.pop("model_class"), "metadata field model_class is missing"),
    (lambda m, t: m.update(timestep_scale=9000), "metadata field timestep_scale must be null, 1 or 1000"),
    (lambda m, t: m.update(percentile=200), "metadata field percentile must be a number in (0, 100]"),
    (lambda m, t: m.update(model_class=7), "metadata field model_class must be a non-empty string"),
    (lambda m, t: m.update(num_train_timesteps=1, timestep_scale=m.get("timestep_scale")),
     "tensor 'noise' does not follow from tensor 'timesteps' and metadata fields num_train_timesteps (1)"),
    (lambda m, t: (t.update(noise=t["noise"] * 0 + 5.0), m.update(timestep_scale=m.get("timestep_scale"))),
     "tensor 'noise' does not follow from tensor 'timesteps'"),
    (lambda m, t: m.update(weights_sample={"param": "x", "values": [1.0]}),
     "metadata field weights_sample must be an object with param (a string) and values (64 finite numbers)"),
    (lambda m, t: t.update({k: -t[k] - 0.1 for k in t if k.endswith("err.int8.rel_l1")}),
     "err.int8.rel_l1 holds -0.1"),
    (lambda m, t: t.update({k: t[k] + float("nan") for k in t if k.endswith("err.int8.cos")}),
     "a measured cos must be finite and in [-1, 1]"),
])
def test_every_metadata_field_and_measured_error_is_validated(saved, tmp_path, change, message):
    _, tensors, meta = saved
    tensors, meta = dict(tensors), json.loads(json.dumps(meta))
    change(meta, tensors)
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(ValueError) as err:
        Calibration.load(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value), str(err.value)


@pytest.mark.parametrize("fit, coef, message", [
    ("fit.qmax", float("nan"), "the fitted q_max range (tensor transformer_blocks.1.attn1::fit.qmax) is nan at noise level 0.000, head 1"),
    ("fit.v", float("inf"), "the fitted v_amax range (tensor transformer_blocks.1.attn1::fit.v) is inf"),
    # finite coefficients whose quadratic overflows float32 towards the end of the noise interval
    ("fit.k", 3e38, "the fitted k_p99 range (tensor transformer_blocks.1.attn1::fit.k) is inf at noise level"),
    ("fit.m", float("-inf"), "the fitted K mean (tensor transformer_blocks.1.attn1::fit.m) is -inf"),
])
def test_fitted_ranges_are_checked_over_the_noise_interval_at_load(saved, tmp_path, fit, coef, message):
    cal = Calibration.load(saved[0])
    cal.layers = {n: {k: t.clone() for k, t in st.items()} for n, st in cal.layers.items()}
    layer = "transformer_blocks.1.attn1"
    t = cal.layers[layer][fit]
    t[1, ..., 2 if coef == 3e38 else 0] = coef  # head 1: n² coefficient, or the constant
    if coef == 3e38:
        t[1, ..., 1] = 3e38
    path = cal.save(tmp_path)  # a consistent checksum: the ranges themselves are refused
    with pytest.raises(ValueError) as err:
        Calibration.load(path)
    assert str(err.value).startswith(f"{path}: layer '{layer}': ") and message in str(err.value), str(err.value)
    assert "finite" in str(err.value)


class RecordingBar:
    """Stands in for tqdm: records the total, each update and what the bar was told to show."""

    made: list = []

    def __init__(self, *_, total=None, disable=False, **__):
        self.total, self.disable, self.updates, self.postfix = total, disable, [], []
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def close(self):
        pass


def test_calibrate_progress_counts_denoising_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from diffusion_int8.__main__ import main
    from diffusion_int8.calibration import run as calibrate_run

    RecordingBar.made = []
    monkeypatch.setattr(calibrate_run, "tqdm", RecordingBar)
    assert main(["calibrate", "--class-labels", "red circle", "blue ring", "green triangle", "--steps", "3",
                 "--batch-size", "2", "--out", str(tmp_path / "cal")]) == 0
    (bar,) = RecordingBar.made
    assert bar.total == 2 * 3 and bar.updates == [1] * 6  # 2 batches × 3 steps, one tick per step


def test_plots_run_the_noise_the_same_way_and_name_the_layers(tmp_path, monkeypatch):
    """ranges.png and errors.png both put the highest noise on the left (denoising runs left to right), and
    ranges.png has a legend naming layers; with more than 8 layers, 8 of them, the first and the last included."""
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from matplotlib.figure import Figure

    from diffusion_int8.calibration import summary

    _, cal = make_calibration()
    saved, real = {}, Figure.savefig

    def savefig(self, path, *a, **kw):
        saved[Path(path).name] = self
        return real(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    for many in (False, True):
        if many:  # the same layers under 12 names
            cal.layers = {f"{name}.copy{i}": st for i in range(6) for name, st in list(cal.layers.items())[:2]}
        summary.plot(cal, tmp_path, budget=0.02)
        ranges, errors = saved["ranges.png"], saved["errors.png"]
        (err_ax,) = errors.axes
        assert err_ax.xaxis_inverted() and all(ax.xaxis_inverted() for ax in ranges.axes)
        (legend,) = ranges.legends
        labels = [t.get_text() for t in legend.get_texts()]
        names = list(cal.layers)
        assert labels[0] == names[0] and labels[-1] == names[-1]
        assert labels == names if len(names) <= 8 else (len(labels) == 8 and set(labels) <= set(names))
        assert (tmp_path / "ranges.png").stat().st_size > 0
    # carried settings: a second panel, one line each, labelled with its error along the trajectory, the chosen thick
    T = len(cal.noise)
    for st in cal.layers.values():
        for every in (2, 3):
            st[f"carry.rel_l1@0.5/{every}"] = torch.full((2, T), 0.01 * every)
            st[f"carry.kept@0.5/{every}"] = torch.full((2, T), 0.5)
    cal.meta["carry"] = [[0.5, 2], [0.5, 3]]
    summary.plot(cal, tmp_path, budget=0.02, carried=(0.5, 3))
    modes_ax, carried_ax = saved["errors.png"].axes
    assert modes_ax.xaxis_inverted() and carried_ax.xaxis_inverted()
    labels = [t.get_text() for t in carried_ax.get_legend().get_texts()]
    assert labels == ["τ 0.5 every 2: 0.020", "τ 0.5 every 3: 0.030 (the schedule's)"]
    widths = [line.get_linewidth() for line in carried_ax.get_lines()]
    assert widths[1] > widths[0]


def test_library_calibrate_gives_the_cli_file(tmp_path, monkeypatch):
    """``diffusion_int8.calibrate`` on a pipeline loaded in Python records what ``diffusion-int8 calibrate`` does,
    and ``write_outputs`` writes the command's set of files."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from diffusion_int8 import calibrate
    from diffusion_int8.__main__ import main
    from diffusion_int8.calibration import write_outputs
    from diffusion_int8.embedded import load_pipeline

    args = ["--class-labels", "red circle", "--steps", "2", "--seed", "3"]
    assert main(["calibrate", *args, "--out", str(tmp_path / "cli")]) == 0
    pipe = load_pipeline(device="cpu")
    with pytest.warns(RuntimeWarning, match="a calibration over 2 denoising steps: its static ranges are quadratics"):
        cal = calibrate(pipe, class_labels=["red circle"], steps=2, seed=3, progress=False)
    cli = Calibration.load(tmp_path / "cli")
    with pytest.warns(RuntimeWarning, match="this calibration of embedded measured 2 noise levels"):
        cli.validate(pipe.transformer)
    assert "| n/a (3 steps or fewer) |" in (tmp_path / "cli" / "summary.md").read_text()  # a quadratic through 2
    assert cal.meta == cli.meta and cal.meta["model"] == "embedded"
    assert cal.meta["weights_sample"]["param"] == "transformer_blocks.0.attn1.to_q.weight"
    assert torch.equal(cal.timesteps, cli.timesteps) and cal.layers.keys() == cli.layers.keys()
    for name, stats in cli.layers.items():
        for key, t in stats.items():
            assert torch.equal(cal.layers[name][key], t), (name, key)
    schedule = PrecisionSchedule.from_calibration(cal, 0.02)
    assert schedule.calibrated_steps == 2  # the count its carried interval would be chosen at, written to the file
    assert json.loads((tmp_path / "cli" / "schedule.json").read_text())["calibrated_steps"] == 2
    write_outputs(cal, schedule, tmp_path / "lib", budget=0.02)
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert (tmp_path / "lib" / "schedule.json").read_text() == (tmp_path / "cli" / "schedule.json").read_text()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_outputs(cal, schedule, tmp_path / "lib")


# -- sparsity levels -------------------------------------------------------------------------------------------

LEVELS = (0.5, 0.9)


def collect_long_dit(monkeypatch, seen=None, timesteps=(900, 300), collector=None):
    """The tiny DiT at 576 tokens (five 128-token blocks) through ``timesteps``, collecting sparsity levels too
    (with ``collector``, default ``Collector(sparsity_levels=LEVELS)``); random weights give keys with little in
    common within a block, so the predictor runs without its guard."""
    import functools

    import diffusers as d

    from diffusion_int8.plugin import processor
    from diffusion_int8.kernels.sparsity import predict_block_mask

    monkeypatch.setattr(processor, "predict_block_mask", functools.partial(predict_block_mask, min_similarity=None))
    torch.manual_seed(0)
    model = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                    num_layers=2, sample_size=48, patch_size=2, num_embeds_ada_norm=10).eval()
    col = collector or Collector(sparsity_levels=LEVELS)

    def observer(call):
        if seen is not None:
            seen.append((call.step, call.layer, call.query.clone(), call.key.clone(), call.value.clone(), call.scale,
                         call.out.clone()))
        col(call)

    handle = enable(model, mode="fp16", observer=observer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in timesteps:
            model(hidden_states=torch.randn(2, 4, 48, 48, generator=g), timestep=torch.tensor([t, t]),
                  class_labels=torch.tensor([1, 3]))
    handle.disable()
    return model, col.record(0)


def test_sparsity_levels_are_collected_as_directly_computed(monkeypatch):
    from diffusion_int8.calibration.stats import output_errors, sparse_sdpa
    from diffusion_int8.kernels.sparsity import predict_block_mask

    seen = []
    _, record = collect_long_dit(monkeypatch, seen)
    timesteps, stats = merge([record])
    for step, layer, q, k, v, scale, exact in seen:
        st = stats[layer]
        for tau in LEVELS:
            mask = predict_block_mask(q, k, tau, sm_scale=scale, min_similarity=None)
            errs = output_errors(sparse_sdpa(q, k, v, mask, scale), exact)
            torch.testing.assert_close(st[f"sparse.rel_l1@{tau}"][:, step], errs["rel_l1"].mean(0))
            torch.testing.assert_close(st[f"sparse.kept@{tau}"][:, step], mask.float().mean((-1, -2)).mean(0))
            # and the exact sparse attention is attention restricted to the kept tokens
            token_mask = mask.repeat_interleave(128, 2).repeat_interleave(128, 3)[..., :q.shape[2], :k.shape[2]]
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=token_mask, scale=scale)
            torch.testing.assert_close(sparse_sdpa(q, k, v, mask, scale), ref)
    for st in stats.values():
        assert (st["sparse.kept@0.5"] <= st["sparse.kept@0.9"]).all() and (st["sparse.kept@0.5"] < 1).any()
        assert (st["sparse.rel_l1@0.5"] > 0).any()
    cal = Calibration.from_stats({"model": "tiny-dit", "model_class": "DiTTransformer2DModel",
                                  "num_train_timesteps": 1000}, timesteps, stats)
    assert cal.sparsity_levels() == [0.5, 0.9] and cal.meta["schema_version"] == 6
    assert cal.kept(0.5).shape == (2, 2) and bool((cal.sparse_error(0.5) >= 0).all())
    with pytest.raises(ValueError, match=r"level 0.7 was not calibrated; the calibrated sparsity levels are \[0.5, 0.9\]"):
        cal.sparse_error(0.7)


def test_sparse_calibration_round_trips_and_schema_2_files_still_load(monkeypatch, tmp_path):
    _, record = collect_long_dit(monkeypatch)
    timesteps, stats = merge([record])
    cal = Calibration.from_stats({"model": "tiny-dit", "model_class": "DiTTransformer2DModel", "num_train_timesteps": 1000},
                                 timesteps, stats)
    back = Calibration.load(cal.save(tmp_path / "sparse.safetensors"))
    assert back.sparsity_levels() == [0.5, 0.9] and torch.equal(back.kept(0.9), cal.kept(0.9))
    # a file of the previous schema: no levels
    dense = {n: {k: t for k, t in st.items() if not k.startswith("sparse.") and k not in SCHEMA_4}
             for n, st in cal.layers.items()}
    meta = {k: v for k, v in cal.meta.items() if k != "sparsity_levels"}
    old = Calibration({**meta, "schema_version": 2}, cal.timesteps, cal.noise, dense).save(tmp_path / "v2.safetensors")
    back = Calibration.load(old)
    assert back.sparsity_levels() == [] and back.meta["schema_version"] == 2
    with pytest.raises(ValueError, match="sparsity_budget needs a calibration with sparsity levels"):
        PrecisionSchedule.from_calibration(back, 0.02, sparsity_budget=0.05)
    # declared levels must have their tensors, and only declared levels may
    layer = next(iter(cal.layers))
    tensors, header = _file_parts(cal.save(tmp_path / "c.safetensors"))
    meta = json.loads(header["diffusion_int8"])
    for change, message in (
            (lambda t, m: t.pop(f"{layer}::sparse.kept@0.9"), f"lacks tensor {layer}::sparse.kept@0.9"),
            (lambda t, m: m.update(sparsity_levels=[0.5]), f"tensor {layer}::sparse.cos@0.9 is not a calibration statistic"),
            (lambda t, m: m.update(sparsity_levels=[0.5, 1.0]), "sparsity_levels must be a list of distinct levels in (0, 1)"),
            (lambda t, m: m.update(schema_version=2), "schema 2 files have no sparsity levels")):
        t, m = dict(tensors), json.loads(json.dumps(meta))
        change(t, m)
        with pytest.raises(ValueError) as err:
            Calibration.load(_write(tmp_path / "bad.safetensors", t, m))
        assert message in str(err.value), str(err.value)


def crafted_sparse(errors: dict, kept: dict, noise):
    """``crafted`` with int8 errors of 0.01 everywhere but an fp16 last step, and per-level sparse errors (L, T)."""
    L = len(next(iter(errors.values())))
    int8 = [[0.01] * (len(noise) - 1) + [0.5]] * L
    cal = crafted(int8, int8, noise)
    for i, st in enumerate(cal.layers.values()):
        for tau in errors:
            st[f"sparse.rel_l1@{tau!r}"] = torch.tensor(errors[tau][i]).repeat(2, 1).float()
            st[f"sparse.kept@{tau!r}"] = torch.tensor(kept[tau][i]).repeat(2, 1).float()
    cal.meta["sparsity_levels"] = sorted(errors)
    return cal


def test_sparse_schedule_from_crafted_calibration():
    noise = [1.0, 0.75, 0.5, 0.25, 0.0]
    errors = {0.8: [[0.09, 0.04, 0.03, 0.10, 0.0], [0.02, 0.02, 0.02, 0.02, 0.0]],
              0.95: [[0.03, 0.01, 0.01, 0.06, 0.0], [0.01, 0.01, 0.01, 0.01, 0.0]]}
    kept = {0.8: [[0.3] * 5] * 2, 0.95: [[0.6] * 5] * 2}
    cal = crafted_sparse(errors, kept, noise)
    s = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05)
    # worst layer per step: 0.8 errors 0.09 0.04 0.03 0.10 -> 0.95, 0.8, 0.8, dense (0.95's 0.06 too); last step fp16
    assert [s.tau_for(t * 1000) for t in noise] == [0.95, 0.8, 0.8, None, None]
    assert [s.mode_for(t * 1000).value for t in noise] == ["int8"] * 4 + ["fp16"]
    assert len(s.rules) == 4  # steps 1 and 2 merged: same mode and level
    assert s.sparse and "sparsity<=0.05" in s.name
    per_layer = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, per_layer=True)
    assert [per_layer.tau_for(t * 1000, "blocks.1.attn") for t in noise] == [0.8] * 4 + [None]
    assert PrecisionSchedule.from_dict(json.loads(json.dumps(per_layer.to_dict()))) == per_layer
    # without a sparsity budget the schedule is the dense one it always was
    dense = PrecisionSchedule.from_calibration(cal, budget=0.02)
    int8 = [[0.01] * 4 + [0.5]] * 2
    assert not dense.sparse and dense == PrecisionSchedule.from_calibration(crafted(int8, int8, noise), budget=0.02)
    with pytest.raises(ValueError, match="sparsity_budget must be a number > 0"):
        PrecisionSchedule.from_calibration(cal, 0.02, sparsity_budget=0)


def test_calibrate_cli_with_sparsity_levels(tmp_path):
    # the shipped model's 256 tokens are two blocks: the predictor runs on every call
    res = run_cli(CLI_ARGS[:3] + ["--class-labels", "red circle", "--steps", "2", "--sparsity-levels", "0.9,0.5",
                                  "--sparsity-budget", "1", "--out", "cal"], tmp_path)
    cal = Calibration.load(tmp_path / "cal")
    assert cal.sparsity_levels() == [0.5, 0.9]
    schedule = PrecisionSchedule.load(tmp_path / "cal" / "schedule.json")
    assert schedule.sparse  # a budget of 1 takes the sparsest level wherever the mode is INT8
    assert {r.tau for r in schedule.rules if r.mode is not Mode.FP16} == {0.5}
    summary = (tmp_path / "cal" / "summary.md").read_text()
    assert "| 0.5 |" in summary and "| step | noise | mode | tau |" in summary
    assert "tau 0.5" in res.stdout and "levels per step:" in res.stdout


def test_a_moving_timestep_does_not_recompile_the_denoiser():
    # Under torch.compile the timestep the hook reads at every step must not become a constant the graph is guarded
    # on: with a trace (record=True), a schedule or a calibration (whose ranges change at every step), a second
    # generation at the same timesteps compiles no new frame, and a third at other timesteps none either (the
    # recompile limit raised, so that a graph guarded on the timestep would show as new frames, not as a fallback)
    from diffusion_int8 import PrecisionSchedule, Rule

    model, cal = make_calibration()
    _, x = build("dit")
    schedule = PrecisionSchedule(rules=[Rule("fp16", min_noise=0.9), Rule("int8", min_noise=0.4)], default="int8_fp16v")
    for kw in (dict(mode="int8", record=True), dict(schedule=schedule), dict(mode="int8", calibration=cal)):
        frames = compiled_frames(model, x, kw)
        assert frames[0] == frames[1] == frames[2] < 16, (kw, frames)


@torch._dynamo.config.patch(recompile_limit=64)
def compiled_frames(model, x, kw) -> list[int]:
    """Frames dynamo compiled after each of three generations of the model, enabled with ``kw``."""
    from torch._dynamo.testing import CompileCounter

    handle = enable(model, speed_gate=False, **kw)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    frames = []
    with torch.no_grad():
        for timesteps in (torch.linspace(999, 1, 10), torch.linspace(999, 1, 10), torch.linspace(990, 3, 12)):
            for t in timesteps:
                compiled(**{**x, "timestep": t.expand(2)}, return_dict=False)
            frames.append(counter.frame_count)
    handle.disable()
    torch._dynamo.reset()
    return frames


# -- carried levels ---------------------------------------------------------------------------------------------

def test_carried_levels_are_collected_as_the_carry_computes_them(monkeypatch, tmp_path):
    """Four steps with a refresh every 2: the refresh steps are exact and compute every block; the step after the
    first refresh merges its kept blocks with the skipped blocks as the first refresh computed them."""
    from diffusion_int8.calibration.stats import output_errors, sparse_sdpa, split_attention
    from diffusion_int8.kernels.api import exact_lse
    from diffusion_int8.kernels.merge import merge_forecast
    from diffusion_int8.kernels.sparsity import predict_block_mask

    def sparse_sdpa_with_lse(q, k, v, mask, scale):  # an independent computation: SDPA with the element mask
        return sparse_sdpa(q, k, v, mask, scale), exact_lse(q, k, block_mask=mask, scale=scale)

    seen = []
    _, record = collect_long_dit(monkeypatch, seen, timesteps=(900, 700, 500, 300),
                                 collector=Collector(modes=(), sparsity_levels=LEVELS, refresh_every=(2,)))
    timesteps, stats = merge([record])
    for layer, st in stats.items():
        for tau in LEVELS:
            err, kept = st[f"carry.rel_l1@{tau!r}/2"], st[f"carry.kept@{tau!r}/2"]
            assert float(err[:, [0, 2]].max()) < 1e-5 and torch.equal(kept[:, [0, 2]], torch.ones(2, 2))
            assert bool((kept[:, [1, 3]] < 1).all()) or tau == 0.9, kept  # near-uniform attention: 0.9 keeps all
        calls = {step: (q, k, v, scale, exact) for step, name, q, k, v, scale, exact in seen if name == layer}
        q0, k0, v0, scale, _ = calls[0]
        q1, k1, v1, _, exact1 = calls[1]
        mask = predict_block_mask(q0, k0, 0.5, sm_scale=scale, min_similarity=None)  # fixed at the first step
        out_k, lse_k = sparse_sdpa_with_lse(q1, k1, v1, mask, scale)
        out_c, lse_c = sparse_sdpa_with_lse(q0, k0, v0, ~mask, scale)
        want = output_errors(merge_forecast(out_k, lse_k, out_c, lse_c), exact1)["rel_l1"].mean(0)
        for got, ref in zip(split_attention(q0, k0, v0, mask, scale), (*sparse_sdpa_with_lse(q0, k0, v0, mask, scale),
                                                                      out_c, lse_c)):
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(st["carry.rel_l1@0.5/2"][:, 1], want)
        torch.testing.assert_close(st["carry.kept@0.5/2"][:, 1], mask.float().mean().expand(2))
    cal = Calibration.from_stats({"model": "tiny-dit", "model_class": "DiTTransformer2DModel",
                                  "num_train_timesteps": 1000}, timesteps, stats)
    assert cal.meta["schema_version"] == 6 and cal.carry_settings() == [(0.5, 2), (0.9, 2)]
    back = Calibration.load(cal.save(tmp_path / "carried.safetensors"))
    assert back.carry_settings() == cal.carry_settings() and torch.equal(back.carry_kept(0.5, 2), cal.carry_kept(0.5, 2))
    with pytest.raises(ValueError, match=r"level 0.5 refreshed every 3 steps was not calibrated; the calibrated pairs "
                                         r"are \[\(0.5, 2\), \(0.9, 2\)\]"):
        cal.carry_error(0.5, 3)
    with pytest.raises(ValueError, match="refresh intervals carry the blocks a sparsity level skips"):
        Collector(refresh_every=(2,))
    with pytest.raises(ValueError, match="a refresh interval must be an integer >= 2"):
        Collector(sparsity_levels=LEVELS, refresh_every=(1,))


def test_calibrate_says_whether_a_carried_setting_was_chosen(capsys, tmp_path):
    from types import SimpleNamespace

    from diffusion_int8.cli.summaries import print_calibration

    carried = {"tau": 0.1, "refresh_every": 4, "skipped": 0.5, "trajectory_rel_l1": 0.2, "mean_rel_l1": 0.1,
               "max_rel_l1": 0.3}
    summary = {"errors": {}, "ranges_vs_sigma": {}, "sparsity": {}, "carried": {"0.1/4": carried},
               "schedule": {"per_step": ["int8"], "tau_per_step": [0.1], "refresh_every": None}}
    print_calibration(summary, SimpleNamespace(name="s", calibrated_steps=20), tmp_path, 1.0, 1.0, carry_budget=0.12)
    assert "no carried setting: none above is within --carry-budget 0.12" in capsys.readouterr().out
    print_calibration(summary, SimpleNamespace(name="s", calibrated_steps=8), tmp_path, 1.0, 1.0, carry_budget=0.12)
    assert "no carried setting: calibrated over 8 steps, and a schedule carries only from 20" in capsys.readouterr().out
    summary["schedule"]["refresh_every"] = 4
    print_calibration(summary, SimpleNamespace(name="s", calibrated_steps=20), tmp_path, 1.0, 1.0, carry_budget=0.12)
    out = capsys.readouterr().out
    assert "refresh every 4 steps" in out and f"diffusion-int8 eval --schedule {tmp_path / 'schedule.json'}" in out


@pytest.fixture
def carry_at_any_step_count(monkeypatch):
    """Crafted calibrations of a few steps, whose choice between carrying and dropping is what a test checks: the
    step minimum for carrying (``test_carrying_needs_a_calibration_of_enough_steps``) lifted."""
    monkeypatch.setattr(schedule_module, "MIN_CARRY_STEPS", 1)


def crafted_carried(carried: dict, noise):
    """``crafted_sparse`` with levels 0.8 and 0.95 and carried (level, interval) -> (errors, kept), (L, T) each."""
    errors = {0.8: [[0.09, 0.04, 0.03, 0.10, 0.0]] * 2, 0.95: [[0.03, 0.01, 0.01, 0.06, 0.0]] * 2}
    cal = crafted_sparse(errors, {0.8: [[0.3] * 5] * 2, 0.95: [[0.6] * 5] * 2}, noise)
    for i, st in enumerate(cal.layers.values()):
        for (tau, every), (err, kept) in carried.items():
            st[f"carry.rel_l1@{tau!r}/{every}"] = torch.tensor(err[i]).repeat(2, 1).float()
            st[f"carry.kept@{tau!r}/{every}"] = torch.tensor(kept[i]).repeat(2, 1).float()
    cal.meta["carry"] = [list(pair) for pair in sorted(carried)]
    return cal


def test_a_carried_level_is_chosen_where_it_computes_fewer_blocks(carry_at_any_step_count):
    noise = [1.0, 0.75, 0.5, 0.25, 0.0]
    # dropped (the crafted levels): 0.95, 0.8, 0.8 and dense over the four INT8 steps, computing 0.6, 0.3, 0.3 and
    # 1 of the blocks (mean 0.55). Carried 0.8 every 2 computes 1, 0.3, 1, 0.3 (mean 0.65: dropping wins), every 4
    # 1, 0.3, 0.3, 0.3 (0.475: chosen), every 8 less still but over the carry budget: each INT8 step removes a
    # quarter of the noise, so the errors along the trajectory are 0.01, 0.0225 and 0.035
    carried = {(0.8, 2): ([[0.0, 0.02, 0.0, 0.02, 0.0]] * 2, [[1, 0.3, 1, 0.3, 1]] * 2),
               (0.8, 4): ([[0.0, 0.02, 0.03, 0.04, 0.0]] * 2, [[1, 0.3, 0.3, 0.3, 1]] * 2),
               (0.8, 8): ([[0.0, 0.02, 0.03, 0.09, 0.0]] * 2, [[1, 0.2, 0.2, 0.2, 0.2]] * 2)}
    cal = crafted_carried(carried, noise)
    s = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=0.03)
    assert s.refresh_every == 4 and "carried every 4, trajectory<=0.03" in s.name
    assert PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=0.04).refresh_every == 8
    assert PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=None).refresh_every is None
    for bad in (0, -1, float("nan"), True, "0.1"):
        for sparsity_budget in (0.05, None):
            with pytest.raises(ValueError, match="carry_budget must be a number > 0 or None"):
                PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=sparsity_budget, carry_budget=bad)
    for bad in (-1, float("nan"), None, "0.02"):  # NaN or -1 would give an all-fp16 schedule with nothing said
        with pytest.raises(ValueError, match=r"budget must be a number >= 0 \(an attention error"):
            PrecisionSchedule.from_calibration(cal, budget=bad)
    with pytest.raises(TypeError, match=r"calibration must be a Calibration, got the path 'calib/'.*Calibration.load"):
        PrecisionSchedule.from_calibration("calib/")
    assert [s.tau_for(t * 1000) for t in noise] == [0.8] * 4 + [None]  # one level wherever INT8 runs
    assert PrecisionSchedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    config = Int8Config("int8", schedule=s)
    assert config.refresh_every == 4 and Int8Config("int8", schedule=s, refresh_every=2).refresh_every == 2
    # carrying that computes as many blocks as dropping is not chosen
    dear = crafted_carried({(0.8, 2): carried[(0.8, 2)]}, noise)
    assert PrecisionSchedule.from_calibration(dear, budget=0.02, sparsity_budget=0.05).refresh_every is None
    # a schedule's refresh_every needs one level
    with pytest.raises(ValueError, match="refresh_every carries the blocks of one sparsity level"):
        PrecisionSchedule(rules=(Rule("int8", min_noise=0.5, tau=0.9), Rule("int8", tau=0.8)), refresh_every=2)
    bad = dict(s.to_dict(), refresh_every=1)
    with pytest.raises(ValueError, match="refresh_every: must be null or an integer >= 2"):
        PrecisionSchedule.from_dict(bad)
    old = {k: v for k, v in s.to_dict().items() if k not in ("refresh_every", "calibrated_steps")}
    assert PrecisionSchedule.from_dict(dict(old, schema_version=3)).refresh_every is None
    with pytest.raises(ValueError, match="refresh_every: unknown field in schema 3"):
        PrecisionSchedule.from_dict(dict(old, refresh_every=4, schema_version=3))
    before = PrecisionSchedule.from_dict(dict(old, refresh_every=4, schema_version=4))  # before calibrated_steps
    assert before == s and before.calibrated_steps is None and s.calibrated_steps == len(noise)


def test_step_weights_are_the_noise_each_step_removes():
    cal = crafted_carried({}, [1.0, 0.8, 0.4, 0.1, 0.02])
    torch.testing.assert_close(cal.step_weights(), torch.tensor([0.2, 0.4, 0.3, 0.08, 0.02]))
    cal.noise = torch.tensor([0.4, 1.0, 0.1, 0.8, 0.02])  # in any order: each step against the next lower level
    torch.testing.assert_close(cal.step_weights(), torch.tensor([0.3, 0.2, 0.08, 0.4, 0.02]))
    cal.noise = torch.full((5,), 0.0)
    torch.testing.assert_close(cal.step_weights(), torch.full((5,), 0.2))
    cal.noise = torch.tensor([0.8, 0.6, 0.2, 0.1, 0.05])  # a trajectory that starts below 1: normalized
    torch.testing.assert_close(cal.step_weights(), torch.tensor([0.25, 0.5, 0.125, 0.0625, 0.0625]))
    cal.noise = torch.tensor([1.0, 0.5, 0.5, 0.25, 0.0])  # two calls at one level share its gap
    torch.testing.assert_close(cal.step_weights(), torch.tensor([0.5, 0.125, 0.125, 0.25, 0.0]))
    cal.noise = torch.tensor([0.7])
    torch.testing.assert_close(cal.step_weights(), torch.tensor([1.0]))


def test_carried_errors_are_weighed_by_the_noise_each_step_removes(carry_at_any_step_count):
    """A forecast error at a step that removes little noise costs little: every 4 errs 0.30 at the third step, which
    removes 5% of the noise (0.032 along the trajectory), every 8 errs 0.05 at the steps that remove 85% of it
    (0.0435): at a carry budget of 0.04 every 4 passes and every 8 does not, though every 4's worst step is worse."""
    noise = [1.0, 0.9, 0.5, 0.45, 0.0]
    carried = {(0.8, 4): ([[0.0, 0.02, 0.30, 0.02, 0.0]] * 2, [[1, 0.3, 0.3, 0.3, 1]] * 2),
               (0.8, 8): ([[0.0, 0.05, 0.02, 0.05, 0.0]] * 2, [[1, 0.2, 0.2, 0.2, 0.2]] * 2)}
    cal = crafted_carried(carried, noise)
    assert PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=0.04).refresh_every == 4
    assert PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=0.045).refresh_every == 8


def test_carried_errors_are_averaged_over_the_int8_steps_alone(carry_at_any_step_count):
    """The last step runs FP16 (crafted_sparse) and removes a fifth of the noise: its forecast error (1.0) does not
    count, and the four INT8 steps' weights are renormalized (0.3125, 0.3125, 0.25, 0.125), so 0.04 at steps 1-3
    averages 0.0275, not the 0.022 of the weights over all five steps."""
    noise = [1.0, 0.75, 0.5, 0.3, 0.2]
    carried = {(0.8, 4): ([[0.0, 0.04, 0.04, 0.04, 1.0]] * 2, [[1, 0.3, 0.3, 0.3, 1]] * 2)}
    cal = crafted_carried(carried, noise)
    assert [PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05, carry_budget=b).refresh_every
            for b in (0.025, 0.03)] == [None, 4]
    assert cal.carry_trajectory_error(0.8, 4, steps=[0, 1, 2, 3]) == pytest.approx(0.0275)
    assert cal.carry_trajectory_error(0.8, 4) == pytest.approx(0.022 + 0.2 * 1.0)  # all five steps


def test_calibrate_cli_with_carried_levels(tmp_path):
    res = run_cli(CLI_ARGS[:3] + ["--class-labels", "red circle", "--steps", "4", "--sparsity-levels", "0.5",
                                  "--refresh-every", "2,3", "--sparsity-budget", "1", "--out", "cal"], tmp_path)
    cal = Calibration.load(tmp_path / "cal")
    assert cal.carry_settings() == [(0.5, 2), (0.5, 3)]
    assert "carried, refresh every 2" in res.stdout and "carried, refresh every 3" in res.stdout
    # said once, before the work: 4 steps are too few for the schedule to carry
    assert "at 4 steps the schedule will not carry them" in res.stdout.split("\n")[1]
    assert "no carried setting: calibrated over 4 steps" in res.stdout and "only from 20" not in res.stderr
    summary = (tmp_path / "cal" / "summary.md").read_text()
    assert "## Error of each level with its skipped blocks carried" in summary and "| 0.5 | 3 |" in summary
    assert "along the trajectory" in summary and "along the trajectory" in res.stdout
    for every in (2, 3):  # the summary's figure is the steps' errors weighted by the noise each removes
        want = float((cal.carry_error(0.5, every).mean(0) * cal.step_weights()).sum())
        got = json.loads((tmp_path / "cal" / "summary.json").read_text())["carried"][f"0.5/{every}"]
        assert got["trajectory_rel_l1"] == pytest.approx(want) and want < got["max_rel_l1"]
    res = run_cli(CLI_ARGS[:3] + ["--class-labels", "red circle", "--sparsity-levels", "0.5", "--refresh-every", "2",
                                  "--carry-budget", "0", "--out", "c3"], tmp_path, check=False)
    assert res.returncode == 2 and "--carry-budget" in res.stderr and not (tmp_path / "c3").exists()
    res = run_cli(CLI_ARGS[:3] + ["--class-labels", "red circle", "--sparsity-levels", "0.5", "--carry-budget", "0.1",
                                  "--out", "c4"], tmp_path, check=False)
    assert res.returncode == 2 and "--carry-budget bounds the carried settings --refresh-every measures" in res.stderr
    assert not (tmp_path / "c4").exists()
    res = run_cli(CLI_ARGS[:3] + ["--class-labels", "red circle", "--refresh-every", "2", "--out", "c2"], tmp_path,
                  check=False)
    assert res.returncode == 2 and "--refresh-every carries the blocks a sparsity level skips" in res.stderr


def test_split_attention_in_blocks_of_rows_equals_one_pass(monkeypatch):
    from diffusion_int8.calibration import stats

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(3))
    mask = torch.rand(2, 2, 3, 3, generator=g) > 0.4
    whole = stats.split_attention(q, k, v, mask, 0.25)
    monkeypatch.setattr(stats, "SPLIT_SCORES", 128 * 2 * 300)  # one query block at a time
    for a, b in zip(stats.split_attention(q, k, v, mask, 0.25), whole):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_carrying_is_chosen_only_from_the_first_step_on(carry_at_any_step_count):
    """The calibration carries from step 0; a schedule whose first steps run fp16 would carry from a later step at
    run time, refreshing on other steps than measured: no carrying then."""
    noise = [1.0, 0.75, 0.5, 0.25, 0.0]
    carried = {(0.8, 4): ([[0.0, 0.02, 0.03, 0.04, 0.0]] * 2, [[1, 0.3, 0.3, 0.3, 1]] * 2)}
    cal = crafted_carried(carried, noise)
    for st in cal.layers.values():  # int8's error too large at the first step: fp16 there
        for key in ("err.int8.rel_l1", "err.int8_fp16v.rel_l1"):
            st[key][:, 0] = 0.5
    s = PrecisionSchedule.from_calibration(cal, budget=0.02, sparsity_budget=0.05)
    assert s.mode_for(1000.0) is Mode.FP16 and s.refresh_every is None
    # and a config's interval taken from a schedule follows the schedule it is replaced with
    carrying = PrecisionSchedule.from_calibration(crafted_carried(carried, noise), budget=0.02, sparsity_budget=0.05)
    config = Int8Config("int8", schedule=carrying)
    assert config.refresh_every == 4 and config.replace(schedule=None).refresh_every is None
    assert config.replace(schedule=s).refresh_every is None


def test_carrying_needs_a_calibration_of_enough_steps():
    """The carry budget held image quality from 20 steps on (BENCHMARKS.md): a calibration of fewer steps drops the
    levels, saying so once, where the same errors over 20 steps carry."""
    def calibration(steps, calls_a_step=1):  # CFG: two calls a step, at one noise level
        noise = [n for n in torch.linspace(1, 0, steps).tolist() for _ in range(calls_a_step)]
        T = len(noise)
        cal = crafted_sparse({0.8: [[0.2] * T]}, {0.8: [[0.5] * T]}, noise)  # over the sparsity budget
        refresh = [1.0 if t // calls_a_step % 2 == 0 else 0.1 for t in range(T)]
        for st in cal.layers.values():
            st["carry.rel_l1@0.8/2"] = torch.tensor([0.01] * T).repeat(2, 1).float()
            st["carry.kept@0.8/2"] = torch.tensor(refresh).repeat(2, 1).float()
        cal.meta["carry"] = [[0.8, 2]]
        return cal

    assert schedule_module.MIN_CARRY_STEPS == 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = PrecisionSchedule.from_calibration(calibration(20), budget=0.02, sparsity_budget=0.05)
    assert s.refresh_every == 2 and s.calibrated_steps == 20
    with pytest.warns(RuntimeWarning, match=r"ran 12 denoising steps; a schedule carries skipped blocks only from 20"):
        s = PrecisionSchedule.from_calibration(calibration(12), budget=0.02, sparsity_budget=0.05)
    assert s.refresh_every is None and "carried" not in s.name and s.tau_for(1000.0) is None
    with pytest.warns(RuntimeWarning, match=r"ran 12 denoising steps"):  # steps, not calls
        assert PrecisionSchedule.from_calibration(calibration(12, 2), budget=0.02,
                                                  sparsity_budget=0.05).refresh_every is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PrecisionSchedule.from_calibration(calibration(20, 2), budget=0.02,
                                                  sparsity_budget=0.05).refresh_every == 2
    with warnings.catch_warnings():  # nothing to say where carrying was not asked for
        warnings.simplefilter("error")
        PrecisionSchedule.from_calibration(calibration(12), budget=0.02, sparsity_budget=0.05, carry_budget=None)
