"""The speed gate: crossover-table files, the decisions they give, and the processor obeying them (on CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_int8 import enable
from diffusion_int8.kernels import Mode
from diffusion_int8.speed_gate import SHIPPED, CrossoverTable, Grid, SpeedGate
from tiny_models import build


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


def table(keys=(64, 4096), rows=(32, 1 << 16), speedup=((0.5, 0.9), (0.8, 1.4)), head_dim=16, dtype="float32"):
    grids = tuple(Grid(m, head_dim, d, keys, rows, speedup) for m in ("int8", "int8_fp16v") for d in ("float16", "bfloat16"))
    return CrossoverTable("test GPU", "sm_00", grids, margin=1.05)


def test_decisions_follow_the_cell_at_or_below_the_shape():
    t = table(head_dim=64)
    # (rows, keys) -> the cell at or below: (keys 4096, rows 65536) is the only one past the margin
    assert t.pays("int8", 64, torch.float16, rows=1 << 16, sk=4096)
    assert t.pays("int8", 64, torch.bfloat16, rows=1 << 20, sk=50_000)  # past the grid: its last cell
    assert not t.pays("int8", 64, torch.float16, rows=(1 << 16) - 1, sk=4096)  # judged by the smaller rows cell
    assert not t.pays("int8", 64, torch.float16, rows=1 << 16, sk=4095)
    assert not t.pays("int8", 64, torch.float16, rows=31, sk=10_000)  # below the grid: SDPA
    assert t.speedup("int8_fp16v", 40, torch.float16, 1 << 16, 4096) == 1.4  # head dim 40 pads to 64's grid
    assert t.speedup("int8", 128, torch.float16, 1 << 16, 4096) is None  # no grid at padded width 128


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
    }
    for what, text in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)):
            CrossoverTable.load(path)


def test_shipped_tables_load():
    files = sorted(SHIPPED.glob("*.json"))
    assert files, "a crossover table ships for sm_90"
    for f in files:
        t = CrossoverTable.load(f)
        assert t.arch == f.stem and t.grids


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


def test_gate_without_table_on_cpu_does_not_gate():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    assert SpeedGate().pays(Mode.INT8, q, q)
    with pytest.raises(TypeError, match="speed_gate"):
        enable(build("dit")[0], "int8", speed_gate=3)


def test_unmeasured_cells_take_the_nearest_measured_cell_below():
    # cells too large to measure are null; a shape there is judged by a measured cell below, not sent to SDPA
    t = table(keys=(1024, 32768), rows=(32, 1 << 20), speedup=((0.5, 0.9), (1.2, None)), head_dim=128)
    assert t.speedup("int8", 128, torch.float16, rows=1 << 21, sk=75_600) == 1.2
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
