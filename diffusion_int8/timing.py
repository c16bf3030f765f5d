"""GPU time of calls, for the speed gate's tables, the demo's speed section and the benchmarks.

* ``graphed``, ``graph_ms``: a call replayed from a CUDA graph (no Python or launch overhead);
* ``interleaved_ms``, ``interleaved_rounds``, ``paired_ratio``: several calls timed taking turns (``take_turns``);
* ``back_to_back``: a call's time when called back to back, as a pipeline calls it.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

__all__ = ["graphed", "graph_ms", "interleaved_ms", "interleaved_rounds", "take_turns", "paired_ratio", "back_to_back",
           "median"]


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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(name: str) -> float:
        replays[name]()
        one = []
        for _ in range(reps):
            start.record()
            replays[name]()
            end.record()
            end.synchronize()
            one.append(start.elapsed_time(end))
        return median(one)

    times = take_turns(tuple(fns), timed, rounds)
    replays.clear()  # the graphs and their memory pools, before the cache is emptied
    torch.cuda.empty_cache()
    return times


def take_turns(names: tuple[str, ...], run: Callable[[str], float], rounds: int) -> dict[str, list[float]]:
    """``run(name)`` for every name, ``rounds`` times, the names taking turns (reversed every other round) so that a
    drift over the run (the GPU's clock, the host's load) reaches them alike: per name, its results in round order."""
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run(name))
    return results


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
