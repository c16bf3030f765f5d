"""Block-sparse attention whose skipped blocks are carried across denoising steps instead of dropped.

Dropping a (query block, key block) pair loses its attention mass at that step, and over a trajectory the losses
add up: the images drift from FP16's as more blocks are skipped (BENCHMARKS.md, block-sparse attention). Attention
changes smoothly from one step to the next, so ``BlockCarry`` computes the skipped blocks now and then and
forecasts them in between:

- every ``every``-th denoising step (the first included) computes every block, the complement's first, and
  keeps the complement's output and log-sum-exp, which the kernel writes on its way to the dense result: one
  call (``int8_attention(..., return_skipped=True)``). Where the generation's step count is known (``enable`` on
  a pipeline reads it from the scheduler), a refresh that would fall on the last step runs at the step before:
  there it also serves the last step's forecast, where the forecast errs most (BENCHMARKS.md);
- the steps between run the mask's blocks alone and merge them with the complement's output and log-sum-exp
  forecast from the last two refreshes, linearly in the noise level (a first-order Taylor step; a zeroth-order
  one, the last refresh's, until there are two). The forecast and the merge are one launch
  (``kernels.merge.merge_forecast``).

The mask is predicted once per generation and call site, at its first step, with the similarity guard off: a
block the pooled scores misjudge is forecast, not lost. It stays fixed, so that both refreshes a forecast reads
computed the same complement. Each call site (an attention module's n-th call in a denoising step) keeps the
complement's output (in the query's dtype) and log-sum-exp at two refreshes: at Wan2.1 1.3B's 32,760 tokens,
200 MB per attention module (cross-attention over more than one block of text included) and batch, until the
next generation starts or ``disable()`` removes the processors. A new generation is told as ``Int8State`` tells
it: by its noise level rising, or, where ``enable`` was given the pipeline, by its scheduler's timesteps being set
anew (a run that starts at or below the level the last one stopped at: after a one-step warm-up, an interrupted
run, an img2img run of low strength). Given the model alone, a run that starts below the level the last one
stopped at is taken for its continuation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..kernels.merge import merge_forecast
from ..kernels.sparsity import predict_block_mask

# calls of one module in one denoising step (CFG as two batches makes two); more means the timestep is not moving
# (a benchmark calling the denoiser at one timestep): each call then starts over instead of adding call sites
MAX_CALLS_PER_STEP = 16


@dataclass
class _Site:
    """One call site's fixed mask, derived once (its pair count), and the complement's result at the last two
    refreshes: (noise level, output, lse)."""

    mask: torch.Tensor
    shape: tuple
    last: tuple | None = None
    before: tuple | None = None

    def __post_init__(self):
        self.kept = self.mask.sum()  # a 0-d device tensor: no host synchronization


class _Generation(threading.local):
    """The generation a thread runs through one processor: its call sites and where it is in its steps (each
    thread's calls are a sequence of their own, so threads sharing a model do not take each other's sites)."""

    def __init__(self):
        self.sites: dict[int, _Site] = {}
        self.noise: float | None = None  # the denoising step's noise level
        self.generation: int | None = None  # ``Int8State.generation`` when it began
        self.step = 0  # denoising steps since the generation began
        self.calls = 0  # calls in this denoising step: the index of the next call site


class BlockCarry:
    """Skipped blocks carried across denoising steps (see the module docstring), for one attention processor.

    Args:
        every: a refresh every ``every`` denoising steps, >= 2.

    ``gain`` (a class attribute) scales the forecast's first-order step: 1 extrapolates the last two refreshes' change
    in full (of 0.5 to 2, the best mean PSNR on the shipped model at every interval: BENCHMARKS.md); 0 would hold the
    last refresh.
    """

    gain = 1.0

    def __init__(self, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"refresh_every must be an integer >= 2 (a dense refresh every that many denoising "
                             f"steps), got {every!r}")
        self.every = every
        self._gen = _Generation()

    def __getstate__(self):  # copies start with no carried state (a thread-local cannot be copied)
        return {"every": self.every}

    def __setstate__(self, state):
        self.__init__(state["every"])

    def _advance(self, noise: float, generation: int | None) -> tuple[_Generation, int]:
        """This thread's generation and the call site of this call; a new noise level starts a denoising step, a
        higher one or a new ``generation`` (the state's count) a generation."""
        gen = self._gen
        new = generation != gen.generation
        if new or noise != gen.noise or gen.calls == MAX_CALLS_PER_STEP:
            if new or gen.noise is None or noise >= gen.noise:
                gen.sites.clear()
                gen.step = 0
            else:
                gen.step += 1
            gen.noise, gen.calls, gen.generation = noise, 0, generation
        gen.calls += 1
        return gen, gen.calls - 1

    def refreshes(self, step: int, steps: int | None = None) -> bool:
        """Whether denoising step ``step`` (from 0) of a generation of ``steps`` (None: not known) computes the
        skipped blocks: every ``every``-th, with the last step's refresh moved to the step before it."""
        if steps is not None and steps >= 3 and step in (steps - 2, steps - 1):
            return step == steps - 2 and ((steps - 1) % self.every == 0 or step % self.every == 0)
        return step % self.every == 0

    @torch.compiler.disable  # Python state across calls: runs eagerly inside a compiled denoiser
    def __call__(self, run, query: torch.Tensor, key: torch.Tensor, *, tau: float, scale: float | None, noise: float,
                 keep_kv_blocks: torch.Tensor | None = None, steps: int | None = None,
                 generation: int | None = None) -> tuple[torch.Tensor, torch.Tensor | int]:
        """One attention call.

        Args:
            run: ``run(block_mask=..., return_lse=True) -> (out, lse)``, and ``run(block_mask=...,
                return_skipped=True) -> (out, skipped_out, skipped_lse)``: this call's INT8 attention
                (``routing.int8_core`` with the call's inputs bound).
            query, key: the call's BHSD Q (B, H, Sq, D) and K (B, Hkv, Sk, D), for the mask.
            tau: the sparsity level the mask is predicted at (``predict_block_mask``).
            scale: the softmax scale (None: D ** -0.5).
            noise: the denoising step's noise level in [0, 1] (``schedule.noise_level``).
            keep_kv_blocks: key blocks always kept (joint text attention).
            steps: the generation's denoising steps (``Int8State.steps``), or None where not known.
            generation: ``Int8State.generation``; where it changes, a generation starts whatever the noise level.

        Returns:
            The output in ``query``'s dtype, and the (query block, key block) pairs computed: all of them at a
            refresh, the mask's (a 0-d device tensor: no host synchronization) between.
        """
        gen, index = self._advance(noise, generation)
        shape = (query.shape, key.shape, query.dtype, query.device)
        site = gen.sites.get(index)
        if site is None or site.shape != shape:
            mask = predict_block_mask(query, key, tau, sm_scale=scale, keep_kv_blocks=keep_kv_blocks,
                                      min_similarity=None)
            site = gen.sites[index] = _Site(mask, shape)
        if self.refreshes(gen.step, steps) or site.last is None:
            # rows whose every block is kept have an empty complement: -inf, and a zero weight in later merges
            out, out_c, lse_c = run(block_mask=site.mask, return_skipped=True)
            site.before, site.last = site.last, (noise, out_c, lse_c)
            return out, site.mask.numel()
        out_k, lse_k = run(block_mask=site.mask, return_lse=True)
        at, out_c, lse_c = site.last
        if site.before is None or site.before[0] == at:  # one refresh so far: its skipped blocks as they were
            return merge_forecast(out_k, lse_k, out_c, lse_c), site.kept
        was, out_p, lse_p = site.before
        step = self.gain * (noise - at) / (at - was)
        return merge_forecast(out_k, lse_k, out_c, lse_c, out_p, lse_p, step), site.kept
