"""``enable``: install ``Int8DiffusionProcessor`` on every attention module of a pipeline's denoisers, and the handle
that takes it off again."""

from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..caller import warn_user
from ..kernels import Mode
from ..kernels.config import MAX_HEAD_DIM
from .models import (TIMESTEP_ARGUMENTS, attention_modules, attention_outside_processors, denoiser, head_dim_of,
                     other_denoisers, reaches_attention, scheduler_of, set_processor)
from .config import Int8Config
from .observer import Observer
from .processor import Int8DiffusionProcessor
from .state import Int8State
from ..schedule import PrecisionSchedule, noise_level
from ..versions import check_diffusers_version


@dataclass
class Int8Handle:
    """What ``enable`` returns: ``disable()`` puts the original processors back exactly; ``summary()`` says what was
    installed where.

    ``originals`` maps each routed module's name to the processor it had; ``skipped`` maps each attention module left
    on its stock processor to the reason. ``others``: the handles of the pipeline's other denoising models (Wan 2.2's
    ``transformer_2``, ControlNets), by component name; they share ``state``, and ``disable()`` disables them too.
    A copy or pickle of an enabled model holds a handle of that model alone (``diffusion_int8.disable``)."""

    model: torch.nn.Module
    state: Int8State
    originals: dict[str, Any]
    skipped: dict[str, str]
    _hook: Any = field(default=None, repr=False)
    others: dict[str, "Int8Handle"] = field(default_factory=dict)
    config: Int8Config | None = None
    _told_replaced: bool = field(default=False, repr=False)

    def __getstate__(self):
        # what a copy or pickle of a model carries: its own handle, not the pipeline's other models (a Wan 2.2
        # expert copied alone would copy the other); in a copied pipeline, diffusion_int8.disable() reaches each
        # model's own
        return dict(self.__dict__, others={})

    def disable(self, *, _stacklevel: int = 2) -> None:
        """Put back the processors ``enable`` replaced where an INT8 one is installed; any other processor set since
        (``load_ip_adapter``'s, ``set_attn_processor``) stays, and a warning says where. A handle already disabled
        does nothing (a later ``enable`` on the model has its own handle, which this one must not touch)."""
        for other in self.others.values():
            other.disable(_stacklevel=_stacklevel + 1)
        if self.model.__dict__.get("_diffusion_int8_handle") is not self:
            return
        modules = attention_modules(self.model)
        replaced = []
        for name, proc in self.originals.items():
            watch = getattr(modules.get(name), "__dict__", {}).get("set_processor")
            if isinstance(watch, _WatchedSetProcessor) and watch.handle is self:
                del modules[name].set_processor
            current = getattr(modules.get(name), "processor", None)
            if isinstance(current, Int8DiffusionProcessor):
                set_processor(modules[name], proc)
            elif current is not proc:
                replaced.append(name)
        if replaced:
            warnings.warn(f"diffusion_int8: {type(self.model).__name__}: {len(replaced)} attention module(s) got "
                          f"another processor after enable(), which disable() leaves in place: "
                          f"{', '.join(replaced[:4])}{', ...' if len(replaced) > 4 else ''}", RuntimeWarning,
                          stacklevel=_stacklevel)
        if self._hook is not None:
            self._hook.remove()
        del self.model.__dict__["_diffusion_int8_handle"]
        self.originals = {}

    def _replaced_since(self, name: str, processor: Any) -> None:
        """``_WatchedSetProcessor``'s report of ``processor`` put on module ``name``: one warning for the first one
        not INT8, and again after this handle's processors are back (``unfuse_qkv_projections``)."""
        if isinstance(processor, Int8DiffusionProcessor):
            self._told_replaced &= processor.state is not self.state
            return
        if self._told_replaced or self.model.__dict__.get("_diffusion_int8_handle") is not self:
            return
        self._told_replaced = True
        warn_user(f"diffusion_int8: {type(self.model).__name__}: {name} got {type(processor).__name__} after enable(), "
                  f"as calls that set processors give every attention module theirs (fuse_qkv_projections, "
                  f"set_attn_processor, enable_xformers_memory_efficient_attention): those modules now run stock "
                  f"attention. Make such calls before enable(), or call handle.disable() and enable() again")

    def summary(self) -> dict:
        """What ``enable`` installed: ``{"model": class name, "settings": {mode, schedule (its name), schedule_levels,
        sparsity, refresh_every, speed_gate, calibration}, "routed": {stock processor class: modules that run the INT8
        processor}, "left_stock": {module name: reason}, "qk_balance": {what the module does
        (``Int8DiffusionProcessor.balance_status``): [module names]}, "replaced": [modules given another processor
        since, e.g. by ``fuse_qkv_projections``]}`` (``routed``, ``qk_balance`` and ``replaced`` are empty once
        disabled), and ``"others": {component: its summary}`` where the pipeline has other denoising models."""
        routed: dict[str, int] = {}
        balance: dict[str, list[str]] = {}
        replaced: list[str] = []
        modules = attention_modules(self.model) if self.originals else {}
        for name, original in self.originals.items():
            proc = getattr(modules.get(name), "processor", None)
            if isinstance(proc, Int8DiffusionProcessor) and proc.state is self.state:
                routed[type(original).__name__] = routed.get(type(original).__name__, 0) + 1
                balance.setdefault(proc.balance_status(), []).append(name)
            elif proc is not original:  # set since (fuse_qkv_projections, load_ip_adapter, set_attn_processor)
                replaced.append(name)
        out = {"model": type(self.model).__name__, "settings": _settings(self.config),
               "routed": dict(sorted(routed.items())), "left_stock": dict(sorted(self.skipped.items())),
               "qk_balance": dict(sorted(balance.items())), "replaced": replaced}
        if self.others:
            out["others"] = {name: other.summary() for name, other in self.others.items()}
        return out

    def __str__(self) -> str:
        return "\n".join(self._lines(self.summary()))

    def __repr__(self) -> str:  # not the dataclass's, which would print the whole model
        return f"<Int8Handle: {self._lines(self.summary())[0]}>"

    @staticmethod
    def _lines(s: dict, indent: str = "") -> list[str]:
        settings = s["settings"]
        said = [settings["mode"] if settings["schedule"] is None else f"schedule {settings['schedule']}"]
        if settings["sparsity"] is not None:
            said.append(f"sparsity {settings['sparsity']:g}")
        elif settings["schedule_levels"]:
            said.append("the schedule's sparsity levels")
        if settings["refresh_every"]:
            said.append(f"skipped blocks carried, refresh every {settings['refresh_every']} steps")
        said.append("speed gate " + ("on" if settings["speed_gate"] else "off"))
        lines = [f"{indent}diffusion_int8 on {s['model']} ({'; '.join(said)}): {sum(s['routed'].values())} attention "
                 f"module(s) routed"]
        lines += [f"{indent}  {n} x {cls}" for cls, n in s["routed"].items()]
        lines += [f"{indent}  Q·Kᵀ balance {status}: {len(names)} module(s)" for status, names in s["qk_balance"].items()]
        if s["replaced"]:
            lines.append(f"{indent}  {len(s['replaced'])} given another processor since enable(), which runs as it is: "
                         f"{', '.join(s['replaced'][:4])}{', ...' if len(s['replaced']) > 4 else ''}")
        if s["left_stock"]:
            lines.append(f"{indent}  {len(s['left_stock'])} left on their stock processor:")
            lines += [f"{indent}    {name}: {why}" for name, why in s["left_stock"].items()]
        for name, other in s.get("others", {}).items():
            lines.append(f"{indent}  and {name}:")
            lines += Int8Handle._lines(other, indent + "    ")
        return lines


def _settings(config: Int8Config | None) -> dict:
    """What a handle's summary says of the config its processors run."""
    if config is None:
        return dict.fromkeys(("mode", "schedule", "schedule_levels", "sparsity", "refresh_every", "speed_gate",
                              "calibration"))
    schedule = config.schedule
    name = None if schedule is None else getattr(schedule, "name", None) or getattr(schedule, "__name__", "callable")
    return {"mode": config.mode.value, "schedule": name, "schedule_levels": bool(getattr(schedule, "sparse", False)),
            "sparsity": config.sparsity, "refresh_every": config.refresh_every,
            "speed_gate": config.speed_gate is not None, "calibration": config.calibration is not None}


def _why_stock(module: torch.nn.Module) -> str | None:
    """Why an attention module keeps its stock processor, or None where the INT8 processor can run it."""
    hd = head_dim_of(module)
    if hd is not None and hd > MAX_HEAD_DIM:
        return f"head dim {hd} > {MAX_HEAD_DIM}"
    proc = module.processor
    if isinstance(proc, Int8DiffusionProcessor):
        return None
    if not reaches_attention(proc):
        return (f"{type(proc).__name__} computes no scaled-dot-product attention (linear attention, or its own "
                f"softmax): nothing for the INT8 op to take")
    return None


def _warn_skipped(model: torch.nn.Module, skipped: dict[str, str]) -> None:
    if skipped:
        by_reason: dict[str, list[str]] = {}
        for name, why in sorted(skipped.items()):
            by_reason.setdefault(why, []).append(name)
        listing = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items())
        warnings.warn(f"diffusion_int8: {type(model).__name__}: left {len(skipped)} attention module(s) on their stock "
                      f"processor: {listing}", RuntimeWarning, stacklevel=4)


def enable(pipe_or_model, mode: "Int8Config | str | Mode" = "int8", *, record: bool = False,
           observer: Observer | None = None, **options) -> Int8Handle:
    """Install ``Int8DiffusionProcessor`` on every attention module of a pipeline's denoisers.

    Args:
        pipe_or_model: a diffusers pipeline or one model. A pipeline's denoiser (its ``transformer``, ``unet`` or
            ``prior``) is routed, and so is each other model of it that runs at the denoising steps and has
            attention (``models.other_denoisers``: Wan 2.2's ``transformer_2``, ControlNets, an unconditional
            transformer), in ``handle.others``, sharing one ``Int8State``. With a calibration, an observer or a
            schedule with per-layer rules, which describe one model, the others stay stock and a warning names
            them, as it does a model compiled before ``enable``.
        mode: an ``Int8Config``, or the mode of one made from ``options``: ``enable(pipe, "int8",
            calibration="calib/")`` is ``enable(pipe, Int8Config("int8", calibration="calib/"))``. The config's
            options (schedule, calibration, speed gate, sparsity, carrying, outlier handling) are documented there;
            a calibration is also checked against the model (layer names, heads, head dims). With a schedule, a
            calibration or carrying, the timestep the denoiser receives (the first element of a CFG batch) is read
            by a forward pre-hook, once per denoiser call (one host read per step), from the argument of
            ``forward`` named as in ``TIMESTEP_ARGUMENTS``; given a pipeline, the hook also reads the generation's
            step count from its scheduler at the first step (``StepCount``), which carrying uses.
        record: keep a trace of ``(step, timestep, layer, mode)`` in ``handle.state.trace``, and count the
            (query block, key block) pairs computed per step: ``handle.state.skipped_blocks()``.
        observer: see ``Int8DiffusionProcessor``; the calibration collector passes one.
        options: keywords of ``Int8Config``, when ``mode`` is not a config.

    Every attention module of the model is routed (diffusers' ``Attention``, ``AttentionModuleMixin`` modules and
    model-specific ones); those the kernel cannot run (head dim > 256, a processor with no scaled-dot-product
    attention) keep their processor, and one warning names the model and lists them (``handle.summary()`` too).
    ``handle.state.int8_calls`` / ``gated_calls`` count the calls that ran INT8 and those the speed gate sent to
    SDPA; ``handle.summary()["qk_balance"]`` lists what each module does about the Q·Kᵀ balance.
    Raises ``ValueError`` for a model without attention modules; refuses a model already enabled, or one compiled
    with ``torch.compile`` (enable first, compile after).
    """
    model = denoiser(pipe_or_model)
    config = Int8Config.of(mode, **options)
    others = [] if isinstance(pipe_or_model, torch.nn.Module) else other_denoisers(pipe_or_model, model)
    _check_enableable(model, "the model" if isinstance(pipe_or_model, torch.nn.Module) else "the denoiser")
    one_model = _one_model(config, observer)
    compiled = [name for name, m in others if _compiled(m)]
    others = [(name, m) for name, m in others if name not in compiled]
    if not one_model:
        for name, m in others:
            _check_enableable(m, name)
    if config.calibration is not None:
        config.calibration.validate(model)
    modules = attention_modules(model)
    outside = attention_outside_processors(model)
    if not modules:
        found = (f"; its attention ({', '.join(outside)}) is computed in the modules' own forward, with no processor "
                 f"to swap") if outside else ""
        raise ValueError(f"diffusion_int8: {type(model).__name__} has no attention module to route (it looks for "
                         f"modules with an attention processor: diffusers' Attention, AttentionModuleMixin modules and "
                         f"model-specific ones){found}; pass a diffusers pipeline or its transformer/unet")
    _warn_unmatched_rules(model, config.schedule, modules)
    check_diffusers_version()
    state = Int8State(trace=[] if record else None)
    # a schedule's refresh interval chosen at its calibrated_steps, where enable() was not given another
    schedule = config.schedule if config._refresh_from_schedule else None
    pipe = None if isinstance(pipe_or_model, torch.nn.Module) else pipe_or_model
    steps = None if pipe is None else StepCount(pipe, schedule, scheduler_of(pipe, model))
    handle = _install(model, modules, outside, config, state, observer, record, steps)
    if compiled:
        warnings.warn(f"diffusion_int8: {type(pipe_or_model).__name__}: left {', '.join(compiled)} on stock attention: "
                      f"compiled before enable() (enable first, compile after)", RuntimeWarning, stacklevel=2)
    if others and one_model:
        warnings.warn(f"diffusion_int8: {type(pipe_or_model).__name__}: left {', '.join(n for n, _ in others)} on "
                      f"stock attention: a calibration, a schedule with per-layer rules or an observer describes one "
                      f"model, the pipeline's denoiser ({type(model).__name__}); enable(pipe.<name>, ...) routes "
                      f"another, with its own", RuntimeWarning, stacklevel=2)
    elif others:
        routed = {id(m) for m in modules.values()}  # a module two models share is routed once
        for name, m in others:
            mods = {n: a for n, a in attention_modules(m).items() if id(a) not in routed}
            routed.update(id(a) for a in mods.values())
            handle.others[name] = _install(m, mods, attention_outside_processors(m), config, state, None, record,
                                           StepCount(pipe, None, scheduler_of(pipe, m)))
    return handle


def _warn_unmatched_rules(model: torch.nn.Module, schedule, modules: dict) -> None:
    """One warning naming a schedule's layer patterns that match none of ``model``'s attention modules (a typo, or
    a schedule made for another model): their rules would never apply, with nothing said; and one naming the
    modules its ``balance_layers`` lists that the model does not have."""
    if not isinstance(schedule, PrecisionSchedule):
        return
    unmatched = sorted({rule.layers for rule in schedule.rules if rule.layers != "*"
                        and not any(fnmatch.fnmatchcase(name, rule.layers) for name in modules)})
    if unmatched:
        names = ", ".join(list(modules)[:2])
        warnings.warn(f"diffusion_int8: {type(model).__name__}: the schedule's layer pattern(s) "
                      f"{', '.join(map(repr, unmatched))} match none of its attention modules (named as {names}, "
                      f"...): their rules never apply", RuntimeWarning, stacklevel=3)
    unknown = sorted(set(schedule.balance_layers or ()) - set(modules))
    if unknown:  # from_calibration's list of the modules that measure the Q·Kᵀ balance; the others never do
        warnings.warn(f"diffusion_int8: {type(model).__name__}: the schedule's balance_layers name "
                      f"{len(unknown)} module(s) it does not have ({', '.join(map(repr, unknown[:3]))}"
                      f"{', ...' if len(unknown) > 3 else ''}; made for another model?): the modules it lists run "
                      f"the Q·Kᵀ balance, and every other module runs without it", RuntimeWarning, stacklevel=3)


def _check_enableable(model: torch.nn.Module, what: str) -> None:
    core = getattr(model, "_orig_mod", model)  # a model compiled after enable holds its handle in the wrapped one
    if "_diffusion_int8_handle" in core.__dict__:
        raise RuntimeError(f"diffusion_int8 is already enabled on {what} ({type(core).__name__})"
                           f"{', compiled since' if core is not model else ''}; call handle.disable(), or "
                           f"diffusion_int8.disable() on it, first (enable(pipe) routes every denoising model of a "
                           f"pipeline)")
    if _compiled(model):
        raise RuntimeError(f"{what} ({type(model).__name__}) is already compiled: call diffusion_int8.enable() "
                           f"before torch.compile")
    by_hand = [name for name, m in attention_modules(model).items() if isinstance(m.processor, Int8DiffusionProcessor)]
    if by_hand:
        shown = ", ".join(by_hand[:3]) + (f" and {len(by_hand) - 3} more" if len(by_hand) > 3 else "")
        raise RuntimeError(f"{what} ({type(model).__name__}) already runs Int8DiffusionProcessor on {shown} (set with "
                           f"set_attn_processor): enable() would put a second one around it, and a stock run would "
                           f"not be stock. Put the stock processors back first (set_default_attn_processor(), or "
                           f"the ones you replaced), or keep yours and leave out enable()")


def disable(pipe_or_model) -> bool:
    """Undo ``enable`` on ``pipe_or_model`` (a diffusers pipeline or one model) as its handle's ``disable()`` does,
    for where that handle is out of reach: ``enable`` called in code that dropped it, or a model copied
    (``copy.deepcopy``) or unpickled while enabled, which carries a handle of its own. Given a pipeline, each of its
    denoising models that is enabled is disabled. Returns whether anything was enabled."""
    if isinstance(pipe_or_model, torch.nn.Module):
        models = [pipe_or_model]
    else:
        main = denoiser(pipe_or_model)
        models = [main, *(m for _, m in other_denoisers(pipe_or_model, main))]
    # a model compiled after enable (the order enable asks for) is wrapped: its handle is on the wrapped one
    handles = [getattr(m, "_orig_mod", m).__dict__.get("_diffusion_int8_handle") for m in models]
    for handle in handles:
        if handle is not None:
            handle.disable(_stacklevel=3)
    return any(h is not None for h in handles)


def check_enableable(pipe_or_model) -> None:
    """Raise where ``pipe_or_model``'s denoiser, or another of its denoising models not compiled, is already
    enabled, compiled (the denoiser) or runs ``Int8DiffusionProcessor`` set by hand, as ``enable`` refuses them. For
    work that runs stock first (``eval``'s baseline), so that it stops before any."""
    model = denoiser(pipe_or_model)
    _check_enableable(model, "the model" if isinstance(pipe_or_model, torch.nn.Module) else "the denoiser")
    if not isinstance(pipe_or_model, torch.nn.Module):
        for name, m in other_denoisers(pipe_or_model, model):
            if not _compiled(m):
                _check_enableable(m, name)


def _compiled(model: torch.nn.Module) -> bool:
    return hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None


def _one_model(config: Int8Config, observer) -> bool:
    """Whether what ``config`` and ``observer`` hold describes one model's modules by name: a calibration, an
    observer, or a schedule with per-layer rules or balanced layers (``from_calibration``'s)."""
    schedule = config.schedule
    per_layer = isinstance(schedule, PrecisionSchedule) and (
        schedule.balance_layers is not None or any(rule.layers != "*" for rule in schedule.rules))
    return config.calibration is not None or observer is not None or per_layer


class _WatchedSetProcessor:
    """A routed module's ``set_processor`` while ``enable``'s processor is on it. diffusers replaces processors
    through it (``fuse_qkv_projections``, ``set_attn_processor``); a stock one put there would turn INT8 off with
    nothing said, so the handle is told (``Int8Handle._replaced_since``). Another INT8 processor is not reported:
    one diffusers rebuilt by its class warns itself, one the user set is meant. ``disable()`` removes it. A shallow
    copy of the module (``copy.copy``, DataParallel's replicas) shares it, and its ``set_processor`` then sets the
    original's processor; ``deepcopy`` copies it with the module."""

    __slots__ = ("module", "name", "handle")

    def __init__(self, module: torch.nn.Module, name: str, handle: Int8Handle):
        self.module, self.name, self.handle = module, name, handle

    def __call__(self, processor, *args, **kwargs):
        type(self.module).set_processor(self.module, processor, *args, **kwargs)
        self.handle._replaced_since(self.name, processor)


def _install(model: torch.nn.Module, modules: dict, outside: list[str], config: Int8Config, state: Int8State,
             observer: Observer | None, record: bool, steps: "StepCount | None") -> Int8Handle:
    """Route ``model``'s attention ``modules`` (``outside``: its attention with no processor, which stays stock) and
    hook its forward to read the timestep where anything needs it; the handle that undoes it."""
    originals = {}
    skipped = {name: "attention computed in the module's own forward, with no processor to swap" for name in outside}
    for name, module in modules.items():
        why = _why_stock(module)
        if why is not None:
            skipped[name] = why
            continue
        originals[name] = module.processor
        set_processor(module, Int8DiffusionProcessor(config, inner=module.processor, state=state, name=name,
                                                     observer=observer))
    _warn_skipped(model, skipped)
    hook = None
    if (config.schedule is not None or record or config.calibration is not None or observer is not None
            or config.refresh_every is not None):
        hook = model.register_forward_pre_hook(
            functools.partial(_read_timestep, state, timestep_argument(model), steps), with_kwargs=True)
    handle = Int8Handle(model, state, originals, skipped, hook, config=config)
    model.__dict__["_diffusion_int8_handle"] = handle
    for name in originals:
        module = modules[name]  # watched unless its set_processor is already an attribute of its own (someone's)
        if callable(getattr(type(module), "set_processor", None)) and "set_processor" not in module.__dict__:
            module.set_processor = _WatchedSetProcessor(module, name, handle)
    return handle


def timestep_argument(model: torch.nn.Module) -> tuple[str, int | None]:
    """(name, index among the positional arguments or None) of ``model.forward``'s timestep argument. A forward
    that declares none of ``TIMESTEP_ARGUMENTS`` (``forward(x, t)``, ``forward(*args, **kwargs)``) is read at the
    keyword ``timestep`` or else its second positional argument."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = next((n for n in TIMESTEP_ARGUMENTS if n in {p.name for p in params}), None)
    if name is None:
        return "timestep", 1
    return name, positional.index(name) if name in positional else None


@torch.compiler.disable
def _read_timestep(state: Int8State, argument: tuple[str, int | None], steps: StepCount | None, module, args,
                   kwargs):
    # outside any compiled graph (one graph break at the denoiser's start): traced, its reads of the state would
    # guard the graph on each step's timestep and recompile it at every step
    name, index = argument
    t = kwargs.get(name)
    if t is None and index is not None and index < len(args):
        t = args[index]
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        # per-token timesteps (image-to-video: Wan 2.2 TI2V, LTX, Sana-Video put the conditioning frame's tokens at
        # 0) give each token its level; the step's is the highest of the first sample's
        t = t.reshape(t.shape[0], -1)[0].amax() if t.dim() > 1 else t.reshape(-1)[0]
    t = float(t)
    # a pipeline's run sets its scheduler's timesteps anew: a run that starts at the level the last one stopped at
    # (a one-step warm-up, a run interrupted at its first step) is told apart by them; judged against the
    # timesteps of the state's generation, so that another model of the pipeline joining the run partway (Wan
    # 2.2's second transformer, the UNet after its ControlNet) continues it
    timesteps = None if steps is None else steps.timesteps()
    if not isinstance(timesteps, torch.Tensor):
        timesteps = None
    seen = None if timesteps is None else state._timesteps.get(steps.scheduler)
    new = state.timestep is None or t > state.timestep or (seen is not None and seen is not timesteps)
    if new:
        # a new generation: denoising starts at its highest noise level, which also tells the scale. Its timesteps
        # the ones a whole generation before it ran through: not set anew, so another pipeline runs this one (a
        # timestep rising within a run, as Lumina's 1 - t or KDPM2's Karras levels give, ends no whole generation)
        stale = seen is not None and seen is timesteps and state.step + 1 >= steps.level_count()
        state.step, state.timestep_scale = -1, 1000.0 if t > 1.0 else 1.0
        state.generation += 1
        state._timesteps = {}
        if stale:
            steps.stale()
        state.steps = None if steps is None or stale else steps(noise_level(t, None, state.timestep_scale))
    if timesteps is not None:
        state._timesteps.setdefault(steps.scheduler, timesteps)
    if not new and t == state.timestep and state._caller not in (None, id(module)):
        return None  # this denoising step again, in another of the pipeline's models (a ControlNet, then its UNet)
    if not new and state.steps is not None and steps is not None and not steps.holds(
            noise_level(t, None, state.timestep_scale)):
        steps.stale()  # a level the scheduler's timesteps lack: they are not this generation's
        state.steps = None
    state.timestep, state._caller = t, id(module)
    state.step += 1
    return None


LEVEL_TOLERANCE = 0.005  # how near a noise level the denoiser receives must be to one of its scheduler's


def _hold(pipe):
    """A weak reference to ``pipe`` where it takes one, else a strong one (an object standing for a pipeline)."""
    try:
        return weakref.ref(pipe)
    except TypeError:
        return functools.partial(_same, pipe)


def _same(x):
    return x


def _no_pipeline():
    return None


class StepCount:
    """The denoising steps of a generation a pipeline starts (``Int8State.steps``): the distinct noise levels in
    ``pipe.scheduler.timesteps`` from the one nearest the generation's first to the last, as ``carry.BlockCarry``
    counts steps (a level a second-order scheduler repeats counts once; an img2img run starts partway). The
    scheduler is looked up at each generation (one swapped in after ``enable`` is the one read), its levels once per
    ``set_timesteps`` (one host read). None where it holds no timesteps or none within 0.005 of the first level (a
    loop it does not describe); a loop that stops early (SDXL's ``denoising_end``) is told the whole schedule's
    count. The pipeline is held weakly where it can be. ``scheduler``: the pipeline attribute holding the scheduler
    (``models.scheduler_of``); ``schedule``: a carried schedule whose ``calibrated_steps`` a generation is checked
    against."""

    def __init__(self, pipe, schedule: PrecisionSchedule | None = None, scheduler: str = "scheduler"):
        self.scheduler = scheduler
        self._calibrated = None
        if schedule is not None and schedule.refresh_every is not None and schedule.calibrated_steps is not None:
            self._calibrated = schedule  # its refresh interval was chosen at calibrated_steps: warned once otherwise
        self._pipe = _hold(pipe)
        self._levels = (None, None)  # (the timesteps read, their distinct levels in [0, 1])
        self._warned_stale = False

    def __getstate__(self):  # a pickled model runs under no pipeline of this process: it has none
        return dict(self.__dict__, _pipe=_no_pipeline, _levels=(None, None))

    def __deepcopy__(self, memo):  # a copied pipeline's copy reads the copy's scheduler; a model copied alone, none
        pipe = self._pipe()
        copied = memo.get(id(pipe)) if pipe is not None else None
        new = copy.copy(self)  # through __getstate__: no pipeline
        new._calibrated = copy.deepcopy(self._calibrated, memo)
        if copied is not None:
            new._pipe = _hold(copied)
        return new

    def _read_levels(self) -> torch.Tensor | None:
        """The distinct levels in [0, 1] of the scheduler's timesteps now (read once per ``set_timesteps``)."""
        timesteps = self.timesteps()
        if not isinstance(timesteps, torch.Tensor) or timesteps.numel() == 0:
            return None
        read, levels = self._levels
        if read is not timesteps:
            t = timesteps.detach().reshape(-1).float().cpu()
            levels = t[torch.cat([torch.ones(1, dtype=torch.bool), t[1:] != t[:-1]])]
            levels = levels / (1000.0 if float(levels[0]) > 1.0 else 1.0)  # as noise_level scales the timestep
            self._levels = (timesteps, levels)
        return levels

    def level_count(self) -> int:
        """How many distinct levels the scheduler's timesteps hold (0 where it holds none)."""
        levels = self._read_levels()
        return 0 if levels is None else len(levels)

    def holds(self, noise: float) -> bool:
        """Whether the scheduler's timesteps hold the level ``noise`` (within ``LEVEL_TOLERANCE``)."""
        levels = self._read_levels()
        return levels is not None and float((levels - noise).abs().min()) <= LEVEL_TOLERANCE

    def stale(self) -> None:
        """Called where a generation's timesteps are not the scheduler's (not set anew at its start, or without the
        level the denoiser received): say once that the step count is unknown there."""
        if not self._warned_stale:
            self._warned_stale = True
            warn_user(f"diffusion_int8: this generation's timesteps are not those of the pipeline enable() was "
                      f"given (its {self.scheduler} was not set anew for the run, or does not hold a timestep the "
                      f"denoiser received): the denoiser runs under another pipeline or loop (one made with "
                      f"from_pipe and a scheduler of its own?). Carried blocks run there without the generation's "
                      f"step count, and a run that starts at the level the last one stopped at continues it. "
                      f"enable() the pipeline that generates")

    def timesteps(self):
        """The pipeline's scheduler's ``timesteps`` now (a pipeline sets a new tensor at every run), or None."""
        return getattr(getattr(self._pipe(), self.scheduler, None), "timesteps", None)

    def __call__(self, noise: float) -> int | None:
        """The step count of a generation whose first noise level (``schedule.noise_level``) is ``noise``."""
        levels = self._read_levels()
        if levels is None:
            return None
        distance = (levels - noise).abs()
        first = int(distance.argmin())
        if float(distance[first]) > LEVEL_TOLERANCE:
            return None
        calibrated, n = self._calibrated, len(levels)  # the whole schedule's steps (an img2img run starts partway)
        if calibrated is not None and n != calibrated.calibrated_steps:
            self._calibrated = None
            warn_user(f"diffusion_int8: the scheduler is set to {n} steps; the schedule {calibrated.name!r} "
                      f"carries skipped blocks with a refresh every {calibrated.refresh_every} steps, chosen from "
                      f"errors calibrated at {calibrated.calibrated_steps} steps. Calibrate at {n} steps (diffusion-"
                      f"int8 calibrate --steps {n}, with the same --sparsity-levels and --refresh-every) or compare "
                      f"the images (diffusion-int8 eval --schedule ...)")
        return n - first
