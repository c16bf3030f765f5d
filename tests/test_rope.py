"""Wan's rotary embedding in one launch (``kernels.rope``) and its use in routed processors (``plugin.rotary``)."""

from __future__ import annotations

import types
import warnings
from unittest import mock

import pytest
import torch
from tiny_models import build

import diffusion_int8
from diffusion_int8.kernels import rope
from diffusion_int8.plugin import rotary


def wan_stock(hidden_states, freqs_cos, freqs_sin):
    """diffusers' WanAttnProcessor.__call__'s nested apply_rotary_emb (0.42), as written there."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def inputs(device, x_dtype, table_dtype, B=2, S=37, H=3, D=40, seed=0):
    """x as Wan's processor has it, (B, S, H, D) cut from a fused projection (not contiguous), with a few large
    values; tables (1, S, 1, D) whose pairs differ (the stock function's indices then matter)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, S, 3 * H * D, generator=g) * 3
    fused[..., H * D + 5 % (H * D)] *= 40
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


def test_rotate_pairs_refuses_what_it_does_not_take(kdev):
    x, cos, sin = inputs(kdev, torch.float16, torch.float32)
    for bad in [(x[..., :-1], cos[..., :-1], sin[..., :-1]),  # odd head dim
                (x, cos[..., :8], sin[..., :8]),  # tables of another head dim
                (x, cos[:, :5], sin[:, :5]),  # tables that do not broadcast
                (x.int(), cos, sin), (x, cos, sin.half()),
                (x.requires_grad_(True), cos, sin)]:
        assert not rope.rotate_pairs_takes(*bad)
        with pytest.raises(ValueError, match="rotate_pairs takes a 4-D x of even head dim"):
            rope.rotate_pairs(*bad)
    x = x.detach()
    with pytest.raises(ValueError, match="out must be"):
        rope.rotate_pairs(x, cos, sin, out=torch.empty_like(x, dtype=torch.float32))


def test_a_nested_wan_rotary_runs_in_one_launch_after_one_check(kdev):
    # made from source, so that the nested function reads only globals, as Wan's does (a closure is left alone)
    src = ("def call(x, cos, sin):\n"
           "    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):\n"
           "        return wan_stock(hidden_states, freqs_cos, freqs_sin)\n"
           "    return apply_rotary_emb(x, cos, sin)\n")
    g = {"wan_stock": wan_stock}
    exec(compile(src, "<wan>", "exec"), g)
    code, names = rotary.with_fast_rotary(g["call"].__code__, g)
    copy = types.FunctionType(code, {**g, **names})
    x, cos, sin = inputs(kdev, torch.bfloat16, torch.float32)
    calls = []
    with mock.patch.object(rotary, "rotate_pairs", lambda *a: calls.append(1) or rope.rotate_pairs(*a)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outs = [copy(x, cos, sin) for _ in range(3)]
    assert calls == [1, 1, 1]  # the check on the first call, then each call
    assert all(torch.equal(o, wan_stock(x, cos, sin)) for o in outs)


def test_a_nested_rotary_that_computes_something_else_runs_as_it_is(kdev):
    src = ("def call(x, cos, sin):\n"
           "    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):\n"
           "        return hidden_states * freqs_cos + freqs_sin\n"
           "    return apply_rotary_emb(x, cos, sin)\n")
    g = {}
    exec(compile(src, "<other>", "exec"), g)
    code, names = rotary.with_fast_rotary(g["call"].__code__, g)
    assert names
    copy = types.FunctionType(code, {**g, **names})
    x, cos, sin = inputs(kdev, torch.float16, torch.float32)
    with pytest.warns(RuntimeWarning, match="computes something else than Wan's rotary embedding"):
        first = copy(x, cos, sin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning
        second = copy(x, cos, sin)
    want = g["call"](x, cos, sin)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_functions_without_a_wan_rotary_are_left_alone():
    def call(x):
        def apply_rotary_emb(hidden_states, freqs):  # another signature (LTX-style)
            return hidden_states * freqs
        return apply_rotary_emb(x, x)

    assert rotary.with_fast_rotary(call.__code__, call.__globals__) == (call.__code__, {})


def test_wan_runs_its_rotary_in_one_launch_and_computes_what_it_did(kdev, monkeypatch):
    """The tiny Wan model, INT8 on the Triton backend: its routed copies rotate through ``rotate_pairs`` and give what
    they give with the stock rotary, bit for bit."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "triton")
    model, x = build("wan")
    model = model.to(kdev, torch.bfloat16 if kdev == "cuda" else torch.float32)
    x = {k: v.to(kdev, model.dtype) if v.is_floating_point() else v.to(kdev) for k, v in x.items()}
    calls, outs = [], {}
    for fast in (True, False):
        takes = rope.rotate_pairs_takes if fast else (lambda *a: False)
        spy = lambda *a: calls.append(a[0].shape) or rope.rotate_pairs(*a)  # noqa: E731
        with mock.patch.object(rotary, "rotate_pairs", spy), mock.patch.object(rotary, "rotate_pairs_takes", takes):
            handle = diffusion_int8.enable(model, "int8", speed_gate=False)
            with torch.no_grad():
                outs[fast] = [model(**x, return_dict=False)[0] for _ in range(2)]
            assert handle.state.int8_calls > 0
            handle.disable()
    assert len(calls) == 4  # the first call's check (Q), then K, then Q and K of the second call
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
