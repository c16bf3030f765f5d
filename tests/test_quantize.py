"""The Triton quantization kernels reproduce the emulation bit for bit; INT8 Q·Kᵀ is exact."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from diffusion_int8.kernels import reference as R
from diffusion_int8.kernels.config import PV, padded_head_dim, tile_config
from diffusion_int8.inputs import realistic_qkv


def kv_stats(k: torch.Tensor, v: torch.Tensor | None):
    """K's token mean (B, H, D) and V's range (B, H, DP) as the statistics pass computes them, in the forms of
    ``reference.token_mean`` and ``reference.v_channel_amax`` (the range None when ``v`` is)."""
    from diffusion_int8.kernels import quantize as TQ
    from diffusion_int8.kernels.layout import v_channel_amax

    D = k.shape[3]
    mean, vmax, _ = TQ.kv_moments(k, v)
    return mean[..., :D], (None if v is None else v_channel_amax(v, vmax[..., :D], static=False))

HEAD_DIMS = [32, 40, 64, 72, 80, 96, 128, 160, 256]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _v_bits(v8: torch.Tensor, pv: PV, block_n: int) -> torch.Tensor:
    """The bits of the kernels' 8-bit V with its keys in the emulation's order (FP8 Vᵀ (B, H, DP, S_pad) stores
    them in ``layout.v8_key_order`` with 128-key tiles)."""
    from diffusion_int8.kernels import layout as L

    if pv is PV.FP8 and L.fp8_v_keys_permuted(v8.shape[2], block_n):
        return _bits(v8).index_select(-1, L.v8_key_order(v8.shape[-1], v8.shape[2]).to(v8.device))
    return _bits(v8)


@pytest.mark.parametrize("dp", [32, 64, 128])
def test_v8_key_order_keeps_each_threads_p_where_its_kernel_reads_it(dp):
    """The accumulator gives the thread at place t of a quad the columns 8i + 2t + e of a tile. At padded head dim
    128 (P staged in shared memory) they must be the thread's 32 contiguous bytes; at ≤ 64 (P as the MMA's 8-bit
    register operand) bytes 4t .. 4t + 3 of every 16, so no byte of P moves between threads."""
    from diffusion_int8.kernels import layout as L

    order = L.v8_key_order(256, dp)
    assert sorted(order.tolist()) == list(range(256)) and torch.equal(order[128:] - 128, order[:128])
    for t in range(4):
        placed = order[torch.tensor([8 * i + 2 * t + e for i in range(16) for e in range(2)])]
        if dp == 128:
            assert torch.equal(placed.sort().values, torch.arange(32 * t, 32 * t + 32))
        else:
            assert torch.equal(placed % 16 // 4, torch.full((32,), t))
            assert torch.equal(placed.sort().values % 4, torch.arange(32) % 4)  # four consecutive bytes a register


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_quantization_bit_exact(kdev, D, dtype, layout, monkeypatch):
    from diffusion_int8.kernels import layout as L
    from diffusion_int8.kernels import quantize as TQ

    monkeypatch.setattr(L, "BALANCE_MIN_QUERIES", 0)  # balance at the CPU's short lengths too

    S = 300 if kdev == "cpu" else 4224  # the two-launch path; test_two_paths_agree_bit_for_bit takes both
    q, k, v = realistic_qkv(2, 3, S, S, D, dtype=dtype, layout=layout, device=kdev, outliers="separate")
    q, k, v = (R.to_bhsd(t, layout) for t in (q, k, v))  # strided views, as the op passes them
    q_amax = torch.full((3,), 2.5, device=kdev)
    v_amax = torch.rand(v.shape[-1], device=kdev) + 0.5
    # K tiles of 64 and 128 keys, with one scale or 4 groups; Q·Kᵀ balanced where no static range is given
    cases = [(PV.FP16, True, None, None, 64, 4), (PV.FP8, False, q_amax, None, 128, 1), (PV.INT8, True, None, None, 64, 1),
             (PV.FP8, True, None, v_amax, 128, 4), (PV.FP8, False, None, None, 64, 4)]
    for pv, smooth, qa, va, bn, groups in cases:
        q8, qs, k8, ks, v8, vs = TQ.quantize_qkv(q, k, v, 0.125, pv, k_tile=(bn, groups), smooth_k=smooth,
                                                 qk_balance=True, q_amax=qa, v_amax=va)
        bal = None if qa is not None else R.balance_scales(q, k, R.token_mean(k) if smooth else None)
        assert bal is None or (bal != 1).any()  # the outlier channels were balanced
        want_q, want_k = R.quantize_q(q, 0.125, qa, bal), R.quantize_k(k, bn, groups, smooth, balance=bal)
        assert torch.equal(q8, want_q[0]) and torch.equal(qs, want_q[1]), pv
        assert torch.equal(k8, want_k[0]) and torch.equal(ks, want_k[1]), pv
        if pv is PV.FP16:
            assert v8 is None and vs is None
        else:
            want_v = R.quantize_v(v, pv, R.v_channel_amax(v, va))
            assert torch.equal(_v_bits(v8, pv, bn), _bits(want_v[0])) and torch.equal(vs, want_v[1]), pv


def test_gqa_and_static_k_range_bit_exact(kdev):
    from diffusion_int8.kernels import quantize as TQ

    q, k, v = realistic_qkv(1, 4, 150, 200, 64, H_kv=2, device=kdev)
    amax = torch.rand(1, 2, device=kdev) * 3 + 0.5  # smaller than the data: values get clipped
    for groups in (1, 4):
        q8, qs, k8, ks, _, _ = TQ.quantize_qkv(q, k, v, 0.5, PV.FP16, k_tile=(64, groups), k_amax=amax)
        want_k = R.quantize_k(k, 64, groups, True, amax)
        assert torch.equal(k8, want_k[0]) and torch.equal(ks, want_k[1])
        assert (k8.abs() == 127).float().mean() > 0.01  # clipping happened
    want_q = R.quantize_q(q, 0.5)
    assert torch.equal(q8, want_q[0]) and torch.equal(qs, want_q[1])


@pytest.mark.parametrize("pv", [PV.FP8, PV.FP16])
def test_static_k_mean_bit_exact_and_skips_the_statistics_pass(kdev, pv, monkeypatch):
    from diffusion_int8.kernels import quantize as TQ

    q, k, v = realistic_qkv(2, 4, 150, 333, 72, H_kv=2, layout="BSHD", device=kdev)
    q, k, v = (R.to_bhsd(t, "BSHD") for t in (q, k, v))
    # any vector is a valid smoothing vector; this one is near K's mean, as a calibration's would be
    mean = k.float().mean((0, 2)) + 0.1 * torch.randn(2, 72, device=kdev)  # (H_kv, D), broadcast over B
    v_amax = v.float().abs().amax((0, 2)) * 0.9  # (H_kv, D): V's top values get clipped
    real = TQ.kv_moments
    measured = []
    monkeypatch.setattr(TQ, "kv_moments",
                        lambda k_, v_, *a, **kw: measured.append((k_ is None, v_ is None)) or real(k_, v_, *a, **kw))
    cfg = tile_config(72, pv)
    tiles = (cfg.block_n, cfg.k_groups)
    q8, qs, k8, ks, v8, vs = TQ.quantize_qkv(q, k, v, 0.2, pv, k_mean=mean, v_amax=v_amax)  # the table's tile
    assert measured == []  # nothing left to measure: no statistics pass
    want_k = R.quantize_k(k, *tiles, True, None, mean)
    assert torch.equal(k8, want_k[0]) and torch.equal(ks, want_k[1])
    assert not torch.equal(k8, R.quantize_k(k, *tiles, True)[0])  # the static mean was used
    if pv is PV.FP8:
        want_v = R.quantize_v(v, pv, R.v_channel_amax(v, v_amax))
        assert torch.equal(_v_bits(v8, pv, cfg.block_n), _bits(want_v[0])) and torch.equal(vs, want_v[1])
        # static mean, measured V range: the pass reads V only
        measured.clear()
        _, _, k8, _, v8, vs = TQ.quantize_qkv(q, k, v, 0.2, pv, k_mean=mean)
        assert measured == [(True, False)]
        assert torch.equal(k8, want_k[0])
        want_v = R.quantize_v(v, pv, R.v_channel_amax(v))
        assert torch.equal(_v_bits(v8, pv, cfg.block_n), _bits(want_v[0])) and torch.equal(vs, want_v[1])


@pytest.mark.parametrize("D", [72, 40])  # padded to 128 and to 64: FP8 V's two key orders
@pytest.mark.parametrize("smooth", [True, False])
def test_two_paths_agree_bit_for_bit(kdev, smooth, D, monkeypatch):
    # Short sequences take one launch (statistics and quantization in one program per K/V head), longer ones
    # a statistics pass and then the quantization; both give the emulation's result bit for bit. GQA (2 query
    # heads per K/V head) and odd lengths; forcing the threshold to 0 sends the same call down the other path.
    from diffusion_int8.kernels import layout as L
    from diffusion_int8.kernels import quantize as TQ

    monkeypatch.setattr(L, "BALANCE_MIN_QUERIES", 0)
    q, k, v = realistic_qkv(1, 2, 77, 203, D, H_kv=1, device=kdev, outliers="separate", n_outliers=3,
                            outlier_gain=100)
    mean = R.token_mean(k) if smooth else None
    bal = R.balance_scales(q, k, mean)
    assert (bal[..., :D] != 1).sum() >= 4
    real, fused_max = TQ.kv_moments, TQ._FUSED_MAX_TOKENS
    # INT8 V, and FP8 V in 128-key tiles, whose keys are stored in layout.v8_key_order
    for pv, (bn, groups) in ((PV.INT8, (64, 4)), (PV.FP8, (128, 1))):
        results, passes = [], []
        monkeypatch.setattr(TQ, "kv_moments", lambda *a, **kw: passes.append(1) or real(*a, **kw))
        for limit in (fused_max, 0):
            monkeypatch.setattr(TQ, "_FUSED_MAX_TOKENS", limit)
            results.append(TQ.quantize_qkv(q, k, v, 0.3, pv, k_tile=(bn, groups), smooth_k=smooth, qk_balance=True))
        assert passes == [1]  # the short call ran no separate statistics pass, the forced one did
        for got, other in zip(*results):
            assert torch.equal(_bits(got), _bits(other)), pv
        want = (*R.quantize_q(q, 0.3, None, bal), *R.quantize_k(k, bn, groups, smooth, k_mean=mean, balance=bal),
                *R.quantize_v(v, pv, R.v_channel_amax(v)))
        got = (*results[0][:4], _v_bits(results[0].v8, pv, bn), results[0].vs)
        for g, w in zip(got, (*want[:4], _bits(want[4]), want[5])):
            assert torch.equal(g, w), pv


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_given_balance_quantizes_as_the_measured_one(kdev, layout, monkeypatch):
    # A balance given as a tensor (a calibrated one) goes through the same kernels as a measured one: given the
    # measured balance, the same bits; given with static ranges, the emulation's bits (no statistics pass for it)
    from diffusion_int8.kernels import layout as L
    from diffusion_int8.kernels import quantize as TQ

    monkeypatch.setattr(L, "BALANCE_MIN_QUERIES", 0)
    q, k, v = realistic_qkv(2, 4, 300, 333, 72, H_kv=2, layout=layout, device=kdev, outliers="separate")
    q, k, v = (R.to_bhsd(t, layout) for t in (q, k, v))
    bal = R.balance_scales(q, k, R.token_mean(k))
    assert (bal[..., :72] != 1).sum() >= 4
    given = bal[..., :72].clone()
    for got, want in zip(TQ.quantize_qkv(q, k, v, 0.3, PV.FP8, qk_balance=given)[:6],
                         TQ.quantize_qkv(q, k, v, 0.3, PV.FP8, qk_balance=True)[:6]):
        assert torch.equal(_bits(got), _bits(want))
    one = given[:1].repeat(1, 1, 2)[..., ::2]  # broadcast over the batch, strided channels
    assert one.stride(-1) == 2
    mean, qa, ka = R.token_mean(k), torch.full((2, 4), 7.0, device=kdev), torch.full((1, 2), 5.0, device=kdev)
    got = TQ.quantize_qkv(q, k, v, 0.3, PV.FP16, qk_balance=one, q_amax=qa, k_amax=ka, k_mean=mean)
    full = R.given_balance(one, 2, 2, 72)
    want = (*R.quantize_q(q, 0.3, qa, full), *R.quantize_k(k, 64, 1, True, ka, mean, full))
    for g, w in zip(got[:4], want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dp", [32, 128, 256])
def test_hadamard_is_the_matrix_product_on_a_grid(dp):
    # reference.hadamard (the kernels' numerics): x·H within the grid's rounding, at most 2^-14 of the row's range a
    # channel; rows of any scale, a zero row stays zero, a row holding NaN or Inf comes out NaN
    i = torch.arange(dp)
    bits = i[:, None] & i[None, :]
    H = (-1.0) ** sum((bits >> b) & 1 for b in range(8)).double()
    x = torch.randn(8, dp) * torch.tensor([1, 1e-30, 1e30, 3e-3, 1, 1, 1, 1])[:, None]
    x[0, 5] *= 40
    x[4] = 0.0
    x[5, 3], x[6, 1] = float("inf"), float("nan")
    y = R.hadamard(x)
    finite = [0, 1, 2, 3, 4, 7]
    exact = x[finite].double() @ H
    bound = dp * 2.0**-14 * x[finite].double().abs().amax(1, keepdim=True)
    assert ((y[finite].double() - exact).abs() <= bound).all()
    assert ((y[finite].double() - exact).abs() > 0).any()  # the grid did round
    assert (y[4] == 0).all() and y[5:7].isnan().all()


@pytest.mark.parametrize("layout, D", [("BHSD", 72), ("BSHD", 72), ("BHSD", 40), ("BSHD", 200)])
def test_rotation_bit_exact_on_both_paths(kdev, layout, D, monkeypatch):
    # qk_rotate: Q's and K's rows through the Hadamard product (two INT8 MMAs of DP = 64, 128 and 256) inside the
    # quantization kernels, on the one-launch path for short sequences and the two-launch one, equal to the
    # emulation's bit for bit, Q's scale carrying the 1/DP
    from diffusion_int8.kernels import quantize as TQ

    q, k, v = realistic_qkv(1, 4, 77, 203, D, H_kv=2, layout=layout, device=kdev, outliers="shared",
                            outlier_gain=400, n_outliers=3)
    q, k, v = (R.to_bhsd(t, layout) for t in (q, k, v))
    from diffusion_int8.kernels import layout as L

    monkeypatch.setattr(L, "BALANCE_MIN_QUERIES", 0)
    mean = R.token_mean(k)
    bal = R.balance_scales(q, k, mean)
    for limit in (TQ._FUSED_MAX_TOKENS, 0):
        monkeypatch.setattr(TQ, "_FUSED_MAX_TOKENS", limit)
        for pv, balance in ((PV.FP8, False), (PV.FP16, False), (PV.FP16, True)):  # with the balance: it applies first
            cfg = tile_config(D, pv)
            b = bal if balance else None
            got = TQ.quantize_qkv(q, k, v, 0.3, pv, qk_rotate=True, qk_balance=balance)
            want = (*R.quantize_q(q, 0.3, None, b, True),
                    *R.quantize_k(k, cfg.block_n, cfg.k_groups, True, None, mean, b, True))
            for g, w in zip(got[:4], want):
                assert torch.equal(g, w), (limit, pv, balance)
    bad = q.clone()
    bad[0, 1, 5, 3], bad[0, 2, 9, 0] = float("nan"), float("inf")  # such a row's scale comes out NaN, as emulated
    got, want = TQ.quantize_qkv(bad, k, v, 0.3, PV.FP8, qk_rotate=True), R.quantize_q(bad, 0.3, None, None, True)
    assert got.qs[0, 1, 5].isnan() and got.qs[0, 2, 9].isnan()
    torch.testing.assert_close(got.qs, want[1], rtol=0, atol=0, equal_nan=True)
    ok = ~got.qs.isnan()  # a poisoned row's int8 values are whatever the backend's min/max make of NaN
    assert torch.equal(got.q8[ok], want[0][ok])
    got = TQ.quantize_qkv(q, k, v, 0.3, PV.FP8, qk_rotate=True)
    with pytest.raises(ValueError, match="qk_rotate needs Q's and K's ranges measured"):
        TQ.quantize_qkv(q, k, v, 0.3, PV.FP8, qk_rotate=True, k_amax=torch.ones(1, device=kdev))
    with pytest.raises(ValueError, match="qk_rotate needs Q's and K's ranges measured"):
        R.emulate_attention(q, k, v, qk_rotate=True, q_amax=torch.ones(1, device=kdev))
    plain = R.quantize_q(q, 0.3)
    assert not torch.equal(got.q8, plain[0])
    # the rotation spreads Q's outlier channels: a token's range, relative to its norm (which the unnormalized
    # rotation multiplies by sqrt(DP)), shrinks, so the other channels get more levels (qs carries 1/DP)
    assert (got.qs[:, :, :77] * padded_head_dim(D) ** 0.5 < plain[1][:, :, :77]).float().mean() > 0.9


def test_rotation_matrix_is_made_outside_graph_capture(monkeypatch):
    # the rotation's ±1 matrix is a per-device constant made on first use: made inside a CUDA graph capture, it
    # would be filled only when the graph replays, so the first rotated call there says what to do instead
    from diffusion_int8.kernels import quantize as TQ

    h = TQ._hadamard_int8(64, torch.device("cpu"))
    assert h.dtype == torch.int8 and torch.equal(h.float() @ h.float().T, 64.0 * torch.eye(64))
    assert torch.equal(R.hadamard(torch.eye(64)), h.float())  # the emulation's transform is this matrix
    i = torch.arange(64)
    assert torch.equal(h, (1 - 2 * (sum(((i[:, None] & i[None, :]) >> b) & 1 for b in range(6)) & 1)).to(torch.int8))
    monkeypatch.setattr(TQ, "_HADAMARD", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="once outside CUDA graph capture"):
        TQ._hadamard_int8(64, torch.device("cuda", 0))


def test_balance_is_exact_and_lifts_outlier_accuracy():
    # Q·Kᵀ of the balanced tensors equals Q·Kᵀ (powers of two: no rounding), and the INT8 scores on inputs with
    # outlier channels of Q apart from K's come much closer to the exact scores.
    q, k, _ = realistic_qkv(2, 4, 256, 256, 64, H_kv=2, outliers="separate", n_outliers=3)
    bal = R.balance_scales(q, k, R.token_mean(k))
    assert ((bal.log2() - bal.log2().round()) == 0).all() and (bal != 1).any()
    per_q = bal.repeat_interleave(2, dim=1)[:, :, None, :64]
    qk = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)
    qk_bal = (q.double() / per_q) @ (k.double().repeat_interleave(2, dim=1) * per_q).transpose(-1, -2)
    assert torch.equal(qk, qk_bal)
    errs = {}
    for name, b in (("plain", None), ("balanced", bal)):
        q8, qs = R.quantize_q(q, 1.0, None, b)
        k8, ks = R.quantize_k(k, 64, 4, True, balance=b)
        k8, ks = k8.repeat_interleave(2, dim=1), ks.repeat_interleave(2, dim=1)
        s = (q8.double() @ k8.double().transpose(-1, -2)) * qs[..., None] * ks[:, :, None, :]
        kc = k.double() - R.token_mean(k).double()[:, :, None]
        exact = q.double() @ kc.repeat_interleave(2, dim=1).transpose(-1, -2) * math.log2(math.e)
        errs[name] = (s[:, :, :256, :256] - exact).abs().mean().item()
    assert errs["balanced"] < 0.5 * errs["plain"], errs


def test_balance_applies_only_where_asked_and_measurable(kdev):
    # Off by default; on request only with measured ranges and mean, and with enough queries per K/V head for
    # Q's channel ranges to mean something (one query row: the balance made accuracy worse)
    from diffusion_int8.kernels import layout as L
    from diffusion_int8.kernels import quantize as TQ

    n = L.BALANCE_MIN_QUERIES
    assert not L.balance_applies(False, None, None, None, n)
    assert L.balance_applies(True, None, None, None, n) and not L.balance_applies(True, None, None, None, n - 1)
    amax = torch.ones(1)
    assert not any(L.balance_applies(True, *s, n) for s in ((amax, None, None), (None, amax, None), (None, None, amax)))
    q, k, v = realistic_qkv(1, 2, n // 2, 64, 32, H_kv=1, device=kdev, outliers="separate")  # 2 heads: n queries
    with_bal = TQ.quantize_qkv(q, k, v, 0.3, PV.FP16, qk_balance=True)
    assert not torch.equal(with_bal.q8, TQ.quantize_qkv(q, k, v, 0.3, PV.FP16).q8)
    assert torch.equal(with_bal.q8, R.quantize_q(q, 0.3, None, R.balance_scales(q, k, R.token_mean(k)))[0])
    short = TQ.quantize_qkv(q[:, :, :5], k, v, 0.3, PV.FP16, qk_balance=True)
    assert torch.equal(short.q8, R.quantize_q(q[:, :, :5], 0.3)[0])


@triton.jit
def _qk_tile_kernel(Q8, K8, OUT, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # The same INT8 tl.dot the attention kernel issues, on one (BM, BN) tile.
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    q = tl.load(Q8 + offs_m[:, None] * DP + offs_d[None, :])
    k = tl.load(K8 + offs_n[None, :] * DP + offs_d[:, None])
    tl.store(OUT + offs_m[:, None] * (tl.num_programs(1) * BN) + offs_n[None, :], tl.dot(q, k))


@pytest.mark.parametrize("D", [40, 64, 128, 256])
def test_int8_qk_dot_bit_exact(kdev, D):
    S = 256 if kdev == "cpu" else 4096
    q, k, _ = realistic_qkv(1, 1, S, S, D, device=kdev)
    q8, _ = R.quantize_q(q, 1.0)
    k8, _ = R.quantize_k(k, 64, 4)
    q8, k8 = q8[0, 0].contiguous(), k8[0, 0].contiguous()
    cfg = tile_config(D, PV.FP8)
    out = torch.full((S, S), -(2**31), dtype=torch.int32, device=kdev)
    _qk_tile_kernel[(S // cfg.block_m, S // cfg.block_n)](q8, k8, out, DP=q8.shape[1], BM=cfg.block_m, BN=cfg.block_n)
    want = (q8.double() @ k8.double().T).to(torch.int32)
    assert torch.equal(out, want)


@pytest.mark.parametrize("seq, D", [(200, 72), (2500, 72), (9000, 72), (1100, 200)])  # 1, 10, 29, 5 chunks
def test_kv_stats_match_pytorch(kdev, seq, D):
    # K's mean in the statistics pass's fixed order of sums, which the emulation follows bit for bit (tiles of 32
    # tokens at D = 200, 64 otherwise), and within fp32 rounding of torch.mean; V's range exact
    from diffusion_int8.kernels import quantize as TQ

    _, k, v = realistic_qkv(2, 3, 10, seq, D, layout="BSHD", device=kdev)
    k, v = R.to_bhsd(k, "BSHD"), R.to_bhsd(v, "BSHD")
    v[0, 1, :, 7] = 0.0  # a silent channel takes the floor
    mean, vamax = kv_stats(k, v)
    assert torch.equal(mean, R.token_mean(k))
    torch.testing.assert_close(mean, k.float().mean(2), rtol=1e-5, atol=1e-5)
    assert torch.equal(vamax, R.v_channel_amax(v))  # a max is exact; floor and padding as the reference's
    assert kv_stats(k, None)[1] is None
    assert TQ.kv_moments(None, v)[0] is None and torch.equal(TQ.kv_moments(None, v)[1], TQ.kv_moments(k, v)[1])
    v[1, 2, seq // 2, 5] = float("nan")
    _, vamax = kv_stats(k, v)
    assert torch.isnan(vamax[1, 2, 5]) and torch.isfinite(vamax[0]).all() and torch.isfinite(vamax[1, 2, 6:]).all()
