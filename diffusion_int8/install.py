"""``enable``: install ``Int8DiffusionProcessor`` on every attention module of a pipeline's denoiser, and the handle
that takes it off again."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .kernels import Mode
from .kernels.config import MAX_HEAD_DIM
from .models import attention_modules, denoiser, head_dim_of
from .processor import Int8DiffusionProcessor, Int8State, Schedule, as_calibration, as_gate, check_carry, check_sparsity
from .schedule import PrecisionSchedule
from .speed_gate import SpeedGate


def _warn_skipped(skipped: dict[str, str]) -> None:
    if skipped:
        listing = ", ".join(f"{n} ({why})" for n, why in sorted(skipped.items()))
        warnings.warn(f"diffusion_int8: left {len(skipped)} attention module(s) on their stock processor: {listing}",
                      RuntimeWarning, stacklevel=3)


@dataclass
class Int8Handle:
    """What ``enable`` returns: ``disable()`` puts the original processors back exactly."""

    model: torch.nn.Module
    state: Int8State
    originals: dict[str, Any]
    skipped: dict[str, str]
    _hook: Any = field(default=None, repr=False)

    def disable(self) -> None:
        """Put back the processors ``enable`` replaced. A handle already disabled does nothing (a later
        ``enable`` on the model has its own handle, which this one must not touch)."""
        if self.model.__dict__.get("_diffusion_int8_handle") is not self:
            return
        modules = attention_modules(self.model)
        for name, proc in self.originals.items():
            modules[name].set_processor(proc)
        if self._hook is not None:
            self._hook.remove()
        del self.model.__dict__["_diffusion_int8_handle"]
        self.originals = {}


def enable(
    pipe_or_model,
    mode: str | Mode = "int8",
    *,
    schedule: Schedule | None = None,
    calibration: "Calibration | str | None" = None,
    record: bool = False,
    observer: Callable | None = None,
    speed_gate: "bool | SpeedGate | str | Path" = True,
    sparsity: float | None = None,
    refresh_every: int | None = None,
    qk_balance: bool = False,
    qk_rotate: bool = False,
) -> Int8Handle:
    """Install ``Int8DiffusionProcessor`` on every attention module of a pipeline's denoiser.

    Args:
        pipe_or_model: a diffusers pipeline (its ``transformer`` or ``unet`` is used) or the model.
        mode: constant precision, when no ``schedule`` is given.
        schedule: a ``PrecisionSchedule``, preset name, schedule file or callable ``timestep -> mode``; the
            timestep the denoiser receives (the first element of a CFG batch) is read by a forward pre-hook,
            once per denoiser call (one host read per step).
        calibration: a ``Calibration`` or its file (``diffusion-int8 calibrate``): checked against the model
            (layer names, heads, head dims), then its ranges at each step become static quantization ranges.
        record: keep a trace of ``(step, timestep, layer, mode)`` in ``handle.state.trace``, and count the
            (query block, key block) pairs computed per step: ``handle.state.skipped_blocks()``.
        observer: see ``Int8DiffusionProcessor``; the calibration collector passes one.
        speed_gate: True (default): INT8 only for the call shapes where it beats SDPA on this GPU, by the
            crossover table shipped for its architecture or measured by ``diffusion-int8 tune``; SDPA elsewhere.
            False forces INT8 (experiments, quality evaluation). A ``SpeedGate`` or table file gates by that.
            ``handle.state.int8_calls`` / ``gated_calls`` count the two outcomes.
        sparsity: block-sparse attention at a constant level tau in (0, 1] (the pooled attention mass kept per
            query block; see ``Int8DiffusionProcessor``) for every INT8 call, with ``mode`` or with a schedule
            that has no levels of its own; a schedule with levels (``PrecisionSchedule.from_calibration(...,
            sparsity_budget=...)``) sets them per step and layer instead, and giving both raises ``ValueError``.
        refresh_every: with ``sparsity``, the skipped blocks are carried instead of dropped: computed every
            ``refresh_every``-th denoising step and forecast in between from the last two such steps, the mask
            predicted once per generation (``carry.BlockCarry``; see ``Int8DiffusionProcessor``). Eager
            pipelines only: each attention module keeps its skipped blocks' last two outputs.
        qk_balance: passed to ``int8_attention``: the exact Q·Kᵀ channel balance against outlier channels.
        qk_rotate: passed to ``int8_attention``: the Hadamard rotation of Q and K against outlier channels, those
            Q and K share included (with ``qk_balance`` too, both apply).

    Modules the kernel cannot run (head dim > 256) keep their processor; one warning lists them.
    Refuses a model already enabled, or one compiled with ``torch.compile`` (enable first, compile after).
    """
    model = denoiser(pipe_or_model)
    if "_diffusion_int8_handle" in model.__dict__:
        raise RuntimeError("diffusion_int8 is already enabled on this model; call handle.disable() first")
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise RuntimeError("the model is already compiled: call diffusion_int8.enable() before torch.compile")
    Mode.parse(mode)
    if isinstance(schedule, str):
        schedule = PrecisionSchedule.load(schedule)
    check_carry(refresh_every, check_sparsity(sparsity, schedule), schedule)
    calibration = as_calibration(calibration)
    if calibration is not None:
        calibration.validate(model)
    gate = as_gate(speed_gate)
    state = Int8State(trace=[] if record else None)
    originals, skipped = {}, {}
    for name, module in attention_modules(model).items():
        hd = head_dim_of(module)
        if hd is not None and hd > MAX_HEAD_DIM:
            skipped[name] = f"head dim {hd} > {MAX_HEAD_DIM}"
            continue
        originals[name] = module.processor
        module.set_processor(
            Int8DiffusionProcessor(mode, schedule=schedule, calibration=calibration, inner=module.processor,
                                   state=state, name=name, observer=observer, speed_gate=gate, sparsity=sparsity,
                                   refresh_every=refresh_every, qk_balance=qk_balance, qk_rotate=qk_rotate)
        )
    _warn_skipped(skipped)
    hook = None
    if schedule is not None or record or calibration is not None or observer is not None or refresh_every is not None:
        hook = model.register_forward_pre_hook(functools.partial(_read_timestep, state), with_kwargs=True)
    handle = Int8Handle(model, state, originals, skipped, hook)
    model.__dict__["_diffusion_int8_handle"] = handle
    return handle


def _read_timestep(state: Int8State, module, args, kwargs):
    t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
    if t is None:
        return None
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    if state.timestep is None or t > state.timestep:
        # a new generation: denoising starts at its highest noise level, which also tells the scale
        state.step, state.timestep_scale = -1, 1000.0 if t > 1.0 else 1.0
    state.timestep = t
    state.step += 1
    return None
