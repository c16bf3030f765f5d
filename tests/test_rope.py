"""diffusers' rotary embeddings in one launch (``kernels.rope``) and their use in routed processors (``plugin.rotary``):
Wan's nested function, ``diffusers.models.embeddings.apply_rotary_emb`` with real tables, LTX-Video's, and complex
tables (Lumina, Qwen-Image, Z-Image)."""

from __future__ import annotations

import functools
import types
import warnings
from unittest import mock

import pytest
import torch
from tiny_models import build
from zoo import build as build_case
from zoo.registry import to_device

import diffusion_int8
from diffusion_int8.kernels import rope
from diffusion_int8.plugin import checked as twin_checks
from diffusion_int8.plugin import rotary, routing


wan_stock = rotary.stock_wan_rotary()  # diffusers' own function, as WanAttnProcessor.__call__ defines it
if wan_stock is None:
    pytest.skip("the installed diffusers' WanAttnProcessor has no nested apply_rotary_emb", allow_module_level=True)


def inputs(device, x_dtype, table_dtype, B=2, S=37, H=3, D=40, seed=0):
    """x as Wan's processor has it, (B, S, H, D) cut from a fused projection (not contiguous), with a few large
    values; tables (1, S, 1, D) whose pairs differ (the stock function's indices then matter)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, S, 3 * H * D, generator=g) * 3
    fused[..., H * D + 5 % (H * D)] *= 40  # one channel of x's slice, large
    x = fused.to(x_dtype).to(device)[..., H * D:2 * H * D].unflatten(2, (H, -1))
    angle = torch.rand(1, S, 1, D, generator=g) * 60
    return x, angle.cos().to(table_dtype).to(device), angle.sin().to(table_dtype).to(device)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", DTYPES)
def test_rotate_pairs_is_wans_rotary_bit_for_bit(kdev, x_dtype, table_dtype):
    x, cos, sin = inputs(kdev, x_dtype, table_dtype)
    out = torch.full_like(x, float("nan"))  # poisoned: an element left unwritten shows
    assert rope.rotate_pairs(x, cos, sin, out=out) is out
    want = wan_stock(x, cos, sin)
    assert not torch.equal(want, x)
    assert torch.equal(out, want)
    got = rope.rotate_pairs(x, cos, sin)  # laid out as the stock result (torch.empty_like)
    assert got.stride() == want.stride() and torch.equal(got, want)


@pytest.mark.parametrize("shape", [(1, 300, 12, 128), (3, 5, 1, 2), (1, 129, 2, 64)])
def test_rotate_pairs_at_other_shapes(kdev, shape):
    B, S, H, D = shape
    x, cos, sin = inputs(kdev, torch.bfloat16, torch.float32, B, S, H, D, seed=1)
    x = x.contiguous()
    out = torch.full_like(x, float("nan"))
    assert torch.equal(rope.rotate_pairs(x, cos[0], sin[0], out=out), wan_stock(x, cos, sin))


def test_rotate_pairs_refuses_what_it_does_not_take(kdev, monkeypatch):
    x, cos, sin = inputs(kdev, torch.float16, torch.float32)
    for bad in [(x[..., :-1], cos[..., :-1], sin[..., :-1]),  # odd head dim
                (x, cos[..., :8], sin[..., :8]),  # tables of another head dim
                (x, cos[:, :5], sin[:, :5]),  # tables that do not broadcast
                (x.int(), cos, sin), (x, cos, sin.half()),
                (x.detach().requires_grad_(True), cos, sin)]:
        assert not rope.rotate_pairs_takes(*bad)
        with pytest.raises(ValueError, match="rotate_pairs does not run these inputs: "):
            rope.rotate_pairs(*bad)
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")  # the setting that keeps every kernel off
    with pytest.raises(ValueError, match="DIFFUSION_INT8_BACKEND=emulation"):
        rope.rotate_pairs(x, cos, sin)
    monkeypatch.delenv("DIFFUSION_INT8_BACKEND")
    with pytest.raises(ValueError, match="out must be"):
        rope.rotate_pairs(x, cos, sin, out=torch.empty_like(x, dtype=torch.float32))


@pytest.fixture(autouse=True)
def _no_checks_kept(monkeypatch):
    monkeypatch.setattr(twin_checks, "MATCHED", {})  # what the process learnt: each test checks anew


def wan_copy():
    """WanAttnProcessor.__call__'s code through ``with_fast_rotary``: (its one stand-in's CheckedRotary)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    fn = WanAttnProcessor.__call__
    code, names = rotary.with_fast_rotary(fn.__code__, fn.__globals__)
    assert code is not fn.__code__ and len(names) == 1
    stock, = (c for c in fn.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb")
    stand_in, = (c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb")
    assert stand_in.co_firstlineno == stock.co_firstlineno  # tracebacks and qualified names read as the stock ones
    assert getattr(stand_in, "co_qualname", None) == getattr(stock, "co_qualname", None)
    return next(iter(names.values()))


def counted(monkeypatch):
    calls = []
    real = rope.rotate_pairs_unchecked
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", lambda *a: calls.append(a[0].dtype) or real(*a))
    return calls


def test_wans_rotary_runs_in_one_launch_after_one_check_per_dtypes(kdev, monkeypatch):
    checked = wan_copy()
    calls = counted(monkeypatch)
    x, cos, sin = inputs(kdev, torch.bfloat16, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [checked(x, cos, sin) for _ in range(3)]
        assert calls == [torch.bfloat16] * 3  # the check on the first call, then each call
        assert all(torch.equal(o, wan_stock(x, cos, sin)) for o in outs)
        x16 = x.half()
        assert torch.equal(checked(x16, cos, sin), wan_stock(x16, cos, sin))
        assert calls[3:] == [torch.float16]  # other dtypes: checked anew
    with mock.patch.object(rotary, "rotate_pairs_takes", lambda *a: False):
        assert torch.equal(checked(x, cos, sin), wan_stock(x, cos, sin)) and len(calls) == 4  # refused: stock


def test_a_rotary_that_gives_other_bits_is_not_used(kdev, monkeypatch):
    checked = wan_copy()
    x, cos, sin = inputs(kdev, torch.float16, torch.float32)
    real = rope.rotate_pairs_unchecked
    # one bit off in one element: what a kernel compiled with FMA contraction could give
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked",
                        lambda *a: real(*a).view(torch.int16).add_((torch.arange(a[0].numel()) == 7).to(
                            a[0].device).view(a[0].shape).short()).view(torch.float16))
    with pytest.warns(RuntimeWarning, match=r"did not reproduce it \(torch.float16 inputs, torch.float32 tables\)"):
        first = checked(x, cos, sin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning
        second = checked(x, cos, sin)
    assert torch.equal(first, wan_stock(x, cos, sin)) and torch.equal(second, first)


def test_a_nan_in_the_first_call_is_checked_by_where_it_is(kdev, monkeypatch):
    checked = wan_copy()
    x, cos, sin = inputs(kdev, torch.bfloat16, torch.float32)
    bad = x.clone()
    bad[0, 3, 1, 4] = float("nan")
    real = rope.rotate_pairs_unchecked
    def other_nan(*a):  # NaNs with another payload than stock's (0x7FC0): the same verdict as without them
        out = real(*a)
        out.view(torch.int16)[out.isnan()] = 0x7F81
        return out

    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", other_nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checked(bad, cos, sin)
    assert torch.equal(out.isnan(), wan_stock(bad, cos, sin).isnan()) and list(twin_checks.MATCHED.values()) == [0]
    # a NaN where stock has none is a difference
    monkeypatch.setattr(twin_checks, "MATCHED", {})
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked",
                        lambda *a: real(*a).index_fill_(1, torch.tensor([0], device=a[0].device), float("nan")))
    with pytest.warns(RuntimeWarning, match="did not reproduce"):
        checked(x, cos, sin)
    assert list(twin_checks.MATCHED.values()) == [None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nothing_is_checked_while_a_cuda_graph_is_captured(monkeypatch):
    checked = wan_copy()
    calls = counted(monkeypatch)
    x, cos, sin = inputs("cuda", torch.bfloat16, torch.float32)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = checked(x, cos, sin)
    assert calls == [] and twin_checks.MATCHED == {}  # stock, captured as it is
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, wan_stock(x, cos, sin))


@pytest.mark.parametrize("src", [
    # Wan's name and arguments, another body
    "    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):\n"
    "        return hidden_states * freqs_cos + freqs_sin\n",
    # Wan's body, reading a variable of the enclosing function (a closure)
    "    scale = 1\n"
    "    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):\n"
    "        x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)\n"
    "        return x1 * freqs_cos * scale\n",
    # another signature (LTX-Video's)
    "    def apply_rotary_emb(hidden_states, freqs):\n"
    "        return hidden_states * freqs\n",
])
def test_other_nested_functions_are_left_alone(src):
    g = {}
    exec(compile("def call(x):\n" + src + "    return apply_rotary_emb\n", "<other>", "exec"), g)
    code = g["call"].__code__
    assert rotary.with_fast_rotary(code, g) == (code, {})


def test_wan_runs_its_rotary_in_one_launch_and_computes_what_it_did(kdev, monkeypatch):
    """The tiny Wan model, INT8 on the Triton backend, its rotary tables in float32 as from_pretrained keeps them:
    its routed copies rotate through ``rotate_pairs`` and give what routed copies of the stock code give, bit for
    bit."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = build("wan")
    dtype = torch.bfloat16 if kdev == "cuda" else torch.float32
    model = model.to(kdev, dtype)
    model.rope.float()
    x = {k: v.to(kdev, dtype) if v.is_floating_point() else v.to(kdev) for k, v in x.items()}
    calls = counted(monkeypatch)
    with_stand_ins, stock = with_and_without_stand_ins(model, x)
    assert calls == [dtype] * 4  # the first call's check (Q), then K, then Q and K of the second call
    assert all(torch.equal(a, b) for a, b in zip(with_stand_ins, stock))


def with_and_without_stand_ins(model, x) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two INT8 forwards of ``model`` with the rotary stand-ins, and two through routed copies without them (the stock
    code, globals and builtins)."""
    outs = {}
    for fast in (True, False):
        stand_ins = rotary.with_fast_rotary if fast else (lambda code, g: (code, {}))
        with mock.patch.object(routing, "with_fast_rotary", stand_ins):
            handle = diffusion_int8.enable(model, "int8", speed_gate=False)
            with torch.no_grad():
                outs[fast] = [model(**x, return_dict=False)[0] for _ in range(2)]
            assert handle.state.int8_calls > 0
            handle.disable()
    return outs[True], outs[False]


# -- diffusers.models.embeddings.apply_rotary_emb (real tables): Flux, CogVideoX, HunyuanVideo, ... --

generic = rotary.generic_rotary()
needs_generic = pytest.mark.skipif(generic is None, reason="the installed diffusers' embeddings.apply_rotary_emb has "
                                                           "other parameters than the stand-in knows")
FORMS = {-1: rope.INTERLEAVED, -2: rope.HALVES}


def generic_inputs(device, x_dtype, table_dtype, sequence_dim, B=2, S=37, H=3, D=40, seed=0):
    """x as the processors have it, cut from a fused projection (not contiguous), (B, S, H, D) for sequence dim 1 and
    its (B, H, S, D) transpose for 2, with a large channel; (S, D) tables whose pairs differ."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, S, 3 * H * D, generator=g) * 3
    fused[..., H * D + 5 % (H * D)] *= 40
    x = fused.to(x_dtype).to(device)[..., H * D:2 * H * D].unflatten(2, (H, -1))
    angle = torch.rand(S, D, generator=g) * 60
    return (x if sequence_dim == 1 else x.transpose(1, 2),
            (angle.cos().to(table_dtype).to(device), angle.sin().to(table_dtype).to(device)))


@needs_generic
@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("sequence_dim", [1, 2])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", DTYPES)
def test_rotate_pairs_is_diffusers_apply_rotary_emb_bit_for_bit(kdev, unbind, sequence_dim, x_dtype, table_dtype):
    x, (cos, sin) = generic_inputs(kdev, x_dtype, table_dtype, sequence_dim)
    shaped = (lambda t: t[None, :, None, :]) if sequence_dim == 1 else (lambda t: t[None, None])
    want = generic.stock(x, (cos, sin), True, unbind, sequence_dim)
    out = torch.full_like(x, float("nan"))
    assert rope.rotate_pairs(x, shaped(cos), shaped(sin), out=out, form=FORMS[unbind]) is out
    assert not torch.equal(want, x) and torch.equal(out, want)
    if unbind == -1:  # the generic function is not Wan's: each channel of a pair takes its own table entries
        assert not torch.equal(rope.rotate_pairs(x, shaped(cos), shaped(sin)), want)


@needs_generic
def test_a_signature_seen_before_replays_its_launch(kdev):
    """The first call of a signature (shapes, strides, dtypes, alignment, form) records its launch and later ones replay
    it with their own tensors' pointers (``launch.Plan``, less host time than Triton's launcher): fresh inputs of that
    signature, held at once so no two share an address, each give their own stock bits."""
    from diffusion_int8.kernels import cache
    from diffusion_int8.kernels.launch import Plan

    cache.clear()
    calls = [generic_inputs(kdev, torch.bfloat16, torch.float32, 1, seed=seed) for seed in range(3)]
    outs = [rope.rotate_pairs(x, cos[None, :, None], sin[None, :, None], form=rope.INTERLEAVED)
            for x, (cos, sin) in calls]
    plans = [plan for key, plan in cache.ENTRIES.items() if key[0] == "rope"]
    assert len(plans) == 1 and isinstance(plans[0], Plan)
    for out, (x, tables) in zip(outs, calls):
        assert torch.equal(out, generic.stock(x, tables, True, -1, 1))
    assert not torch.equal(outs[1], outs[2])
    # other strides, and an output given: signatures of their own, each recorded anew
    x, (cos, sin) = calls[0]
    for x, out in ((x.contiguous(), None), (x, torch.full_like(x, float("nan")))):
        got = rope.rotate_pairs(x, cos[None, :, None], sin[None, :, None], out=out, form=rope.INTERLEAVED)
        assert torch.equal(got, generic.stock(x, (cos, sin), True, -1, 1))
    assert sum(key[0] == "rope" for key in cache.ENTRIES) == 3


@needs_generic
@pytest.mark.parametrize("D", [2, 6, 64])
def test_rotate_pairs_generic_forms_at_other_head_dims(kdev, D):
    for unbind in (-1, -2):
        x, (cos, sin) = generic_inputs(kdev, torch.bfloat16, torch.float32, 1, B=1, S=9, H=2, D=D, seed=D)
        got = rope.rotate_pairs(x, cos[None, :, None], sin[None, :, None], form=FORMS[unbind])
        assert torch.equal(got, generic.stock(x, (cos, sin), True, unbind, 1))
    with pytest.raises(ValueError, match="form must be"):
        rope.rotate_pairs(x, cos[None, :, None], sin[None, :, None], form=4)


def generic_counted(monkeypatch):
    calls = []
    real = rope.rotate_pairs_unchecked
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", lambda *a: calls.append(a[4]) or real(*a))
    return calls


@needs_generic
def test_generic_stand_in_runs_in_one_launch_after_one_check_and_leaves_other_calls_stock(kdev, monkeypatch):
    calls = generic_counted(monkeypatch)
    x, tables = generic_inputs(kdev, torch.bfloat16, torch.float32, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [generic(x, tables) for _ in range(3)]
        assert calls == [rope.INTERLEAVED] * 3  # the check on the first call, then each call
        assert all(torch.equal(o, generic.stock(x, tables)) for o in outs)
        x1 = x.transpose(1, 2)
        assert torch.equal(generic(x1, tables, sequence_dim=1, use_real_unbind_dim=-2),
                           generic.stock(x1, tables, sequence_dim=1, use_real_unbind_dim=-2))
        assert calls[3:] == [rope.HALVES]  # another form and sequence dim: checked anew
        n = len(calls)
        complex_freqs = torch.polar(torch.ones(37, 20), torch.rand(37, 20)).to(kdev)
        stock_calls = [
            (x, complex_freqs, False),  # complex tables (Lumina)
            (x, tuple(t[None] for t in tables)),  # tables the stand-in does not shape
            (x, tables, True, -3),  # an unbind dim the stock function refuses: its error, not the stand-in's
            (x, [tables[0]]),
        ]
        for args in stock_calls:
            try:
                want = generic.stock(*args)
            except Exception as exc:  # noqa: BLE001 - the stand-in must raise what stock raises
                with pytest.raises(type(exc)):
                    generic(*args)
            else:
                assert torch.equal(generic(*args), want)
        assert len(calls) == n
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):  # what torch.compile traces: stock
            assert torch.equal(generic(x, tables), generic.stock(x, tables)) and len(calls) == n


@needs_generic
def test_generic_stand_in_keeps_stock_where_the_launch_differs_or_fails(kdev, monkeypatch):
    x, tables = generic_inputs(kdev, torch.bfloat16, torch.float32, 1)
    real = rope.rotate_pairs_unchecked
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked",  # one bit off in one element
                        lambda *a: real(*a).view(torch.int16).add_((torch.arange(a[0].numel()) == 7).to(
                            a[0].device).view(a[0].shape).short()).view(torch.bfloat16))
    want = generic.stock(x, tables, sequence_dim=1)
    with pytest.warns(RuntimeWarning, match="did not reproduce"):
        assert torch.equal(generic(x, tables, sequence_dim=1), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning
        assert torch.equal(generic(x, tables, sequence_dim=1), want)
    monkeypatch.setattr(twin_checks, "MATCHED", {})

    def fails(*a):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", fails)  # a kernel that cannot launch on this device
    with pytest.warns(RuntimeWarning, match="failed .RuntimeError: out of resources"):
        assert torch.equal(generic(x, tables, sequence_dim=1), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(generic(x, tables, sequence_dim=1), want) and list(twin_checks.MATCHED.values()) == [None]
    # arguments stock takes apart from plain ints go to stock, which raises what it raises for them
    with pytest.raises(ValueError, match="use_real_unbind_dim"):
        generic(x, tables, True, [-1])
    assert torch.equal(generic(x, tables, True, -1, torch.tensor(1)), want)
    assert len(twin_checks.MATCHED) == 1


def test_ltx_stand_in_is_ltx_rotary_bit_for_bit_after_one_check(kdev, monkeypatch):
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_stock

    calls = generic_counted(monkeypatch)
    checked = rotary.CheckedTokenRotary(ltx_stock)
    g = torch.Generator().manual_seed(3)
    B, S, C = 2, 21, 70  # C = 2 heads of 32 and LTX's 6 padding channels (cos 1, sin 0), as its rope makes them
    for x_dtype, table_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                 (torch.float32, torch.bfloat16)):
        fused = torch.randn(B, S, 3 * C, generator=g) * 3
        x = fused.to(x_dtype).to(kdev)[..., C:2 * C]  # a slice of a fused projection: not contiguous
        angle = torch.rand(1, S, C - 6, generator=g) * 60
        cos = torch.cat([torch.ones(1, S, 6), angle.cos()], -1).to(table_dtype).to(kdev)
        sin = torch.cat([torch.zeros(1, S, 6), angle.sin()], -1).to(table_dtype).to(kdev)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outs = [checked(x, (cos, sin)) for _ in range(2)]
        want = ltx_stock(x, (cos, sin))
        assert not torch.equal(want, x) and all(torch.equal(o, want) and o.shape == want.shape for o in outs)
    assert calls == [rope.INTERLEAVED] * 6 and list(twin_checks.MATCHED.values()) == [0, 0, 0]
    tables = (cos.double(), sin.double())  # float64 tables: the stock function
    assert torch.equal(checked(x, tables), ltx_stock(x, tables)) and len(calls) == 6
    with pytest.raises(ValueError):  # 4-D x: the stock function, which raises what it raises
        checked(x.unflatten(2, (2, -1)), (cos[..., :35], sin[..., :35]))
    assert len(calls) == 6


def code_of(text: str, g: dict) -> types.CodeType:
    exec(compile(text, "<processor>", "exec"), g)
    return g["call"].__code__


@needs_generic
def test_processors_get_the_generic_stand_in_where_they_read_or_import_diffusers_function():
    from diffusers.models.attention_processor import AttnProcessor2_0, CogVideoXAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    for processor, imports in ((FluxAttnProcessor, False), (CogVideoXAttnProcessor2_0, True),
                               (HunyuanVideoAttnProcessor2_0, True), (AttnProcessor2_0, None)):
        fn = processor.__call__
        code, names = rotary.with_fast_rotary(fn.__code__, fn.__globals__)
        if imports is None:
            assert names == {}
        elif imports:
            assert set(names) == {"__builtins__"}
            copy = types.FunctionType(compile("def f():\n from diffusers.models.embeddings import apply_rotary_emb, "
                                              "get_1d_rotary_pos_embed as g\n return apply_rotary_emb, g\n", "<f>",
                                              "exec").co_consts[0], {"__builtins__": names["__builtins__"]})
            from diffusers.models import embeddings
            assert copy() == (generic, embeddings.get_1d_rotary_pos_embed)  # the rest of the module as it is
        else:
            assert names == {"apply_rotary_emb": generic}
    from diffusers.models.transformers import transformer_ltx, transformer_ltx2

    for processor, name, stock in ((transformer_ltx.LTXVideoAttnProcessor, "apply_rotary_emb",
                                    transformer_ltx.apply_rotary_emb),
                                   (transformer_ltx2.LTX2AudioVideoAttnProcessor, "apply_interleaved_rotary_emb",
                                    transformer_ltx2.apply_interleaved_rotary_emb)):
        fn = processor.__call__
        _, names = rotary.with_fast_rotary(fn.__code__, fn.__globals__)
        assert list(names) == [name] and isinstance(names[name], rotary.CheckedTokenRotary)
        assert names[name].stock is stock
    # a look-alike global, and an import of another module's function of that name, stay as they are
    g = {"apply_rotary_emb": lambda x, f: x}
    code = code_of("def call(x, f):\n    return apply_rotary_emb(x, f)\n", g)
    assert rotary.with_fast_rotary(code, g) == (code, {})
    g = {}
    code = code_of("def call(x):\n    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb\n"
                   "    return apply_rotary_emb\n", g)
    code2, names = rotary.with_fast_rotary(code, g)
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx
    assert types.FunctionType(code2, {**g, **names})(None) is ltx


def test_a_generic_function_of_other_parameters_is_left_alone(monkeypatch):
    from diffusers.models import embeddings

    # a fresh cache, so that the process's stand-in (the module's ``generic``) stays the one other tests compare with
    monkeypatch.setattr(rotary, "generic_rotary", functools.lru_cache(maxsize=1)(rotary.generic_rotary.__wrapped__))
    monkeypatch.setattr(embeddings, "apply_rotary_emb", lambda x, freqs_cis, use_real=True: x)
    assert rotary.generic_rotary() is None
    g = {"apply_rotary_emb": embeddings.apply_rotary_emb}
    code = code_of("def call(x, f):\n    return apply_rotary_emb(x, f)\n", g)
    assert rotary.with_fast_rotary(code, g) == (code, {})


def model_on(kdev: str, family: str):
    """A tiny model of ``family`` (a ``tiny_models`` family or a zoo case) on ``kdev`` in bfloat16 (float32 on the CPU),
    and its inputs in that dtype, the rotary tables (a tuple) kept in float32 as the pipelines make them."""
    model, x = build(family) if family == "flux" else build_case(family)
    dtype = torch.bfloat16 if kdev == "cuda" else torch.float32

    def cast(v):  # Z-Image's inputs are lists of tensors
        if isinstance(v, (list, tuple)):
            return type(v)(map(cast, v))
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return model.to(kdev, dtype), {k: cast(v) for k, v in to_device(x, kdev).items()}


@needs_generic
@pytest.mark.parametrize("family, form, rotations", [
    ("flux", rope.INTERLEAVED, 4), ("CogVideoXTransformer3DModel", rope.INTERLEAVED, 2),
    ("HunyuanVideoTransformer3DModel", rope.INTERLEAVED, 4),
    ("CogView4Transformer2DModel", rope.HALVES, 2),  # its tables made on the CPU: moved to the GPU, as stock moves them
    ("LTXVideoTransformer3DModel", rope.INTERLEAVED, 2)])
def test_models_run_the_generic_rotary_in_one_launch_and_compute_what_they_did(kdev, monkeypatch, family, form,
                                                                                rotations):
    """Tiny Flux (a module global), CogVideoX-5b, HunyuanVideo and CogView4 (imported inside ``__call__``; CogView4's
    channel pairs are halves) and LTX-Video (its own function, on (B, S, C) tokens), INT8 on the Triton backend: their
    routed copies rotate through ``rotate_pairs`` and give what routed copies without stand-ins (stock builtins and
    globals) give, bit for bit."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = model_on(kdev, family)
    calls = generic_counted(monkeypatch)
    with_stand_ins, stock = with_and_without_stand_ins(model, x)
    # Q and K of each block with rotary tables, two forwards: each through rotate_pairs (the first as the check)
    assert calls == [form] * (2 * rotations)
    # every twin checked matched: the rotary, and on the GPU HunyuanVideo's RMSNorms too (on the CPU the probe finds
    # no order: the interpreter sums in another)
    norm = kdev == "cuda" and family == "HunyuanVideoTransformer3DModel"
    assert list(twin_checks.MATCHED.values()) == [0] * (2 if norm else 1)
    assert all(torch.equal(a, b) for a, b in zip(with_stand_ins, stock))


@needs_generic
@pytest.mark.parametrize("family, rotations", [
    ("flux", 4), ("HunyuanVideoTransformer3DModel", 4), ("WanTransformer3DModel", 4), ("QwenImageTransformer2DModel", 8)])
def test_gated_calls_run_the_rotary_in_one_launch_and_compute_what_stock_does(kdev, monkeypatch, family, rotations):
    """Every call sent to SDPA by the speed gate: from the third forward on, each module's calls skip the routed copy
    for the stock processor (the copy found them all gated), whose rotary embedding runs in one launch there too
    (``routing.rotary_only``: Flux's a module global, HunyuanVideo's imported inside ``__call__``, Wan's nested,
    Qwen-Image's its own on complex tables). The forward is the stock one, bit for bit."""
    from test_zoo import NO_TABLE

    from diffusion_int8.plugin.processor import Int8DiffusionProcessor
    from diffusion_int8.plugin.speed_gate import SpeedGate

    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = model_on(kdev, family)
    with torch.no_grad():
        stock = model(**x, return_dict=False)[0]
    calls = []
    real = rope.rotate_pairs_unchecked
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", lambda *a: calls.append(a) or real(*a))
    handle = diffusion_int8.enable(model, "int8", speed_gate=SpeedGate(NO_TABLE))
    procs = {id(p): p for p in model.attn_processors.values() if isinstance(p, Int8DiffusionProcessor)}.values()
    with torch.no_grad():
        for _ in range(2):  # the routed copy: the first call of a rotary form is its check
            model(**x, return_dict=False)
        routed_before, before = [list(p._outcomes) for p in procs], len(calls)
        out = model(**x, return_dict=False)[0]
    assert [list(p._outcomes) for p in procs] == routed_before, "the third forward still ran the routed copy"
    assert handle.state.int8_calls == 0 and handle.state.gated_calls > 0
    assert len(calls) - before == rotations
    assert twin_checks.MATCHED and None not in twin_checks.MATCHED.values()
    assert torch.equal(out, stock)
    handle.disable()


# -- complex tables (use_real=False): Lumina's generic call, Qwen-Image's function, Z-Image's nested one --

qwen_stock = rotary.stock_qwen_rotary()
zimage_stock = rotary.stock_zimage_rotary()
needs_complex = pytest.mark.skipif(generic is None or qwen_stock is None or zimage_stock is None,
                                   reason="the installed diffusers lacks a complex-table rotary the stand-ins know")


def complex_inputs(device, x_dtype, B=2, S=37, H=3, D=64, seed=0):
    """x (B, S, H, D) cut from a fused projection (not contiguous), with a large channel, and a complex64 (S, D/2) table
    of unit phases. D/2 a multiple of 16: PyTorch's CPU complex product computes a row's last elements, past its
    vector width, with fused multiply-adds and the rest without."""
    x, _ = generic_inputs(device, x_dtype, torch.float32, 1, B, S, H, D, seed)
    angle = torch.rand(S, D // 2, generator=torch.Generator().manual_seed(seed + 1)) * 60
    return x, torch.polar(torch.ones_like(angle), angle).to(device)


def complex_table(freqs, dim):
    return torch.view_as_real(freqs.unsqueeze(dim)).flatten(-2)


@needs_complex
def test_rotate_pairs_is_a_complex_product_bit_for_bit_for_one_choice_of_fused_products(kdev):
    """One choice of fused multiply-adds (the compiler's, in the PyTorch build) gives Qwen-Image's product bit for bit
    in float32, where the choices differ, signed zeros included; the same choice then gives it for 16-bit x."""
    x, freqs = complex_inputs(kdev, torch.float32)
    x[..., :8] = 0  # zero pairs, and position 0's table 1 + 0i: the products' zeros are signed, and so are the sums'
    freqs[0] = 1
    table = complex_table(freqs, 1)
    want = qwen_stock(x, freqs, use_real=False)
    assert (want.view(torch.int32) == torch.iinfo(torch.int32).min).any()  # some -0.0
    outs = {}
    for fused in rotary._FUSED_ORDER:
        out = torch.full_like(x, float("nan"))
        assert rope.rotate_pairs(x, table, table, out=out, form=rope.COMPLEX, fused=fused) is out
        outs[fused] = out
    matching = [f for f, out in outs.items() if torch.equal(out, want)]
    assert len(matching) >= 1 and not torch.equal(want, x)
    assert len({o.view(torch.int32).sum().item() for o in outs.values()}) > 1, "the choices should differ somewhere"
    for dtype in (torch.bfloat16, torch.float16):
        x16 = x.to(dtype)
        got = rope.rotate_pairs(x16, table, table, form=rope.COMPLEX, fused=matching[0])
        assert torch.equal(got, qwen_stock(x16, freqs, use_real=False))
    with pytest.raises(ValueError, match="fused must be"):
        rope.rotate_pairs(x, table, table, form=rope.INTERLEAVED, fused=(1, 1))
    with pytest.raises(ValueError, match="complex64"):
        rope.rotate_pairs(x, table.half(), table.half(), form=rope.COMPLEX)


@needs_complex
def test_complex_stand_ins_find_the_product_in_float32_then_run_in_one_launch(kdev, monkeypatch):
    """Qwen-Image's function, Z-Image's nested one and the generic one with ``use_real=False``: the first bfloat16 call
    finds the fused products on x in float32 (where a 16-bit result would hide them), checks that choice on bfloat16,
    and later calls run one launch each, equal to stock; other calls stay stock."""
    calls = generic_counted(monkeypatch)
    x, freqs = complex_inputs(kdev, torch.bfloat16)
    batched = freqs[None].expand(2, -1, -1)  # (B, S, D/2), as Lumina and Z-Image have it
    cases = ((rotary.CheckedQwenRotary(qwen_stock), lambda f, x: f(x, freqs, use_real=False)),
             (rotary.CheckedNestedComplexRotary(zimage_stock), lambda f, x: f(x, batched)),
             (generic, lambda f, x: f(x, batched, False)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for checked, call in cases:
            stock = checked.stock
            twin_checks.MATCHED.clear()
            del calls[:]
            outs = [call(checked, x) for _ in range(3)]
            assert all(torch.equal(o, call(stock, x)) for o in outs) and not torch.equal(outs[0], x)
            probe, bf16 = (next(v for k, v in twin_checks.MATCHED.items() if k[3] is dt)
                           for dt in (torch.float32, torch.bfloat16))
            assert probe is not None and bf16 == 0
            # the probe tried every choice, then one check on bfloat16 and two calls
            assert calls == [rope.COMPLEX] * (len(rotary._FUSED_ORDER) + 1 + 2)
    del calls[:]
    for args in ((x, freqs, True), (x, freqs.to(torch.complex128), False), (x.double(), freqs, False)):
        try:
            want = qwen_stock(*args)
        except Exception as exc:  # noqa: BLE001 - the stand-in must raise what stock raises
            with pytest.raises(type(exc)):
                rotary.CheckedQwenRotary(qwen_stock)(*args)
        else:
            assert torch.equal(rotary.CheckedQwenRotary(qwen_stock)(*args), want)
    assert calls == []


@needs_complex
def test_complex_stand_in_keeps_a_choice_only_where_the_data_told_it_apart(kdev, monkeypatch):
    """A first call whose data every choice reproduces (exact products) decides nothing: the next call checks again, and
    keeps the one choice that alone gives stock's bits. The key is per head dim: another head dim checks anew."""
    calls = generic_counted(monkeypatch)
    checked = rotary.CheckedQwenRotary(qwen_stock)
    x, freqs = complex_inputs(kdev, torch.float32)
    # small integers times dyadic table entries, zeros among them: every product and sum exact, and every choice gives
    # the same bits, signed zeros included
    g = torch.Generator().manual_seed(7)
    plain = torch.randint(-8, 8, x.shape, generator=g).float().to(kdev)
    dyadic = torch.complex(*(torch.randint(-4, 4, freqs.shape, generator=g).float() / 4 for _ in range(2))).to(kdev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(checked(plain, dyadic, use_real=False), qwen_stock(plain, dyadic, use_real=False))
        assert twin_checks.MATCHED == {} and len(calls) == len(rotary._FUSED_ORDER)  # every choice tried, none kept
        for _ in range(2):
            assert torch.equal(checked(x, freqs, use_real=False), qwen_stock(x, freqs, use_real=False))
    (key, found), = twin_checks.MATCHED.items()
    assert found is not None and key[-1] == 64
    assert len(calls) == 2 * len(rotary._FUSED_ORDER) + 1  # the second call's check tried every choice too
    x2, freqs2 = complex_inputs(kdev, torch.float32, D=32, seed=5)
    assert torch.equal(checked(x2, freqs2, use_real=False), qwen_stock(x2, freqs2, use_real=False))
    assert len(twin_checks.MATCHED) == 2


@needs_complex
def test_complex_stand_in_leaves_to_stock_what_stock_raises_or_what_the_table_view_refuses(kdev, monkeypatch):
    """float32 x that stock's ``view_as_complex`` refuses (odd strides, channels not contiguous) raises as stock does;
    a conjugated or negated table, which ``view_as_real`` refuses, gives stock's result."""
    calls = generic_counted(monkeypatch)
    checked = rotary.CheckedQwenRotary(qwen_stock)
    x, freqs = complex_inputs(kdev, torch.float32)
    checked(x, freqs, use_real=False)  # the check, done: later calls would run the twin if they reached it
    n = len(calls)
    for bad in (torch.randn(2, 37, 3, 65, device=kdev)[..., :64], torch.randn(2, 37, 64, 3, device=kdev).mT):
        with pytest.raises(RuntimeError):
            qwen_stock(bad, freqs, use_real=False)
        with pytest.raises(RuntimeError):
            checked(bad, freqs, use_real=False)
    for table in (freqs.conj(), torch.neg(freqs.conj()).conj()):
        assert torch.equal(checked(x, table, use_real=False), qwen_stock(x, table, use_real=False))
    assert len(calls) == n


@needs_complex
def test_complex_stand_in_keeps_the_last_tables_view_for_the_calls_that_share_it(kdev, monkeypatch):
    """Q and K, and every block of a forward, pass one table: the stand-in works out its (re, im) view and whether the
    twin takes the call once, and again for another table, another x shape, or the same table object given other
    memory; the view follows the table's values; the gradient mode and the backend setting are asked every call."""
    takes = []
    real_takes = rotary.rotate_pairs_takes
    monkeypatch.setattr(rotary, "rotate_pairs_takes", lambda *a: takes.append(a[0].shape) or real_takes(*a))
    checked = rotary.CheckedQwenRotary(qwen_stock)
    x, freqs = complex_inputs(kdev, torch.bfloat16)
    k = torch.randn_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (x, k, x, k):
            assert torch.equal(checked(t, freqs, use_real=False), qwen_stock(t, freqs, use_real=False))
        assert len(takes) == 1
        freqs.mul_(torch.polar(torch.ones(()), torch.tensor(0.5)).to(kdev))  # the same tensor, rotated in place
        assert torch.equal(checked(x, freqs, use_real=False), qwen_stock(x, freqs, use_real=False))
        other = freqs.clone()
        x2 = x[:1]
        for t, f in ((x, other), (x2, other), (x2, other)):
            assert torch.equal(checked(t, f, use_real=False), qwen_stock(t, f, use_real=False))
        assert len(takes) == 3
        with torch.enable_grad():  # a gradient to keep, in a call like the last: stock
            xg = x2.clone().requires_grad_()
            got = checked(xg, other, use_real=False)
            assert got.requires_grad and torch.equal(got, qwen_stock(xg, other, use_real=False))
        # the same tensor object given other memory: of its shape (other values), then of another (stock raises)
        other.set_(torch.polar(torch.ones(37, 32), torch.rand(37, 32) * 9).to(kdev))
        assert torch.equal(checked(x2, other, use_real=False), qwen_stock(x2, other, use_real=False))
        n = len(takes)
        other.set_(other[:5].clone())
        with pytest.raises(RuntimeError):
            qwen_stock(x2, other, use_real=False)
        with pytest.raises(RuntimeError):
            checked(x2, other, use_real=False)
        assert len(takes) == n + 1  # asked again, and refused
    # the backend set to the emulation between calls like the last: the kernels stay off
    calls = generic_counted(monkeypatch)
    assert torch.equal(checked(x, freqs, use_real=False), qwen_stock(x, freqs, use_real=False)) and len(calls) == 1
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    assert torch.equal(checked(x, freqs, use_real=False), qwen_stock(x, freqs, use_real=False)) and len(calls) == 1


@needs_complex
def test_a_complex_product_with_one_table_replays_its_launch(kdev):
    """The complex form passes its table as both tables: its plan takes it once (a plan refuses inputs that share
    memory) and replays fresh inputs; two distinct tables of the same signature are another plan."""
    from diffusion_int8.kernels import cache
    from diffusion_int8.kernels.launch import Plan

    cache.clear()
    x, freqs = complex_inputs(kdev, torch.float32)
    table = complex_table(freqs, 1)
    outs = [rope.rotate_pairs(x * k, table, table, form=rope.COMPLEX) for k in (1, 2, 3)]
    plans = [plan for key, plan in cache.ENTRIES.items() if key[0] == "rope"]
    assert len(plans) == 1 and isinstance(plans[0], Plan)
    want = [rope.rotate_pairs(x * k, table, table.clone(), form=rope.COMPLEX) for k in (1, 2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(outs, want)) and not torch.equal(outs[1], outs[2])
    assert sum(key[0] == "rope" for key in cache.ENTRIES) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_complex
def test_no_complex_probe_runs_while_a_cuda_graph_is_captured(monkeypatch):
    calls = generic_counted(monkeypatch)
    checked = rotary.CheckedQwenRotary(qwen_stock)
    x, freqs = complex_inputs("cuda", torch.bfloat16)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = checked(x, freqs, use_real=False)
    assert calls == [] and twin_checks.MATCHED == {}  # stock, captured as it is, without the float32 probe
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qwen_stock(x, freqs, use_real=False))


@needs_complex
def test_a_copy_of_qwens_function_with_other_defaults_is_left_alone():
    g = {}
    exec(compile("def call(x, f):\n    return rope_fn(x, f)\n", "<processor>", "exec"), g)
    fn = types.FunctionType(qwen_stock.__code__, qwen_stock.__globals__, "rope_fn", (False, -1))
    g["rope_fn"] = fn
    code = g["call"].__code__
    assert rotary.with_fast_rotary(code, g) == (code, {})
    g["rope_fn"] = types.FunctionType(qwen_stock.__code__, qwen_stock.__globals__, "rope_fn", qwen_stock.__defaults__)
    assert isinstance(rotary.with_fast_rotary(code, g)[1]["rope_fn"], rotary.CheckedQwenRotary)


@needs_complex
def test_a_complex_product_no_choice_reproduces_runs_stock_with_one_warning(kdev, monkeypatch):
    real = rope.rotate_pairs_unchecked
    monkeypatch.setattr(rotary, "rotate_pairs_unchecked", lambda *a: real(*a).neg_())
    checked = rotary.CheckedQwenRotary(qwen_stock)
    x, freqs = complex_inputs(kdev, torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="did not reproduce"):
        got = checked(x, freqs, use_real=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = checked(x, freqs, use_real=False)
    want = qwen_stock(x, freqs, use_real=False)
    assert torch.equal(got, want) and torch.equal(again, want)


@needs_complex
def test_processors_get_the_complex_stand_ins():
    from diffusers.models.transformers import transformer_nucleusmoe_image, transformer_qwenimage, transformer_z_image

    for processor, name in ((transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0, "apply_rotary_emb_qwen"),
                            (transformer_nucleusmoe_image.NucleusMoEAttnProcessor2_0, "_apply_rotary_emb_nucleus")):
        fn = processor.__call__
        _, names = rotary.with_fast_rotary(fn.__code__, fn.__globals__)
        assert list(names) == [name] and isinstance(names[name], rotary.CheckedQwenRotary)
    fn = transformer_z_image.ZSingleStreamAttnProcessor.__call__
    code, names = rotary.with_fast_rotary(fn.__code__, fn.__globals__)
    (name, stand_in), = names.items()
    assert isinstance(stand_in, rotary.CheckedNestedComplexRotary) and stand_in.stock.__code__ in fn.__code__.co_consts
    stub = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb")
    assert stub.co_varnames[:2] == ("x_in", "freqs_cis") and name in stub.co_names


@needs_complex
@pytest.mark.parametrize("family, rotations", [
    ("QwenImageTransformer2DModel", 8), ("LuminaNextDiT2DModel", 6), ("ZImageTransformer2DModel", 6),
    ("NucleusMoEImageTransformer2DModel", 6)])
def test_models_run_the_complex_rotary_in_one_launch_and_compute_what_they_did(kdev, monkeypatch, family, rotations):
    """Tiny Qwen-Image and NucleusMoE (Qwen-Image's function, image and text streams), Lumina-Next (the generic function,
    use_real=False) and Z-Image (its nested function), INT8 on the Triton backend: their routed copies rotate through
    ``rotate_pairs``'s complex form and give what routed copies without stand-ins give, bit for bit."""
    if kdev == "cuda" and family == "NucleusMoEImageTransformer2DModel":
        pytest.skip("its stock forwards differ from run to run on the GPU (test_zoo): nothing to compare bit for bit")
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = model_on(kdev, family)
    calls = generic_counted(monkeypatch)
    with_stand_ins, stock = with_and_without_stand_ins(model, x)
    assert set(calls) == {rope.COMPLEX} and len(calls) > 2 * rotations  # the checks' launches on top
    found = {k: v for k, v in twin_checks.MATCHED.items() if k[1] == rope.COMPLEX}
    assert found and None not in found.values()
    # checked: a third forward runs Q and K of every rotary call in one launch each, and nothing more
    del calls[:]
    handle = diffusion_int8.enable(model, "int8", speed_gate=False)
    with torch.no_grad():
        third = model(**x, return_dict=False)[0]
    handle.disable()
    assert calls == [rope.COMPLEX] * rotations
    with_stand_ins.append(third)
    stock.append(stock[-1])
    flat = [[t for o in outs for t in (o if isinstance(o, list) else [o])] for outs in (with_stand_ins, stock)]
    assert all(torch.equal(a, b) for a, b in zip(*flat)) and len(flat[0]) == len(flat[1]) >= 2  # Z-Image: lists
