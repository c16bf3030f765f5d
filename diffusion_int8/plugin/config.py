"""``Int8Config``: what ``enable()`` and ``Int8DiffusionProcessor`` do, checked once where it is made."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from ..calibration.file import Calibration
from .carry import BlockCarry
from ..kernels import Mode
from ..kernels.sparsity import check_tau
from ..schedule import PrecisionSchedule
from .speed_gate import CrossoverTable, SpeedGate

Schedule = Union[PrecisionSchedule, str, Callable[[float], Union[str, Mode]]]


@dataclass(frozen=True, eq=False)
class Int8Config:
    """The options of the INT8 attention processor, validated when the config is made (a ``ValueError`` or
    ``TypeError`` naming the option and what it accepts); files are read then too.

    Attributes:
        mode: constant precision, ``"int8"``, ``"int8_fp16v"`` or ``"fp16"`` (the stock processor exactly),
            when no ``schedule`` is given; kept as a ``Mode``.
        schedule: a ``PrecisionSchedule`` (per noise level and layer), a preset name or schedule file
            (``PrecisionSchedule.load``; kept loaded), or any callable ``timestep -> mode``; evaluated at every
            call from the timestep ``enable`` reads. Until a timestep is known, ``fp16`` runs (one warning says so).
            A callable is checked here: its signature, and what it returns for 1000.0 (one call).
        calibration: a ``Calibration`` or its file or directory (``diffusion-int8 calibrate``; kept loaded): its
            fitted per-head ranges at the current noise level and K means become the kernel's static ranges and
            smoothing vector (no statistics pass over K and V). Needs the timestep.
        speed_gate: True (default) runs an INT8 mode only for call shapes where it is faster than SDPA on the GPU
            (``speed_gate.SpeedGate``; elsewhere SDPA, exact); False forces INT8 wherever the mode says; a
            ``SpeedGate``, ``CrossoverTable`` or table file gates by that table. Kept as a ``SpeedGate`` or None.
        sparsity: a constant sparsity level tau in (0, 1] for every INT8 call: the call predicts which key blocks
            hold ``tau`` of each query block's pooled attention mass and the kernel skips the rest (1 or None:
            dense). A schedule with levels of its own (``PrecisionSchedule.sparse``) sets them instead, and giving
            both is an error. Calls that run SDPA, calls with an ``attn_mask`` (but a key mask that keeps the
            first n keys, as text padding does: the call runs sparse over those keys) and calls of at most one key
            block stay dense; in joint text+image attention the text tokens' key blocks are always kept.
        refresh_every: with ``sparsity``, carry the skipped blocks instead of dropping them (``carry.BlockCarry``):
            every ``refresh_every``-th denoising step computes them too (one due on the last step runs at the
            step before, where ``enable`` is given the pipeline and so its step count), the steps between forecast
            them from the last two such steps; the mask is predicted once per generation. Not inside a captured
            CUDA graph; under ``torch.compile`` each carried call breaks the graph (it reads the timestep).
            A schedule with one level carries its blocks at its own ``refresh_every`` (a calibrated one chooses
            it) unless this is given.
        qk_balance: ``int8_attention``'s Q·Kᵀ channel balance, against outlier channels that Q or K carries
            alone. None (the default) balances where a module needs it: with a calibration, by its static balance;
            with a schedule from a calibration, in the modules its ``balance_layers`` name; else by the module's
            first INT8 call of 1,024+ queries per head, which looks once for a channel the balance would move.
            True balances every call that measures Q's and K's ranges and has 1,024+ queries per K/V head (fewer
            sampled queries give noise, not outlier channels), False none.
        qk_rotate: ``int8_attention``'s Hadamard rotation of Q and K, for outlier channels Q and K share or not
            (with ``qk_balance`` too, both apply). With a calibration, Q's and K's ranges are then measured per
            call; its V ranges, K mean and balance still apply. The speed gate's tables do not include its cost,
            and a warning says so.

    ``replace(**changes)`` gives a copy with some options changed, checked again.
    """

    mode: Mode | str = "int8"
    schedule: Schedule | None = None
    calibration: Calibration | str | Path | None = None
    speed_gate: bool | SpeedGate | CrossoverTable | str | Path | None = True
    sparsity: float | None = None
    refresh_every: int | None = None
    qk_balance: bool | None = None
    qk_rotate: bool = False
    _refresh_from_schedule: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        put("mode", Mode.parse(self.mode))
        schedule = self.schedule
        if isinstance(schedule, (str, Path)):
            schedule = PrecisionSchedule.load(schedule)
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a PrecisionSchedule, a preset name, a file or a callable, "
                            f"got {type(schedule).__name__}")
        if schedule is not None and not isinstance(schedule, PrecisionSchedule):
            _check_schedule_callable(schedule)
        put("schedule", schedule)
        calibration = self.calibration
        if isinstance(calibration, (str, Path)):
            calibration = Calibration.load(calibration)
        if calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration or its file, got {type(calibration).__name__}")
        put("calibration", calibration)
        put("speed_gate", _gate(self.speed_gate))
        put("sparsity", _sparsity(self.sparsity, schedule))
        if self.refresh_every is None and isinstance(schedule, PrecisionSchedule) and schedule.refresh_every:
            put("refresh_every", schedule.refresh_every)
            put("_refresh_from_schedule", True)
        _check_carry(self.refresh_every, self.sparsity, schedule)
        if self.qk_balance is not None and not isinstance(self.qk_balance, bool):
            raise TypeError(f"qk_balance must be None (where the module needs it), True or False, got {self.qk_balance!r}")
        if not isinstance(self.qk_rotate, bool):
            raise TypeError(f"qk_rotate must be True or False, got {self.qk_rotate!r}")
        if self.qk_rotate and self.speed_gate is not None:
            _warn_rotation_cost()
        if calibration is not None and self.qk_balance and not calibration.has_channel_ranges():
            _warn_no_channel_ranges(calibration.meta.get("schema_version"))

    @classmethod
    def of(cls, mode_or_config: "Int8Config | Mode | str" = "int8", **options) -> "Int8Config":
        """``mode_or_config`` itself where it is a config (no ``options`` then), else a config of that mode and
        ``options``."""
        if isinstance(mode_or_config, Int8Config):
            if options:
                raise TypeError(f"give an Int8Config or its options as keywords, not both (got {', '.join(options)} "
                                f"beside a config): config.replace({', '.join(f'{k}=...' for k in options)})")
            return mode_or_config
        return cls(mode_or_config, **options)

    def replace(self, **changes) -> "Int8Config":
        if self._refresh_from_schedule and "refresh_every" not in changes:
            changes["refresh_every"] = None  # the schedule's interval: taken again from the schedule the copy has
        return dataclasses.replace(self, **changes)


def _check_schedule_callable(schedule: Callable) -> None:
    """A callable schedule takes the denoiser's timestep (a float) and returns a mode. Its signature is checked, and
    the result of one call at 1000.0 must be a mode; a call that raises is let through, since a schedule may take
    only its scheduler's timesteps."""
    try:
        inspect.signature(schedule).bind(1000.0)
    except TypeError as e:
        raise TypeError(f"a schedule callable takes one argument, the denoiser's timestep (a float), and returns a "
                        f"mode; {schedule!r} cannot be called with one ({e})") from None
    except ValueError:  # no signature to read (some builtins): the call below tells
        pass
    try:
        got = schedule(1000.0)
    except Exception:  # noqa: BLE001 - see the docstring
        return
    try:
        Mode.parse(got)
    except ValueError:
        raise ValueError(f"a schedule callable returns a mode, one of {[m.value for m in Mode]}; "
                         f"{schedule!r} returned {got!r} for the timestep 1000.0") from None


def _gate(speed_gate) -> SpeedGate | None:
    if speed_gate is True:
        return SpeedGate()
    if speed_gate is False or speed_gate is None:
        return None
    if isinstance(speed_gate, SpeedGate):
        return speed_gate
    if isinstance(speed_gate, (str, Path, CrossoverTable)):
        return SpeedGate(speed_gate)
    raise TypeError(f"speed_gate must be True, False, a SpeedGate, a CrossoverTable or its file, got {speed_gate!r}")


def _sparsity(sparsity, schedule) -> float | None:
    """``sparsity`` (None or a level in (0, 1]) checked, and not given beside a schedule with levels of its own."""
    if sparsity is None:
        return None
    sparsity = check_tau(sparsity, "sparsity")
    if isinstance(schedule, PrecisionSchedule) and schedule.sparse:
        raise ValueError(f"schedule {schedule.name!r} sets sparsity levels of its own; give sparsity= or a schedule "
                         f"with levels, not both")
    return sparsity


def _check_carry(refresh_every, sparsity: float | None, schedule=None) -> None:
    """``refresh_every`` (None: nothing carried) needs a constant ``sparsity`` below 1, or a schedule of one level
    (``carry.BlockCarry`` checks the interval itself)."""
    if refresh_every is None:
        return
    if isinstance(schedule, PrecisionSchedule) and schedule.sparse:
        if schedule.carried_tau() is None:
            raise ValueError(f"refresh_every={refresh_every!r} carries the blocks of one sparsity level, and "
                             f"schedule {schedule.name!r} sets several: give sparsity=tau with mode= or a schedule "
                             f"with one level")
        BlockCarry(refresh_every)
        return
    if sparsity is None or sparsity >= 1:
        raise ValueError(f"refresh_every={refresh_every!r} carries the blocks a sparsity level skips: give "
                         f"sparsity=tau (a constant level below 1) too, got sparsity={sparsity!r}")
    BlockCarry(refresh_every)  # its own check of the interval, now rather than per module


@functools.lru_cache(maxsize=None)
def _warn_rotation_cost() -> None:
    warnings.warn("diffusion_int8: qk_rotate costs up to several percent of an INT8 call, which the speed gate's "
                  "crossover tables do not include: calls it sends to INT8 may be slower than SDPA. Time your model "
                  "with and without it (benchmarks/pipeline.py).", UserWarning, stacklevel=5)


@functools.lru_cache(maxsize=None)
def _warn_no_channel_ranges(schema) -> None:
    warnings.warn(f"diffusion_int8: qk_balance=True with a schema {schema} calibration, which has no per-channel Q/K "
                  f"maxima: its static ranges run without the Q·Kᵀ balance. Run `diffusion-int8 calibrate` again to "
                  f"record them.", UserWarning, stacklevel=5)
