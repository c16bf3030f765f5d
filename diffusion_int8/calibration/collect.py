"""Recording attention statistics while a pipeline runs, and merging the records of several batches.

``Collector`` is an ``enable(..., observer=...)`` observer: at every attention call it receives an
``AttentionCall``: the layer, the step, the BHSD inputs the kernel would see (after the model's norms and RoPE)
and the exact output. It keeps,
per layer and denoising step, sums over images of the per-head statistics of ``stats.py``, so records
of different batches, processes or machines merge exactly by adding them in batch order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import Mode
from ..kernels.config import SPARSE_BLOCK
from ..kernels.sparsity import check_tau
from ..plugin.carry import BlockCarry
from ..plugin.observer import AttentionCall
from ..plugin.routing import int8_sdpa
from .stats import QUANTIZED_MODES, carry_key, input_stats, output_errors, sparse_key, sparse_sdpa, split_attention

MEAN_STATS = ("q_p99", "k_p99", "q_max", "k_max", "k_mean", "q_cmax", "k_cmax")  # averaged over images
MAX_STATS = ("v_amax",)  # maximum over images


class Collector:
    """Observer that accumulates per (layer, step) sums of per-head statistics over a batch of images.

    Args:
        percentile: the percentile of |Q| and |K| to record (99 by default).
        modes: the quantized modes whose error against exact attention is measured at every call.
        sparsity_levels: levels tau in (0, 1) whose error is measured at every call: exact attention over the
            block pairs the processor's predictor keeps at that level, against all pairs, and the fraction of
            pairs kept (calls the processor keeps dense, e.g. with an attention mask, count as exact and whole).
        refresh_every: refresh intervals whose error is measured at every call and level: the skipped blocks carried
            across steps as ``plugin.carry.BlockCarry`` carries them (computed every ``every``-th step, forecast in
            between), in exact attention, against all pairs, and the fraction of pairs computed at each step. Each
            (layer, level, interval) keeps the skipped blocks' output at two refreshes, as the carry does at run time.
    """

    def __init__(self, percentile: float = 99.0, modes=QUANTIZED_MODES, sparsity_levels: Sequence[float] = (),
                 refresh_every: Sequence[int] = ()):
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
            raise ValueError(f"percentile must be a number in (0, 100], got {percentile!r}")
        self.percentile = percentile
        self.modes = tuple(Mode.parse(m) for m in modes)
        self.sparsity_levels = tuple(check_sparsity_levels(sparsity_levels))
        self.refresh_every = tuple(check_refresh_intervals(refresh_every, self.sparsity_levels))
        self.reset()

    def reset(self) -> None:
        self.acc: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.timesteps: dict[int, float] = {}
        self.carries: dict[tuple, BlockCarry] = {}  # (layer, level, interval) -> its carried blocks

    @torch.no_grad()
    def __call__(self, call: AttentionCall) -> None:
        step, layer, q, k, v = call.step, call.layer, call.query, call.key, call.value
        attn_mask, scale, exact = call.attn_mask, call.scale, call.out
        self.timesteps[step] = call.timestep
        found = input_stats(q, k, v, self.percentile)
        for mode in self.modes:
            errs = output_errors(int8_sdpa(mode, q, k, v, attn_mask, scale=scale), exact)
            found.update({f"err.{mode.value}.{m}": t for m, t in errs.items()})
        for tau in self.sparsity_levels:
            mask = call.block_mask(tau)
            found.update(self._sparse_stats(call, tau, mask))
            split = {}  # the carried mask's two sides, computed once for every interval
            for every in self.refresh_every:
                found.update(self._carry_stats(call, tau, every, mask is not None, split))
        entry = self.acc.setdefault(layer, {}).setdefault(step, {})
        entry["count"] = entry.get("count", 0) + q.shape[0]
        for key, t in found.items():
            t = t.detach().double().cpu()
            if key in MAX_STATS:
                t = t.amax(0)
                entry[key] = torch.maximum(entry[key], t) if key in entry else t
            else:
                t = t.sum(0)
                entry[key] = entry[key] + t if key in entry else t

    @staticmethod
    def _sparse_stats(call: AttentionCall, tau: float, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per (batch, head): the error of block-sparse exact attention at ``tau`` (the processor's ``mask``, None
        where it runs dense) and the fraction of pairs kept."""
        q, k, v, scale, exact = call.query, call.key, call.value, call.scale, call.out
        B, H = q.shape[:2]
        if mask is None:
            errs = {"rel_l1": q.new_zeros(B, H), "cos": q.new_ones(B, H)}
            kept = q.new_ones(B, H)
        else:
            errs = output_errors(sparse_sdpa(q, k, v, mask, scale), exact)
            kept = mask.float().mean((-1, -2))
        return {sparse_key("sparse.rel_l1", tau): errs["rel_l1"], sparse_key("sparse.cos", tau): errs["cos"],
                sparse_key("sparse.kept", tau): kept}

    def _carry_stats(self, call: AttentionCall, tau: float, every: int, sparse: bool,
                     split: dict) -> dict[str, torch.Tensor]:
        """Per (batch, head): the error of exact attention with the blocks ``tau`` skips carried, refreshed every
        ``every`` steps, and the fraction of pairs computed at this step (1 at a refresh). ``split``: this call's
        ``split_attention`` over the carried mask, shared by the intervals (their masks are the same: predicted
        from the generation's first step at ``tau``)."""
        q, k, v, scale = call.query, call.key, call.value, call.scale
        B, H = q.shape[:2]
        if not sparse or call.noise is None:  # a call the processor runs dense
            errs, kept = {"rel_l1": q.new_zeros(B, H), "cos": q.new_ones(B, H)}, q.new_ones(B, H)
        else:
            carry = self.carries.setdefault((call.layer, tau, every), BlockCarry(every))

            def run(block_mask, return_lse=False, return_skipped=False):
                # exact attention over the carried mask's blocks, or over every block with the skipped ones apart
                if "mask" not in split:
                    split["mask"], split["sides"] = block_mask, split_attention(q, k, v, block_mask, scale)
                out_k, lse_k, out_c, lse_c = split["sides"]
                return (call.out, out_c, lse_c) if return_skipped else (out_k, lse_k)

            out, computed = carry(run, q, k, tau=tau, scale=scale, noise=call.noise, keep_kv_blocks=call.keep_kv_blocks,
                                  steps=call.steps)
            errs = output_errors(out, call.out)
            total = B * H * -(-q.shape[2] // SPARSE_BLOCK) * -(-k.shape[2] // SPARSE_BLOCK)
            kept = q.new_full((B, H), float(computed) / total)
        return {carry_key(f"carry.{m}", tau, every): errs[m] for m in ("rel_l1", "cos")} | {
            carry_key("carry.kept", tau, every): kept}

    def record(self, index: int) -> dict:
        """This batch's statistics as plain tensors, ``(H, T)`` or ``(H, D, T)`` sums and maxima, then reset.

        ``index`` orders the batch for ``merge``.
        """
        steps = sorted(self.timesteps)
        if steps != list(range(len(steps))):
            raise RuntimeError(f"denoiser steps seen: {steps}; expected 0..T-1 (was the state reset per batch?)")
        layers = {}
        for layer, per_step in self.acc.items():
            if sorted(per_step) != steps:
                raise RuntimeError(f"layer {layer} ran at steps {sorted(per_step)}, the denoiser at {steps}")
            keys = per_step[0].keys() - {"count"}
            layers[layer] = {key: torch.stack([per_step[s][key] for s in steps], -1) for key in keys}
            layers[layer]["count"] = torch.tensor([per_step[s]["count"] for s in steps], dtype=torch.float64)
        rec = {"index": index, "timesteps": [self.timesteps[s] for s in steps], "layers": layers}
        self.reset()  # the carried blocks too: the next batch is a generation of its own
        return rec


def merge(records: list[dict]) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Add up batch records in their index order; means for ``MEAN_STATS`` and errors, maxima for ``MAX_STATS``.

    Returns the timesteps and, per layer, float32 tensors ``(H, T)`` (``k_mean``, ``v_amax``, ``q_cmax``,
    ``k_cmax``: ``(H, D, T)``).
    The result depends only on the set of records, not on how they were split among processes.
    """
    if not records:
        raise ValueError("no calibration records to merge")
    records = sorted(records, key=lambda r: r["index"])
    timesteps = records[0]["timesteps"]
    for r in records[1:]:
        if r["timesteps"] != timesteps:
            raise ValueError(f"batch {r['index']} ran timesteps {r['timesteps']}, batch {records[0]['index']} ran {timesteps}")
    out = {}
    for layer in records[0]["layers"]:
        total: dict[str, torch.Tensor] = {}
        for r in records:
            for key, t in r["layers"][layer].items():
                if key not in total:
                    total[key] = t.clone()
                elif key in MAX_STATS:
                    total[key] = torch.maximum(total[key], t)
                else:
                    total[key] += t
        count = total.pop("count")
        out[layer] = {key: (t if key in MAX_STATS else t / count).float() for key, t in total.items()}
    return timesteps, out


def check_sparsity_levels(levels: Sequence[float]) -> list[float]:
    """Sparsity levels to calibrate, ascending; ``ValueError`` unless each is in (0, 1) and none repeats."""
    out = sorted(check_tau(t, "a sparsity level") for t in levels)
    if any(t >= 1 for t in out):
        raise ValueError(f"a sparsity level to calibrate must be below 1 (1 is dense), got {max(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"sparsity levels repeat: {out}")
    return out


def check_refresh_intervals(intervals: Sequence[int], levels: Sequence[float]) -> list[int]:
    """Refresh intervals to calibrate, ascending; ``ValueError`` unless each is an integer >= 2, none repeats, and
    there are sparsity levels whose skipped blocks they carry."""
    out = []
    for every in intervals:
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"a refresh interval must be an integer >= 2 (the skipped blocks are computed every that "
                             f"many steps), got {every!r}")
        out.append(every)
    if len(set(out)) != len(out):
        raise ValueError(f"refresh intervals repeat: {sorted(out)}")
    if out and not levels:
        raise ValueError("refresh intervals carry the blocks a sparsity level skips: give sparsity levels too")
    return sorted(out)
