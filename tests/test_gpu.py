"""GPU-only properties: torch.compile, CUDA graphs, and no O(N²) memory."""

from __future__ import annotations

import pytest
import torch

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.layout import padded_len
from diffusion_int8.inputs import realistic_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["int8", "int8_fp16v"])
def test_torch_compile_fullgraph(mode, dynamo_warnings):
    q, k, v = realistic_qkv(2, 8, 1000, 1000, 64, layout="BSHD", device="cuda")

    def block(q, k, v):
        return int8_attention(q * 1.0, k, v, mode=mode, layout="BSHD") + 1.0

    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), atol=0, rtol=0)
    assert not [w for w in dynamo_warnings if "lru_cache" in str(w.message)]  # dynamo traced through a cache


@pytest.mark.parametrize("mode", ["int8", "int8_fp16v"])
def test_cuda_graph_capture_and_replay(mode):
    q, k, v = realistic_qkv(2, 8, 777, 777, 128, device="cuda")
    static = [t.clone() for t in (q, k, v)]
    int8_attention(*static, mode=mode)  # compile kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int8_attention(*static, mode=mode)
    for _ in range(2):
        fresh = realistic_qkv(2, 8, 777, 777, 128, device="cuda")
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.testing.assert_close(out, int8_attention(*fresh, mode=mode), atol=0, rtol=0)


def test_float32_calls_past_fp16s_range_capture_in_a_graph_and_compile(dynamo_warnings):
    """The float32 route's powers of two stay on the device: a CUDA graph captures the call (a host synchronization
    would fail the capture) and replays it on new inputs, some past ±65504 and some not, as eager computes them;
    torch.compile takes it whole."""
    from diffusion_int8.plugin.routing import int8_sdpa

    def draw(big):
        q, k, v = realistic_qkv(1, 4, 700, 700, 64, dtype=torch.float32, device="cuda")
        return (q * 2e4, k / 2e4, v * 3e4) if big else (q, k, v)

    static = [t.clone() for t in draw(True)]
    int8_sdpa("int8", *static)  # compile kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int8_sdpa("int8", *static)
    for big in (True, False):
        fresh = draw(big)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        eager = int8_sdpa("int8", *fresh)
        assert bool(eager.isfinite().all())
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
    compiled = torch.compile(lambda q, k, v: int8_sdpa("int8", q, k, v), fullgraph=True)
    fresh = draw(True)
    torch.testing.assert_close(compiled(*fresh), int8_sdpa("int8", *fresh), atol=0, rtol=0)


def test_memory_is_linear_in_sequence():
    B, H, S, D = 1, 8, 16384, 128
    q, k, v = realistic_qkv(B, H, S, S, D, device="cuda")
    int8_attention(q, k, v, mode="int8")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    int8_attention(q, k, v, mode="int8")
    extra = torch.cuda.max_memory_allocated() - base
    tokens = B * H * padded_len(S)
    budget = 3 * tokens * D + 2 * q.numel() + tokens * 8 + (1 << 20)  # 8-bit Q/K/V, output, scales and stats, slack
    assert extra <= budget, f"{extra / 2**20:.1f} MiB extra; an (S, S) fp32 buffer would be {S * S * 4 / 2**20:.0f} MiB"


@pytest.mark.parametrize("family", ["dit", "flux", "wan"])
def test_processor_on_gpu_and_compiled(family, dynamo_warnings):
    import diffusion_int8
    from tiny_models import build

    model, x = build(family)
    model = model.cuda().half()
    x = {k: (v.cuda().half() if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v.cuda())
         for k, v in x.items()}
    with torch.no_grad():
        stock = model(**x, return_dict=False)[0]
        # forced: at these tiny shapes the speed gate would send every call to SDPA
        handle = diffusion_int8.enable(model, "int8", speed_gate=False)
        eager = model(**x, return_dict=False)[0]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(**x, return_dict=False)[0]
    handle.disable()
    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert 0 < rel(eager, stock) < 0.02, rel(eager, stock)
    # inductor fuses the fp16 ops around the kernel (norms, RoPE) with other roundings, and a flipped
    # INT8 rounding moves single outputs by ~1e-3: compare the compiled model as a whole
    assert rel(compiled, stock) < 0.02 and rel(compiled, eager) < 0.005, (rel(compiled, stock), rel(compiled, eager))
    assert not [w for w in dynamo_warnings if "lru_cache" in str(w.message)]  # dynamo traced through a cache


def test_100k_tokens_against_emulation():
    # 100k+ queries and keys: int64 offsets and the tail tile at a length that is no multiple of a block. The
    # emulation of the first 4,096 query rows and of the last 4,099 (the partial tile among them) against every key
    from diffusion_int8.kernels import reference as R
    from diffusion_int8.kernels.attention import triton_attention
    from diffusion_int8.kernels.config import PV

    S = 100_003
    q, k, v = realistic_qkv(1, 2, S, S, 64, layout="BSHD", device="cuda")
    for pv in (PV.FP8, PV.FP16):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        triton_attention(q, k, v, layout="BSHD", pv=pv, sm_scale=0.125, out=out)
        assert torch.isfinite(out).all()
        for rows in (slice(0, 4096), slice(S - 4099, S)):
            emu = R.emulate_attention(q[:, rows], k, v, layout="BSHD", pv=pv, sm_scale=0.125)
            close = torch.isclose(out[:, rows].float(), emu.float(), atol=2e-3 * emu.abs().max().item(), rtol=2e-3)
            assert (~close).float().mean() < 1e-3, (pv, rows, (~close).sum().item())


@pytest.mark.parametrize("name", ["flux", "wan", "sdxl", "dit", "pixart", "sd35", "cogvideox", "hunyuanvideo", "ltx",
                                  "qwenimage", "lumina2"])
def test_families_at_real_shapes(name):
    """benchmarks/pipeline.py's full-size configs (cut to a few blocks where it says so; padded prompts where the model
    takes a mask): fp16 mode and every call gated reproduce stock bit for bit, and forced INT8 runs the kernels on
    the device (the sm_90 ones at head dim 128) close to stock."""
    import os
    import sys

    import diffusion_int8
    from diffusion_int8.plugin.speed_gate import CrossoverTable, SpeedGate

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from pipeline import cast, models

    with torch.device("cuda"):
        model, x, dtype, _ = models()[name]()
    model, x = model.to(dtype).eval(), cast(x, dtype)

    def run():
        with torch.no_grad():
            return model(**x, return_dict=False)[0]

    stock = run()
    assert torch.equal(run(), stock), "the stock forward is not reproducible"
    for kw in (dict(mode="fp16"), dict(mode="int8", speed_gate=SpeedGate(CrossoverTable("none", "none", ())))):
        handle = diffusion_int8.enable(model, **kw)
        assert torch.equal(run(), stock), kw
        handle.disable()
    handle = diffusion_int8.enable(model, "int8", speed_gate=False)
    out = run()
    handle.disable()
    assert handle.state.int8_calls > 0
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), stock.double().flatten(), dim=0).item()
    assert cos >= 0.99, cos
    assert torch.equal(run(), stock)


def test_tune_measures_a_table_the_gate_reads(tmp_path):
    """``diffusion-int8 tune`` at one head dim and dtype: a table for this GPU's architecture with both INT8 modes'
    grids, unmasked and with a key mask, every measured cell a positive speed-up, which a speed gate loads and decides with (long sequences, where
    BENCHMARKS.md measures INT8 ahead on the H100, pay; the shortest do not)."""
    import subprocess
    import sys

    from diffusion_int8.kernels.config import Mode
    from diffusion_int8.plugin.speed_gate import CrossoverTable, SpeedGate, arch_of

    out = tmp_path / "table.json"
    res = subprocess.run([sys.executable, "-m", "diffusion_int8", "tune", "--out", str(out), "--head-dims", "128",
                          "--dtypes", "float16"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    table = CrossoverTable.load(out)
    assert table.arch == arch_of(torch.device("cuda"))
    assert {(g.mode, g.head_dim, g.dtype, g.kind) for g in table.grids} == {
        (m, 128, "float16", kind) for m in ("int8", "int8_fp16v") for kind in ("plain", "key")}  # tails: head dim 64
    assert all(x is None or x > 0 for g in table.grids for r in g.speedup for x in r)
    # SDPA's fastest rate over the cells, TFLOPS, which bounds eager calls' savings: below a dense 16-bit peak (989
    # on an H100 SXM and an H200) and, on sm_90, above a fifth of it
    assert 0 < table.sdpa_tflops == table.measured["sdpa_tflops"] < 989
    assert table.arch != "sm_90" or table.sdpa_tflops > 200
    gate = SpeedGate(out, eager_saving_ms=0)  # the cells' decisions; eager calls' further condition: the next test
    q = torch.empty(1, 24, 32768, 128, dtype=torch.float16, device="cuda")
    short = torch.empty(1, 24, 1024, 128, dtype=torch.float16, device="cuda")
    assert gate.pays(Mode.INT8, q, q) and not gate.pays(Mode.INT8, short, short)
    assert SpeedGate(out).pays(Mode.INT8, q, q)  # in eager mode too: it saves milliseconds
    # SDPA slows down under a key mask and the kernels do not: at 2K keys only the masked cells pay
    mid = torch.empty(1, 32, 2048, 128, dtype=torch.float16, device="cuda")
    keys = torch.ones(1, 1, 1, 2048, dtype=torch.bool, device="cuda")
    assert gate.pays(Mode.INT8, mid, mid, keys) and not gate.pays(Mode.INT8, mid, mid)
    masked, plain = ({(n, r): x for g in table.grids if (g.mode, g.kind) == ("int8", kind)
                      for n, row in zip(g.keys, g.speedup) for r, x in zip(g.rows, row) if x is not None}
                     for kind in ("key", "plain"))
    assert sum(masked[c] > plain[c] for c in plain) >= 0.9 * len(plain)


@pytest.mark.parametrize("D", [40, 96, 128, 256])
def test_the_default_balances_outlier_channels_on_the_gpu(D):
    # test_processor.py's held-out-style inputs through a module with identity projections, on the kernels:
    # outlier channels Q or K carries alone are found at the first call and balanced by default
    from tiny_models import identity_attention, run_identity

    from diffusion_int8 import Int8DiffusionProcessor
    from diffusion_int8.kernels import reference as R
    from diffusion_int8.compare import cos_l1

    attn = identity_attention(2, D).cuda()
    for n, gain, sink in ((3, 30.0, True), (1, 30.0, False), (3, 20.0, False)):
        q, k, v = realistic_qkv(1, 2, 2048, 2048, D, outliers="separate", n_outliers=n, outlier_gain=gain, sink=sink,
                                device="cuda")
        ref = R.attention_ref(q, k, v)
        for mode, floor in (("int8_fp16v", 0.999), ("int8", 0.998)):
            attn.set_processor(Int8DiffusionProcessor(mode, speed_gate=False))
            cos = cos_l1(run_identity(attn, q, k, v), ref)[0]
            assert attn.processor.balance_status() == "on (outlier channels at the first call)"
            assert cos >= floor, (D, n, gain, sink, mode, cos)


def test_calibrated_ranges_on_the_gpu_equal_those_on_the_cpu():
    # ranges() on a GPU: the CPU's values, in one copy, each a view at a multiple of 16 bytes
    from diffusion_int8.calibration import Calibration, Collector, merge
    from tiny_models import build

    from diffusion_int8 import enable

    model, x = build("dit")
    col = Collector(modes=())
    handle = enable(model, mode="fp16", observer=col)
    for t in (900, 500, 100):
        with torch.no_grad():
            model(**{**x, "timestep": torch.tensor([t, t])})
    handle.disable()
    timesteps, stats = merge([col.record(0)])
    cal = Calibration.from_stats({"model": "tiny", "model_class": type(model).__name__, "num_train_timesteps": 1000},
                                 timesteps, stats)
    layer = next(iter(cal.layers))
    for t in (950.0, 640.0, 30.0):
        for balance in (False, True):
            cpu, gpu = cal.ranges(layer, t, balance=balance), cal.ranges(layer, t, "cuda", balance=balance)
            for a, b in zip(cpu, gpu):
                assert (a is None) == (b is None)
                assert a is None or (b.is_cuda and b.data_ptr() % 16 == 0 and torch.equal(a, b.cpu()))


def test_the_energy_counter_reads_the_work_of_this_gpu():
    # NVML's counter, found by this GPU's UUID, moves over half a second of matmuls, at a power between 10 W and
    # 2 kW (a counter read from the wrong unit or the wrong GPU would fall outside)
    import time

    from diffusion_int8.eval.energy import EnergyCounter

    counter = EnergyCounter.open(torch.device("cuda"))
    assert counter is not None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    j0, t0 = counter.joules(), time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    watts = (counter.joules() - j0) / (time.perf_counter() - t0)
    assert 10 < watts < 2000, watts


def test_eager_calls_that_save_little_stay_on_sdpa_and_captured_ones_run_int8():
    # SD3.5-medium's joint attention at batch 1 (24 heads, 4,429 tokens, head dim 64): where this GPU's table runs it
    # INT8, it saves a few hundredths of a millisecond, less than an eager call's extra host time: SDPA in eager
    # mode, INT8 inside a CUDA graph's capture, each decided apart
    from diffusion_int8.kernels.config import Mode
    from diffusion_int8.plugin.speed_gate import EAGER_SAVING_MS, SpeedGate

    gate = SpeedGate()
    table = gate.table_for(torch.device("cuda"))
    if table is None or not table.pays("int8", 64, torch.float16, 24 * 4429, 4429, kind="tail"):
        pytest.skip("this GPU's table does not run SD3.5's calls INT8")
    assert not table.pays("int8", 64, torch.float16, 24 * 4429, 4429, kind="tail", min_saving_ms=EAGER_SAVING_MS)
    q = torch.empty(1, 24, 4429, 64, dtype=torch.float16, device="cuda")
    assert not gate.pays(Mode.INT8, q, q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gate.pays(Mode.INT8, q, q)
        q.mul(2)  # a graph with one kernel in it
    assert captured and not gate.pays(Mode.INT8, q, q)
    # through the processor: eager calls go to SDPA (the second straight to the stock processor, learnt), and a
    # call captured into a CUDA graph runs INT8 all the same
    from diffusers.models.attention_processor import Attention

    from diffusion_int8 import Int8DiffusionProcessor

    attn = Attention(query_dim=1536, heads=24, dim_head=64).to("cuda", torch.float16).eval()
    proc = Int8DiffusionProcessor("int8")
    attn.set_processor(proc)
    x = torch.randn(1, 4429, 1536, device="cuda", dtype=torch.float16)
    with torch.no_grad():  # the eager calls run the INT8 call once, unused: its kernels compile outside the capture
        eager = attn(x)
        assert torch.equal(attn(x), eager)
        assert (proc.state.int8_calls, proc.state.gated_calls) == (0, 2)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
            out = attn(x)
        graph.replay()
    assert proc.state.int8_calls == 1 and not torch.equal(out, eager)
    assert (out - eager).abs().max() < 0.05 * eager.abs().max()


def test_compiled_calls_follow_the_table_and_trace_whole(dynamo_warnings):
    # torch.compile(fullgraph=True) through the processor: a call the table keeps on SDPA (1,024 tokens) and, where
    # this GPU's table runs it INT8, SD3.5-medium's joint attention (4,429 tokens), which an eager call would keep on
    # SDPA for its host time; neither breaks the graph (the eager checks of the CUDA state would)
    from diffusers.models.attention_processor import Attention

    from diffusion_int8 import Int8DiffusionProcessor
    from diffusion_int8.plugin.speed_gate import SpeedGate

    table = SpeedGate().table_for(torch.device("cuda"))
    attn = Attention(query_dim=1536, heads=24, dim_head=64).to("cuda", torch.float16).eval()
    stock_proc = attn.processor
    with torch.no_grad():
        for tokens in (1024, 4429):
            x = torch.randn(1, tokens, 1536, device="cuda", dtype=torch.float16)
            attn.set_processor(stock_proc)
            torch._dynamo.reset()
            stock = torch.compile(attn, fullgraph=True)(x)
            proc = Int8DiffusionProcessor("int8")
            attn.set_processor(proc)
            attn(x)  # an eager call first, as a pipeline's warm-up: it decides the Q·Kᵀ balance
            torch._dynamo.reset()
            out = torch.compile(attn, fullgraph=True)(x)
            int8 = table is not None and table.pays("int8", 64, torch.float16, 24 * tokens, tokens,
                                                    kind="tail" if tokens % 128 else "plain")
            assert not (int8 and tokens == 1024)  # too short for INT8 on every table
            rel = ((out.float() - stock.float()).norm() / stock.float().norm()).item()
            if int8:
                assert 0 < rel < 0.02, rel
            else:
                assert rel < 1e-3, rel  # SDPA in both graphs


def test_the_speed_section_times_every_call_and_follows_the_gate():
    # the demo's speed section at a few replays: every call timed, each decision the gate's own, and "you get" the
    # INT8 speed-up exactly where the gate runs INT8
    from diffusion_int8.eval.speed import CALLS, measure
    from diffusion_int8.plugin.speed_gate import SpeedGate, kind_of_call

    lines = []
    section = measure(torch.device("cuda"), progress=lines.append, reps=2, rounds=1, steps=False)
    table = SpeedGate().table_for(torch.device("cuda"))
    assert [r["model"] for r in section["calls"]] == [c.model for c in CALLS] and len(lines) == len(CALLS)
    for row, call in zip(section["calls"], CALLS):
        B, H, S, D = call.shape
        assert row["sdpa_ms"] > 0 and row["int8_ms"] > 0 and row["int8_fp16v_ms"] > 0
        kind = kind_of_call(S, S, bool(call.masked_text))  # decided as an eager call: enable()'s default use
        assert row["gate_int8"] == table.pays("int8", D, call.dtype, B * H * S, S, kind=kind,
                                              min_saving_ms=SpeedGate().eager_saving_ms)
        assert row["gate_int8_graphs"] == table.pays("int8", D, call.dtype, B * H * S, S, kind=kind)
        assert row["you_get"] == (row["int8_speedup"] if row["gate_int8"] else 1.0)
    assert section["headline"].startswith("On this GPU INT8 attention pays from")
    # a key mask slows SDPA and not the kernels: INT8 pays from as few tokens with one as without, or fewer
    for other in ("pays_from_masked", "pays_from_tail"):
        for d, m in (section[other] or {}).items():  # None: the table has no cells of that kind
            n = section["pays_from"][d]
            assert n is None or (m is not None and m <= n + 64), (other, d, section[other], n)
