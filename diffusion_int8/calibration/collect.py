"""Recording attention statistics while a pipeline runs, and merging the records of several batches.

``Collector`` is an ``enable(..., observer=...)`` observer: at every attention call it receives the
BHSD inputs the kernel would see (after the model's norms and RoPE) and the exact output. It keeps,
per layer and denoising step, sums over images of the per-head statistics of ``stats.py``, so records
of different batches, processes or machines merge exactly by adding them in batch order.
"""

from __future__ import annotations

import torch

from ..kernels import Mode
from ..routing import int8_sdpa
from .stats import QUANTIZED_MODES, input_stats, output_errors

MEAN_STATS = ("q_p99", "k_p99", "q_max", "k_max", "k_mean")  # averaged over images
MAX_STATS = ("v_amax",)  # maximum over images


class Collector:
    """Observer that accumulates per (layer, step) sums of per-head statistics over a batch of images.

    Args:
        percentile: the percentile of |Q| and |K| to record (99 by default).
        modes: the quantized modes whose error against exact attention is measured at every call.
    """

    def __init__(self, percentile: float = 99.0, modes=QUANTIZED_MODES):
        self.percentile = percentile
        self.modes = tuple(Mode.parse(m) for m in modes)
        self.reset()

    def reset(self) -> None:
        self.acc: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.timesteps: dict[int, float] = {}

    @torch.no_grad()
    def __call__(self, proc, q, k, v, attn_mask, scale, exact) -> None:
        step, layer = proc.state.step, proc.name
        self.timesteps[step] = proc.state.timestep
        found = input_stats(q, k, v, self.percentile)
        for mode in self.modes:
            errs = output_errors(int8_sdpa(mode, q, k, v, attn_mask, scale=scale), exact)
            found.update({f"err.{mode.value}.{m}": t for m, t in errs.items()})
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
        self.reset()
        return rec


def merge(records: list[dict]) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Add up batch records in their index order; means for ``MEAN_STATS`` and errors, maxima for ``MAX_STATS``.

    Returns the timesteps and, per layer, float32 tensors ``(H, T)`` (``k_mean``, ``v_amax``: ``(H, D, T)``).
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
