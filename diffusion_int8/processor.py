"""diffusers integration: an attention processor that swaps only the attention core for INT8.

Every stock diffusers processor ends in ``torch.nn.functional.scaled_dot_product_attention``, called through
its module's ``F`` (``AttnProcessor2_0``, ``JointAttnProcessor2_0``, ``CogVideoXAttnProcessor2_0`` …), or in
the attention dispatcher's ``dispatch_attention_fn`` (``FluxAttnProcessor``, ``WanAttnProcessor`` …).
``Int8DiffusionProcessor`` runs the module's own stock processor, with its norms, RoPE, projections and
residuals, as a copy of its ``__call__`` whose globals ``F`` and ``dispatch_attention_fn`` route the
attention call to ``int8_attention``. Nothing is patched globally, and nothing else in the processor pays
for the routing (a ``TorchFunctionMode`` around the call, the earlier design, intercepted every torch call
in it: 0.3-0.5 ms of host time per attention module).
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .kernels import Mode, int8_attention
from .kernels.config import MAX_HEAD_DIM
from .schedule import PrecisionSchedule
from .speed_gate import CrossoverTable, SpeedGate

Schedule = Union[PrecisionSchedule, str, Callable[[float], Union[str, Mode]]]


@dataclass
class Int8State:
    """The denoising position the processors read, held by the user's handle (no module globals).

    ``timestep`` is the value the denoiser was last called with (first element for CFG batches),
    ``step`` counts denoiser calls since ``reset()``; ``trace``, when a list, records
    ``(step, timestep, layer, mode)`` for every attention call (the mode the schedule chose, before the speed
    gate); ``int8_calls`` and ``gated_calls`` count the calls that ran INT8 and those the gate sent to SDPA (in eager
    mode: under ``torch.compile`` the counts stay as they are).
    """

    timestep: float | None = None
    step: int = -1
    trace: list | None = None
    timestep_scale: float | None = None  # 1000 or 1: what the timesteps of this generation are out of
    int8_calls: int = 0  # attention calls that ran an INT8 mode
    gated_calls: int = 0  # calls the schedule gave an INT8 mode and the speed gate sent to SDPA

    def reset(self) -> None:
        self.timestep, self.step, self.timestep_scale = None, -1, None
        self.int8_calls = self.gated_calls = 0
        if self.trace is not None:
            self.trace.clear()


def _routed(fn: Callable, sdpa: Callable, dispatch: Callable) -> Callable | None:
    """A copy of the stock processor's ``__call__`` ``fn`` whose module-level ``F.scaled_dot_product_attention``
    is ``sdpa`` and ``dispatch_attention_fn`` is ``dispatch``; None when ``fn`` reaches attention through neither."""
    g = fn.__globals__
    names = {}
    if g.get("F") is F:
        routed_f = types.ModuleType(F.__name__)
        routed_f.__dict__.update(F.__dict__)
        routed_f.scaled_dot_product_attention = sdpa
        names["F"] = routed_f
    if callable(g.get("dispatch_attention_fn")):
        names["dispatch_attention_fn"] = dispatch
    if not names:
        return None
    copy = types.FunctionType(fn.__code__, {**g, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_DISPATCH_MODULE = None  # diffusers.models.attention_dispatch once a processor exists


def _attention_dispatch():
    """diffusers' attention dispatcher module, imported when the first processor is made: an import inside code
    torch.compile traces is a graph break (``diffusers.models`` is a lazy module)."""
    global _DISPATCH_MODULE
    if _DISPATCH_MODULE is None:
        from diffusers.models import attention_dispatch

        _DISPATCH_MODULE = attention_dispatch
    return _DISPATCH_MODULE


def _keeps_stock(backend, parallel_config) -> bool:
    """Whether a ``dispatch_attention_fn`` call goes to another attention backend than diffusers' native one
    (``backend`` None: the active one), or is split across devices (context parallelism): such calls stay stock."""
    if parallel_config is not None:
        return True
    if backend is None:
        backend = _attention_dispatch()._AttentionBackendRegistry.get_active_backend()[0]
    return backend != "native"


def _other_backend(inner) -> bool:
    """``_keeps_stock`` for a stock processor's settings; processors without the dispatcher have none."""
    if not hasattr(inner, "_attention_backend") and getattr(inner, "_parallel_config", None) is None:
        return False
    return _keeps_stock(getattr(inner, "_attention_backend", None), getattr(inner, "_parallel_config", None))


class _RouteToInt8(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to ``sdpa`` for the duration of one processor call (traced by
    torch.compile); ``dispatch_attention_fn``'s native backend ends in that call."""

    def __init__(self, sdpa: Callable):
        super().__init__()
        self.sdpa = sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if func is torch.Tensor.unflatten:
            # Tensor.unflatten is Python calling super().unflatten, which dynamo cannot trace inside a
            # torch-function mode (Flux and Wan processors use it); torch.unflatten is the same op.
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


def int8_sdpa(mode, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, ranges=None):
    """``scaled_dot_product_attention``'s signature (BHSD), in ``mode``; cases the kernel does not cover go to SDPA.

    ``ranges``: optional static ``(q_amax, k_amax, v_amax, k_mean)`` for ``int8_attention``, shaped (1, H),
    (1, H), (1, H, D), (1, H, D) (``Calibration.ranges``; ``k_mean`` may be None).
    """
    mode = Mode.parse(mode)
    if mode is Mode.FP16 or not kernel_takes(query, key, attn_mask, dropout_p, is_causal):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    return _int8_core(mode, query, key, value, attn_mask, scale, ranges)


def _int8_core(mode: Mode, query, key, value, attn_mask, scale, ranges):
    """``int8_sdpa`` for a call ``kernel_takes`` (the processor has checked it already)."""
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):  # fp32 models: the kernel computes in fp16
        query, key, value = (t.to(torch.float16) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(torch.float32)
    q_amax, k_amax, v_amax, k_mean = ranges if ranges is not None else (None, None, None, None)
    out = int8_attention(query, key, value, mode=mode, layout="BHSD", attn_mask=attn_mask, scale=scale,
                         q_amax=q_amax, k_amax=k_amax, v_amax=v_amax, k_mean=k_mean)
    return out.to(dtype)


def kernel_takes(query, key, attn_mask=None, dropout_p=0.0, is_causal=False) -> bool:
    """Whether an SDPA call (BHSD) is one the INT8 kernel covers: 4-D, no dropout, not causal, head dim
    <= 256, a mask that broadcasts to (B, H, Sq, Sk). Other calls stay on SDPA."""
    if is_causal or dropout_p > 0 or query.dim() != 4 or query.shape[-1] > MAX_HEAD_DIM:
        return False
    return attn_mask is None or (attn_mask.dim() <= 4 and _broadcasts(attn_mask, query, key))


def _broadcasts(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        return torch.broadcast_shapes(mask.shape, full) == torch.Size(full)
    except RuntimeError:
        return False


def _as_gate(speed_gate) -> SpeedGate | None:
    if speed_gate is True:
        return SpeedGate()
    if speed_gate is False or speed_gate is None:
        return None
    if isinstance(speed_gate, SpeedGate):
        return speed_gate
    if isinstance(speed_gate, (str, Path, CrossoverTable)):
        return SpeedGate(speed_gate)
    raise TypeError(f"speed_gate must be True, False, a SpeedGate, a CrossoverTable or its file, got {speed_gate!r}")


def _as_calibration(calibration):
    """A ``Calibration`` from itself, its file or directory, or None."""
    if isinstance(calibration, (str, Path)):
        from .calibration import Calibration

        return Calibration.load(calibration)
    return calibration


def stock_processor_for(attn: torch.nn.Module, called_with_context: bool):
    """The processor diffusers' own model code gives ``attn``, inferred from the module.

    New-style modules (Flux, Wan, …) name it in ``_default_processor_cls``. Legacy ``Attention`` modules
    take ``JointAttnProcessor2_0`` (SD3: added K/V projections), ``CogVideoXAttnProcessor2_0`` (self-
    attention that receives the text tokens to attend jointly) or ``AttnProcessor2_0``.
    """
    from diffusers.models import attention_processor as ap

    cls = getattr(type(attn), "_default_processor_cls", None)
    if cls is not None:
        return cls()
    if getattr(attn, "add_k_proj", None) is not None and getattr(attn, "context_pre_only", None) is not None:
        return ap.JointAttnProcessor2_0()
    if called_with_context and not getattr(attn, "is_cross_attention", True):
        return ap.CogVideoXAttnProcessor2_0()
    return ap.AttnProcessor2_0()


@functools.lru_cache(maxsize=None)
def _call_params(processor_type: type) -> tuple[frozenset[str], bool]:
    """A processor's keyword parameter names, and whether it takes ``**kwargs``."""
    params = inspect.signature(processor_type.__call__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(params) - {"self", "attn"}, var_kw


class Int8DiffusionProcessor:
    """A diffusers attention processor whose attention core runs in INT8.

    Use it the diffusers way, ``pipe.transformer.set_attn_processor(Int8DiffusionProcessor(mode="int8"))``
    (or ``pipe.unet``), or through ``diffusion_int8.enable(pipe, ...)``, which wraps each module's current
    processor and wires the timestep.

    Args:
        mode: constant precision, ``"int8"``, ``"int8_fp16v"`` or ``"fp16"`` (the stock processor exactly).
        schedule: instead of ``mode``, a ``PrecisionSchedule`` (per noise level and layer), a preset name
            or schedule file (``PrecisionSchedule.load``), or any callable ``timestep -> mode``; evaluated at
            every call from ``state.timestep`` (``enable`` keeps it current). Until a timestep is known,
            ``fp16`` runs.
        calibration: a ``Calibration`` (or its file): its fitted per-head ranges at the current noise level
            and K means become the kernel's static quantization ranges and smoothing vector for module ``name``
            (no statistics pass over K and V). Needs the timestep.
        inner: the stock processor to wrap; inferred per module when None (``stock_processor_for``).
        state: the ``Int8State`` to read the timestep from and record into.
        name: the module's name, for the trace and the calibration.
        observer: a callable ``observer(processor, query, key, value, attn_mask, scale, out)`` given every
            attention call's BHSD inputs and exact output (``out``); the calibration collector is one.
        speed_gate: True (default) runs an INT8 mode only for call shapes where it is faster than SDPA on the
            GPU (``speed_gate.SpeedGate``; elsewhere SDPA, exact); False forces INT8 wherever the mode says;
            a ``SpeedGate``, or a crossover table file, gates by that table.
    """

    def __init__(
        self,
        mode: str | Mode = "int8",
        *,
        schedule: Schedule | None = None,
        calibration: "Calibration | str | None" = None,
        inner: Any = None,
        state: Int8State | None = None,
        name: str | None = None,
        observer: Callable | None = None,
        speed_gate: "bool | SpeedGate | str | Path" = True,
    ):
        self.mode = Mode.parse(mode)
        self.gate = _as_gate(speed_gate)
        _attention_dispatch()  # imported now, not while torch.compile traces a call
        if isinstance(schedule, str):
            schedule = PrecisionSchedule.load(schedule)
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a PrecisionSchedule, a preset name, a file or a callable, got {type(schedule).__name__}")
        self.schedule = schedule
        self.inner = inner
        self.state = state if state is not None else Int8State()
        self.name = name
        calibration = _as_calibration(calibration)
        if calibration is not None and name not in calibration.layers:
            raise ValueError(f"the calibration has no layer {name!r}: pass the module's name (enable() does)")
        self.calibration = calibration
        self.observer = observer
        self._inferred: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._routed_calls: dict[type, Callable] = {}  # stock processor type -> its routed __call__
        self._routed_hit = False  # set by the routes: did the first routed call reach them
        self._ranges: tuple = (None, None, None)  # (timestep, device, ranges) of the last call

    def current_mode(self) -> Mode:
        if self.schedule is None:
            return self.mode
        if self.state.timestep is None:
            return Mode.FP16
        if isinstance(self.schedule, PrecisionSchedule):
            return self.schedule.mode_for(self.state.timestep, self.name, self.state.timestep_scale)
        return Mode.parse(self.schedule(self.state.timestep))

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        # Positional arguments go to the stock processor untouched (new-style modules pass
        # encoder_hidden_states, attention_mask, image_rotary_emb positionally); keyword arguments are
        # forwarded when it takes them. __call__.__signature__ below names what legacy ``Attention``
        # modules check before passing keyword arguments.
        inner = self.inner
        if inner is None:
            inner = self._inferred.get(attn)
            if inner is None:
                with_context = (args[0] if args else kwargs.get("encoder_hidden_states")) is not None
                inner = self._inferred[attn] = stock_processor_for(attn, with_context)
        params, var_kw = _call_params(type(inner))
        if not var_kw:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        mode = self.current_mode()
        if self.state.trace is not None:
            self.state.trace.append((self.state.step, self.state.timestep, self.name, mode.value))
        if mode is Mode.FP16 and self.observer is None:
            return inner(attn, hidden_states, *args, **kwargs)
        if torch.compiler.is_compiling():
            # dynamo cannot trace a function whose globals differ from its module's; a torch-function mode
            # costs nothing in a compiled graph (it is traced away). As in eager, another attention backend
            # or a context-parallel split keeps the stock processor.
            if _other_backend(inner):
                return inner(attn, hidden_states, *args, **kwargs)
            with _RouteToInt8(self._attention):
                return inner(attn, hidden_states, *args, **kwargs)
        call = self._routed_calls.get(type(inner))
        if call is not None:
            return call(inner, attn, hidden_states, *args, **kwargs)
        # first call of this processor type: check that the routed copy reaches the INT8 path; where it
        # cannot (attention reached another way), route through a torch-function mode instead
        routed = _routed(type(inner).__call__, self._attention, self._dispatch)
        call = routed or self._mode_call
        self._routed_hit = False
        out = call(inner, attn, hidden_states, *args, **kwargs)
        if routed is None or (not self._routed_hit and not _other_backend(inner)):
            warnings.warn(f"diffusion_int8: {type(inner).__name__} reaches attention outside its module's F and "
                          f"dispatch_attention_fn; routing it through a torch-function mode (more host time per call)",
                          RuntimeWarning, stacklevel=2)
            if routed is not None:
                call = self._mode_call
                out = call(inner, attn, hidden_states, *args, **kwargs)
        self._routed_calls[type(inner)] = call
        return out

    def _mode_call(self, inner, attn, hidden_states, *args, **kwargs):
        with _RouteToInt8(self._attention):
            return inner(attn, hidden_states, *args, **kwargs)

    def _static_ranges(self, device: torch.device):
        """The calibration's ranges at the current timestep, evaluated once per step and device."""
        if self.calibration is None or self.state.timestep is None:
            return None
        t, dev, ranges = self._ranges
        if t != self.state.timestep or dev != device:
            ranges = self.calibration.ranges(self.name, self.state.timestep, device)
            self._ranges = (self.state.timestep, device, ranges)
        return ranges

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """What the stock processor's ``F.scaled_dot_product_attention`` call runs: this call's mode, shown to
        the observer first."""
        if not torch.compiler.is_compiling():
            self._routed_hit = True
        mode = self.current_mode()
        exact = None
        if self.observer is not None:
            exact = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            self.observer(self, query, key, value, attn_mask, scale, exact)
        if mode is Mode.FP16 or not kernel_takes(query, key, attn_mask, dropout_p, is_causal):
            return exact if exact is not None else F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
        # the counts are kept in eager mode only: torch.compile guards on an int it reads, so counting inside a
        # compiled graph would recompile it at every call
        counting = not torch.compiler.is_compiling()
        if self.gate is not None and not self.gate.pays(mode, query, key):
            if counting:
                self.state.gated_calls += 1
            return exact if exact is not None else F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
        if counting:
            self.state.int8_calls += 1
        return _int8_core(mode, query, key, value, attn_mask, scale, self._static_ranges(query.device))

    def _dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """What the stock processor's ``dispatch_attention_fn`` call runs: (B, S, H, D) in and out, as the
        dispatcher's. Calls for another backend than the native one, or split across devices, go to it."""
        if attention_kwargs or _keeps_stock(backend, parallel_config):
            return _attention_dispatch().dispatch_attention_fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            attention_kwargs, backend=backend, parallel_config=parallel_config)
        out = self._attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                              dropout_p, is_causal, scale, enable_gqa)
        return out.transpose(1, 2)


_P = inspect.Parameter
Int8DiffusionProcessor.__call__.__signature__ = inspect.Signature(
    [_P("self", _P.POSITIONAL_OR_KEYWORD), _P("attn", _P.POSITIONAL_OR_KEYWORD), _P("hidden_states", _P.POSITIONAL_OR_KEYWORD)]
    + [_P(n, _P.POSITIONAL_OR_KEYWORD, default=None)
       for n in ("encoder_hidden_states", "attention_mask", "temb", "image_rotary_emb")]
    + [_P("kwargs", _P.VAR_KEYWORD)]
)


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The diffusers attention modules of ``model`` (anything with a settable ``processor``)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "processor") and hasattr(m, "set_processor")}


def head_dim_of(module: torch.nn.Module) -> int | None:
    heads, inner = getattr(module, "heads", None), getattr(module, "inner_dim", None)
    if heads and inner:
        return inner // heads
    return None


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


def _denoiser(pipe_or_model) -> torch.nn.Module:
    if isinstance(pipe_or_model, torch.nn.Module):
        return pipe_or_model
    for attr in ("transformer", "unet", "prior"):
        model = getattr(pipe_or_model, attr, None)
        if isinstance(model, torch.nn.Module):
            return model
    raise TypeError(
        f"{type(pipe_or_model).__name__} has no denoiser (looked for .transformer, .unet, .prior); "
        f"pass the model itself"
    )


def enable(
    pipe_or_model,
    mode: str | Mode = "int8",
    *,
    schedule: Schedule | None = None,
    calibration: "Calibration | str | None" = None,
    record: bool = False,
    observer: Callable | None = None,
    speed_gate: "bool | SpeedGate | str | Path" = True,
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
        record: keep a trace of ``(step, timestep, layer, mode)`` in ``handle.state.trace``.
        observer: see ``Int8DiffusionProcessor``; the calibration collector passes one.
        speed_gate: True (default): INT8 only for the call shapes where it beats SDPA on this GPU, by the
            crossover table shipped for its architecture or measured by ``diffusion-int8 tune``; SDPA elsewhere.
            False forces INT8 (experiments, quality evaluation). A ``SpeedGate`` or table file gates by that.
            ``handle.state.int8_calls`` / ``gated_calls`` count the two outcomes.

    Modules the kernel cannot run (head dim > 256) keep their processor; one warning lists them.
    Refuses a model already enabled, or one compiled with ``torch.compile`` (enable first, compile after).
    """
    model = _denoiser(pipe_or_model)
    if "_diffusion_int8_handle" in model.__dict__:
        raise RuntimeError("diffusion_int8 is already enabled on this model; call handle.disable() first")
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise RuntimeError("the model is already compiled: call diffusion_int8.enable() before torch.compile")
    Mode.parse(mode)
    if isinstance(schedule, str):
        schedule = PrecisionSchedule.load(schedule)
    calibration = _as_calibration(calibration)
    if calibration is not None:
        calibration.validate(model)
    gate = _as_gate(speed_gate)
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
                                   state=state, name=name, observer=observer, speed_gate=gate)
        )
    _warn_skipped(skipped)
    hook = None
    if schedule is not None or record or calibration is not None or observer is not None:
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
