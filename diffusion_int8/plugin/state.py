"""``Int8State``: the denoising position the processors of one ``enable`` read, and what their calls did."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..kernels.config import SPARSE_BLOCK
from ..kernels.key_mask import valid_prefix
from ..kernels.layout import cdiv


@dataclass
class Int8State:
    """The denoising position the processors read, held by the user's handle (no module globals).

    ``timestep`` is the value the denoiser was last called with (first element for CFG batches; the highest of the
    first sample's for per-token timesteps), ``step`` counts denoiser calls since ``reset()``: a pipeline that runs
    CFG as two calls (Wan, Qwen-Image) counts two per denoising step, so ``trace`` and ``block_counts`` are per call
    (a call of another of the pipeline's models at the same timestep, a ControlNet's before its UNet's, is the same
    step); ``steps`` is the number of noise levels this generation runs
    at, where the pipeline's scheduler tells it (``enable`` on a pipeline), else None; ``trace``, when a list, records
    ``(step, timestep, layer, mode)`` for every attention call (the mode the schedule chose, before the speed
    gate); ``int8_calls`` and ``gated_calls`` count the calls that ran INT8 and those the gate sent to SDPA (in eager
    mode: under ``torch.compile`` the counts stay as they are). While a trace is kept, ``block_counts`` adds up per
    step the (query block, key block) pairs computed and all pairs, over every attention call, dense ones included
    (``skipped_blocks`` reads them).
    """

    timestep: float | None = None
    step: int = -1
    trace: list | None = None
    timestep_scale: float | None = None  # 1000 or 1: what the timesteps of this generation are out of
    steps: int | None = None
    generation: int = 0  # generations started (and resets): a carry starts over when it changes
    int8_calls: int = 0  # attention calls that ran an INT8 mode
    gated_calls: int = 0  # calls the schedule gave an INT8 mode and the speed gate sent to SDPA
    # step -> [pairs computed (a device tensor where a mask was predicted: no host sync per call), all pairs]
    block_counts: dict = field(default_factory=dict)
    # the last key mask whose valid prefix was read, with what it was read for, and the prefix: the same mask
    # reaches every attention module of a denoiser call, so it is read once per call of the denoiser
    _prefix: tuple = field(default=(None, None, None), repr=False, compare=False)
    _caller: int | None = field(default=None, repr=False, compare=False)  # id of the model that set ``timestep``
    # scheduler attribute -> its timesteps (the tensor) in this generation, whichever model read them first: a
    # pipeline sets them anew at every run, which tells a run that starts at the level the last one stopped at
    _timesteps: dict = field(default_factory=dict, repr=False, compare=False)
    # the eager calls whose INT8 run ahead of CUDA-graph capture was made, by shape (``Int8DiffusionProcessor``'s
    # ``_settle_for_capture``): the compiled kernels and launch plans it leaves are this process's, not a copy's
    settled: set = field(default_factory=set, repr=False, compare=False)

    def reset(self) -> None:
        self.timestep, self.step, self.timestep_scale, self.steps, self._caller = None, -1, None, None, None
        self.generation += 1
        self._timesteps = {}
        self.int8_calls = self.gated_calls = 0
        self.block_counts.clear()
        self._prefix = (None, None, None)
        if self.trace is not None:
            self.trace.clear()

    def __getstate__(self):  # the cached mask read is a weak reference, the settled calls this process's, the
        # schedulers' timesteps a pipeline's: not copied
        return {k: v for k, v in self.__dict__.items() if k not in ("_prefix", "settled", "_timesteps")}

    def __setstate__(self, state):
        self.__dict__.update(state, _prefix=(None, None, None), settled=set(), _timesteps={})

    def valid_prefix(self, attn_mask: torch.Tensor, B: int, H: int, Sk: int) -> int | None:
        """``kernels.key_mask.valid_prefix`` of ``attn_mask``, read once per mask (a view of the mask, such as the
        dispatcher's (B, 1, 1, Sk) of a (B, Sk) one, counts as the mask)."""
        base = attn_mask if attn_mask._base is None else attn_mask._base
        what = (attn_mask.shape, attn_mask.stride(), attn_mask.storage_offset(), attn_mask.dtype, base._version, B, H,
                Sk)  # the version: a mask refilled in place is read again
        ref, seen, n = self._prefix
        if ref is not None and ref() is base and seen == what:
            return n
        n = valid_prefix(attn_mask, B, H, Sk)
        self._prefix = (weakref.ref(base), what, n)
        return n

    def count_blocks(self, kept, total: int) -> None:
        """Add one attention call's computed pairs (an int or a 0-d device tensor) and all its pairs to this step."""
        entry = self.block_counts.setdefault(self.step, [0, 0])
        entry[0] = entry[0] + kept
        entry[1] += total

    def block_totals(self) -> dict[int, tuple[float, int]]:
        """``{step: (pairs computed, all pairs)}`` since ``reset()``, read from the device counters (one host
        synchronization per step: call it at report time)."""
        return {s: (float(kept), total) for s, (kept, total) in sorted(self.block_counts.items())}

    def skipped_blocks(self) -> dict | None:
        """The fraction of (query block, key block) pairs skipped, ``{"steps": [...], "per_step": [...], "overall":
        f}`` over the steps since ``reset()``, or None where nothing was counted (no trace kept)."""
        return skipped_fractions(self.block_totals())


def skipped_fractions(totals: dict[int, tuple[float, int]]) -> dict | None:
    """``Int8State.block_totals`` (or their sums over generations) as skipped fractions per step and overall."""
    if not totals:
        return None
    steps = sorted(totals)
    kept, total = sum(totals[s][0] for s in steps), sum(totals[s][1] for s in steps)
    return {"steps": steps, "per_step": [1 - totals[s][0] / max(totals[s][1], 1) for s in steps],
            "overall": 1 - kept / max(total, 1)}


def block_pairs(query: torch.Tensor, key: torch.Tensor) -> int:
    """(query block, key block) pairs of an attention call, over its batch and heads (BHSD, or any with S at -2)."""
    batch_heads = query.numel() // max(query.shape[-2] * query.shape[-1], 1)
    return batch_heads * cdiv(query.shape[-2], SPARSE_BLOCK) * cdiv(key.shape[-2], SPARSE_BLOCK)
