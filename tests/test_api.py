"""The public op: dispatch, fallbacks, custom-op registration and input validation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import diffusion_int8
from diffusion_int8 import int8_attention
from diffusion_int8.kernels import config, reference as R
from diffusion_int8.inputs import local_qkv, realistic_qkv
from test_attention import check


def test_fp16_mode_is_sdpa():
    q, k, v = realistic_qkv(2, 4, 50, 70, 64, H_kv=2, layout="BSHD")
    out = int8_attention(q, k, v, mode="fp16", layout="BSHD")
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("mode,pv", [("int8", config.PV.FP8), ("int8_fp16v", config.PV.FP16)])
def test_public_op_matches_emulation(kdev, mode, pv):
    q, k, v = realistic_qkv(1, 3, 77, 130, 80, device=kdev)
    mask = torch.rand(1, 1, 1, 130, device=kdev) > 0.2
    mask[..., 0] = True
    out = int8_attention(q, k, v, mode=mode, attn_mask=mask, scale=0.1)
    emu = R.emulate_attention(q, k, v, pv=pv, attn_mask=mask, sm_scale=0.1)
    check(out, emu, R.attention_ref(q, k, v, attn_mask=mask, sm_scale=0.1), pv, q.dtype,
          call=(q, k, v, dict(pv=pv, attn_mask=mask, sm_scale=0.1)))


def test_env_forces_int8_pv(monkeypatch):
    monkeypatch.setenv(config.ENV_PV8, "int8")
    assert diffusion_int8.kernel_info("cpu", "int8")["pv"] == "int8"
    monkeypatch.setenv(config.ENV_PV8, "FP8")
    assert diffusion_int8.kernel_info("cpu", "int8")["pv"] == "fp8"
    monkeypatch.setenv(config.ENV_PV8, "fp9")
    with pytest.raises(ValueError, match="fp8 or int8"):
        diffusion_int8.kernel_info("cpu", "int8")


def test_cpu_without_interpreter_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(config, "interpreting", lambda: False)
    config._warn_fallback.cache_clear()
    q, k, v = realistic_qkv(1, 2, 33, 33, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = diffusion_int8.kernel_info("cpu")  # asks, runs nothing: says why, and leaves the warning to the call
        assert info["backend"] == "emulation" and "CUDA GPU" in info["reason"] and not caught
        out1 = int8_attention(q, k, v, mode="int8")
        out2 = int8_attention(q, k, v, mode="int8")
    msgs = [str(w.message) for w in caught if "emulation" in str(w.message)]
    assert len(msgs) == 1 and "CUDA GPU" in msgs[0]
    torch.testing.assert_close(out1, out2, atol=0, rtol=0)
    torch.testing.assert_close(out1, R.emulate_attention(q, k, v, pv=config.PV.FP8), atol=0, rtol=0)
    assert diffusion_int8.kernel_info("cpu")["backend"] == "emulation"


def test_requesting_triton_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(config, "interpreting", lambda: False)
    monkeypatch.setenv(config.ENV_BACKEND, "triton")
    q, k, v = realistic_qkv(1, 2, 8, 8, 64)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        int8_attention(q, k, v, mode="int8")


def test_opcheck_cpu(kdev):
    q, k, v = realistic_qkv(1, 2, 40, 72, 64, device=kdev)
    backend = config.select_backend(q.device).value
    mask = torch.rand(1, 1, 40, 72, device=kdev) > 0.3
    mask[..., 0] = True
    # (q, k, v, attn_mask, block_mask, q_amax, k_amax, v_amax, k_mean, balance, keep_kv_blocks, layout, pv, sm_scale,
    #  smooth_k, qk_balance, qk_rotate, sparsity, backend, return_lse, return_skipped, return_block_mask)
    args = (q, k, v, mask, None, None, None, None, None, None, None, "BHSD", "fp8", 0.125, True, True, False, None,
            backend, False, False, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    blocks = torch.tensor([True, False], device=kdev).view(1, 2, 1, 1)  # head 1 skips its one block: zeros
    args = (q, k, v, None, blocks, None, None, None, None, None, None, "BHSD", "fp16", 0.125, True, False, True, None,
            backend, True, False, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    # a BHSD view of (B, S, H, D) memory: the fake output's strides are the real one's
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    args = (*strided, None, None, None, None, None, None, None, None, "BHSD", "fp8", 0.125, True, False, False, None,
            backend, False, False, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    # every static input given: no statistics pass
    static = (q.float().abs().amax((2, 3)), torch.full((1, 2), 3.0, device=kdev), v.float().abs().amax(2),
              k.float().mean(2))
    args = (q, k, v, None, None, *static, None, None, "BHSD", "fp8", 0.125, True, True, False, None, backend, True,
            False, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    # and a given Q·Kᵀ balance with them
    balance = torch.tensor([0.5, 1.0, 2.0, 4.0], device=kdev).repeat(16)
    args = (q, k, v, None, None, *static, balance, None, "BHSD", "int8", 0.125, True, False, False, None, backend,
            False, False, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    # the mask predicted in the call, with an always-kept block, returned with the log-sum-exp
    q, k, v = local_qkv(1, 2, 300, 400, 64, device=kdev)
    keep = torch.tensor([False, False, True, False], device=kdev)
    args = (q, k, v, None, None, None, None, None, None, None, keep, "BHSD", "fp8", 0.125, True, False, False, 0.8,
            backend, True, False, True)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)
    # a block mask's skipped blocks returned apart from the dense result
    blocks = torch.tensor([[True, False, True, False], [False, True, True, True]], device=kdev).view(1, 2, 1, 4)
    args = (q, k, v, None, blocks.expand(1, 2, 3, 4), None, None, None, None, None, None, "BHSD", "fp8", 0.125, True,
            False, False, None, backend, False, True, False)
    torch.library.opcheck(torch.ops.diffusion_int8.quantized_attention.default, args)


def _qkv(**over):
    q, k, v = realistic_qkv(1, 2, 16, 16, 64)
    d = dict(q=q, k=k, v=v)
    d.update(over)
    return d


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(q=torch.randn(1, 2, 16, 64)), TypeError, "float16, torch.bfloat16"),
        (dict(v=torch.randn(1, 2, 16, 64).bfloat16()), TypeError, "share a dtype"),
        (dict(q=torch.randn(2, 16, 64).half()), ValueError, "4-D"),
        (dict(q="not a tensor"), TypeError, "torch.Tensor"),
        (dict(k=torch.randn(1, 2, 16, 32).half(), v=torch.randn(1, 2, 16, 32).half()), ValueError, "head dims differ"),
        (dict(q=torch.randn(1, 2, 16, 512).half(), k=torch.randn(1, 2, 16, 512).half(), v=torch.randn(1, 2, 16, 512).half()), ValueError, "1 to 256"),
        (dict(k=torch.randn(1, 3, 16, 64).half(), v=torch.randn(1, 3, 16, 64).half()), ValueError, "multiple of the key/value"),
        (dict(v=torch.randn(1, 2, 15, 64).half()), ValueError, "same shape"),
        (dict(k=torch.randn(2, 2, 16, 64).half(), v=torch.randn(2, 2, 16, 64).half()), ValueError, "batch sizes differ"),
        (dict(layout="SBHD"), ValueError, "layout must be one of"),
        (dict(mode="int4"), ValueError, "mode must be one of"),
        (dict(attn_mask=torch.ones(1, 2, 16, 15, dtype=torch.bool)), ValueError, "does not broadcast"),
        (dict(attn_mask=torch.ones(1, 2, 16, 16, dtype=torch.int32)), TypeError, "torch.bool"),
        (dict(scale=-1.0), ValueError, "positive"),
        (dict(q_amax=torch.ones(3)), ValueError, "q_amax of shape"),
        (dict(v_amax=torch.ones(2, 64, dtype=torch.int32)), TypeError, "float tensor"),
        (dict(k_mean=torch.ones(3, 64)), ValueError, r"k_mean of shape \(3, 64\) does not broadcast to \(1, 2, 64\)"),
        (dict(k_mean=torch.zeros(64), smooth_k=False), ValueError, "needs smooth_k=True"),
        (dict(qk_balance=1), TypeError, "qk_balance must be True, False or a tensor"),
        (dict(qk_balance=torch.ones(3, 64)), ValueError, r"qk_balance of shape \(3, 64\) does not broadcast"),
        (dict(qk_balance=torch.ones(64, dtype=torch.int32)), TypeError, "qk_balance must be a float tensor"),
        (dict(qk_balance=torch.ones(64), mode="fp16"), ValueError, "do not apply to mode 'fp16'"),
        (dict(qk_rotate=1), TypeError, "qk_rotate must be True or False"),
        (dict(qk_rotate=True, k_amax=torch.ones(2)), ValueError, "qk_rotate needs Q's and K's ranges measured"),
    ],
)
def test_bad_inputs_raise(kwargs, exc, match):
    args = _qkv(**{k: v for k, v in kwargs.items() if k in ("q", "k", "v")})
    opts = {k: v for k, v in kwargs.items() if k not in ("q", "k", "v")}
    opts.setdefault("mode", "int8")
    with pytest.raises(exc, match=match):
        int8_attention(args["q"], args["k"], args["v"], **opts)


def test_qk_balance_flag_is_checked_after_a_cached_call():
    # 1 == True: a checked qk_balance=True call must not let qk_balance=1 skip the type check through the cache
    d = _qkv()
    int8_attention(d["q"], d["k"], d["v"], mode="int8", qk_balance=True)
    with pytest.raises(TypeError, match="qk_balance must be True, False or a tensor"):
        int8_attention(d["q"], d["k"], d["v"], mode="int8", qk_balance=1)


def test_the_emulation_takes_pv_by_name():
    q, k, v = realistic_qkv(1, 2, 20, 30, 64)
    for pv in config.PV:
        torch.testing.assert_close(R.emulate_attention(q, k, v, pv=pv.value), R.emulate_attention(q, k, v, pv=pv),
                                   atol=0, rtol=0)


def test_no_heads_is_named_as_such():
    q = torch.randn(1, 0, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="at least one head of each"):
        int8_attention(q, q, q)


def test_flags_and_scale_are_checked_after_a_cached_call():
    d = _qkv()
    int8_attention(d["q"], d["k"], d["v"], mode="int8", scale=1)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        int8_attention(d["q"], d["k"], d["v"], mode="int8", scale=True)
    for name in ("smooth_k", "return_lse"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            int8_attention(d["q"], d["k"], d["v"], mode="int8", **{name: 1})


def test_fp16_mode_takes_the_masks_the_int8_modes_take():
    """A 1-D key mask, a float64 or a bfloat16 additive mask beside float16 queries: SDPA refuses them as given, the
    INT8 modes take them; mode fp16 runs them as SDPA runs the equivalent 2-D / float32 mask."""
    d = _qkv()
    q, k, v = d["q"], d["k"], d["v"]
    Sk = k.shape[2]
    keep = torch.arange(Sk) % 3 != 1
    bias = torch.linspace(-2, 1, Sk, dtype=torch.float64).expand(1, 1, q.shape[2], Sk)
    cases = ((keep, keep.reshape(1, Sk)), (bias, bias.float()), (bias.bfloat16(), bias.bfloat16().float()))
    for given, as_sdpa in cases:
        int8_attention(q, k, v, mode="int8", attn_mask=given)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=as_sdpa)
        assert torch.equal(int8_attention(q, k, v, mode="fp16", attn_mask=given), want)


def test_the_int8_modes_have_no_backward_and_say_so(monkeypatch):
    monkeypatch.setenv(config.ENV_BACKEND, "emulation")
    d = _qkv()
    q, k, v = (t.clone().requires_grad_() for t in (d["q"], d["k"], d["v"]))
    with pytest.warns(RuntimeWarning, match="no backward"):
        out = int8_attention(q, k, v, mode="int8_fp16v")
    assert not out.requires_grad  # never a gradient through the quantization scales alone
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(int8_attention(q, k, v, mode="int8_fp16v"), out, atol=0, rtol=0)
    exact = int8_attention(q, k, v, mode="fp16")
    exact.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_the_default_dtype_does_not_reach_the_kernels(monkeypatch):
    monkeypatch.setenv(config.ENV_BACKEND, "emulation")
    q, k, v = realistic_qkv(1, 2, 300, 300, 64)
    want = int8_attention(q, k, v, mode="int8", qk_rotate=True, return_lse=True)
    torch.set_default_dtype(torch.float64)
    try:
        got = int8_attention(q, k, v, mode="int8", qk_rotate=True, return_lse=True)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fp16_mode_compiles_with_dynamic_shapes():
    q, k, v = (t.half() for t in torch.randn(3, 1, 2, 64, 64).unbind(0))
    f = torch.compile(lambda q, k, v: int8_attention(q, k, v, mode="fp16"), fullgraph=True, dynamic=True,
                      backend="eager")
    assert torch.equal(f(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_static_ranges_rejected_in_fp16_mode():
    d = _qkv()
    with pytest.raises(ValueError, match="do not apply"):
        int8_attention(d["q"], d["k"], d["v"], mode="fp16", q_amax=torch.ones(2))


def test_check_finite_raises_and_default_propagates():
    d = _qkv()
    d["k"][0, 1, 3, 3] = math.nan
    with pytest.raises(ValueError, match="k contains NaN"):
        int8_attention(d["q"], d["k"], d["v"], mode="int8", check_finite=True)


def test_device_mismatch_raises():
    d = _qkv()
    meta = torch.empty(1, 2, 16, 64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        int8_attention(d["q"], meta, meta)


def test_tracers_record_the_op_and_eager_skips_its_layers(monkeypatch):
    """make_fx and torch.compile see one diffusion_int8::quantized_attention node; eager calls the implementation."""
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from torch.fx.experimental.proxy_tensor import make_fx

    from diffusion_int8.kernels import ops

    q, k, v = (torch.randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    fn = lambda q, k, v: int8_attention(q, k, v, mode="int8")  # noqa: E731
    graph = make_fx(fn)(q, k, v)
    assert any("diffusion_int8.quantized_attention" in str(n.target) for n in graph.graph.nodes)

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
    assert any("diffusion_int8.quantized_attention" in t for t in seen)

    calls = []
    monkeypatch.setattr(ops, "quantized_attention", lambda *a: calls.append(a) or ops._quantized_attention(*a))
    eager = fn(q, k, v)
    assert not calls  # eager: the custom-op layers are skipped
    torch.testing.assert_close(eager, out, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["q_amax", "k_amax", "v_amax", "k_mean", "qk_balance"])
def test_invalid_static_ranges_are_refused_on_cpu(name, monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    q = k = v = torch.randn(1, 2, 16, 32, dtype=torch.float16)
    shape = (1, 2, 32) if name in ("v_amax", "k_mean", "qk_balance") else (1, 2)
    bads = (float("nan"), float("inf")) if name == "k_mean" else (0.0, -1.0, float("nan"), float("inf"))
    for bad in bads:
        t = torch.ones(shape)
        t[0, 1] = bad
        with pytest.raises(ValueError, match=name):
            diffusion_int8.int8_attention(q, k, v, mode="int8", **{name: t})
    diffusion_int8.int8_attention(q, k, v, mode="int8", **{name: torch.ones(shape)})  # valid: runs


@pytest.mark.parametrize("backend", ["emulation", "triton"])
def test_empty_batch_and_sequences_give_zeros_in_both_backends(backend, monkeypatch):
    if backend == "triton" and not config.interpreting() and not torch.cuda.is_available():
        pytest.skip("the Triton backend needs a GPU or the interpreter")
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for (B, Sq, Sk) in ((0, 16, 16), (2, 0, 16), (2, 16, 0)):
        q = torch.randn(B, 2, Sq, 32, dtype=torch.float16, device=device)
        k = v = torch.randn(B, 2, Sk, 32, dtype=torch.float16, device=device)
        for mode in ("int8", "int8_fp16v"):
            out = diffusion_int8.int8_attention(q, k, v, mode=mode)
            assert out.shape == q.shape and out.dtype == q.dtype and not out.any()


@pytest.mark.parametrize("backend", ["emulation", "triton"])
def test_output_is_laid_out_as_q(backend, kdev, monkeypatch):
    # diffusers passes BHSD views of (B, S, H, D) memory and flattens the output's heads back without a copy, as
    # SDPA's output allows: the output has q's memory order, and the values of the call on contiguous inputs
    monkeypatch.setenv(config.ENV_BACKEND, backend)
    B, H, S, D = 2, 3, 70, 64
    q, k, v = realistic_qkv(B, H, S, S, D, device=kdev)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*strided)
    for mode in ("int8", "int8_fp16v"):
        out = int8_attention(*strided, mode=mode)
        assert out.stride() == sdpa.stride() == (S * H * D, D, H * D, 1)
        assert out.transpose(1, 2).view(B, S, H * D).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, int8_attention(q, k, v, mode=mode), atol=0, rtol=0)
        assert int8_attention(q, k, v, mode=mode).is_contiguous()
    # slices of a fused projection (not dense): the output is dense in their order
    qkv = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=3)  # (B, S, H, 3, D)
    out = int8_attention(*(qkv[:, :, :, i].transpose(1, 2) for i in range(3)), mode="int8")
    assert out.stride() == (S * H * D, D, H * D, 1)
    torch.testing.assert_close(out, int8_attention(q, k, v, mode="int8"), atol=0, rtol=0)
    # a batch broadcast from one sample (stride 0): dense, the batch outermost
    out = int8_attention(q[:1].expand(B, -1, -1, -1), k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1),
                         mode="int8")
    assert out.stride() == (H * S * D, S * D, D, 1)


def test_return_lse_in_every_mode(monkeypatch):
    # int8_attention(return_lse=True) gives (out, lse (B, H, Sq) float32) in either layout: fp16's log-sum-exp is
    # exact against float64 (with a mask that leaves a row no key: -inf), the INT8 modes' the emulation's; the same
    # output as without it; and traced, the custom op carries it
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = realistic_qkv(2, 4, 50, 70, 32, H_kv=2, layout="BSHD")
    mask = torch.rand(2, 1, 50, 70) > 0.2
    mask[1, :, 7] = False
    ref, ref_lse = R.attention_ref(q, k, v, layout="BSHD", attn_mask=mask, return_lse=True)
    for mode in ("fp16", "int8_fp16v", "int8"):
        out, lse = int8_attention(q, k, v, mode=mode, layout="BSHD", attn_mask=mask, return_lse=True)
        assert torch.equal(out, int8_attention(q, k, v, mode=mode, layout="BSHD", attn_mask=mask))
        assert lse.shape == (2, 4, 50) and lse.dtype == torch.float32
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)) and torch.isinf(lse[1, :, 7]).all()
        keys = torch.isfinite(ref_lse)
        if mode == "fp16":
            torch.testing.assert_close(lse[keys], ref_lse[keys].float(), atol=1e-4, rtol=1e-5)
        else:
            pv = {"int8_fp16v": config.PV.FP16, "int8": config.PV.FP8}[mode]
            emu, emu_lse = R.emulate_attention(q, k, v, layout="BSHD", pv=pv, attn_mask=mask, sm_scale=32**-0.5,
                                               return_lse=True)
            assert torch.equal(out, emu) and torch.equal(lse, emu_lse)
    graph = make_fx(lambda q, k, v: int8_attention(q, k, v, mode="int8", layout="BSHD", return_lse=True))(q, k, v)
    assert any("diffusion_int8.quantized_attention" in str(n.target) for n in graph.graph.nodes)
    empty = int8_attention(q[:, :0], k, v, mode="int8", layout="BSHD", return_lse=True)
    assert empty[0].shape == (2, 0, 4, 32) and empty[1].shape == (2, 4, 0)


def test_sdpa_with_lse(kdev):
    # exact attention with its log-sum-exp (mode fp16's, and the processor's exact ring blocks): on a GPU unmasked
    # 16-bit calls come from one flash-attention kernel, the rest from SDPA and a float32 Q·Kᵀ; both against float64
    from diffusion_int8.kernels.api import exact_lse, sdpa_with_lse

    for dtype, H_kv, masked in ((torch.float16, 4, False), (torch.bfloat16, 4, False), (torch.float16, 2, True)):
        q, k, v = realistic_qkv(2, 4, 300, 517, 64, H_kv=H_kv, dtype=dtype, device=kdev)
        mask = None
        if masked:
            mask = torch.rand(2, 1, 1, 517, device=kdev) > 0.3
            mask[1] = False  # batch 1 has no key: zeros, and -inf
        out, lse = sdpa_with_lse(q, k, v, mask, scale=0.1)
        ref, ref_lse = R.attention_ref(q, k, v, attn_mask=mask, sm_scale=0.1, return_lse=True)
        keys = torch.isfinite(ref_lse)
        assert lse.dtype == torch.float32 and torch.equal(torch.isfinite(lse), keys)
        torch.testing.assert_close(lse[keys], ref_lse[keys].float(), atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(lse[keys], exact_lse(q, k, mask, scale=0.1)[keys], atol=2e-4, rtol=1e-5)
        rows = keys[..., None].expand_as(out)
        # the output's own rounding: half a unit in the last place of fp16 (2^-11) or bf16 (2^-8), relative
        bf16 = dtype == torch.bfloat16
        torch.testing.assert_close(out[rows].double(), ref[rows], atol=1e-2 if bf16 else 1e-3, rtol=8e-3 if bf16 else 1e-3)
    q, k, v = realistic_qkv(1, 2, 5, 3, 64, device=kdev)
    assert (sdpa_with_lse(q, k[:, :, :0], v[:, :, :0])[1] == -math.inf).all()  # no keys (flash's own says +inf)
