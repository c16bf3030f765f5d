"""Diffusers' dispatcher calls: another backend's, the native one's, and those split across devices.

``DispatcherCalls`` is the part of ``Int8DiffusionProcessor`` that a stock processor's ``dispatch_attention_fn``
call reaches. Calls for another attention backend go to it. Under diffusers' context parallelism the INT8 op runs
each device's share: every token of its heads (Ulysses, through diffusers' template), or its queries against each
K/V block passed around, merged through the op's log-sum-exp (ring: diffusers' native backend has none). The
settings diffusers' ``enable_parallelism`` and ``set_attention_backend`` put on every module's processor are passed
on to the stock processor this one runs.
"""

from __future__ import annotations

import functools

import torch

from ..caller import warn_user
from ..kernels import Mode, StaticRanges
from ..kernels.api import sdpa_with_lse
from .routing import attention_dispatch, int8_core, keeps_stock, kernel_takes


def context_split(parallel_config) -> str | None:
    """How diffusers' ``parallel_config`` splits attention: ``"ulysses"`` (heads exchanged by all-to-all, each device
    attending over every token of its heads), ``"ring"`` (K/V blocks passed around, partial results merged through
    their log-sum-exp), or None for none or both at once (which runs diffusers' own attention)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or (cp.ring_degree > 1) == (cp.ulysses_degree > 1):
        return None
    return "ring" if cp.ring_degree > 1 else "ulysses"


def ulysses_share(inner) -> tuple[int, int] | None:
    """(this device's rank, devices) where a stock processor's dispatcher call is split Ulysses-wise on diffusers'
    native backend, whose template ends in one SDPA call on this device's share of the heads; else None."""
    config = getattr(inner, "_parallel_config", None)
    if context_split(config) != "ulysses" or keeps_stock(getattr(inner, "_attention_backend", None), None):
        return None
    cp = config.context_parallel_config
    return cp._ulysses_local_rank, cp.ulysses_degree


def heads_share(ranges: StaticRanges, rank: int, devices: int) -> StaticRanges:
    """A module's per-head static ranges cut to the heads device ``rank`` of ``devices`` holds under Ulysses (the
    rank-th of ``devices`` equal blocks of heads, as diffusers' all-to-all deals them). Where the heads do not
    divide evenly (diffusers' ``ulysses_anything`` pads them), no static ranges: the call measures its own."""
    if any(t is not None and t.shape[1] % devices for t in ranges):
        return StaticRanges()

    def cut(t):
        if t is None or t.shape[1] == 1:  # absent, or one value for every head
            return t
        n = t.shape[1] // devices
        return t[:, rank * n:(rank + 1) * n]

    return StaticRanges(*(cut(t) for t in ranges))


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as the plain tensor it wraps, once the collective is done: diffusers' ring
    passes each K/V block on as a view of an all-gather's ``AsyncCollectiveTensor``, a tensor subclass with no
    storage of its own, which a kernel cannot read; other tensors unchanged."""
    return t.trigger_wait() if type(t) is not torch.Tensor and callable(getattr(t, "trigger_wait", None)) else t


class DispatcherCalls:
    """The dispatcher-facing half of ``Int8DiffusionProcessor`` (a mixin: it runs the processor's ``_attention``,
    ``current_mode``, ``gate``, ``state`` and balance)."""

    # diffusers' enable_parallelism and set_attention_backend set these on every module's processor: they belong
    # to the stock processor this one runs, whose dispatcher call carries them (unset, a context-parallel model
    # would attend over each device's share of the tokens alone)
    @property
    def _parallel_config(self):
        return self._parallel if self.inner is None else getattr(self.inner, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, config):
        self._parallel = config
        self._ring = context_split(config) == "ring"
        self._set_on_stock("_parallel_config", config)

    @property
    def _attention_backend(self):
        return self._backend if self.inner is None else getattr(self.inner, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, backend):
        self._backend = backend
        self._set_on_stock("_attention_backend", backend)

    def _set_on_stock(self, name: str, value) -> None:
        """Set ``name`` on the stock processor(s) this one runs, where they have it; what the fast path learnt
        under the old setting is forgotten."""
        self._stock_shapes.clear()
        for inner in [self.inner] if self.inner is not None else list(self._inferred.values()):
            if hasattr(inner, name):
                setattr(inner, name, value)

    def _dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """What the stock processor's ``dispatch_attention_fn`` call runs: (B, S, H, D) in and out, as the
        dispatcher's. Calls for another backend than the native one go to it. Under diffusers' context parallelism
        the INT8 op runs each device's share: all tokens of its heads (Ulysses), or its queries against each K/V
        block passed around, merged through the op's log-sum-exp (ring); masked ring calls (diffusers passes every
        block the local mask) and both splits at once run diffusers' own attention."""
        if not torch.compiler.is_compiling():
            self._routed_hit = True  # the route reached the dispatcher, whichever backend the call then goes to
        dispatch = attention_dispatch()
        split = context_split(parallel_config)
        if split is not None and self.observer is not None:
            raise ValueError("diffusion_int8: an observer (calibration) sees one device's share of a context-parallel "
                             "model; calibrate on one device, with batches sharded by accelerate launch")
        other = keeps_stock(backend, None)
        if (attention_kwargs or other or (parallel_config is not None and split is None)
                or (split == "ring" and attn_mask is not None)):
            if not torch.compiler.is_compiling():
                self._outcomes[2] += 1
                if other and not self._warned_backend:
                    self._warned_backend = True
                    warn_other_backend(backend)
            return dispatch.dispatch_attention_fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                                  attention_kwargs, backend=backend, parallel_config=parallel_config)
        if (attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] == query.shape[0]
                and attn_mask.shape[1] == key.shape[1]):
            # a key mask (B, Sk), which diffusers' native backend broadcasts over heads and queries before SDPA
            attn_mask = attn_mask[:, None, None, :]
        if split == "ulysses":
            cp = parallel_config.context_parallel_config
            forward = functools.partial(self._local_attention, (cp._ulysses_local_rank, cp.ulysses_degree))
        elif split == "ring":
            # diffusers' native backend has no ring attention of its own: calls that do not run INT8 run SDPA
            # with its log-sum-exp here
            mode = self._ring_mode(query.transpose(1, 2), key.transpose(1, 2), dropout_p, is_causal, enable_gqa)
            forward = functools.partial(self._ring_block, mode)
        else:
            out = self._attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                                  dropout_p, is_causal, scale, enable_gqa)
            return out.transpose(1, 2)
        return dispatch._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, forward_op=forward,
            backward_op=dispatch._native_attention_backward_op, _parallel_config=parallel_config)

    def _ring_mode(self, query, key, dropout_p, is_causal, enable_gqa) -> Mode:
        """The mode an unmasked ring-split call (BHSD: this device's queries, one K/V block) runs: the schedule's
        INT8 mode where the kernel takes the call and the gate lets it, else ``fp16``; counted as ``_attention``
        counts."""
        mode = self.current_mode()
        if mode is Mode.FP16 or not kernel_takes(query, key, None, dropout_p, is_causal, enable_gqa):
            return Mode.FP16
        counting = not torch.compiler.is_compiling()
        if self.gate is not None and not (self.gate.pays(mode, query, key) and (
                not self.balance.for_call(query, key, self._static_ranges(query.device))
                or self.gate.pays(mode, query, key, balance=True))):
            if counting:
                self.state.gated_calls += 1
            return Mode.FP16
        if counting:
            self.state.int8_calls += 1
        return mode

    def _local_attention(self, share: tuple[int, int], ctx, query, key, value, attn_mask=None, dropout_p=0.0,
                         is_causal=False, scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                         _parallel_config=None):
        """The forward op diffusers' Ulysses template calls on each device's heads, (B, S, H, D) in and out
        (inference: nothing is saved for a backward pass). ``share``: (this device's rank, devices): its heads are
        that block of the module's, which the calibration's per-head ranges and per-head masks are sliced to."""
        out = self._attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                              dropout_p, is_causal, scale, enable_gqa, share=share)
        return out.transpose(1, 2)

    def _ring_block(self, mode: Mode, ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False, return_lse=True, _save_ctx=True, _parallel_config=None):
        """The forward op diffusers' ring template calls for each K/V block, in ``mode`` (``_ring_mode``'s): the
        output (B, S, H, D) and log-sum-exp (B, S, H), which the template merges (inference: nothing is saved)."""
        q, k, v = (_waited(t).transpose(1, 2) for t in (query, key, value))
        if mode is Mode.FP16:
            out, lse = sdpa_with_lse(q, k, v, scale=scale)
        else:
            ranges = self._static_ranges(q.device)
            out, lse = int8_core(mode, q, k, v, None, scale, ranges, qk_balance=self.balance.for_call(q, k, ranges),
                                 qk_rotate=self.qk_rotate, return_lse=True)
        return out.transpose(1, 2), lse.transpose(1, 2)


def warn_other_backend(backend) -> None:
    """Said once per processor; the same words from every module, so Python shows them once at the user's line."""
    name = getattr(backend, "value", backend) or getattr(
        attention_dispatch()._AttentionBackendRegistry.get_active_backend()[0], "value", "another")
    warn_user(f"diffusion_int8: diffusers' attention backend is {name!r} (set_attention_backend or the "
              f"attention_backend context), so the attention calls routed to INT8 run that backend instead: INT8 "
              f"takes the calls diffusers sends to its native backend. model.set_attention_backend('native') gives "
              f"them back to INT8 (reset_attention_backend leaves diffusers' active backend as it was)")
