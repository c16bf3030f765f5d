"""diffusers' RMSNorm in one launch (``kernels.rmsnorm``) and its use for the query/key norms of routed processors
(``plugin.norms``)."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch
from diffusers.models.normalization import RMSNorm
from zoo import CASES as ZOO
from zoo import build as build_case
from zoo import run as run_case
from zoo.registry import UNROUTABLE, to_device

import diffusion_int8
from diffusion_int8.kernels import rmsnorm
from diffusion_int8.kernels.rmsnorm import HALVES, ORDERS, PAIRS, STRIDED, VECTORIZED
from diffusion_int8.plugin import checked as twin_checks
from diffusion_int8.plugin import norms, processor
from diffusion_int8.plugin.models import attention_modules

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _no_checks_kept(monkeypatch):
    # what the process learnt: each test probes and checks anew
    monkeypatch.setattr(twin_checks, "MATCHED", {})
    monkeypatch.setattr(norms, "_ORDER", {})


def inputs(device, dtype, D, rows=(3, 37, 4), seed=0):
    """Rows of D channels as Q or K comes out of a projection: a mean per channel, one outlier channel, rows of
    very different scales (a sink token's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, D, generator=g) + torch.randn(D, generator=g)
    x[..., 3 % D] *= 30
    x[:, 0] *= 50
    return x.to(dtype).to(device)


def stock(x, weight, eps=1e-6):
    m = RMSNorm(x.shape[-1], eps, elementwise_affine=weight is not None).to(x.device)
    if weight is not None:
        m.weight.data = weight
    return m(x)


def emulated(x, weight, eps, order, tree):
    """What the kernel computes, in PyTorch on the CPU: the squares summed in ``order`` and ``tree`` (the kernel
    module's docstring), the reciprocal square root as Triton's interpreter takes it (1 / sqrt in float32)."""
    D = x.shape[-1]
    f = x.reshape(-1, D).float().cpu()
    R = f.shape[0]
    if order == STRIDED:
        s = torch.zeros(R, 32)
        for i in range(-(-D // 32)):
            cols = torch.arange(32) + 32 * i
            s = s + torch.where(cols < D, f[:, cols.clamp(max=D - 1)], 0).square()
    else:
        acc = torch.zeros(R, 128)
        for k in range(D // 128):
            acc = acc + f[:, 128 * k:128 * (k + 1)].square()
        q = acc.view(R, 32, 4)
        s = ((q[..., 0] + q[..., 1]) + q[..., 2]) + q[..., 3]
    while s.shape[1] > 1:  # the warp's shuffle-down tree
        n = s.shape[1] // 2
        s = s[:, :n] + s[:, n:] if tree == HALVES else s[:, 0::2] + s[:, 1::2]
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    mean = s * f32(f32(R) / f32(R * D)) + torch.tensor(eps, dtype=torch.float32)
    y = f * torch.from_numpy(1 / np.sqrt(mean.numpy()))
    y = y.to(x.dtype) if weight is None else y.to(weight.dtype) * weight.cpu()
    return y.reshape(x.shape)


CASES = [(STRIDED, 128), (STRIDED, 64), (STRIDED, 72), (VECTORIZED, 128), (VECTORIZED, 384)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's arithmetic (the GPU's is checked against "
                                                      "stock instead)")
@pytest.mark.parametrize("order, D", CASES)
@pytest.mark.parametrize("tree", [HALVES, PAIRS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", [None, "same", torch.float32])
def test_rms_norm_sums_in_the_order_it_documents(order, D, tree, dtype, weight):
    x = inputs("cpu", dtype, D)
    w = None if weight is None else (torch.rand(D) + 0.5).to(dtype if weight == "same" else weight)
    got = rmsnorm.rms_norm(x, w, 1e-6, order, tree)
    want = emulated(x, w, 1e-6, order, tree)
    assert got.dtype == want.dtype == stock(x, w).dtype and torch.equal(got, want)
    # and the stock module's result up to the float32 sums' order (the CPU's differs from the GPU's)
    torch.testing.assert_close(got, stock(x, w), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("weight", [None, torch.bfloat16])
def test_a_signature_seen_before_replays_its_launch(kdev, weight):
    """The first call of a signature (shapes, strides, dtypes, alignment, eps, order) records its launch and later ones
    replay it with their own tensors' pointers (``launch.Plan``): each of three inputs held at once (no two at one
    address) gives what a first call of it gives."""
    from diffusion_int8.kernels import cache
    from diffusion_int8.kernels.launch import Plan

    cache.clear()
    xs = [inputs(kdev, torch.bfloat16, 128, seed=seed) for seed in range(3)]
    w = None if weight is None else (torch.rand(128) + 0.5).to(weight).to(kdev)
    outs = [rmsnorm.rms_norm(x, w, 1e-6, VECTORIZED) for x in xs]
    plans = [plan for key, plan in cache.ENTRIES.items() if key[0] == "rmsnorm"]
    assert len(plans) == 1 and isinstance(plans[0], Plan)
    for out, x in zip(outs, xs):
        cache.clear()
        assert torch.equal(out, rmsnorm.rms_norm(x, w, 1e-6, VECTORIZED))
    assert not torch.equal(outs[1], outs[2])
    # another eps: a signature of its own (the eps is a launch argument the plan keeps)
    cache.clear()
    first = rmsnorm.rms_norm(xs[0], w, 1e-6, VECTORIZED)
    other = rmsnorm.rms_norm(xs[0], w, 0.5, VECTORIZED)
    assert sum(key[0] == "rmsnorm" for key in cache.ENTRIES) == 2 and not torch.equal(first, other)
    cache.clear()
    assert torch.equal(other, rmsnorm.rms_norm(xs[0], w, 0.5, VECTORIZED))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's arithmetic")
@pytest.mark.parametrize("layout", ["17 rows", "transposed"])
def test_rms_norm_at_few_rows_and_transposed_rows(layout):
    """17 rows (the fewest it takes are 16); Q as SD3 normalizes it, (B, H, S, D) viewed from (B, S, H·D): the rows
    are read and written where they lie, and the result is laid out as stock's."""
    x = inputs("cpu", torch.float16, 72, rows=(17,)) if layout == "17 rows" else \
        inputs("cpu", torch.float16, 64, rows=(2, 37, 3)).transpose(1, 2)
    w = torch.rand(x.shape[-1]).half() + 0.5
    got = rmsnorm.rms_norm(x, w, 1e-6, STRIDED, HALVES)
    want = stock(x, w)
    assert got.stride() == want.stride() and torch.equal(got, emulated(x.contiguous(), w, 1e-6, STRIDED, HALVES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D", [32, 64, 72, 96, 128, 256, 1536, 3072])
def test_the_probe_finds_the_order_that_gives_the_stock_module_bit_for_bit(D):
    """The claim the plugin relies on: on this PyTorch's CUDA reduction exactly one order and tree reproduces the stock
    module on the float32 probe, and that one reproduces it at every dtype, weight and layout, every element written
    (the freed block the output is likely to reuse holds NaNs first)."""
    order = norms.probed_order(D, torch.device("cuda"))
    assert order is not None, f"no single order gives the stock bits at D={D}"
    with torch.no_grad():
        for dtype in DTYPES:
            for weight in (None, dtype, torch.float32):
                x = inputs("cuda", dtype, D, rows=(2, 300, 3), seed=D)
                w = None if weight is None else (torch.rand(D) + 0.5).to("cuda", weight)
                for layout in (x, x.transpose(1, 2)):
                    want = stock(layout, w)
                    torch.full_like(want, float("nan"))  # freed at once
                    got = rmsnorm.rms_norm(layout, w, 1e-6, *order)
                    assert got.stride() == want.stride() and torch.equal(got, want), (dtype, weight)


def test_rms_norm_refuses_what_it_does_not_take(kdev):
    x = inputs(kdev, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="order must be"):
        rmsnorm.rms_norm(x, None, 1e-6, 2)
    with pytest.raises(ValueError, match="tree must be"):
        rmsnorm.rms_norm(x, None, 1e-6, STRIDED, 2)
    for bad, order, why in [(x[..., :16].contiguous(), STRIDED, "last dim \\(16\\)"),
                            (inputs(kdev, torch.bfloat16, 200), VECTORIZED, "last dim \\(200\\)"),
                            (x[0, :3], STRIDED, "fewer than 16 rows"),
                            (x[:, ::2], STRIDED, "rows tile one block"), (x.int(), STRIDED, "float16, bfloat16"),
                            (x.detach().requires_grad_(True), STRIDED, "no backward")]:
        assert rmsnorm.rms_norm_refusal(bad, None, order) is not None
        with pytest.raises(ValueError, match=f"rms_norm does not run these inputs: .*{why}"):
            rmsnorm.rms_norm(bad, None, 1e-6, order)
    for w in (torch.ones(64, device=kdev), torch.ones(256, device=kdev)[::2]):  # another size; strided
        with pytest.raises(ValueError, match="the weight must be a contiguous \\(128,\\)"):
            rmsnorm.rms_norm(x, w, 1e-6)
    # the orders' refusals differ in the head dims they cover alone (CheckedRMSNorm asks one of them): at D = 128,
    # which both cover, every input gets the same answer from both
    for bad in (x, x[0, :3], x[:, ::2], x.int(), x.detach().requires_grad_(True), x.double()):
        for w in (None, torch.ones(128, device=kdev), torch.ones(64, device=kdev)):
            assert rmsnorm.rms_norm_refusal(bad, w, STRIDED) == rmsnorm.rms_norm_refusal(bad, w, VECTORIZED)


def stock_equal(calls):
    """A twin that gives the stock module's result (whatever the order): the plugin's paths run as they would where the
    kernel matches, here on the CPU too."""
    def twin(x, weight, eps, order, tree):
        calls.append((order, tree))
        return stock(x, weight, eps)
    return twin


def test_the_probe_keeps_the_one_order_that_matches_and_nothing_when_not_one(monkeypatch):
    cpu = torch.device("cpu")
    # a PyTorch whose sums are ORDERS[1]'s: found, once
    probes = []
    monkeypatch.setattr(norms, "stock_probe", lambda p: probes.append(p) or emulated(p, None, 1e-6, *ORDERS[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norms.probed_order(128, cpu) == ORDERS[1] and norms.probed_order(128, cpu) == ORDERS[1]
    assert len(probes) == 1 and probes[0].dtype == torch.float32 and probes[0].shape == (norms._PROBE_ROWS, 128)
    assert probes[0].abs().max() / probes[0].abs().min() > 1e6  # widely spread values: an order shows in float32
    # none that matches, and several that do: nothing, with one warning
    monkeypatch.setattr(norms, "stock_probe", lambda p: emulated(p, None, 1e-6, *ORDERS[0]) * 2)
    with pytest.warns(RuntimeWarning, match="0 reduction orders .* D=64"):
        assert norms.probed_order(64, cpu) is None
    calls = []
    monkeypatch.setattr(norms, "rms_norm_unchecked", stock_equal(calls))
    monkeypatch.setattr(norms, "stock_probe", lambda p: stock(p, None))
    with pytest.warns(RuntimeWarning, match="2 reduction orders .* D=256"):
        assert norms.probed_order(256, cpu) is None
    assert len(calls) == 2  # at D=256 the strided order does not run: the vectorized one with each tree
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norms.probed_order(256, cpu) is None and norms.probed_order(64, cpu) is None  # asked once


@torch.no_grad()
def test_checked_norm_runs_the_twin_once_it_matched_and_the_module_otherwise(monkeypatch):
    m = RMSNorm(128, 1e-6).to(torch.bfloat16)
    x = inputs("cpu", torch.bfloat16, 128)
    fast = norms.CheckedRMSNorm(m)
    want = m(x)
    monkeypatch.setattr(norms, "probed_order", lambda d, device: ORDERS[1])
    # a twin that gives the stock bits: checked once, then run alone
    calls = []
    monkeypatch.setattr(norms, "rms_norm_unchecked", stock_equal(calls))
    assert torch.equal(fast(x), want) and calls == [ORDERS[1]]
    assert torch.equal(fast(x), want) and calls == [ORDERS[1]] * 2 and list(twin_checks.MATCHED.values()) == [0]
    # one off by a bit on the real call: one warning, the module from then on
    monkeypatch.setattr(twin_checks, "MATCHED", {})
    calls.clear()
    monkeypatch.setattr(norms, "rms_norm_unchecked", lambda x_, w, eps, *order: calls.append(order) or
                        stock(x_, w, eps).view(torch.int16).add(1).view(torch.bfloat16))
    with pytest.warns(RuntimeWarning, match=r"RMSNorm \(query/key norm\) did not reproduce it \(torch.bfloat16 input"):
        assert torch.equal(fast(x), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fast(x), want)
    assert calls == [ORDERS[1]] and list(twin_checks.MATCHED.values()) == [None]
    # no order found for the head dim: the module, and no twin
    monkeypatch.setattr(twin_checks, "MATCHED", {})
    monkeypatch.setattr(norms, "probed_order", lambda d, device: None)
    calls.clear()
    assert torch.equal(fast(x), want) and calls == [] and twin_checks.MATCHED == {}


def test_checked_norm_leaves_what_it_does_not_cover_to_the_module(monkeypatch):
    calls = []
    monkeypatch.setattr(norms, "rms_norm_unchecked", stock_equal(calls))
    monkeypatch.setattr(norms, "probed_order", lambda d, device: (STRIDED, HALVES))
    x = inputs("cpu", torch.float16, 64)
    with_bias = RMSNorm(64, 1e-6, bias=True).half()
    hooked = RMSNorm(64, 1e-6).half()
    hooked.register_forward_hook(lambda mod, args, out: out * 2)
    pre_hooked = RMSNorm(64, 1e-6).half()
    pre_hooked.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    own_forward = RMSNorm(64, 1e-6).half()
    own_forward.forward = lambda h: h + 1  # as diffusers' and accelerate's hooks wrap a module's forward
    small = RMSNorm(16, 1e-6).half()
    with torch.no_grad():
        for m, arg in [(with_bias, x), (hooked, x), (pre_hooked, x), (own_forward, x),
                       (small, inputs("cpu", torch.float16, 16)), (RMSNorm(64, 1e-6).half(), x[..., ::2, :])]:
            assert torch.equal(norms.CheckedRMSNorm(m)(arg), m(arg))
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: out)
        try:
            assert torch.equal(norms.CheckedRMSNorm(RMSNorm(64, 1e-6).half())(x), RMSNorm(64, 1e-6).half()(x))
        finally:
            handle.remove()
    plain = RMSNorm(64, 1e-6).half()
    assert torch.equal(norms.CheckedRMSNorm(plain)(x), plain(x))  # gradients to keep (a Parameter weight): the module
    assert calls == [] and twin_checks.MATCHED == {}
    assert norms.CheckedRMSNorm(hooked).eps == 1e-6  # other attributes are the module's
    with torch.no_grad():
        norms.CheckedRMSNorm(plain)(x)
    assert calls  # the same input to a plain module without gradients: the twin runs


def test_the_view_reads_and_writes_the_module(monkeypatch):
    from diffusers.models.attention_processor import Attention

    cpu = torch.device("cpu")
    monkeypatch.setattr(norms, "triton_unavailable", lambda device: None)  # as where the kernels run
    attn = Attention(64, heads=2, dim_head=32, qk_norm="rms_norm", added_kv_proj_dim=16, context_pre_only=False)
    view = norms.with_fast_norms(attn, cpu)
    assert isinstance(view, norms.FastNorms)
    for name in norms.NORMS:
        stand_in = getattr(view, name)
        assert isinstance(stand_in, norms.CheckedRMSNorm) and stand_in.module is getattr(attn, name)
    assert view.to_q is attn.to_q and view.heads == attn.heads and view.prepare_attention_mask.__self__ is attn
    view.some_state = 3  # what a processor stores on its module goes to the module
    assert attn.some_state == 3
    with pytest.raises(AttributeError):
        view.no_such_attribute
    across = Attention(64, heads=2, kv_heads=2, dim_head=32, qk_norm="rms_norm_across_heads")  # diffusers' RMSNorm too
    assert isinstance(norms.with_fast_norms(across, cpu).norm_k, norms.CheckedRMSNorm)
    # LayerNorm, torch.nn.RMSNorm (one fused PyTorch kernel already) and no norm: the module itself
    for plain in (Attention(64, heads=2, dim_head=32, qk_norm="layer_norm"), Attention(64, heads=2, dim_head=32)):
        assert norms.with_fast_norms(plain, cpu) is plain
    torch_norms = Attention(64, heads=2, dim_head=32)
    torch_norms.norm_q = torch.nn.RMSNorm(32)
    assert norms.with_fast_norms(torch_norms, cpu) is torch_norms
    # where the kernels do not run on the call's device (no GPU, the emulation backend): no view, whose norms would
    # only check and go to the module
    monkeypatch.setattr(norms, "triton_unavailable", lambda device: "no Triton here")
    assert norms.with_fast_norms(attn, cpu) is attn


def test_hunyuanvideo_runs_its_norms_in_one_launch_and_computes_what_it_did(kdev, monkeypatch):
    """The tiny HunyuanVideo, INT8 on the Triton backend, every call's norms through the view: the same output, bit for
    bit, as routed copies handed the module itself, with the twin running in the second forward. On the GPU the twin is
    the kernel; on the CPU, whose sums are in another order, a stand-in for it that gives the stock result."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = build_case("HunyuanVideoTransformer3DModel")
    dtype = torch.bfloat16 if kdev == "cuda" else torch.float32
    model = model.to(kdev, dtype)
    x = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
         for k, v in to_device(x, kdev).items()}
    calls = []
    if kdev == "cpu":
        monkeypatch.setattr(norms, "probed_order", lambda d, device: (STRIDED, HALVES))
        monkeypatch.setattr(norms, "rms_norm_unchecked", stock_equal(calls))
    else:
        real = norms.rms_norm_unchecked
        monkeypatch.setattr(norms, "rms_norm_unchecked", lambda *a: calls.append(a[3:]) or real(*a))
    outs = {}
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(processor, "with_fast_norms", lambda attn, device: attn)
        handle = diffusion_int8.enable(model, "int8", speed_gate=False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no order left unfound, no twin that differs
            outs[fast] = [model(**x, return_dict=False)[0] for _ in range(2)]
        assert handle.state.int8_calls > 0
        handle.disable()
        if fast:
            first = len(calls)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert twin_checks.MATCHED and all(v == 0 for v in twin_checks.MATCHED.values())
    # the twin ran with the view and never without it
    assert first > 0 and len(calls) == first


@pytest.mark.parametrize("gated", [False, True], ids=["routed", "gated"])
@pytest.mark.parametrize("name", sorted(set(ZOO) - set(UNROUTABLE)))
def test_every_zoo_model_computes_what_it_did_through_the_view(name, gated, monkeypatch):
    """Every zoo model whose attention modules have a diffusers-``RMSNorm`` query/key norm, INT8 on the emulation
    backend with every call handed the view and every such norm taking the twin's path (a stand-in twin that gives
    the stock result, as the kernel does where its order matched): the same output, bit for bit, as calls handed the
    module itself. Routed: every call runs the processor's routed copy. Gated: the speed gate sends every call to
    SDPA, so from the third forward on each module's calls go straight to its stock processor, which the view then
    reaches (and nothing else runs the routed copy in that forward, so the twin's calls are the stock path's). What
    this holds is the view: a processor that reads or writes its module in a way the view does not
    pass on would differ or fail here."""
    from test_zoo import NO_TABLE

    from diffusion_int8.plugin.speed_gate import SpeedGate

    model, x = build_case(name)
    monkeypatch.setattr(norms, "triton_unavailable", lambda device: None)  # the view as where the kernels run
    if all(norms.with_fast_norms(m, torch.device("cpu")) is m for m in attention_modules(model).values()):
        pytest.skip("no diffusers RMSNorm among its attention modules' query/key norms")
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    monkeypatch.setattr(norms, "probed_order", lambda d, device: (STRIDED, HALVES))
    monkeypatch.setattr(norms, "rms_norm_refusal", lambda *a: None)
    monkeypatch.setattr(norms, "covers", lambda order, d: True)  # the zoo's tiny head dims too
    calls = []
    monkeypatch.setattr(norms, "rms_norm_unchecked", stock_equal(calls))
    outs, counts = {}, {}
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(processor, "with_fast_norms", lambda attn, device: attn)
        handle = diffusion_int8.enable(model, "int8", speed_gate=SpeedGate(NO_TABLE) if gated else False)
        run_case(model, x)  # a processor type's first call decides its route, with the module itself
        if gated:
            run_case(model, x)  # the routed copy finds every call gated: the next forward goes to the stock processor
        procs = {id(m.processor): m.processor for m in attention_modules(model).values()
                 if isinstance(m.processor, processor.Int8DiffusionProcessor)}.values()
        routed_before = [list(p._outcomes) for p in procs]
        before = len(calls)
        outs[fast] = run_case(model, x)
        if gated and fast and [list(p._outcomes) for p in procs] != routed_before:
            pytest.skip("some calls still take the routed copy (another backend's attention): the stock path's view "
                        "cannot be told apart")
        counts[fast] = (handle.state.int8_calls, handle.state.gated_calls, len(calls) - before)
        handle.disable()
    (int8_calls, gated_calls, through_view), (*_, without_view) = counts[True], counts[False]
    assert (int8_calls == 0 and gated_calls > 0) if gated else int8_calls > 0
    assert through_view > 0 and without_view == 0
    assert len(outs[True]) == len(outs[False]) and all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
