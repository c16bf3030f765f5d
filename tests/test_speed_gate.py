"""The speed gate: crossover-table files, the decisions they give, and the processor obeying them (on CPU)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from diffusion_int8 import enable
from diffusion_int8.kernels import Mode
from diffusion_int8.plugin import speed_gate
from diffusion_int8.plugin.speed_gate import (KINDS, SHIPPED, TAIL_HEAD_DIM, CrossoverTable, Grid, SpeedGate,
                                              kind_of_call, shipped_path)
from tiny_models import build


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


def table(keys=(64, 4096), rows=(32, 1 << 16), speedup=((0.5, 0.9), (0.8, 1.4)), head_dim=16, dtype="float32"):
    grids = tuple(Grid(m, head_dim, d, keys, rows, speedup) for m in ("int8", "int8_fp16v") for d in ("float16", "bfloat16"))
    return CrossoverTable("test GPU", "sm_00", grids, margin=1.05)


def test_decisions_interpolate_small_grids():
    t = table(head_dim=64)
    # a 2 x 2 grid is interpolated bilinearly in (log2 keys, log2 rows): its cells come back exactly
    for i, sk in enumerate((64, 4096)):
        for j, rows in enumerate((32, 1 << 16)):
            assert t.speedup("int8", 64, torch.float16, rows, sk) == pytest.approx(((0.5, 0.9), (0.8, 1.4))[i][j])
    # between the cells: bilinear in the logs (512 keys is halfway from 64 to 4096, 1024 rows 5/11 of the way)
    fx, fy = 0.5, 5 / 11
    expected = (1 - fx) * ((1 - fy) * 0.5 + fy * 0.9) + fx * ((1 - fy) * 0.8 + fy * 1.4)
    assert t.speedup("int8", 64, torch.float16, 1024, 512) == pytest.approx(expected)
    # a shape between lattice points is judged at the one below it, an eighth of an octave at most
    assert t.speedup("int8", 64, torch.float16, 1024, 530) == pytest.approx(expected)
    assert t.pays("int8", 64, torch.float16, rows=1 << 16, sk=4096)
    assert t.pays("int8", 64, torch.bfloat16, rows=1 << 20, sk=50_000)  # past the grid: its edge
    assert not t.pays("int8", 64, torch.float16, rows=1 << 16, sk=128)  # 0.9 + (1.4 - 0.9) / 6 < 1.05
    assert not t.pays("int8", 64, torch.float16, rows=31, sk=10_000)  # below the grid: SDPA
    assert t.speedup("int8", 64, torch.float16, 1 << 16, 63) is None
    assert t.speedup("int8_fp16v", 40, torch.float16, 1 << 16, 4096) == pytest.approx(1.4)  # 40 pads to 64's grid
    assert t.speedup("int8", 128, torch.float16, 1 << 16, 4096) is None  # no grid at padded width 128


def test_a_noisy_cell_does_not_flip_a_decision():
    # a full grid of a smooth trend (the speed-up grows with the log of the keys) with one cell 8% off either way
    # (the shipped tables' cells scatter by about 5%): the fitted surface keeps the trend's decision there
    keys, rows = (1024, 2048, 4096, 8192, 16384, 32768), (1 << 15, 1 << 16, 1 << 17, 1 << 18)
    trend = lambda n: 0.6 + 0.09 * (math.log2(n) - 10)  # noqa: E731  (1.05 at 5 doublings past 1024)
    for sk, bump in ((8192, 1.08), (32768, 0.92), (16384, 0.92)):
        speedup = tuple(tuple(round(trend(n) * (bump if n == sk and r == 1 << 16 else 1.0), 3) for r in rows) for n in keys)
        grid = Grid("int8", 64, "float16", keys, rows, speedup)
        t = CrossoverTable("test GPU", "sm_00", (grid,), margin=1.03)
        assert abs(t.speedup("int8", 64, torch.float16, 1 << 16, sk) - trend(sk)) < 0.03
        assert t.pays("int8", 64, torch.float16, 1 << 16, sk) == (trend(sk) >= 1.03)


def test_shipped_sm90_table_keeps_short_sequences_on_sdpa():
    # what the shipped H100 table decides for the attention shapes of the benchmark's models (rows = batch x heads x
    # queries): the image models' 1-5K tokens run SDPA, only video-length self-attention runs int8
    t = CrossoverTable.load(SHIPPED / "sm_90.json")
    sdpa = {"SDXL 64x64": (torch.float16, 64, 2 * 10 * 4096, 4096), "SDXL 32x32": (torch.float16, 64, 2 * 20 * 1024, 1024),
            "PixArt": (torch.float16, 72, 16 * 4096, 4096), "DiT": (torch.float16, 72, 4 * 16 * 1024, 1024),
            "SD3.5": (torch.float16, 64, 24 * 4429, 4429), "Flux": (torch.bfloat16, 128, 24 * 4608, 4608),
            "Wan cross-attention": (torch.bfloat16, 128, 12 * 20280, 512)}
    for name, (dtype, d, rows, keys) in sdpa.items():
        for mode in ("int8", "int8_fp16v"):
            assert not t.pays(mode, d, dtype, rows, keys), (name, mode)
    assert t.pays("int8", 128, torch.bfloat16, 12 * 20280, 20280)  # Wan 480p x 49 frames
    assert t.pays("int8", 128, torch.float16, 16 * 16384, 16384)


def test_table_files_round_trip_and_bad_files_name_the_problem(tmp_path):
    t = table()
    path = tmp_path / "t.json"
    t.save(path)
    assert CrossoverTable.load(path) == t
    good = json.loads(path.read_text())
    cases = {
        "not json": "{",
        "a list": "[]",
        "other format": json.dumps({**good, "format": "x"}),
        "future version": json.dumps({**good, "version": 99}),
        "shape": json.dumps({**good, "grids": [{**good["grids"][0], "speedup": [[1.0]]}]}),
        "negative": json.dumps({**good, "grids": [{**good["grids"][0], "speedup": [[1.0, -1], [1, 1]]}]}),
        "unsorted keys": json.dumps({**good, "grids": [{**good["grids"][0], "keys": [4096, 64]}]}),
        "bad mode": json.dumps({**good, "grids": [{**good["grids"][0], "mode": "int4"}]}),
        "bad dtype": json.dumps({**good, "grids": [{**good["grids"][0], "dtype": "float64"}]}),
        "bad kind": json.dumps({**good, "grids": [{**good["grids"][0], "kind": "causal"}]}),
        "unknown field": json.dumps({**good, "grids": [{**good["grids"][0], "mask": "key"}]}),
        "masked grid in version 1": json.dumps({**good, "version": 1, "grids": [{**good["grids"][0], "kind": "key"}]}),
    }
    for what, text in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)):
            CrossoverTable.load(path)


def test_version_1_files_load_as_unmasked_grids(tmp_path):
    t = table()
    data = t.to_json()
    data["version"] = 1
    for g in data["grids"]:
        del g["kind"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    assert CrossoverTable.load(path) == t and all(g.kind == "plain" for g in t.grids)


def test_shipped_tables_load():
    files = sorted(SHIPPED.glob("*.json"))
    assert any(f.stem == "sm_90" for f in files), "a crossover table ships for sm_90"
    for f in files:
        t = CrossoverTable.load(f)
        assert t.grids and f == shipped_path(t.arch, None if f.stem == t.arch else t.device), f
        # a GPU's own table measures what the architecture's does, and every kind of call (tails at head dim 64)
        if f.stem != t.arch:
            grids = {(g.mode, g.head_dim, g.dtype, g.kind) for g in t.grids}
            assert grids == {(m, d, dt, kind) for m, d, dt, _ in grids for kind in KINDS
                             if kind != "tail" or d <= TAIL_HEAD_DIM}, f


def test_processor_sends_gated_calls_to_sdpa_and_counts_them(tmp_path):
    # the tiny DiT's self-attention: 2 heads x 64 tokens of head dim 32, batch 2 -> 256 query rows, 64 keys
    model, x = build("dit")
    with torch.no_grad():
        stock = model(**x, return_dict=False)[0]
    heads_rows, keys = 2 * 2 * 64, 64

    def run_with(speedup):
        path = tmp_path / "t.json"
        table(keys=(keys,), rows=(heads_rows,), speedup=((speedup,),), head_dim=32).save(path)
        handle = enable(model, "int8", speed_gate=path)
        with torch.no_grad():
            out = model(**x, return_dict=False)[0]
        handle.disable()
        return out, handle.state

    out, state = run_with(0.7)  # INT8 slower than SDPA here: every call gated, the output is stock's
    assert state.int8_calls == 0 and state.gated_calls == 2  # one self-attention call in each of 2 layers
    assert torch.equal(out, stock)
    out, state = run_with(1.5)
    assert state.int8_calls == 2 and state.gated_calls == 0
    assert not torch.equal(out, stock)
    handle = enable(model, "int8", speed_gate=False)  # forced
    with torch.no_grad():
        model(**x, return_dict=False)
    handle.disable()
    assert handle.state.int8_calls == 2


@pytest.mark.parametrize("family", ["dit", "flux"])
def test_gated_shapes_go_straight_to_the_stock_processor(family, tmp_path):
    # once every attention call of a module's input shape was gated, later calls of that shape skip the routing (the
    # stock processor runs as is), still counted; where INT8 pays, calls are routed and run INT8
    model, x = build(family)
    with torch.no_grad():
        stock = model(**x, return_dict=False)[0]
    head_dim = 16 if family == "flux" else 32

    def run(speedup, calls):
        path = tmp_path / f"{speedup}.json"
        table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((speedup,) * 2,) * 2, head_dim=head_dim).save(path)
        handle = enable(model, "int8", speed_gate=path)
        procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
        outs, reached = [], []
        with torch.no_grad():
            for _ in range(calls):
                for p in procs:
                    p._routed_hit = False  # set when a call reaches the routed attention
                before = handle.state.gated_calls
                outs.append(model(**x, return_dict=False)[0])
                reached.append(all(p._routed_hit for p in procs))
                assert handle.state.gated_calls - before == (2 if speedup < 1 else 0)  # 2 layers (or blocks)
        handle.disable()
        return outs, reached, handle.state, procs

    outs, reached, state, procs = run(0.7, 4)  # INT8 slower than SDPA: every call gated
    assert reached == [True, True, False, False]  # routed twice (the first call checks the route), then stock
    assert state.int8_calls == 0 and all(torch.equal(o, stock) for o in outs)
    outs, reached, state, procs = run(1.5, 3)
    assert all(reached) and state.int8_calls == 6 and not torch.equal(outs[-1], stock)
    assert not any(p._stock_shapes for p in procs)


def test_calls_sent_to_another_backend_are_not_learnt_as_gated(tmp_path):
    # under diffusers' attention_backend(...) the calls go to that backend without reaching the gate: nothing is
    # learnt from them, so back on the native backend the same inputs run INT8 where it pays
    from diffusers.models.attention_dispatch import attention_backend

    model, x = build("flux")
    path = tmp_path / "t.json"
    table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((1.5, 1.5), (1.5, 1.5)), head_dim=16).save(path)
    handle = enable(model, "int8", speed_gate=path)
    with torch.no_grad():
        with attention_backend("_native_math"):
            for _ in range(3):
                model(**x, return_dict=False)
        assert handle.state.int8_calls == 0 and handle.state.gated_calls == 0
        model(**x, return_dict=False)
    assert handle.state.int8_calls == 2
    handle.disable()


def test_a_shared_processor_caches_each_module_apart():
    # one processor set on modules of the same input width but other head dims: the gate judges each module
    from diffusers.models.attention_processor import Attention
    from diffusion_int8 import Int8DiffusionProcessor

    proc = Int8DiffusionProcessor("int8", speed_gate=table(keys=(8, 4096), rows=(8, 1 << 16), speedup=((1.5, 1.5), (1.5, 1.5)), head_dim=16))
    narrow = Attention(query_dim=32, heads=2, dim_head=16, processor=proc)  # head dim 16: the table says INT8 pays
    wide = Attention(query_dim=32, heads=1, dim_head=128, processor=proc)  # head dim 128: no grid, gated
    x = torch.randn(1, 64, 32)
    with torch.no_grad():
        for _ in range(3):
            wide(x)
        gated = proc.state.gated_calls
        narrow(x), narrow(x)
    assert gated == 3 and proc.state.gated_calls == 3 and proc.state.int8_calls == 2


def test_gate_without_table_on_cpu_does_not_gate():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    assert SpeedGate().pays(Mode.INT8, q, q)
    with pytest.raises(TypeError, match="speed_gate"):
        enable(build("dit")[0], "int8", speed_gate=3)


def test_unmeasured_cells_are_judged_by_the_surface():
    # cells too large to measure are null; a shape there is judged by the surface through the measured cells (here a
    # plane, rising with the keys and rows as the measured ones do), not sent to SDPA
    t = table(keys=(1024, 32768), rows=(32, 1 << 20), speedup=((0.5, 0.9), (1.2, None)), head_dim=128)
    assert t.speedup("int8", 128, torch.float16, rows=1 << 21, sk=75_600) >= 1.2
    assert t.pays("int8", 128, torch.float16, rows=1 << 21, sk=75_600)


def test_gated_counts_skip_calls_the_kernel_does_not_take():
    # a 3-D call (legal for SDPA) and a causal one stay on SDPA without reaching the gate or the counters
    from diffusion_int8 import Int8DiffusionProcessor

    proc = Int8DiffusionProcessor("int8", speed_gate=table(head_dim=16))
    q = torch.randn(2, 8, 16)
    torch.testing.assert_close(proc._attention(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
    q4 = torch.randn(1, 2, 8, 16)
    proc._attention(q4, q4, q4, is_causal=True)
    assert proc.state.int8_calls == proc.state.gated_calls == 0


def test_gate_decisions_guard_on_ranges_under_torch_compile():
    # torch.compile with dynamic shapes: the gate judges a call by comparisons with its lattice, so lengths within one
    # lattice step share a compiled graph (arithmetic on the length would fix each value and recompile per length)
    from torch._dynamo.testing import CompileCounter

    t = table(keys=(1024, 32768), rows=(1, 1 << 20), speedup=((0.5, 0.6), (1.4, 1.5)), head_dim=16)
    gate = SpeedGate(t)

    def f(q, k):
        return q * 2 if gate.pays(Mode.INT8, q, k) else q * 3

    counter = CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True)
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    torch._dynamo.reset()
    for sk in (5000, 5100, 5200):  # one eighth-octave step: [4871, 5312)
        k = torch.randn(1, 2, sk, 16, dtype=torch.float16)
        assert torch.equal(compiled(q, k), f(q, k))
    assert counter.frame_count == 1
    k = torch.randn(1, 2, 30000, 16, dtype=torch.float16)  # another step, another decision
    assert torch.equal(compiled(q, k), f(q, k)) and counter.frame_count == 2


def test_compiled_calls_with_a_key_mask_read_the_masked_grids():
    t = table(keys=(1024, 32768), rows=(1, 1 << 20), speedup=((0.5, 0.6), (1.4, 1.5)), head_dim=16)
    masked = tuple(Grid(g.mode, g.head_dim, g.dtype, g.keys, g.rows, ((1.5, 1.6), (1.9, 2.0)), "key") for g in t.grids)
    gate = SpeedGate(CrossoverTable(t.device, t.arch, t.grids + masked, t.margin))

    def f(q, k, mask):
        return q * 2 if gate.pays(Mode.INT8, q, k, mask) else q * 3

    compiled = torch.compile(f, backend="eager", dynamic=True)
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 2000, 16, dtype=torch.float16)  # unmasked about 0.7: SDPA; with a key mask about 1.6: INT8
    keys = torch.ones(1, 1, 1, 2000, dtype=torch.bool)
    torch._dynamo.reset()
    assert torch.equal(compiled(q, k, None), q * 3) and torch.equal(compiled(q, k, keys), q * 2)


def test_compiled_calls_past_whole_tiles_read_the_tail_grids():
    t = table(keys=(1024, 32768), rows=(1, 1 << 20), speedup=((0.5, 0.6), (1.4, 1.5)), head_dim=64)
    tail = tuple(Grid(g.mode, g.head_dim, g.dtype, g.keys, g.rows, ((1.5, 1.6), (1.9, 2.0)), "tail") for g in t.grids)
    gate = SpeedGate(CrossoverTable(t.device, t.arch, t.grids + tail, t.margin))

    def f(q, k):
        return q * 2 if gate.pays(Mode.INT8, q, k) else q * 3

    compiled = torch.compile(f, backend="eager", dynamic=True)
    torch._dynamo.reset()
    for s, runs_int8 in ((2048 + 64, True), (2048 + 77, True), (2048, False), (2048 + 128, False)):
        q, k = torch.randn(1, 2, s, 64, dtype=torch.float16), torch.randn(1, 2, s, 64, dtype=torch.float16)
        assert torch.equal(compiled(q, k), q * (2 if runs_int8 else 3)), s


def test_the_gate_judges_a_masked_call_as_it_will_run():
    # a key mask (the same for every query: text padding) runs at the kernels' unmasked speed, so the table decides;
    # a mask that varies over the queries takes the element-wise path, which the table does not measure: SDPA
    gate = SpeedGate(table(head_dim=64))
    q = torch.zeros(1, 16, 4096, 64, dtype=torch.float16)
    k = torch.zeros(1, 16, 4096, 64, dtype=torch.float16)
    keys = torch.ones(1, 1, 1, 4096, dtype=torch.bool)
    assert gate.pays(Mode.INT8, q, k) and gate.pays(Mode.INT8, q, k, keys)
    assert gate.pays(Mode.INT8, q, k, torch.zeros(1, 16, 1, 4096, dtype=torch.float16))  # per head, diffusers'
    assert not gate.pays(Mode.INT8, q, k, torch.ones(1, 1, 4096, 4096, dtype=torch.bool))
    assert not gate.pays(Mode.INT8, q, k, torch.ones(4096, 4096, dtype=torch.bool))
    short = torch.zeros(1, 16, 64, 64, dtype=torch.float16)  # where INT8 does not pay, a key mask changes nothing
    assert not gate.pays(Mode.INT8, short, short) and not gate.pays(Mode.INT8, short, short, keys[..., :64])


def test_key_masked_calls_are_judged_by_the_masked_grids_where_a_table_has_them():
    # SDPA slows down with a key mask and the kernels do not: a table measured with the mask says INT8 pays at a
    # shape where it does not unmasked; without masked grids, a masked call is judged as an unmasked one
    plain = table(head_dim=64).grids
    masked = tuple(Grid(g.mode, g.head_dim, g.dtype, g.keys, g.rows, ((0.9, 1.3), (1.2, 1.9)), "key")
                   for g in plain if g.mode == "int8")
    q = torch.zeros(1, 16, 64, 64, dtype=torch.float16)  # 1024 rows, 512 keys: 0.88 unmasked, 1.30 masked
    k = torch.zeros(1, 16, 512, 64, dtype=torch.float16)
    keys = torch.ones(1, 1, 1, 512, dtype=torch.bool)
    gate = SpeedGate(CrossoverTable("test GPU", "sm_00", plain + masked, margin=1.05))
    assert not gate.pays(Mode.INT8, q, k) and gate.pays(Mode.INT8, q, k, keys)
    assert gate.table_for(q.device).speedup("int8", 64, torch.float16, 1024, 512, kind="key") == pytest.approx(1.3)
    assert not gate.pays(Mode.INT8_FP16V, q, k, keys)  # no masked grid for int8_fp16v: its unmasked one judges
    assert not gate.pays(Mode.INT8, q, k, torch.ones(1, 1, 64, 512, dtype=torch.bool))  # element-wise: never
    unmasked_only = SpeedGate(CrossoverTable("test GPU", "sm_00", plain, margin=1.05))
    assert not unmasked_only.pays(Mode.INT8, q, k, keys)


def test_lengths_past_whole_tiles_are_judged_by_the_tail_grids():
    # SDPA runs a tenth or more slower where the sequence leaves a partial 128-key tile, the kernels hardly: a call
    # with both lengths past whole tiles reads the tail grids, one with either length whole the plain ones
    assert [kind_of_call(*c) for c in ((4096, 4096, False), (4429, 4429, False), (4429, 4429, True),
                                       (4429, 4096, False), (4096, 4429, False), (64, 4173, False))] == [
        "plain", "tail", "key", "plain", "plain", "tail"]
    plain = table(head_dim=64).grids
    tail = tuple(Grid(g.mode, g.head_dim, g.dtype, g.keys, g.rows, ((0.9, 1.3), (1.2, 1.9)), "tail") for g in plain)
    gate = SpeedGate(CrossoverTable("test GPU", "sm_00", plain + tail, margin=1.05))
    whole = torch.zeros(1, 16, 512, 64, dtype=torch.float16)  # 8192 rows, 512 keys: plain about 0.95, tail 1.4
    past = torch.zeros(1, 16, 517, 64, dtype=torch.float16)
    assert not gate.pays(Mode.INT8, whole, whole) and gate.pays(Mode.INT8, past, past)
    assert not SpeedGate(CrossoverTable("test GPU", "sm_00", plain, margin=1.05)).pays(Mode.INT8, past, past)
    # the same rows and keys, one call past whole tiles and one not: decided (and remembered) apart
    k = torch.zeros(1, 2, 517, 64, dtype=torch.float16)
    q_past, q_whole = torch.zeros(1, 2, 192, 64, dtype=torch.float16), torch.zeros(1, 3, 128, 64, dtype=torch.float16)
    assert gate.pays(Mode.INT8, q_past, k) and not gate.pays(Mode.INT8, q_whole, k)
    assert gate.pays(Mode.INT8, q_past, k) and not gate.pays(Mode.INT8, q_whole, k)
    # past padded head dim 64 the tail grids judge nothing: there the gain past whole tiles moves with the remainder
    wide = tuple(Grid(g.mode, 128, g.dtype, g.keys, g.rows, g.speedup, g.kind) for g in plain + tail)
    past128 = torch.zeros(1, 16, 517, 128, dtype=torch.float16)
    assert not SpeedGate(CrossoverTable("test GPU", "sm_00", wide, margin=1.05)).pays(Mode.INT8, past128, past128)


def test_a_gpu_with_its_own_shipped_table_reads_it_before_its_architectures(monkeypatch, tmp_path):
    own = CrossoverTable("NVIDIA Test GPU", "sm_90", table(head_dim=64).grids)
    monkeypatch.setattr(speed_gate, "SHIPPED", tmp_path)
    monkeypatch.setattr(speed_gate, "cache_path", lambda device: tmp_path / "no-cached-table.json")
    monkeypatch.setattr(speed_gate, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    arch = CrossoverTable("NVIDIA Other GPU", "sm_90", table(head_dim=128).grids)
    arch.save(tmp_path / "sm_90.json")
    assert speed_gate._find_table(torch.device("cuda", 0)) == arch
    own.save(tmp_path / "sm_90-nvidia-test-gpu.json")
    assert speed_gate.shipped_path("sm_90", "NVIDIA Test GPU") == tmp_path / "sm_90-nvidia-test-gpu.json"
    assert speed_gate._find_table(torch.device("cuda", 0)) == own
    # a table tune cached for this GPU comes first (with every kind of cell: no warning)
    cached = CrossoverTable("NVIDIA Test GPU", "sm_90", own.grids + tuple(
        Grid(g.mode, g.head_dim, g.dtype, g.keys, g.rows, g.speedup, kind)
        for g in own.grids for kind in ("tail", "key")), measured={"sdpa_tflops": 600.0})
    cached.save(tmp_path / "cached.json")
    monkeypatch.setattr(speed_gate, "cache_path", lambda device: tmp_path / "cached.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert speed_gate._find_table(torch.device("cuda", 0)) == cached


def test_a_table_measured_with_another_triton_release_asks_more_of_a_call(monkeypatch, tmp_path):
    measured = CrossoverTable("NVIDIA Test GPU", "sm_90", table(head_dim=64).grids, measured={"triton": "3.6.0"})
    monkeypatch.setattr(speed_gate, "_triton_release", lambda: "3.6.1")
    assert speed_gate.for_this_triton(measured) is measured
    monkeypatch.setattr(speed_gate, "_triton_release", lambda: "3.9.0")
    other = speed_gate.for_this_triton(measured)
    assert other.margin == pytest.approx(1.03 * speed_gate.OTHER_RELEASE_SLACK) and other.grids == measured.grids
    # a shape the table gives a speed-up between the two margins runs INT8 with 3.6 and SDPA with 3.9
    between = [(rows, sk) for sk in range(64, 4097, 64) for rows in (1 << 12, 1 << 14, 1 << 16)
               if 1.03 < measured.speedup("int8", 64, torch.float32, rows, sk) < other.margin]
    assert between
    rows, sk = between[0]
    assert measured.pays("int8", 64, torch.float32, rows, sk) and not other.pays("int8", 64, torch.float32, rows, sk)
    # the gate reads the shipped table so, and a table without the release it was measured with as it is
    monkeypatch.setattr(speed_gate, "SHIPPED", tmp_path)
    monkeypatch.setattr(speed_gate, "cache_path", lambda device: tmp_path / "no-cached-table.json")
    monkeypatch.setattr(speed_gate, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    measured.save(tmp_path / "sm_90.json")
    assert speed_gate._find_table(torch.device("cuda", 0)) == other
    unrecorded = CrossoverTable("NVIDIA Test GPU", "sm_90", measured.grids)
    assert speed_gate.for_this_triton(unrecorded) is unrecorded


def test_the_shipped_h200_table_decides_as_benchmarks_says(monkeypatch):
    # BENCHMARKS.md, "The H200's own table": on an H200, LTX-Video's self-attention runs int8 and the image models'
    # unmasked calls stay on SDPA; joint attention with a key mask runs INT8 from image lengths on
    t = CrossoverTable.load(shipped_path("sm_90", "NVIDIA H200"))
    assert t.device == "NVIDIA H200" and t.measured["date"] == "2026-11-30"
    calls = {"LTX-Video": (torch.bfloat16, 64, 2 * 32 * 6144, 6144), "SD3.5": (torch.float16, 64, 2 * 24 * 4429, 4429),
             "Flux": (torch.bfloat16, 128, 24 * 4608, 4608), "SDXL": (torch.float16, 64, 2 * 10 * 4096, 4096),
             "PixArt": (torch.float16, 72, 2 * 16 * 4096, 4096), "DiT": (torch.float16, 72, 4 * 16 * 1024, 1024),
             "Qwen-Image joint": (torch.bfloat16, 128, 24 * 4352, 4352), "Wan": (torch.bfloat16, 128, 12 * 20280, 20280)}
    runs_int8 = {name: t.pays("int8", d, dtype, rows, keys) for name, (dtype, d, rows, keys) in calls.items()}
    assert runs_int8 == {"LTX-Video": True, "SD3.5": False, "Flux": False, "SDXL": False, "PixArt": False,
                         "DiT": False, "Qwen-Image joint": False, "Wan": True}
    dtype, d, rows, keys = calls["Qwen-Image joint"]
    assert t.pays("int8", d, dtype, rows, keys, kind="key")
    # past whole tiles: SD3.5's 4,429 tokens (head dim 64) run int8, Qwen-Image's unmasked joint attention at 4,296
    # (head dim 128, where tails are not judged apart) stays on SDPA
    assert t.pays("int8", 64, torch.float16, 2 * 24 * 4429, 4429, kind="tail")
    assert not t.pays("int8", 128, torch.bfloat16, 24 * 4296, 4296, kind="tail")
    # eager calls must also save EAGER_SAVING_MS of GPU time (estimated from below): SD3.5-medium's (0.02 ms at batch
    # 1) and SD3.5 Large's CFG batch (0.08 ms) stay on SDPA there; Qwen-Image's masked joint attention with CFG
    # (0.22 ms) and Wan's run INT8
    eager = dict(min_saving_ms=speed_gate.EAGER_SAVING_MS)
    assert not t.pays("int8", 64, torch.float16, 24 * 4429, 4429, kind="tail", **eager)
    assert not t.pays("int8", 64, torch.bfloat16, 2 * 38 * 4429, 4429, kind="tail", **eager)
    assert t.pays("int8", d, dtype, 2 * rows, keys, kind="key", **eager)
    assert t.pays("int8", 128, torch.bfloat16, 12 * 20280, 20280, **eager)
    assert t.speedup("int8", d, dtype, rows, keys, kind="key") == pytest.approx(1.45, abs=0.01)
    # with another Triton release than the table's 3.6 (BENCHMARKS.md, "The speed gate"): the same calls run INT8,
    # LTX-Video's by a hair, and the crossovers move
    monkeypatch.setattr(speed_gate, "_triton_release", lambda: "3.9.0")
    wide = speed_gate.for_this_triton(t)
    assert wide.margin > t.margin
    assert {name: wide.pays("int8", d_, dt, r, n) for name, (dt, d_, r, n) in calls.items()} == runs_int8
    assert wide.pays("int8", 64, torch.float16, 2 * 24 * 4429, 4429, kind="tail")
    assert not wide.pays("int8", 64, torch.bfloat16, 24 * 6272, 6272)
    assert wide.pays("int8", 64, torch.bfloat16, 24 * 8192, 8192)
    # masked cells beat their unmasked ones nearly everywhere: SDPA slows down under a mask, the kernels do not
    for g in t.grids:
        if g.kind == "key":
            plain = next(p for p in t.grids
                         if (p.mode, p.head_dim, p.dtype, p.kind) == (g.mode, g.head_dim, g.dtype, "plain"))
            pairs = [(a, b) for ra, rb in zip(g.speedup, plain.speedup) for a, b in zip(ra, rb) if a is not None]
            assert sum(a > 1.2 * b for a, b in pairs) >= 0.9 * len(pairs), g


def test_grids_and_measure_refuse_masks_they_cannot_time():
    with pytest.raises(ValueError, match="kind 'keys' is not one of"):
        Grid("int8", 64, "float16", (1024,), (1024,), ((1.0,),), "keys")
    for kinds in ((), ("plain", "plain"), ("plain", "causal")):
        with pytest.raises(ValueError, match="kinds must be some of"):
            speed_gate.measure(torch.device("cpu"), kinds=kinds)
    with pytest.raises(ValueError, match="whole 128-key tiles"):
        speed_gate.measure(torch.device("cpu"), keys=(1000, 2048))
    with pytest.raises(ValueError, match="every key length must exceed it, got 32"):
        speed_gate.measure(torch.device("cpu"), keys=(32, 1024))


def test_eager_calls_run_int8_only_where_they_also_save_gpu_time(monkeypatch, tmp_path):
    # an INT8 call spends more host time than SDPA's, which an eager step that waits on the host pays: on a GPU,
    # outside CUDA graphs and torch.compile, a call must also save eager_saving_ms of GPU time, estimated from below
    # as SDPA's multiply-adds at the fastest rate SDPA reached in the table's measurements (else its architecture's)
    t = CrossoverTable("test GPU", "sm_90", table(head_dim=64).grids, margin=1.05, measured={"sdpa_tflops": 500.0})
    assert t.sdpa_tflops == 500.0
    assert CrossoverTable("test GPU", "sm_90", t.grids).sdpa_tflops == speed_gate.SDPA_TFLOPS["sm_90"]
    assert CrossoverTable("test GPU", "sm_00", t.grids).sdpa_tflops == speed_gate.OTHER_SDPA_TFLOPS
    sdpa_ms = 4 * (1 << 16) * 4096 * 64 / 500e9  # 0.137 ms at 500 TFLOPS
    assert t.saved_ms(1.4, 64, 1 << 16, 4096) == pytest.approx(sdpa_ms * (1 - 1 / 1.4))  # 0.039 ms
    assert t.pays("int8", 64, torch.float16, 1 << 16, 4096)
    assert not t.pays("int8", 64, torch.float16, 1 << 16, 4096, min_saving_ms=0.05)
    assert t.pays("int8", 64, torch.float16, 1 << 20, 4096, min_saving_ms=0.05)  # 16 times the rows: 0.63 ms
    assert not t.pays("int8", 64, torch.float16, 1 << 20, 64, min_saving_ms=0.05)  # no speed-up, no saving

    gate = SpeedGate(t)
    assert gate.eager_saving_ms == speed_gate.EAGER_SAVING_MS == 0.1
    q = torch.zeros(1, 16, 4096, 64, dtype=torch.float16)  # 65,536 rows: 1.4x, saves 0.039 ms
    big = q.expand(16, -1, -1, -1)  # 1,048,576 rows
    assert gate.pays(Mode.INT8, q, q)  # CPU tensors: not an eager GPU call
    monkeypatch.setattr(speed_gate, "eager_call", lambda x: True)
    assert not gate.pays(Mode.INT8, q, q) and gate.pays(Mode.INT8, big, big)
    assert SpeedGate(t, eager_saving_ms=0).pays(Mode.INT8, q, q)
    monkeypatch.setattr(speed_gate, "eager_call", lambda x: False)  # captured into a CUDA graph: decided apart
    assert gate.pays(Mode.INT8, q, q)
    for bad in (-0.1, float("nan"), "0.05", None):
        with pytest.raises(ValueError, match="eager_saving_ms must be a finite number >= 0"):
            SpeedGate(t, eager_saving_ms=bad)
    # the rate travels with the table's file, and a bad one names the problem
    t.save(tmp_path / "t.json")
    assert CrossoverTable.load(tmp_path / "t.json").sdpa_tflops == 500.0
    data = json.loads((tmp_path / "t.json").read_text())
    data["measured"]["sdpa_tflops"] = -3
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"measured.sdpa_tflops must be a finite positive number \(TFLOPS\), got -3"):
        CrossoverTable.load(tmp_path / "bad.json")
    for bad in (0, -1.0, "600", float("inf")):  # made in code, as from a file
        with pytest.raises(ValueError, match="measured.sdpa_tflops must be a finite positive number"):
            CrossoverTable("test GPU", "sm_90", t.grids, measured={"sdpa_tflops": bad})
    assert SpeedGate(t, eager_saving_ms=np.float32(0.2)).eager_saving_ms == pytest.approx(0.2)


def test_calls_learnt_as_gated_in_eager_mode_run_int8_when_captured(monkeypatch):
    # the tiny DiT's calls save microseconds: in eager mode they are gated and then go straight to the stock
    # processor; the same inputs in a CUDA graph's capture are decided apart and run INT8
    from diffusion_int8.plugin import processor

    model, x = build("dit")
    with torch.no_grad():
        stock = model(**x, return_dict=False)[0]
    gate = SpeedGate(table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((1.5,) * 2,) * 2, head_dim=32))
    handle = enable(model, "int8", speed_gate=gate)
    for eager in (True, True, False):  # twice eager (the second from what the first learnt), then captured
        monkeypatch.setattr(speed_gate, "eager_call", lambda t, eager=eager: eager)
        monkeypatch.setattr(processor, "eager_call", lambda t, eager=eager: eager)
        before = handle.state.int8_calls, handle.state.gated_calls
        with torch.no_grad():
            out = model(**x, return_dict=False)[0]
        ran = handle.state.int8_calls - before[0], handle.state.gated_calls - before[1]
        assert ran == ((0, 2) if eager else (2, 0)) and torch.equal(out, stock) == eager, eager
    handle.disable()


def _settle_spy(monkeypatch):
    """Every call eager (as on a GPU outside capture) and the INT8 runs of the processor recorded."""
    from diffusion_int8.plugin import processor

    monkeypatch.setattr(speed_gate, "eager_call", lambda t: True)
    monkeypatch.setattr(processor, "eager_call", lambda t: True)
    runs = []
    core = processor.int8_core
    monkeypatch.setattr(processor, "int8_core", lambda *a, **kw: runs.append(kw) or core(*a, **kw))
    return runs


def _attention(gate, **options):
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    from diffusion_int8 import Int8DiffusionProcessor

    attn = Attention(query_dim=64, heads=2, dim_head=32).eval()
    proc = Int8DiffusionProcessor("int8", inner=AttnProcessor2_0(), speed_gate=gate, **options)
    attn.set_processor(proc)
    return attn, proc


def test_an_eager_call_kept_on_sdpa_settles_what_its_captured_run_needs(monkeypatch):
    # the eager rule keeps the call on SDPA, and a CUDA graph captured after it runs the call INT8, where its first
    # INT8 run (compiling the kernels, recording the launch plan, making the rotation's matrix) cannot happen: the
    # eager call decides the module's Q·Kᵀ balance, runs the INT8 call once, its result unused, and returns SDPA's
    from diffusers.models.attention_processor import AttnProcessor2_0

    runs = _settle_spy(monkeypatch)
    gate = SpeedGate(table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((1.5,) * 2,) * 2, head_dim=32))
    with warnings.catch_warnings():  # the rotation's cost, said once a process
        warnings.simplefilter("ignore")
        attn, proc = _attention(gate, qk_rotate=True)
    x = torch.randn(1, 1024, 64)  # 1,024 queries: enough for the balance to apply
    with torch.no_grad():
        out, stock = attn(x), AttnProcessor2_0()(attn, x)
        assert (proc.state.int8_calls, proc.state.gated_calls) == (0, 1) and torch.equal(out, stock)
        assert proc.balance.measured is not None and len(runs) == 1 and runs[0]["qk_rotate"] is True
        attn(x), attn(x)  # its shape settled once: nothing run again
    assert len(runs) == 1 and proc.state.gated_calls == 3


def test_a_call_torch_compile_traces_is_not_eager_and_asks_nothing_of_cuda(monkeypatch):
    # dynamo breaks the graph at torch.backends.cuda.is_built and torch.cuda.is_current_stream_capturing (a compiled
    # SD3.5-medium step broke at every gated call and ran 0.75x stock): under torch.compile a call is not eager,
    # decided before either is asked
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: asked.append("built") or True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append("capturing") or False)
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    assert speed_gate.eager_call(on_gpu) and asked == ["built", "capturing"]
    asked.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not speed_gate.eager_call(on_gpu) and asked == []


def test_a_call_gated_in_graphs_too_runs_no_int8_ahead_of_capture(monkeypatch):
    # SDXL-like: the table keeps the call on SDPA whether eager or captured, so nothing is run ahead of a capture
    runs = _settle_spy(monkeypatch)
    attn, proc = _attention(SpeedGate(table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((0.8,) * 2,) * 2,
                                             head_dim=32)))
    with torch.no_grad():
        attn(torch.randn(1, 1024, 64))
    assert runs == [] and proc.state.gated_calls == 1 and proc.balance.measured is None  # nor the balance decided


def test_a_call_the_balance_gates_when_eager_is_settled_for_its_captured_run(monkeypatch):
    # the call pays eagerly without the Q·Kᵀ balance and not with it (the balance's cost takes its saving under the
    # eager minimum), while a captured call pays with it: the eager call runs SDPA and the INT8 call once, balanced
    runs = _settle_spy(monkeypatch)
    t = table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((1.5,) * 2,) * 2, head_dim=32)
    rows, sk = 2 * 1024, 1024
    plain, balanced = (t.saved_ms(t.speedup("int8", 32, torch.float32, rows, sk, b), 32, rows, sk) for b in (False, True))
    assert 0 < balanced < plain and t.pays("int8", 32, torch.float32, rows, sk, balance=True)
    attn, proc = _attention(SpeedGate(t, eager_saving_ms=(plain + balanced) / 2), qk_balance=True)
    x = torch.randn(1, sk, 64)
    with torch.no_grad():
        out = attn(x)
    assert (proc.state.int8_calls, proc.state.gated_calls) == (0, 1)
    assert len(runs) == 1 and runs[0]["qk_balance"] is True
    from diffusers.models.attention_processor import AttnProcessor2_0

    assert torch.equal(out, AttnProcessor2_0()(attn, x))


def test_the_int8_run_ahead_of_capture_is_made_once_per_shape_for_a_handles_modules(monkeypatch):
    # the compiled kernels and launch plans are the process's: two modules of one handle with the same call run it
    # once (each decides its own balance); a pickled state forgets it; a failing run is said and changes nothing
    import pickle

    runs = _settle_spy(monkeypatch)
    gate = SpeedGate(table(keys=(8, 1 << 16), rows=(8, 1 << 20), speedup=((1.5,) * 2,) * 2, head_dim=32))
    first, p1 = _attention(gate)
    second, p2 = _attention(gate, state=p1.state)
    x = torch.randn(1, 1024, 64)
    with torch.no_grad():
        first(x), second(x), first(x)
    assert len(runs) == 1 and p1.state.gated_calls == 3
    assert p1.balance.measured is not None and p2.balance.measured is not None
    assert pickle.loads(pickle.dumps(p1.state)).settled == set()
    from diffusion_int8.plugin import processor

    monkeypatch.setattr(processor, "int8_core", lambda *a, **kw: 1 / 0)
    third, p3 = _attention(gate)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="run ahead of CUDA-graph capture .*ZeroDivisionError"):
        out = third(x)
    assert p3.state.gated_calls == 1 and torch.isfinite(out).all()
