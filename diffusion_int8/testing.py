"""Helpers shared by the tests, the benchmarks and ``diffusion-int8 check``.

* ``realistic_qkv``: attention inputs with the structure diffusion models show (a K channel bias, outlier
  channels, an attention sink), never zeros or plain N(0, 1), which hide quantization errors.
* ``cosine``, ``rel_l1``, ``cos_l1``: the accuracy of an output against a reference, in float64.
* ``graphed``, ``graph_ms``: GPU time of a call replayed from a CUDA graph (no Python or launch overhead);
  ``interleaved_ms``, ``interleaved_rounds``, ``paired_ratio``: several calls timed taking turns;
  ``back_to_back``: a call's time when called back to back, as a pipeline calls it.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["realistic_qkv", "local_qkv", "cosine", "rel_l1", "cos_l1", "graphed", "graph_ms", "interleaved_ms",
           "interleaved_rounds", "paired_ratio", "back_to_back", "median"]


def realistic_qkv(
    B: int, H: int, Sq: int, Sk: int, D: int, *, H_kv: int | None = None,
    dtype: torch.dtype = torch.float16, layout: str = "BHSD", device="cpu", seed: int | None = None,
    k_bias: float = 4.0, outlier_gain: float = 20.0, n_outliers: int = 2, outliers: str = "shared",
    sink: bool = True,
) -> list[torch.Tensor]:
    """Fresh random q, k, v in ``layout`` (``"BHSD"`` or ``"BSHD"``), ``dtype``, on ``device``.

    K carries a per-channel bias shared by all tokens (what smoothing removes); ``n_outliers`` channels
    are outliers: with ``outliers="shared"`` the same channels of Q and K, each scaled by sqrt(gain) so
    their product is ``outlier_gain`` times larger; with ``"separate"``, Q's channels and K's are drawn
    apart and each scaled by ``outlier_gain`` (as where Q's and K's norms learned different weights).
    Token 0 of K is a sink that every query attends to strongly; V has a channel bias.
    The values are drawn on the CPU from a generator seeded with ``seed`` (drawn from torch's global
    generator when None), so a seed gives the same inputs on every device.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    H_kv = H_kv or H
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, H_kv, Sk, D, generator=g)
    v = torch.randn(B, H_kv, Sk, D, generator=g) + 0.5 * torch.randn(B, H_kv, 1, D, generator=g)
    k = k + k_bias * torch.randn(B, H_kv, 1, D, generator=g)
    ch = torch.randperm(D, generator=g)
    if outliers == "shared":
        q[..., ch[:n_outliers]] *= outlier_gain**0.5
        k[..., ch[:n_outliers]] *= outlier_gain**0.5
    elif outliers == "separate":
        q[..., ch[:n_outliers]] *= outlier_gain
        k[..., ch[n_outliers : 2 * n_outliers]] *= outlier_gain
    else:
        raise ValueError(f"outliers must be 'shared' or 'separate', got {outliers!r}")
    if sink and Sk > 1:
        # token 0: aligned with the mean query direction, so it takes a large share of attention
        qdir = q.mean(2, keepdim=True).view(B, H_kv, H // H_kv, 1, D).mean(2)  # per KV group
        qdir = qdir / qdir.norm(dim=-1, keepdim=True) * D**0.5 * 1.5
        k[:, :, :1] = qdir + k[:, :, :1] * 0.1
    return _as_given((q, k, v), dtype, layout, device)


def local_qkv(
    B: int, H: int, Sq: int, Sk: int, D: int, *, H_kv: int | None = None, dtype: torch.dtype = torch.float16,
    layout: str = "BHSD", device="cpu", seed: int | None = None, gain: float = 1.5, wavelength: float = 300.0,
) -> list[torch.Tensor]:
    """Fresh random q, k, v whose attention is local in the sequence, as a DiT's over an image or a video is in
    space and time: each token's Q and K hold features of its position (sines and cosines of wavelengths from
    ``wavelength`` / 4 tokens up, scaled by ``gain``) plus noise, and K a channel bias. So nearby blocks take most
    of a query block's mass, and the block-sparse predictor has structure to find: with the defaults, a mass of 0.9
    skips half (4,000 tokens) to two thirds (1,000) of the blocks. Other arguments as ``realistic_qkv``'s."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, ()).item())
    H_kv = H_kv or H
    freqs = torch.rand(D - D // 2, generator=g) * (4.0 / wavelength)

    def tokens(S: int, heads: int) -> torch.Tensor:
        angle = torch.arange(S, dtype=torch.float32)[:, None] * freqs
        pos = torch.cat([angle.cos(), angle.sin()], -1)[:, :D] * (2 * gain * D**-0.25)
        return pos + 0.5 * torch.randn(B, heads, S, D, generator=g)

    q = tokens(Sq, H)
    k = tokens(Sk, H_kv) + 2.0 * torch.randn(B, H_kv, 1, D, generator=g)
    v = torch.randn(B, H_kv, Sk, D, generator=g)
    return _as_given((q, k, v), dtype, layout, device)


def _as_given(tensors, dtype: torch.dtype, layout: str, device) -> list[torch.Tensor]:
    """(B, H, S, D) float32 CPU tensors in ``dtype``, ``layout`` (made contiguous there) and on ``device``."""
    out = []
    for t in tensors:
        t = t.to(dtype)
        if layout == "BSHD":
            t = t.transpose(1, 2).contiguous()
        out.append(t.to(device))
    return out


def _flat(out: torch.Tensor, ref: torch.Tensor, start_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return out.double().flatten(start_dim), ref.double().flatten(start_dim)


def cosine(out: torch.Tensor, ref: torch.Tensor, start_dim: int = 0) -> torch.Tensor:
    """Cosine similarity of ``out`` and ``ref`` in float64, over the dims from ``start_dim`` on (all by
    default: a 0-d tensor; ``start_dim=2`` on (B, H, S, D): one value per (batch, head))."""
    o, r = _flat(out, ref, start_dim)
    return F.cosine_similarity(o, r, dim=-1, eps=1e-30)


def rel_l1(out: torch.Tensor, ref: torch.Tensor, start_dim: int = 0) -> torch.Tensor:
    """Relative L1 error ``sum |out - ref| / sum |ref|`` in float64, over the dims from ``start_dim`` on
    (as ``cosine``); the denominator is floored at 1e-30."""
    o, r = _flat(out, ref, start_dim)
    return (o - r).abs().sum(-1) / r.abs().sum(-1).clamp_min(1e-30)


def cos_l1(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(cosine, rel_l1)`` of the whole tensors, as Python floats."""
    return cosine(out, ref).item(), rel_l1(out, ref).item()


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after one eager call, which also compiles any kernel): the returned
    callable replays it and returns what the captured call returned (its output buffers, rewritten by
    each replay). Timing the replays times the GPU work without Python and launch overhead. The callable keeps
    ``fn`` alive, and with it whatever ``fn`` holds: the graph reads those buffers at every replay, and a buffer
    freed after capture would be read from released memory (the next capture empties the allocator's cache)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    replay.fn = fn
    return replay


def graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median GPU time in ms of ``fn`` replayed from a CUDA graph (``graphed``), over ``reps`` replays, or
    7 where the first takes over 2 ms (long calls vary little). The graph and its private memory pool
    are released before returning."""
    replay = graphed(fn)
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if times[0] > 2.0 and len(times) >= 7:  # long calls vary little: fewer replays
            break
    del replay
    torch.cuda.empty_cache()  # the graph's private memory pool, before the next measurement allocates
    return median(times)


def interleaved_ms(fns: dict, reps: int, rounds: int = 5) -> dict:
    """GPU ms of each callable replayed from its CUDA graph: the median over ``rounds`` of each round's median of
    ``reps`` replays, the callables taking turns (reversed every other round), so a drift of the GPU's clock or of
    its neighbours' load reaches them all alike."""
    return {name: median(t) for name, t in interleaved_rounds(fns, reps, rounds).items()}


def interleaved_rounds(fns: dict, reps: int, rounds: int = 5) -> dict:
    """``interleaved_ms``'s timings before the median over rounds: each callable's list of ``rounds`` round medians,
    in round order, so a ratio of two callables can be taken within each round (``paired_ratio``)."""
    replays = {name: graphed(fn) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        for name in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            replays[name]()
            one = []
            for _ in range(reps):
                start.record()
                replays[name]()
                end.record()
                end.synchronize()
                one.append(start.elapsed_time(end))
            times[name].append(median(one))
    del replays
    torch.cuda.empty_cache()
    return times


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) over rounds of num[r] / den[r], from ``interleaved_rounds``: a ratio whose two
    times were taken side by side, so a drift between rounds cancels."""
    ratios = sorted(a / b for a, b in zip(num, den))
    return median(ratios), ratios[0], ratios[-1]


def back_to_back(fn: Callable[[], object], calls: int = 200, seconds: float | None = None) -> float:
    """ms a call of ``fn`` takes called back to back on the GPU's stream (host clock, synchronized at both ends), each
    call's host time overlapping the GPU work of the one before: ``calls`` calls (a multiple of 10) after 10, or with
    ``seconds``, as many as that takes after 0.5 s of the same (the GPU's clock then settles where its power cap
    holds it)."""
    end = time.perf_counter() + 0.5
    for i in itertools.count():
        fn()
        if (seconds is None and i == 9) or (seconds is not None and time.perf_counter() > end):
            break
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while (n < calls) if seconds is None else (time.perf_counter() - t0 < seconds):
        for _ in range(10):
            fn()
        n += 10
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count), as every timing here reports it."""
    return sorted(values)[len(values) // 2]
