"""Misuse and faults of the library API: concurrent calls, tampered files and tables, bad arguments.

Each test plants one fault the package once missed (a silently wrong result, a crash, damage left behind) and
checks it is now caught, exactly, or refused before any work with a message naming what was wrong.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings

import pytest
import torch

from diffusion_int8 import Int8DiffusionProcessor


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


def _joint_attention():
    """An SD3-style joint text+image attention module (2 heads x 32), seeded."""
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    torch.manual_seed(0)
    return Attention(query_dim=64, added_kv_proj_dim=64, dim_head=32, heads=2, out_dim=64, context_pre_only=False,
                     bias=True, processor=JointAttnProcessor2_0()).eval()


def _inputs(n: int, seed: int):
    """(image tokens (1, 300, 64), text tokens (1, n, 64)) drawn from ``seed``; the image tokens change slowly
    along the sequence (runs of 32 alike), as a latent's do, so the block predictor skips some key blocks."""
    g = torch.Generator().manual_seed(seed)
    runs = torch.randn(1, 10, 64, generator=g) * 2
    image = runs.repeat_interleave(32, dim=1)[:, :300] + 0.2 * torch.randn(1, 300, 64, generator=g)
    return image, torch.randn(1, n, 64, generator=g)


@pytest.fixture(autouse=True)
def _switch_often():
    """Threads switched every microsecond, so a race shows in a few calls."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _threads(n: int, work) -> None:
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_sharing_a_sparse_joint_attention_get_their_own_results():
    """Six threads call one module with text of 5 and 250 tokens: each output equals the same call made alone
    (the always-kept text blocks are per call, not whatever another thread's call left on the processor). The
    stock processor pauses before its projections in the short-text calls, so a long-text call can come in
    between."""
    import time

    from diffusers.models.attention_processor import JointAttnProcessor2_0

    class Pausing(JointAttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, **kwargs):
            if encoder_hidden_states.shape[1] == 5:
                time.sleep(0.01)
            return super().__call__(attn, hidden_states, encoder_hidden_states, **kwargs)

    attn = _joint_attention()
    with pytest.warns(RuntimeWarning, match="outside its module's F"):
        attn.set_processor(Int8DiffusionProcessor("int8", sparsity=0.3, inner=Pausing(), speed_gate=False))
        attn(*_inputs(5, 99)[:1], encoder_hidden_states=_inputs(5, 99)[1])
    cases = [_inputs(5 if i % 2 else 250, i) for i in range(6)]
    with torch.no_grad():
        alone = [attn(x, encoder_hidden_states=c) for x, c in cases]
        got = [[] for _ in cases]

        def work(i):
            for _ in range(10):
                got[i].append(attn(*cases[i][:1], encoder_hidden_states=cases[i][1]))

        _threads(6, work)
    for i, outs in enumerate(got):
        for out in outs:
            assert all(torch.equal(a, b) for a, b in zip(out, alone[i])), i


def test_threads_carrying_skipped_blocks_keep_their_own_call_sites():
    """Four threads run three denoising steps through one carrying processor in lock-step (the timestep is the
    handle's, one for all), three calls a step each: every thread's outputs equal its calls run alone on a fresh
    processor (the carried blocks are that thread's own, not another thread's call site's)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    timesteps = (900, 600, 300)

    def processor():
        return Int8DiffusionProcessor("int8", sparsity=0.3, refresh_every=2, inner=JointAttnProcessor2_0(),
                                      speed_gate=False)

    calls = [[_inputs(5 if (i + j) % 2 else 250, 10 * i + j) for j in range(3)] for i in range(4)]

    def run_alone(i):
        attn = _joint_attention()
        attn.set_processor(proc := processor())
        outs = []
        for t in timesteps:
            proc.state.timestep = t
            outs += [attn(x, encoder_hidden_states=c)[0] for x, c in calls[i]]
        return outs

    with torch.no_grad():
        alone = [run_alone(i) for i in range(4)]
        attn = _joint_attention()
        attn.set_processor(proc := processor())
        got = [[] for _ in calls]
        barrier = threading.Barrier(4, action=lambda: None)

        def work(i):
            for t in timesteps:
                barrier.wait()
                if i == 0:
                    proc.state.timestep = t
                barrier.wait()
                got[i] += [attn(x, encoder_hidden_states=c)[0] for x, c in calls[i]]

        _threads(4, work)
    for i in range(4):
        assert all(torch.equal(a, b) for a, b in zip(got[i], alone[i])), i


# -- speed-gate tables and the JSON files the package reads --

def _table_json(tmp_path):
    from diffusion_int8.plugin.speed_gate import CrossoverTable, Grid

    grid = Grid("int8", 64, "float16", (1024, 4096), (1 << 16, 1 << 18), ((0.8, 1.1), (1.2, 1.5)))
    path = tmp_path / "table.json"
    CrossoverTable("test GPU", "sm_90", (grid,)).save(path)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("change, message", [
    (lambda g: g["grids"][0]["speedup"][0].__setitem__(0, float("inf")), "Infinity is not JSON"),
    (lambda g: g["grids"][0]["speedup"][0].__setitem__(0, True), "finite positive numbers or null, got True"),
    (lambda g: g["grids"][0]["keys"].__setitem__(1, 4096.7), "keys must be a non-empty, strictly increasing list of integers"),
    (lambda g: g["grids"].append(dict(g["grids"][0])), "a second grid for mode 'int8', head_dim 64, dtype 'float16'"),
    (lambda g: g.__setitem__("arch", "hopper"), "arch must name a CUDA architecture"),
    (lambda g: g.__setitem__("margin", "1.03"), "margin must be a finite positive number"),
])
def test_crossover_tables_are_validated_whole(tmp_path, change, message):
    from diffusion_int8.plugin.speed_gate import CrossoverTable

    path, data = _table_json(tmp_path)
    change(data)
    path.write_text(json.dumps(data))  # json.dumps writes inf as Infinity, as a hand edit might
    with pytest.raises(ValueError) as err:
        CrossoverTable.load(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value), str(err.value)


def test_a_cached_table_of_another_architecture_is_ignored_with_a_warning(tmp_path, monkeypatch):
    from diffusion_int8.plugin import speed_gate

    path, data = _table_json(tmp_path)
    path.write_text(json.dumps({**data, "arch": "sm_80"}))
    monkeypatch.setattr(speed_gate, "cache_path", lambda device: path)
    monkeypatch.setattr(speed_gate, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")  # none of its own
    with pytest.warns(RuntimeWarning, match="measured on sm_80, and this GPU is sm_90"):
        table = speed_gate._find_table(torch.device("cuda", 0))
    assert table == speed_gate.for_this_triton(speed_gate.CrossoverTable.load(speed_gate.SHIPPED / "sm_90.json"))


def test_a_cached_table_without_masked_cells_is_used_with_a_warning(tmp_path, monkeypatch):
    from diffusion_int8.plugin import speed_gate

    path, _ = _table_json(tmp_path)
    monkeypatch.setattr(speed_gate, "cache_path", lambda device: path)
    monkeypatch.setattr(speed_gate, "arch_of", lambda device: "sm_90")
    with pytest.warns(RuntimeWarning, match="has no cells of the kinds tail, key .*tune --overwrite"):
        table = speed_gate._find_table(torch.device("cuda", 0))
    assert table == speed_gate.CrossoverTable.load(path)
    # tail cells are measured at head dim 64 alone: a table of head dim 128 lacks only the key-mask cells
    wide = speed_gate.CrossoverTable("test GPU", "sm_90", tuple(
        speed_gate.Grid("int8", 128, "float16", g.keys, g.rows, g.speedup) for g in table.grids))
    wide.save(path)
    with pytest.warns(RuntimeWarning, match="has no cells of the kinds key "):
        speed_gate._find_table(torch.device("cuda", 0))
    # every kind of cell, but from a release that did not record SDPA's rate, which eager calls' decisions read
    every = speed_gate.CrossoverTable("test GPU", "sm_90", tuple(
        speed_gate.Grid("int8", 64, "float16", g.keys, g.rows, g.speedup, kind) for g in table.grids[:1]
        for kind in speed_gate.KINDS))
    every.save(path)
    with pytest.warns(RuntimeWarning, match=r"has no SDPA rate \(measured.sdpa_tflops\), so eager calls' savings are "
                                            r"judged at 700 TFLOPS: calls may run SDPA .*tune --overwrite"):
        speed_gate._find_table(torch.device("cuda", 0))
    speed_gate.CrossoverTable(every.device, every.arch, every.grids, measured={"sdpa_tflops": 650.0}).save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert speed_gate._find_table(torch.device("cuda", 0)).sdpa_tflops == 650.0


def test_saving_a_table_does_not_follow_a_link_planted_beside_it(tmp_path):
    """The temporary file the write goes through is made new: a link planted at the name an earlier release used
    (``.{name}.{pid}.tmp``) is neither followed nor left changed, and no temporary file is left."""
    import os

    path, _ = _table_json(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / f".{path.name}.{os.getpid()}.tmp"
    link.symlink_to(victim)
    from diffusion_int8.plugin.speed_gate import CrossoverTable

    table = CrossoverTable.load(path)
    CrossoverTable(table.device, table.arch, table.grids, margin=1.2).save(path)
    assert victim.read_text() == "keep me" and link.is_symlink()
    assert CrossoverTable.load(path).margin == 1.2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, victim.name, link.name])


def test_deeply_nested_json_is_refused_before_parsing(tmp_path):
    from diffusion_int8 import PrecisionSchedule
    from diffusion_int8.plugin.speed_gate import CrossoverTable

    from diffusion_int8.pipelines import check_model

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "model_index.json").write_text(deep.read_text())
    for load, path in ((PrecisionSchedule.load, deep), (CrossoverTable.load, deep), (check_model, tmp_path)):
        with pytest.raises(ValueError, match="JSON nested 100000 deep"):
            load(path)


# -- library entry points: arguments checked before any work, the pipeline left as it was --

def test_a_non_finite_scale_is_refused():
    from diffusion_int8 import int8_attention

    q = torch.randn(1, 2, 64, 32).half()
    for scale in (float("inf"), float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            int8_attention(q, q, q, mode="int8", scale=scale)


@pytest.fixture(scope="module")
def shipped_pipe():
    from diffusion_int8.embedded import load_pipeline

    return load_pipeline()


def _processors(pipe):
    from diffusion_int8.plugin.models import attention_modules
    from diffusion_int8.pipelines import denoiser

    return {n: type(m.processor) for n, m in attention_modules(denoiser(pipe)).items()}


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size must be from 1 to 4096, got 0"),
    ({"steps": 0}, "steps must be from 1 to 10000, got 0"),
    ({"steps": 1_000_000_000}, "steps must be from 1 to 10000"),
    ({"percentile": 200}, "percentile must be a number in (0, 100], got 200"),
    ({"seed": -1}, "seed must be an integer from 0 to 9223372036854775807 (2**63 - 1), got -1"),
])
def test_calibrate_refuses_bad_arguments_first_and_leaves_the_pipeline_as_it_was(shipped_pipe, kwargs, message):
    from diffusion_int8 import calibrate, enable

    before = _processors(shipped_pipe)
    with pytest.raises(ValueError) as err:
        calibrate(shipped_pipe, class_labels=["red circle"], progress=False, **{"steps": 2, **kwargs})
    assert message in str(err.value), str(err.value)
    assert _processors(shipped_pipe) == before
    enable(shipped_pipe, "int8").disable()  # not "already enabled"


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be from 1 to 10000, got 0"),
    ({"batch_size": 0}, "batch_size must be from 1 to 4096, got 0"),
    ({"modes": ["int4"]}, "mode must be one of"),
    ({"modes": "int8"}, "modes must be a list of INT8 mode names (int8, int8_fp16v), got 'int8'"),
    ({"modes": ["int8", "fp16"]}, "modes lists 'fp16', the stock pipeline every report compares with"),
    ({"modes": []}, "nothing to compare with fp16: give modes (int8, int8_fp16v), a schedule, a calibration or"),
    ({"seed": 2**64}, "seed must be an integer from 0 to 9223372036854775807 (2**63 - 1), got"),
    ({"lpips_weights": "/nonexistent/lpips.pth"}, "lpips_weights: no file at /nonexistent/lpips.pth"),
])
def test_evaluate_refuses_bad_arguments_before_any_image(shipped_pipe, kwargs, message, monkeypatch):
    from diffusion_int8.eval import evaluate
    from diffusion_int8.eval import run as eval_run

    def no_images(*args, **kwargs):
        raise AssertionError("generation started")

    monkeypatch.setattr(eval_run, "generate_all", no_images)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        evaluate(shipped_pipe, class_labels=["red circle"], progress=False, **{"steps": 2, **kwargs})
    assert message in str(err.value), str(err.value)


def test_evaluate_refuses_weights_for_a_metric_it_cannot_run_before_any_image(shipped_pipe, monkeypatch):
    from diffusion_int8.eval import evaluate
    from diffusion_int8.eval import run as eval_run
    from diffusion_int8.eval.metrics import Unavailable

    def no_images(*args, **kwargs):
        raise AssertionError("generation started")

    monkeypatch.setattr(eval_run, "generate_all", no_images)
    monkeypatch.setattr(eval_run, "missing_package", lambda metric: Unavailable(f"{metric} is not installed"))
    for what in ("lpips_weights", "fid_weights"):
        with pytest.raises(ValueError, match=f"{what} was given, but {what[:-8]} is not installed"):
            evaluate(shipped_pipe, class_labels=["red circle"], progress=False, steps=2, **{what: __file__})
