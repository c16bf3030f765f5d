"""The block-sparse predictor (``kernels.sparsity.predict_block_mask``): what it keeps, against pooled scores
computed here in float64, on planted structure, at odd lengths, with GQA and both layouts; its errors; and that
it traces without graph breaks (no host synchronization)."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.kernels.sparsity import predict_block_mask
from diffusion_int8.inputs import local_qkv, realistic_qkv

BLK = SPARSE_BLOCK


def pooled_probs(q, k, scale=None):
    """Pooled block scores in float64, written the plain way: per block mean (K less its token mean), softmax
    over key blocks of mean_q · mean_k · scale + log(tokens in the key block)."""
    q, k = q.double(), k.double()
    k = k - k.mean(2, keepdim=True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qm = torch.stack([q[:, :, s:s + BLK].mean(2) for s in range(0, q.shape[2], BLK)], 2)
    km = torch.stack([k[:, :, s:s + BLK].mean(2) for s in range(0, k.shape[2], BLK)], 2)
    counts = torch.tensor([min(BLK, k.shape[2] - s) for s in range(0, k.shape[2], BLK)], dtype=torch.float64)
    km = km.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.softmax(qm @ km.transpose(-1, -2) * scale + counts.log(), -1)


def planted(B, H, n_blocks, D=64, tail=0, gain=8.0, seed=0):
    """Q and K whose query block i attends to key block i: block i's tokens share direction e_i (times ``gain``)
    plus noise; ``tail`` extra tokens form a last, partial block of either."""
    g = torch.Generator().manual_seed(seed)
    S = n_blocks * BLK + tail
    blocks = torch.arange(S) // BLK
    base = torch.zeros(S, D)
    base[torch.arange(S), blocks] = gain
    q = base + 0.3 * torch.randn(B, H, S, D, generator=g)
    k = base + 0.3 * torch.randn(B, H, S, D, generator=g)
    return q.half(), k.half()


def test_tau_one_keeps_every_block_at_odd_lengths():
    q, k, _ = realistic_qkv(2, 3, 300, 1000, 64)
    mask = predict_block_mask(q, k, 1.0)
    assert mask.dtype == torch.bool and mask.shape == (2, 3, 3, 8) and bool(mask.all())


@pytest.mark.parametrize("tau", [0.5, 0.9, 0.97])
@pytest.mark.parametrize("sq, sk", [(1024, 1024), (300, 1000), (4224, 129)])
def test_kept_mass_reaches_tau_with_the_smallest_set(tau, sq, sk):
    q, k, _ = realistic_qkv(2, 2, sq, sk, 64, sink=False)
    mask = predict_block_mask(q, k, tau, min_similarity=None)
    p = pooled_probs(q, k)
    kept = (p * mask).sum(-1)
    assert bool((kept >= tau - 1e-5).all()), kept.min()
    # the smallest such set: without its least likely kept block, a row falls short of tau
    least = torch.where(mask, p, torch.inf).amin(-1)
    assert bool((kept - least < tau + 1e-5).all())
    # and those are the most likely blocks: nothing skipped outranks anything kept
    skipped_max = torch.where(mask, -torch.inf, p).amax(-1)
    assert bool((least >= skipped_max - 1e-6).all())


def test_planted_block_diagonal_attention_is_recovered_and_holds_the_mass():
    q, k = planted(2, 2, n_blocks=6, tail=37)
    mask = predict_block_mask(q, k, 0.9)
    diag = torch.eye(7, dtype=torch.bool).expand(2, 2, 7, 7)
    assert torch.equal(mask, diag)
    # the true attention puts almost all its mass on the kept pairs
    qf, kf = q.double(), k.double()
    p = torch.softmax(qf @ kf.transpose(-1, -2) * 64**-0.5, -1)
    token_mask = mask.repeat_interleave(BLK, 2).repeat_interleave(BLK, 3)[:, :, :q.shape[2], :k.shape[2]]
    assert (p * token_mask).sum(-1).min() >= 0.9


def test_the_tail_block_is_weighted_by_its_token_count():
    # every key the same: the softmax gives each key the same weight, so the full block holds 128/129 of the mass
    # and the one-token tail 1/129; unweighted means would split it 50/50 and keep both
    q = torch.randn(1, 1, BLK, 64)
    k = torch.randn(1, 1, 1, 64).expand(1, 1, BLK + 1, 64)
    mask = predict_block_mask(q, k, 0.99, min_similarity=None)
    assert mask.tolist() == [[[[True, False]]]]
    assert predict_block_mask(q, k, 0.995, min_similarity=None).all()


def test_blocks_not_represented_by_their_mean_stay_dense():
    # query block 2 and key block 1 keep their planted mean, but each token carries a large random part, so the
    # mean no longer says where a token attends (mean cosine to the mean about 0.3)
    q, k = planted(1, 1, n_blocks=4)
    g = torch.Generator().manual_seed(1)
    q[:, :, 2 * BLK:3 * BLK] += (3 * torch.randn(BLK, 64, generator=g)).half()
    k[:, :, 1 * BLK:2 * BLK] += (3 * torch.randn(BLK, 64, generator=g)).half()
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(predict_block_mask(q, k, 0.9, min_similarity=None)[0, 0], eye)  # the means alone
    want = eye.clone()
    want[2, :] = True
    want[:, 1] = True
    assert torch.equal(predict_block_mask(q, k, 0.9)[0, 0], want)


def test_gqa_matches_the_expanded_heads_and_layouts_agree():
    q, k, _ = realistic_qkv(2, 4, 700, 900, 64, H_kv=2)
    mask = predict_block_mask(q, k, 0.8)
    assert torch.equal(mask, predict_block_mask(q, k.repeat_interleave(2, 1), 0.8))
    bshd = predict_block_mask(q.transpose(1, 2), k.transpose(1, 2), 0.8, layout="BSHD")
    assert torch.equal(mask, bshd)


def test_always_kept_blocks_and_scale():
    q, k = planted(1, 2, n_blocks=4)
    keep = torch.zeros(4, dtype=torch.bool)
    keep[3] = True
    mask = predict_block_mask(q, k, 0.9, keep_kv_blocks=keep)
    assert mask[..., 3].all() and torch.equal(mask[..., :3], torch.eye(4, dtype=torch.bool)[:, :3].expand(1, 2, 4, 3))
    # a tiny softmax scale flattens the pooled scores: every block is needed to reach tau
    assert predict_block_mask(q, k, 0.9, sm_scale=1e-6).all()


def test_empty_sequences_give_empty_masks():
    q, k, _ = realistic_qkv(1, 2, 0, 200, 32)
    assert predict_block_mask(q, k, 0.9).shape == (1, 2, 0, 2)
    q, k, _ = realistic_qkv(1, 2, 200, 0, 32, sink=False)
    assert predict_block_mask(q, k, 0.9).shape == (1, 2, 2, 0)


def test_nan_inputs_keep_their_blocks():
    q, k = planted(1, 1, n_blocks=3)
    q[0, 0, 5, 0] = math.nan
    assert predict_block_mask(q, k, 0.9)[0, 0, 0].all()  # the NaN row computes everything, so its NaN shows


@pytest.mark.parametrize("tau", [0, -0.1, 1.5, math.nan, True, "0.9", None])
def test_bad_tau_is_refused_saying_what_is_accepted(tau):
    q, k, _ = realistic_qkv(1, 1, 128, 128, 32)
    with pytest.raises(ValueError, match=r"tau must be a number in \(0, 1\]"):
        predict_block_mask(q, k, tau)


def test_bad_shapes_and_arguments_are_refused():
    q, k, _ = realistic_qkv(1, 4, 256, 256, 32)
    with pytest.raises(ValueError, match="must be 4-D"):
        predict_block_mask(q[0], k, 0.9)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        predict_block_mask(q, k[:, :3], 0.9)
    with pytest.raises(ValueError, match="batch size and head dim"):
        predict_block_mask(q, k[..., :16], 0.9)
    with pytest.raises(ValueError, match="layout must be one of"):
        predict_block_mask(q, k, 0.9, layout="SBHD")
    with pytest.raises(TypeError, match="floating-point"):
        predict_block_mask(q.to(torch.int8), k, 0.9)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, nQB, nKB\) = \(1, 4, 2, 2\)"):
        predict_block_mask(q, k, 0.9, keep_kv_blocks=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        predict_block_mask(q, k, 0.9, keep_kv_blocks=torch.ones(2))
    with pytest.raises(ValueError, match="min_similarity"):
        predict_block_mask(q, k, 0.9, min_similarity=2.0)


def test_traces_whole_without_host_synchronization():
    # fullgraph=True fails on any .item(), data-dependent shape or Python branch on a tensor's value
    q, k, _ = realistic_qkv(2, 4, 300, 700, 64, H_kv=2)
    keep = torch.zeros(6, dtype=torch.bool)
    keep[0] = True
    compiled = torch.compile(lambda q, k, keep: predict_block_mask(q, k, 0.9, keep_kv_blocks=keep),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, keep), predict_block_mask(q, k, 0.9, keep_kv_blocks=keep))


def test_gpu_passes_match_the_torch_predictor(kdev):
    # The Triton pooling and prediction (what a GPU runs) against the PyTorch code the CPU runs, in the interpreter
    # on CPU and on the GPU: the block sums against float64 ones, and the same masks (float32 sums in another order:
    # a block exactly at a threshold could differ, none does on these draws), with the guard, GQA and kept blocks
    from diffusion_int8.kernels import pool

    q, k, _ = local_qkv(2, 4, 700, 1000, 72, H_kv=2, device=kdev)
    sums, sq = pool.block_sums(q)
    blocks = [q.double().cpu()[:, :, s:s + BLK] for s in range(0, 700, BLK)]
    torch.testing.assert_close(sums[..., :72].cpu().double(), torch.stack([b.sum(2) for b in blocks], 2),
                               atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(sq.cpu().double(), torch.stack([b.square().sum((2, 3)) for b in blocks], -1),
                               atol=1e-2, rtol=1e-5)
    assert not sums[..., 72:].any()  # padded channels
    torch.testing.assert_close(pool.block_sums(q, channels_first=True)[0], sums.transpose(2, 3), atol=0, rtol=0)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[-1] = True
    masks = []
    for tau, guard, kp in ((0.5, None, None), (0.9, 0.5, keep), (0.99, 0.6, None), (1e-6, None, keep)):
        want = predict_block_mask(q.cpu(), k.cpu(), tau, min_similarity=guard, keep_kv_blocks=kp)
        got = pool.predict_bhsd(q, k, tau, 72**-0.5, guard, None if kp is None else kp.to(kdev))
        assert torch.equal(got.cpu(), want), (tau, guard)
        masks.append(want)
    assert all(0 < m.sum() < m.numel() for m in masks)
