"""Block-sparse attention (``int8_attention(..., block_mask=...)``): the kernels against the emulation and float64."""

from __future__ import annotations

import pytest
import torch

from diffusion_int8.kernels import int8_attention
from diffusion_int8.kernels import reference as R
from diffusion_int8.kernels.api import expand_block_mask
from diffusion_int8.kernels.config import PV, SPARSE_BLOCK
from diffusion_int8.kernels.sparsity import predict_block_mask
from diffusion_int8.inputs import local_qkv, realistic_qkv
from test_attention import BOUNDS, bounds_for, check, cos_l1, run_kernel


def _blocks(n: int) -> int:
    return -(-n // SPARSE_BLOCK)


def _random_mask(B, H, Sq, Sk, keep, device, seed=0):
    """A random block mask keeping about ``keep`` of the blocks and the first (the sink's: a predictor keeps it,
    and without it rows attend so evenly that the float64 bounds are of the input, not of the kernel), with one
    query block that keeps nothing (where there are two or more)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, H, _blocks(Sq), _blocks(Sk), generator=g) < keep
    mask[..., 0] = True
    if mask.shape[2] > 1:
        mask[0, 0, 0] = False
    return mask.to(device)


def _sparse_ref(q, k, v, mask, layout="BHSD"):
    """float64 attention over the kept blocks; rows whose block keeps nothing are 0."""
    s_ax = 2 if layout == "BHSD" else 1
    Sq, Sk = q.shape[s_ax], k.shape[s_ax]
    ref = R.attention_ref(q, k, v, layout=layout, attn_mask=expand_block_mask(mask, Sq, Sk))
    empty = ~mask.any(-1).repeat_interleave(SPARSE_BLOCK, -1)[..., :Sq]  # (B, H, Sq)
    if layout == "BSHD":
        empty = empty.transpose(1, 2)
    return ref.masked_fill(empty[..., None], 0.0)


@pytest.mark.parametrize("pv", list(PV))
@pytest.mark.parametrize("D", [40, 64, 128])
def test_kernel_matches_emulation_and_float64(kdev, pv, D):
    n = 1 if kdev == "cpu" else 8
    for B, H, H_kv, Sq, Sk, layout in [(1, 2, 1, 300 * n, 333 * n, "BHSD"), (2, 2, 2, 129 * n, 257 * n, "BSHD"),
                                      (1, 1, 1, 1, 200 * n, "BHSD")]:
        q, k, v = realistic_qkv(B, H, Sq, Sk, D, H_kv=H_kv, layout=layout, device=kdev)
        mask = _random_mask(B, H, Sq, Sk, 0.5, kdev)
        kw = dict(layout=layout, pv=pv, block_mask=mask)
        out = run_kernel(q, k, v, **kw)  # written into a NaN-poisoned output
        # against float64, INT8 P (one scale per row and block) read cos 0.99880 / rel L1 0.057 on one CI draw at
        # D = 64, the kernel equal to the emulation: a bound of the format on these inputs, looser than the dense
        # tests'. One query row is one per-token Q scale, the dense tests' tiny case: over 1,500 draws of it
        # (200 keys) the emulation's worst was cos 0.99439 / rel L1 0.099 (D = 40, 8-bit P·V), and a CI draw read
        # rel L1 0.1002 at D = 128 with 16-bit P·V, so it takes the tiny bounds. The kernel-against-emulation
        # comparison in check() is the strict one.
        bounds = bounds_for(pv, Sq, Sk) if Sq == 1 else (0.998, 0.065) if pv is PV.INT8 else None
        check(out, R.emulate_attention(q, k, v, **kw), _sparse_ref(q, k, v, mask, layout), pv, q.dtype, bounds,
              call=(q, k, v, kw))


@pytest.mark.parametrize("pv", list(PV))
def test_keeping_every_block_is_the_dense_result_bit_for_bit(kdev, pv):
    n = 1 if kdev == "cpu" else 16
    for D, Sq, Sk in [(64, 200 * n, 301 * n), (128, 130 * n, 129 * n), (72, 128 * n, 256 * n)]:
        q, k, v = realistic_qkv(1, 2, Sq, Sk, D, device=kdev)
        ones = torch.ones(1, 1, _blocks(Sq), _blocks(Sk), dtype=torch.bool, device=kdev)
        dense = run_kernel(q, k, v, layout="BHSD", pv=pv)
        assert torch.equal(run_kernel(q, k, v, layout="BHSD", pv=pv, block_mask=ones), dense)
        assert torch.equal(R.emulate_attention(q, k, v, pv=pv, block_mask=ones), R.emulate_attention(q, k, v, pv=pv))


def test_skipped_blocks_change_nothing_else(kdev):
    # a key block skipped by every query block is as if its keys were masked out, bit for bit in the emulation
    q, k, v = realistic_qkv(1, 2, 256, 384, 64, device=kdev)
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=kdev)
    mask[..., 1] = False
    keys = torch.ones(1, 1, 1, 384, dtype=torch.bool, device=kdev)
    keys[..., 128:256] = False
    for pv in PV:
        sparse = R.emulate_attention(q, k, v, pv=pv, block_mask=mask)
        assert torch.equal(sparse, R.emulate_attention(q, k, v, pv=pv, attn_mask=keys))
        check(run_kernel(q, k, v, layout="BHSD", pv=pv, block_mask=mask), sparse,
              _sparse_ref(q, k, v, mask), pv, q.dtype, call=(q, k, v, dict(pv=pv, block_mask=mask)))


def test_with_a_key_padding_mask(kdev):
    q, k, v = realistic_qkv(2, 2, 200, 300, 64, device=kdev)
    pad = torch.ones(2, 1, 1, 300, dtype=torch.bool, device=kdev)
    pad[1, ..., 250:] = False
    mask = _random_mask(2, 2, 200, 300, 0.6, kdev, seed=3)
    kw = dict(layout="BHSD", pv=PV.FP8, attn_mask=pad, block_mask=mask)
    ref = R.attention_ref(q, k, v, attn_mask=pad & expand_block_mask(mask, 200, 300))
    check(run_kernel(q, k, v, **kw), R.emulate_attention(q, k, v, **kw), ref, PV.FP8, q.dtype, call=(q, k, v, kw))


def test_block_lists(kdev):
    from diffusion_int8.kernels.attention import block_lists

    mask = _random_mask(2, 3, 700, 1500, 0.4, kdev, seed=5)
    counts, idx = block_lists(mask[:, :1], 2, 3, 700, 1500)  # broadcast over heads
    flat = mask[:, :1].expand(2, 3, -1, -1).reshape(-1, mask.shape[-1]).cpu()
    assert torch.equal(counts.cpu(), flat.sum(-1).int())
    for row, c in zip(range(flat.shape[0]), counts.cpu().tolist()):
        assert idx[row, :c].cpu().tolist() == flat[row].nonzero().flatten().tolist()


def test_split_block_lists(kdev):
    from diffusion_int8.kernels.attention import block_lists

    mask = _random_mask(2, 3, 700, 1500, 0.4, kdev, seed=6)
    mask[1, 0, 2] = True  # a row keeping every block, and (from _random_mask) one keeping none
    counts, idx = block_lists(mask, 2, 3, 700, 1500, split=True)
    flat = mask.reshape(-1, mask.shape[-1]).cpu()
    assert torch.equal(counts.cpu(), (~flat).sum(-1).int())
    for row in range(flat.shape[0]):
        skipped, kept = (~flat[row]).nonzero().flatten().tolist(), flat[row].nonzero().flatten().tolist()
        assert idx[row].cpu().tolist() == skipped + kept


def _poisoned_split(q, k, v, kw):
    """``run_kernel`` with ``return_skipped``: the output NaN-poisoned, and the memory the skipped blocks' results
    are allocated in too (NaN blocks of their sizes, freed after the output's allocation, which the allocator hands
    out again)."""
    from diffusion_int8.kernels.attention import triton_attention

    B, H, Sq = R.to_bhsd(q, kw["layout"]).shape[:3]
    out = torch.full_like(q, float("nan"))
    poison = [torch.full_like(q, float("nan")), torch.full((B, H, Sq), float("nan"), device=q.device)]
    del poison
    res = triton_attention(q, k, v, out=out, sm_scale=q.shape[-1] ** -0.5, return_skipped=True, **kw)
    assert res[0] is out
    return res


@pytest.mark.parametrize("pv", list(PV))
@pytest.mark.parametrize("D", [64, 128])
def test_one_launch_returns_the_dense_result_and_the_skipped_blocks_apart(kdev, pv, D):
    """``return_skipped``: the skipped blocks' output and log-sum-exp are the complement's call's (the same tiles
    in the same order: the sparse check against the emulation), and the output is the dense call's, up to P's
    rounding in another order of the blocks; rows keeping every block give 0 and -inf, rows keeping none the dense
    result twice. GQA, and a BHSD view of (B, S, H, D) memory as diffusers hands it over."""
    n = 1 if kdev == "cpu" else 8
    for B, H, H_kv, Sq, Sk, layout, view in [(1, 2, 2, 300 * n, 333 * n, "BHSD", False),
                                             (2, 2, 2, 129 * n, 257 * n, "BSHD", False),
                                             (1, 4, 2, 200 * n, 270 * n, "BHSD", True),
                                             (1, 2, 2, 200, 256, "BHSD", False),  # no partial key block
                                             (1, 2, 2, 200, 100, "BHSD", False)]:  # one key block, partial
        q, k, v = realistic_qkv(B, H, Sq, Sk, D, H_kv=H_kv, layout=layout, device=kdev, seed=D + Sq)
        if view:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        mask = _random_mask(B, H, Sq, Sk, 0.5, kdev, seed=Sk)  # its query block 0 of head 0 keeps nothing
        mask[0, 1, 0] = True  # one that keeps every block
        out, skipped, skipped_lse = _poisoned_split(q, k, v, dict(layout=layout, pv=pv, block_mask=mask))
        rest = dict(layout=layout, pv=pv, block_mask=~mask)
        emu_rest, emu_rest_lse = R.emulate_attention(q, k, v, return_lse=True, **rest)
        check(skipped, emu_rest, _sparse_ref(q, k, v, ~mask, layout), pv, q.dtype, call=(q, k, v, rest))
        finite = torch.isfinite(emu_rest_lse)
        assert torch.equal(finite, torch.isfinite(skipped_lse))
        torch.testing.assert_close(skipped_lse[finite], emu_rest_lse[finite], atol=2e-3, rtol=1e-4)
        rows = slice(0, min(SPARSE_BLOCK, Sq))
        assert (skipped_lse[0, 1, rows] == float("-inf")).all() and (R.to_bhsd(skipped, layout)[0, 1, rows] == 0).all()
        ref = R.attention_ref(q, k, v, layout=layout)
        dense = run_kernel(q, k, v, layout=layout, pv=pv)
        if pv is PV.FP16:  # 16-bit P: the order of the blocks changes float32 sums only
            check(out, dense, ref, pv, q.dtype)
        else:  # the same format's error, its rounding moved (row by row it goes either way): the dense call's
            (cos, l1), (_, dense_l1) = cos_l1(out, ref), cos_l1(dense, ref)
            assert cos >= BOUNDS[pv][0] and l1 <= min(BOUNDS[pv][1], 1.2 * dense_l1), (cos, l1, dense_l1)
            err, dense_err = ((t.double() - ref).abs().max() for t in (out, dense))
            assert err <= 2 * dense_err, (err, dense_err)
        # the query block that keeps nothing skips everything: its skipped result is the dense one
        o, s_ = (R.to_bhsd(t, layout)[0, 0, rows] for t in (out, skipped))
        assert torch.equal(s_, o)


def test_skipped_blocks_through_the_public_op_and_mode_fp16(kdev):
    q, k, v = realistic_qkv(1, 2, 300, 260, 64, layout="BSHD", device=kdev)
    mask = _random_mask(1, 2, 300, 260, 0.5, kdev, seed=2)
    out, skipped, lse = int8_attention(q, k, v, mode="fp16", layout="BSHD", block_mask=mask, return_skipped=True)
    assert torch.equal(out, int8_attention(q, k, v, mode="fp16", layout="BSHD"))  # exact: the dense call
    rest, rest_lse = int8_attention(q, k, v, mode="fp16", layout="BSHD", block_mask=~mask, return_lse=True)
    assert torch.equal(skipped, rest) and torch.equal(lse, rest_lse)
    # INT8 (on a GPU, the kernels; on the CPU, the emulation through the op)
    out, dense_lse, skipped, lse = int8_attention(q, k, v, mode="int8", layout="BSHD", block_mask=mask,
                                                  return_lse=True, return_skipped=True)
    check(skipped, R.emulate_attention(q, k, v, layout="BSHD", pv=PV.FP8, block_mask=~mask), _sparse_ref(
        q, k, v, ~mask, "BSHD"), PV.FP8, q.dtype, call=(q, k, v, dict(layout="BSHD", pv=PV.FP8, block_mask=~mask)))
    assert lse.shape == dense_lse.shape == (1, 2, 300) and torch.isfinite(dense_lse).all()
    # the dense log-sum-exp is the merge of the two parts'
    _, kept_lse = int8_attention(q, k, v, mode="int8", layout="BSHD", block_mask=mask, return_lse=True)
    torch.testing.assert_close(dense_lse, torch.logaddexp(kept_lse, lse), atol=0.02, rtol=0)
    # no keys: zeros and -inf for the skipped blocks too
    empty = int8_attention(q, k[:, :0], v[:, :0], mode="int8", layout="BSHD", block_mask=mask[..., :0],
                           return_skipped=True)
    assert (empty[0] == 0).all() and (empty[1] == 0).all() and (empty[2] == float("-inf")).all()
    with pytest.raises(ValueError, match="return_skipped needs a block_mask"):
        int8_attention(q, k, v, mode="int8", layout="BSHD", return_skipped=True)
    with pytest.raises(TypeError, match="return_skipped must be True or False"):
        int8_attention(q, k, v, mode="int8", layout="BSHD", block_mask=mask, return_skipped=1)
    from diffusion_int8.kernels.attention import triton_attention

    with pytest.raises(ValueError, match="return_skipped needs a block_mask of the caller's"):  # the kernel's entry
        triton_attention(q, k, v, layout="BSHD", pv=PV.FP8, sm_scale=0.125, sparsity=0.5, return_skipped=True)


def test_public_op_and_mode_fp16():
    q, k, v = realistic_qkv(1, 2, 300, 260, 64, layout="BSHD")
    mask = _random_mask(1, 2, 300, 260, 0.5, "cpu", seed=1)
    ref = _sparse_ref(q, k, v, mask, "BSHD")
    exact = int8_attention(q, k, v, mode="fp16", layout="BSHD", block_mask=mask)
    # exact up to the output's fp16 rounding: half a unit in the last place is 2^-11 of the value (an element of 4.96
    # read 0.0022 off against an absolute 0.002 alone)
    torch.testing.assert_close(exact.double(), ref, atol=2e-3, rtol=2**-11)
    out = int8_attention(q, k, v, mode="int8", layout="BSHD", block_mask=mask)
    check(out, R.emulate_attention(q, k, v, layout="BSHD", pv=PV.FP8, block_mask=mask), ref, PV.FP8, q.dtype,
          call=(q, k, v, dict(layout="BSHD", pv=PV.FP8, block_mask=mask)))


def test_block_masks_broadcast_as_documented(kdev):
    """A block mask with size-1 dims (broadcastable to (B, H, nQB, nKB)) gives what its expanded form gives: bit for
    bit in the kernels and the emulation, and within the output's rounding in mode fp16."""
    n = 1 if kdev == "cpu" else 8
    B, H, Sq, Sk = 1, 2, 300 * n, 280 * n
    q, k, v = realistic_qkv(B, H, Sq, Sk, 64, device=kdev)
    nq, nk = _blocks(Sq), _blocks(Sk)
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.rand(nk, generator=g) < 0.6, torch.rand(nq, 1, generator=g) < 0.6
    keys[0] = queries[0] = keys[-1] = True
    queries[1] = False  # a query block that keeps nothing: its rows give 0
    masks = {"(nKB,)": keys, "(nQB, 1)": queries, "(1, 1, 1, 1)": torch.ones(1, 1, 1, 1, dtype=torch.bool),
             "(B, H, 1, nKB)": keys.view(1, 1, 1, nk).expand(B, H, 1, nk)}
    for name, mask in masks.items():
        mask = mask.to(kdev)
        full = mask.expand(B, H, nq, nk).contiguous()
        for pv in PV:
            kw = dict(layout="BHSD", pv=pv)
            out = run_kernel(q, k, v, block_mask=mask, **kw)
            assert torch.equal(out, run_kernel(q, k, v, block_mask=full, **kw)), (name, pv)
            assert torch.equal(R.emulate_attention(q, k, v, block_mask=mask, **kw),
                               R.emulate_attention(q, k, v, block_mask=full, **kw)), (name, pv)
        exact = int8_attention(q, k, v, mode="fp16", block_mask=mask)
        torch.testing.assert_close(exact.double(), _sparse_ref(q, k, v, full), atol=2e-3, rtol=2**-11, msg=name)


def test_bad_block_masks_are_refused_before_any_work():
    q, k, v = realistic_qkv(1, 2, 300, 260, 64)
    good = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="block_mask has dtype torch.float32; accepted: torch.bool"):
        int8_attention(q, k, v, mode="int8", block_mask=good.float())
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, H, ceil\(Sq / 128\), ceil\(Sk / 128\)\) = \(1, 2, 3, 3\)"):
        int8_attention(q, k, v, mode="int8", block_mask=torch.ones(1, 2, 300, 260, dtype=torch.bool))
    with pytest.raises(TypeError, match="block_mask must be a torch.Tensor"):
        int8_attention(q, k, v, mode="fp16", block_mask=[[True]])


# -- the mask predicted inside the call: int8_attention(..., sparsity=tau) --

# FP8 P on local_qkv's peaked rows at the interpreter's lengths: over 600 draws of the test below, the emulation's
# rel L1 against float64 had median 0.037 and maximum 0.042 (4% of draws past BOUNDS' 0.04), cos at least 0.99912
_LOCAL_FP8_BOUNDS = (0.999, 0.045)


@pytest.mark.parametrize("pv, D", [(PV.FP8, 64), (PV.FP16, 128), (PV.INT8, 40)])
def test_predicted_in_the_call_matches_the_predictor(kdev, pv, D):
    # The quantization launch's block sums and one more launch give predict_block_mask's mask (float32 sums in
    # another order: a block exactly at a threshold could differ, none does on these draws), and the call runs
    # exactly the sparse kernel of that mask (bit for bit). Odd lengths, GQA, both layouts; K tiles of 64 and 128.
    n = 1 if kdev == "cpu" else 8
    for B, H, H_kv, Sq, Sk, layout, tau in [(1, 2, 1, 700 * n, 1000 * n, "BHSD", 0.9), (2, 2, 2, 1100 * n, 650 * n, "BSHD", 0.6)]:
        q, k, v = local_qkv(B, H, Sq, Sk, D, H_kv=H_kv, layout=layout, device=kdev)
        kw = dict(layout=layout, pv=pv)
        out, mask = run_kernel(q, k, v, sparsity=tau, return_block_mask=True, **kw)
        want = predict_block_mask(q, k, tau, layout=layout)
        assert torch.equal(mask, want)
        assert 0.2 < 1 - want.float().mean().item() < 0.9  # something to predict, not the whole row
        assert torch.equal(out, run_kernel(q, k, v, block_mask=mask, **kw))
        check(out, R.emulate_attention(q, k, v, block_mask=mask, **kw), _sparse_ref(q, k, v, mask, layout), pv, q.dtype,
              bounds=_LOCAL_FP8_BOUNDS if pv is PV.FP8 else None, call=(q, k, v, dict(kw, block_mask=mask)))


def test_predicted_keeps_the_always_kept_blocks_and_tau_one_is_dense(kdev):
    q, k, v = local_qkv(1, 2, 600, 900, 64, device=kdev)
    keep = torch.zeros(_blocks(900), dtype=torch.bool, device=kdev)
    keep[3] = True
    _, mask = run_kernel(q, k, v, layout="BHSD", pv=PV.FP8, sparsity=0.7, keep_kv_blocks=keep, return_block_mask=True)
    assert torch.equal(mask, predict_block_mask(q, k, 0.7, keep_kv_blocks=keep))
    assert mask[..., 3].all() and not mask.all()
    out, mask = run_kernel(q, k, v, layout="BHSD", pv=PV.FP8, sparsity=1.0, return_block_mask=True)
    assert mask.all() and torch.equal(out, run_kernel(q, k, v, layout="BHSD", pv=PV.FP8))


def test_predicted_on_the_public_op_every_backend_and_mode():
    # CPU tensors: the emulation backend predicts with predict_block_mask; mode fp16 applies the same mask exactly
    q, k, v = local_qkv(1, 2, 500, 700, 64, layout="BSHD")
    mask = predict_block_mask(q, k, 0.8, layout="BSHD")
    out, lse, got = int8_attention(q, k, v, mode="int8", layout="BSHD", sparsity=0.8, return_lse=True,
                                   return_block_mask=True)
    assert torch.equal(got, mask)
    want, want_lse = int8_attention(q, k, v, mode="int8", layout="BSHD", block_mask=mask, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    exact, got = int8_attention(q, k, v, mode="fp16", layout="BSHD", sparsity=0.8, return_block_mask=True)
    assert torch.equal(got, mask) and torch.equal(exact, int8_attention(q, k, v, mode="fp16", layout="BSHD", block_mask=mask))
    assert torch.equal(int8_attention(q, k, v, mode="int8", layout="BSHD", sparsity=0.8), want)


def test_bad_sparsity_arguments_are_refused_before_any_work():
    q, k, v = realistic_qkv(1, 2, 300, 260, 64)
    with pytest.raises(ValueError, match=r"sparsity must be a number in \(0, 1\]"):
        int8_attention(q, k, v, sparsity=1.5)
    with pytest.raises(ValueError, match="not both"):
        int8_attention(q, k, v, sparsity=0.9, block_mask=torch.ones(1, 2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep_kv_blocks goes with sparsity"):
        int8_attention(q, k, v, keep_kv_blocks=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="return_block_mask goes with sparsity"):
        int8_attention(q, k, v, return_block_mask=True)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, nQB, nKB\) = \(1, 2, 3, 3\)"):
        int8_attention(q, k, v, sparsity=0.9, keep_kv_blocks=torch.ones(4, dtype=torch.bool))


def test_predicted_guard_sees_k_less_its_own_mean(kdev):
    # The launch sums K as it quantizes it: less its measured mean, a static one, or nothing (smooth_k=False). The
    # guard must judge K less its own token mean whichever: noise blocks around K's mean are dissimilar, and their
    # columns stay dense (the guard changes the mask here), with any smoothing vector.
    g = torch.Generator().manual_seed(1)
    q, k, v = local_qkv(1, 2, 600, 900, 64, device=kdev)
    k = k.float().cpu()
    k[:, :, 512:768] = torch.randn(1, 2, 256, 64, generator=g) * 0.5 + k.mean(2, keepdim=True)
    k = k.half().to(kdev)
    want = predict_block_mask(q, k, 0.7)
    assert not torch.equal(want, predict_block_mask(q, k, 0.7, min_similarity=None))
    for kw in ({}, dict(k_mean=torch.zeros(1, 2, 64, device=kdev)), dict(k_mean=torch.full((1, 2, 64), 0.4, device=kdev)),
               dict(smooth_k=False)):
        _, mask = run_kernel(q, k, v, layout="BHSD", pv=PV.FP8, sparsity=0.7, return_block_mask=True, **kw)
        assert torch.equal(mask, want), kw


def test_predicted_with_an_attention_mask_is_refused():
    # the predictor does not see attn_mask: it could keep only masked blocks and leave rows with nothing
    q, k, v = realistic_qkv(1, 2, 300, 260, 64)
    with pytest.raises(ValueError, match="sparsity does not take an attn_mask"):
        int8_attention(q, k, v, sparsity=0.9, attn_mask=torch.ones(1, 1, 1, 260, dtype=torch.bool))


@pytest.mark.parametrize("loop", ["dense", "block-listed", "refresh"])
def test_tma_tiles_match_pointer_loads(kdev, monkeypatch, loop):
    # On sm_90 the portable kernel's FP8 loops at head dim 64 take K and V tiles by TMA (attention.tma_tiles) in long
    # calls, elsewhere from pointers: the same tiles, so the same bits. Two batches of GQA heads, a partial last tile,
    # a query block keeping only the partial key block; each call recorded, then replayed on new inputs (the plan
    # swaps the descriptors' base). In the interpreter the launch is made as on sm_90.
    from diffusion_int8.kernels import attention as A
    from diffusion_int8.kernels import cache, clear_cache

    if kdev != "cpu" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA tiles are taken on sm_90 only")
    if kdev == "cpu":
        monkeypatch.setattr(A, "is_sm90", lambda device: True)
    made = []
    from_tensor = A.TensorDescriptor.from_tensor
    monkeypatch.setattr(A.TensorDescriptor, "from_tensor", staticmethod(lambda *a: made.append(a) or from_tensor(*a)))
    B, H, S = 2, 4, 300 if kdev == "cpu" else 1100
    inputs = [realistic_qkv(B, H, S, S, 64, H_kv=2, device=kdev, seed=seed) for seed in (1, 2)]
    kw = dict(layout="BHSD", pv=PV.FP8)
    if loop != "dense":
        n = -(-S // SPARSE_BLOCK)
        mask = (torch.rand(B, H, n, n, device=kdev) > 0.5) | torch.eye(n, dtype=torch.bool, device=kdev)
        kw["block_mask"] = mask
        mask[1, 0, 0] = False
        mask[1, 0, 0, -1] = True
    results, asked = {}, []
    for tma in (False, True):
        monkeypatch.setattr(A, "tma_tiles", lambda *a, tma=tma: asked.append(a) or tma)
        clear_cache()  # recorded again, not replayed from the other's plan
        made.clear()
        results[tma] = []
        for q, k, v in inputs:  # the second call replays the first's plan
            res = _poisoned_split(q, k, v, kw) if loop == "refresh" else (run_kernel(q, k, v, **kw),)
            assert not any(t.isnan().any() for t in res)
            results[tma].append(res)
        assert sum(key[0] == "plan" for key in cache.ENTRIES) == 1
        assert len(made) == 2 * tma  # K's descriptor and V's, made once: the replay moved them
    for a, b in zip(results[False], results[True]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert asked[0] == (PV.FP8, 64, 0, B * H * S * S)  # the launch asks with the call's scores
    (q, k, v), res = inputs[1], results[True][1]
    if loop == "dense":
        check(res[0], R.emulate_attention(q, k, v, **kw), R.attention_ref(q, k, v), PV.FP8, q.dtype, call=(q, k, v, kw))
    else:  # the listed blocks' attention: the block-listed call's output, the refresh's skipped blocks
        listed = dict(kw, block_mask=mask if loop == "block-listed" else ~mask)
        check(res[0 if loop == "block-listed" else 1], R.emulate_attention(q, k, v, **listed),
              _sparse_ref(q, k, v, listed["block_mask"], "BHSD"), PV.FP8, q.dtype, call=(q, k, v, listed))


def test_tma_tiles_only_in_long_unmasked_head_dim_64_fp8_calls():
    # TMA tiles cost host time at every launch (two tensor maps), so short calls keep cp.async tiles
    from diffusion_int8.kernels import attention as A

    long = A.TMA_MIN_SCORES
    assert A.tma_tiles(PV.FP8, 64, 0, long) and A.tma_tiles(PV.FP8, 64, 0, 4 * long)
    assert not A.tma_tiles(PV.FP8, 64, 0, long - 1)
    assert not any(A.tma_tiles(pv, 64, 0, long) for pv in (PV.FP16, PV.INT8))
    assert not any(A.tma_tiles(PV.FP8, dp, 0, long) for dp in (32, 128, 256))
    assert not any(A.tma_tiles(PV.FP8, 64, mask, long) for mask in (1, 2, 3))  # elementwise and key masks
