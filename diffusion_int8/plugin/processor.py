"""The diffusers attention processor whose attention core runs in INT8.

``Int8DiffusionProcessor`` runs the module's own stock processor, with its norms, RoPE, projections and
residuals, as a copy of its ``__call__`` whose attention call is routed to the INT8 op (``routing``); the
precision and the sparsity level come from a constant mode and level or a per-step schedule, the speed gate
decides whether INT8 pays for the call's shape, and a calibration gives static ranges. Its parts live beside it:
the dispatcher's calls and context parallelism (``context_parallel.DispatcherCalls``, a mixin), the Q·Kᵀ balance
(``balance.BalanceChoice``), what calls did (``state.Int8State``) and what an observer sees (``observer``).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..caller import warn_user
from ..kernels import Mode
from ..kernels.config import SPARSE_BLOCK
from ..kernels.layout import cdiv
from ..kernels.sparsity import predict_block_mask
from ..schedule import PrecisionSchedule, noise_level
from .balance import BalanceChoice
from .carry import BlockCarry
from .config import Int8Config
from .context_parallel import DispatcherCalls, context_split, heads_share, ulysses_share, warn_other_backend
from .models import (any_stock_signature, call_params, declaring_subclass, skip_metadata_as, skip_metadata_inferred,
                     stock_processor_for, stock_signature, text_position)
from .norms import with_fast_norms
from .observer import AttentionCall, Observer
from .routing import RouteToInt8, attention_dispatch, int8_core, kernel_takes, other_backend, rotary_only, routed
from .speed_gate import eager_call
from .state import Int8State, block_pairs


class _Default(str):
    """``mode``'s default, ``"int8"``, told apart from a mode given as ``"int8"``."""


_DEFAULT_MODE = _Default("int8")


class Int8DiffusionProcessor(DispatcherCalls):
    """A diffusers attention processor whose attention core runs in INT8.

    Use it the diffusers way, ``pipe.transformer.set_attn_processor(Int8DiffusionProcessor(mode="int8"))``
    (or ``pipe.unet``), or through ``diffusion_int8.enable(pipe, ...)``, which wraps each module's current
    processor and wires the timestep.

    Args:
        mode: an ``Int8Config``, or the mode of one made from ``options`` (``Int8Config(mode, **options)``: the
            schedule, calibration, speed gate, sparsity, carrying and outlier options, each documented there).
        inner: the stock processor to wrap; inferred per module when None (``stock_processor_for``).
        state: the ``Int8State`` to read the timestep from and record into.
        name: the module's name, for the trace and the calibration.
        observer: called with every attention call (``observer.AttentionCall``: the layer, the step, the BHSD
            inputs and SDPA's exact output); the calibration's collector is one.
        options: keywords of ``Int8Config``, when ``mode`` is not a config.
    """

    def __new__(cls, *args, inner: Any = None, **kwargs):
        if cls is not Int8DiffusionProcessor:  # a declaring subclass already (a copy, or diffusers' type(proc)())
            return super().__new__(cls)
        proc = super().__new__(_subclass_for(inner))
        proc.__dict__["_made"] = True  # made as Int8DiffusionProcessor(...), not rebuilt by its class
        return proc

    def __init__(self, mode: "Int8Config | str | Mode" = _DEFAULT_MODE, *, inner: Any = None,
                 state: Int8State | None = None, name: str | None = None, observer: Observer | None = None, **options):
        if not self.__dict__.pop("_made", False) and mode is _DEFAULT_MODE and inner is None and state is None \
                and name is None and observer is None and not options:
            mode, inner = _rebuilt(type(self))
        mode = "int8" if mode is _DEFAULT_MODE else mode
        if isinstance(self, torch.nn.Module):  # wrapping a stock processor with weights (``_StockWeights``)
            torch.nn.Module.__init__(self)
            if inner is not None:
                for held in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
                    object.__setattr__(self, held, getattr(inner, held))
        config = self.config = Int8Config.of(mode, **options)
        self.mode, self.gate, self.schedule = config.mode, config.speed_gate, config.schedule
        self.sparsity, self.qk_balance, self.qk_rotate = config.sparsity, config.qk_balance, config.qk_rotate
        self.carry = None if config.refresh_every is None else BlockCarry(config.refresh_every)
        attention_dispatch()  # imported now, not while torch.compile traces a call
        self._warned_carry = self._warned_schedule = self._warned_backend = False
        self.inner = inner
        self.state = state if state is not None else Int8State()
        self.name = name
        calibration = self.calibration = config.calibration
        if calibration is not None and name is None:
            raise ValueError("a processor with a calibration needs its module's name (name=..., as calibrated), which "
                             "enable() passes; set_attn_processor cannot")
        if calibration is not None and name not in calibration.layers:
            raise ValueError(f"the calibration has no layer {name!r}: pass the module's name as calibrated")
        self.balance = BalanceChoice(config.qk_balance, calibration, config.schedule, name)
        self.observer = _checked_observer(observer)
        self._inferred: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_infer = False
        self._routed_calls: dict[type, Callable] = {}  # stock processor type -> its routed __call__
        # ... and its __call__ with the rotary in one launch (gated calls), False where that is the stock one
        self._stock_calls: dict[type, Callable | bool] = {}
        self._routed_hit = False  # set by the routes: did the first routed call reach them
        self._undecided = 0  # first calls that reached no attention at all
        self._text: tuple[int, str | None] = (0, None)  # text tokens of the current call and where they are
        self._keep: dict = {}  # (keys, text tokens, where, device) -> always-kept key blocks
        # module -> {(mode, eager, input shapes, dtype, device): gated calls} for inputs whose every attention call
        # was gated
        self._stock_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # attention calls of this processor that ran INT8, were gated, or went to another backend: what one
        # routed call did, for the stock fast path (the shared Int8State counts every processor's)
        self._outcomes = [0, 0, 0]
        self._parallel = None  # a context-parallel config diffusers gave this processor, for inferred stock ones
        self._backend = None  # likewise an attention backend (set_attention_backend)
        # ring attention on diffusers' native backend, which has none: every call runs here, INT8 or exact
        self._ring = context_split(getattr(inner, "_parallel_config", None)) == "ring"
        self._lock = threading.RLock()
        self._own = frozenset(self.__dict__)  # what ``_StockWeights`` never forwards to the stock processor

    # What depends on the timestep is looked up outside any compiled graph (``torch.compiler.disable``: a graph
    # break where a schedule or a calibration is in use). Traced, each step's timestep would be a constant the graph
    # is guarded on, and every step would recompile it; the graph is guarded on what the lookup returns instead (a
    # mode or a level: a few values), and static ranges reach it as tensors.

    def current_mode(self) -> Mode:
        return self.mode if self.schedule is None else self._scheduled_mode()

    @torch.compiler.disable
    def _scheduled_mode(self) -> Mode:
        if self.state.timestep is None:  # exact until a step is known: said once, not silent
            if not self._warned_schedule:
                self._warned_schedule = True
                warn_user("diffusion_int8: a precision schedule chooses each call's mode from the denoiser's "
                          "timestep, which this processor has not been given (diffusion_int8.enable() reads it "
                          "from the denoiser's timestep argument; set_attn_processor gives it none); until it "
                          "is, every call runs exact attention (fp16)")
            return Mode.FP16
        if isinstance(self.schedule, PrecisionSchedule):
            return self.schedule.mode_for(self.state.timestep, self.name, self.state.timestep_scale)
        return Mode.parse(self.schedule(self.state.timestep))

    def current_tau(self) -> float | None:
        """The sparsity level of this call: the schedule's, else the constant ``sparsity`` (None: dense)."""
        if isinstance(self.schedule, PrecisionSchedule) and self.schedule.sparse:
            tau = self._scheduled_tau()
            if tau is not None:
                return tau
        return self.sparsity

    @torch.compiler.disable
    def _scheduled_tau(self) -> float | None:
        if self.state.timestep is None:
            return None
        return self.schedule.tau_for(self.state.timestep, self.name, self.state.timestep_scale)

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        # Positional arguments go to the stock processor untouched (new-style modules pass
        # encoder_hidden_states, attention_mask, image_rotary_emb positionally); keyword arguments are
        # forwarded as it declares them (this processor's class declares the stock processor's signature, so
        # diffusers passes them: ``models.declaring_subclass``). An eager call holds the processor's lock: what a call
        # plans (its text tokens, what its routed copy did) lives on the processor until it returns, so threads
        # sharing a model take turns on the host side (the GPU work they queue is not waited for).
        if torch.compiler.is_compiling():
            return self._call(attn, hidden_states, *args, **kwargs)
        with self._lock:
            return self._call(attn, hidden_states, *args, **kwargs)

    def __repr__(self) -> str:  # what diffusers prints of a processor (attn_processors, its errors)
        what = self.mode.value if self.schedule is None else "scheduled"
        inner = "the stock one inferred per module" if self.inner is None else type(self.inner).__name__
        return f"Int8DiffusionProcessor({what}, wrapping {inner})"

    # identity, as before a stock type was among the bases (a dataclass one would make it unhashable)
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    # what a copy or a pickle leaves out and makes anew: the lock, and caches of stock processors and shapes
    _TRANSIENT = ("_lock", "_inferred", "_stock_shapes", "_routed_calls", "_stock_calls")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.RLock(), _inferred=weakref.WeakKeyDictionary(),
                             _stock_shapes=weakref.WeakKeyDictionary(), _routed_calls={}, _stock_calls={})
        self.__dict__.setdefault("_undecided", 0)
        self.__dict__.setdefault("_warned_backend", False)

    def __reduce__(self):
        # the declaring subclass is made at run time, per signature: a pickle names the base and makes it again
        return _restore, (self.__getstate__(),)

    def _call(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        inner = self.inner
        if inner is None:
            inner = self._inferred.get(attn)
            if inner is None:
                return self._first_inferred_call(attn, hidden_states, *args, **kwargs)
        params, var_kw = call_params(type(inner))
        if not var_kw:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        if torch._C._is_torch_function_mode_enabled() and _scores_skipped():
            return inner(attn, hidden_states, *args, **kwargs)
        mode = self.current_mode()
        tracing = self.state.trace is not None
        if tracing and not torch.compiler.is_compiling():  # kept in eager mode only, as the counts are
            self.state.trace.append((self.state.step, self.state.timestep, self.name, mode.value))
        if mode is Mode.FP16 and self.observer is None and not tracing and not self._ring:  # a trace counts blocks
            return inner(attn, hidden_states, *args, **kwargs)
        context = args[0] if args else kwargs.get("encoder_hidden_states")
        self._text = (context.shape[-2], text_position(inner)) if isinstance(context, torch.Tensor) else (0, None)
        if torch.compiler.is_compiling():
            # dynamo cannot trace a function whose globals differ from its module's; a torch-function mode
            # costs nothing in a compiled graph (it is traced away). Under a Ulysses split on the native backend
            # the SDPA call it catches is the one diffusers' template makes on this device's heads; another
            # backend or a ring split keeps the stock processor (ring needs a backend with a log-sum-exp, and
            # the native one has none).
            share = ulysses_share(inner)
            if other_backend(inner) and share is None:
                if not self._warned_backend:  # a break in the first graph only: the flag it sets is guarded on
                    self._warn_backend(inner)
                return inner(attn, hidden_states, *args, **kwargs)
            sdpa = self._attention if share is None else functools.partial(self._attention, share=share)
            with RouteToInt8(sdpa):
                return inner(attn, hidden_states, *args, **kwargs)
        # Inputs whose every attention call the speed gate sent to SDPA last time go straight to the stock
        # processor: the gate decides by the call's mode, shapes, dtype and device, which follow from the module
        # and its inputs' shapes, and whether the call is eager (``SpeedGate.pays``), so this is what the routed
        # copy would run, without its host time (image models at 1-4K tokens, every call gated). Its rotary
        # embedding runs in one launch, as in the routed copy (``routing.rotary_only``). A backend change
        # clears what was learnt. Not under a context-parallel split, where the routed copy also mends what
        # diffusers' split gets wrong (per-head masks, ring).
        key = shapes = None
        if self.gate is not None and self.observer is None and not tracing and self._parallel_config is None:
            shapes = self._stock_shapes.get(attn)
            key = (mode, eager_call(hidden_states), hidden_states.shape, hidden_states.dtype,
                   hidden_states.get_device(),
                   tuple(a.shape if isinstance(a, torch.Tensor) else None for a in args),
                   tuple((k, v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
            gated = None if shapes is None else shapes.get(key)
            if gated is not None:
                self.state.gated_calls += gated
                copy = self._stock_calls.get(type(inner))
                if copy is None:  # False: the stock processor itself
                    copy = self._stock_calls[type(inner)] = rotary_only(type(inner).__call__) or False
                view = with_fast_norms(attn, hidden_states.device)
                if copy:
                    return copy(inner, view, hidden_states, *args, **kwargs)
                return inner(view, hidden_states, *args, **kwargs)
        before = tuple(self._outcomes)
        call = self._routed_calls.get(type(inner))
        if call is not None:
            out = call(inner, with_fast_norms(attn, hidden_states.device), hidden_states, *args, **kwargs)
            int8, gated, other = (a - b for a, b in zip(self._outcomes, before))
            if key is not None and gated > 0 and int8 == 0 and other == 0:
                shapes = self._stock_shapes.setdefault(attn, {})
                if len(shapes) < 64:
                    shapes[key] = gated
            return out
        # first calls of this processor type: does the routed copy reach the INT8 path, or attention another way
        # (through another module's F)? A torch-function mode routes and counts the latter, so the call runs once
        # (the stock processor may have side effects, such as a KV cache it stores into) and in INT8 either way. A
        # call reaching no attention at all (every sample perturbed) decides nothing until MAX_UNDECIDED such calls.
        route = routed(type(inner).__call__, self._attention, self._dispatch)
        if route is None:
            out = self._mode_call(inner, attn, hidden_states, *args, **kwargs)
            self._routed_calls[type(inner)] = self._mode_call
            _warn_outside(inner)
            return out
        watch = _OutsideAttention(self._attention)
        checked = routed(type(inner).__call__, watch.skip(self._attention), watch.skip(self._dispatch))
        self._routed_hit = False
        with watch:
            out = checked(inner, attn, hidden_states, *args, **kwargs)
        if watch.calls:
            self._routed_calls[type(inner)] = self._mode_call
            _warn_outside(inner)
        elif self._routed_hit or other_backend(inner):
            self._routed_calls[type(inner)] = route
        elif self._undecided < MAX_UNDECIDED:
            self._undecided += 1
        else:
            self._routed_calls[type(inner)] = route
            warn_user(f"diffusion_int8: {type(inner).__name__} reached no attention through F, "
                      f"dispatch_attention_fn or torch's SDPA in its first {MAX_UNDECIDED + 1} calls (its own "
                      f"kernel, or none): it runs as stock")
        return out

    @torch.compiler.disable
    def _warn_backend(self, inner) -> None:
        self._warned_backend = True
        warn_other_backend(getattr(inner, "_attention_backend", None))

    def _infer_stock(self, attn: torch.nn.Module, args: tuple, kwargs: dict):
        """The stock processor for a module this processor (made without ``inner``) meets for the first time, as
        ``stock_processor_for`` infers it from the module's class; one warning per processor says so, since a model
        whose code gives its modules processors of their own then computes something else."""
        with_context = (args[0] if args else kwargs.get("encoder_hidden_states")) is not None
        inner = self._inferred[attn] = stock_processor_for(attn, with_context)
        if self._parallel is not None and hasattr(inner, "_parallel_config"):
            inner._parallel_config = self._parallel
        if self._backend is not None and hasattr(inner, "_attention_backend"):
            inner._attention_backend = self._backend
        if not self._warned_infer:
            self._warned_infer = True
            warn_user(f"diffusion_int8: an Int8DiffusionProcessor made without inner= runs the stock processor "
                      f"inferred from each module's class ({type(inner).__name__} for {type(attn).__name__}); "
                      f"models whose code gives their attention modules processors of their own then compute "
                      f"something else (AuraFlow, Sana) or raise an error saying so (Qwen-Image, HunyuanVideo, ...). "
                      f"diffusion_int8.enable(pipe) wraps the processors the model has.")
        return inner

    def _first_inferred_call(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        """A module's first call to a processor made without ``inner``: the stock processor inferred for it must take
        what the model passes: a ``ValueError`` where it does not, rather than compute something else (the model's
        code gives the module a processor of its own, which this one cannot know); an error it raises gets a note
        saying so."""
        inner = self._infer_stock(attn, args, kwargs)
        params, _ = call_params(type(inner))
        # a stock processor's **kwargs only take deprecated arguments (``scale``), which it ignores
        dropped = sorted(k for k, v in kwargs.items() if k not in params and k != "scale" and v is not None)
        enable = "diffusion_int8.enable(model) wraps the processors the model has"
        if dropped:
            del self._inferred[attn]
            raise ValueError(f"diffusion_int8: {type(attn).__name__} was called with {', '.join(dropped)}, which "
                             f"{type(inner).__name__} (the stock processor inferred from its class) does not take: "
                             f"the model's code gives this module a processor of its own, which a processor set by "
                             f"set_attn_processor cannot know (or one that ignores it, which this processor cannot "
                             f"tell apart); {enable}")
        try:
            return self._call(attn, hidden_states, *args, **kwargs)
        except Exception as e:
            self._inferred.pop(attn, None)
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"diffusion_int8: raised by {type(inner).__name__}, the stock processor inferred for "
                           f"{type(attn).__name__} from its class; if the model's code gives it a processor of its "
                           f"own, {enable}")
            raise

    def _mode_call(self, inner, attn, hidden_states, *args, **kwargs):
        with RouteToInt8(self._attention):
            return inner(attn, hidden_states, *args, **kwargs)

    def _static_ranges(self, device: torch.device):
        return None if self.calibration is None else self._calibrated_ranges(device)

    @torch.compiler.disable
    def _calibrated_ranges(self, device: torch.device):
        """The calibration's ranges at the current timestep on ``device`` (without Q's and K's with ``qk_rotate``),
        evaluated for every layer at once the first time a timestep is seen and kept by the calibration
        (``Calibration.ranges_at``): a generation's steps reuse those of the last one with the same schedule, with
        no work on the host and no copy to the GPU."""
        if self.state.timestep is None:
            return None
        ranges = self.calibration.ranges_at(self.state.timestep, device, balance=self.balance.range_balance)[self.name]
        if self.qk_rotate:  # the rotated Q and K are measured: their calibrated ranges are of the unrotated ones
            ranges = ranges._replace(q_amax=None, k_amax=None)
        return ranges

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, share: tuple[int, int] | None = None):
        """What the stock processor's ``F.scaled_dot_product_attention`` call runs: this call's mode, shown to
        the observer first. ``share``: (rank, devices) under a Ulysses split, where the call holds that block of
        the module's heads; a mask the processor made per head before the split (LTX-Video's (B, H, 1, Sk)) is cut
        to them (diffusers' own split fails on it)."""
        if not torch.compiler.is_compiling():
            self._routed_hit = True
        if share is not None and attn_mask is not None and attn_mask.dim() == 4:
            rank, devices = share
            heads = query.shape[1]
            if devices > 1 and attn_mask.shape[1] == heads * devices:
                attn_mask = attn_mask[:, rank * heads:(rank + 1) * heads]
        mode = self.current_mode()
        exact = None
        if self.observer is not None:
            exact = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            noise = None if self.state.timestep is None else noise_level(self.state.timestep, None,
                                                                         self.state.timestep_scale)
            # a key mask that keeps the first n keys is shown cut, as a sparse call runs it (the same computation)
            seen = (key, value, attn_mask) if attn_mask is None else self._key_prefix(query, key, value, attn_mask)
            predict = functools.partial(self.block_mask_for, full_keys=key.shape[2])
            self.observer(AttentionCall(self.name, self.state.step, self.state.timestep, noise, query, *seen, scale,
                                        exact, self._text_blocks(query, seen[0], key.shape[2]), predict,
                                        steps=self.state.steps))
        # the counts are kept in eager mode only: torch.compile guards on an int it reads, so counting inside a
        # compiled graph would recompile it at every call
        counting = not torch.compiler.is_compiling()
        blocks = counting and self.state.trace is not None
        if mode is Mode.FP16 or not kernel_takes(query, key, attn_mask, dropout_p, is_causal, enable_gqa):
            if blocks:
                pairs = block_pairs(query, key)
                self.state.count_blocks(pairs, pairs)
            return exact if exact is not None else F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
        full_keys = key.shape[2]
        if attn_mask is not None and _sparse(self.current_tau(), key, None):
            key, value, attn_mask = self._key_prefix(query, key, value, attn_mask)
        if self.gate is None:
            ranges = self._call_ranges(query.device, share)
            balance = self.balance.for_call(query, key, ranges)
        else:
            # judged as the call runs (``eager``: by the eager rule too) and, for an eager call, as a CUDA graph
            # captured later would run it; the Q·Kᵀ balance is decided only where the table runs INT8 in either
            eager = eager_call(query)
            runs = self.gate.pays(mode, query, key, attn_mask, eager=eager)
            captured = runs or (eager and self.gate.pays(mode, query, key, attn_mask, eager=False))
            ranges, balance = None, False
            if captured:
                ranges = self._call_ranges(query.device, share)
                balance = self.balance.for_call(query, key, ranges)
                if balance:  # a call that measures the balance pays only if INT8's lead covers the balance too
                    runs = runs and self.gate.pays(mode, query, key, attn_mask, balance=True, eager=eager)
                    captured = self.gate.pays(mode, query, key, attn_mask, balance=True, eager=False)
            if not runs:
                if eager and captured:
                    self._settle_for_capture(mode, query, key, value, attn_mask, scale, ranges, balance)
                return self._gated(query, key, value, attn_mask, scale, enable_gqa, exact, counting, blocks)
        if counting:
            self.state.int8_calls += 1
            self._outcomes[0] += 1
        tau = self.current_tau()
        if not _sparse(tau, key, attn_mask):
            tau = None
        if tau is not None and self.carry is not None:
            res = self._carried(mode, query, key, value, scale, ranges, balance, tau, full_keys)
            if res is not None:
                out, kept = res
                if blocks:
                    self.state.count_blocks(kept, block_pairs(query, key))
                return out
        res = int8_core(mode, query, key, value, attn_mask, scale, ranges, qk_balance=balance,
                        qk_rotate=self.qk_rotate, sparsity=tau,
                        keep_kv_blocks=None if tau is None else self._text_blocks(query, key, full_keys),
                        return_block_mask=blocks and tau is not None)
        out, block_mask = res if isinstance(res, tuple) else (res, None)
        if blocks:
            total = block_pairs(query, key)
            self.state.count_blocks(total if block_mask is None else block_mask.sum(), total)
        return out

    def _call_ranges(self, device: torch.device, share: tuple[int, int] | None):
        """The calibration's ranges for this call (``_static_ranges``), cut to this device's heads under a split."""
        ranges = self._static_ranges(device)
        return ranges if ranges is None or share is None else heads_share(ranges, *share)

    def _settle_for_capture(self, mode: Mode, query, key, value, attn_mask, scale, ranges, balance: bool):
        """Run the call in INT8 once, its result unused: the gate keeps this eager call on SDPA for its host time,
        and a CUDA graph captured later runs it INT8, where its first run cannot happen (compiling the kernels,
        recording the launch plan, making the rotation's matrix). The caller has decided the module's Q·Kᵀ balance
        (``balance``), which a capture would otherwise measure in every replay. Once per call shape for every
        module of the handle (``Int8State.settled``: the kernels and plans are the process's); dense (a
        block-sparse call's own kernels are not compiled by it). A failure is said (once per shape) and leaves eager
        calls on SDPA, as they were."""
        mask = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype)
        call = (mode, query.shape, key.shape, query.dtype, query.device, mask, balance, self.qk_rotate, ranges is None)
        settled = self.state.settled
        if call in settled or len(settled) >= 64:
            return
        settled.add(call)
        try:
            int8_core(mode, query, key, value, attn_mask, scale, ranges, qk_balance=balance, qk_rotate=self.qk_rotate)
        except Exception as exc:  # noqa: BLE001 - its result is unused: the eager call still runs SDPA
            warn_user(f"diffusion_int8: the INT8 call run ahead of CUDA-graph capture for {tuple(query.shape)} "
                      f"{query.dtype} failed ({type(exc).__name__}: {exc}); eager calls run SDPA as before, and a "
                      f"CUDA graph captured with this call may fail the same way")

    def _gated(self, query, key, value, attn_mask, scale, enable_gqa, exact, counting: bool, blocks: bool):
        """A call the speed gate sends to SDPA (``exact`` if the observer already ran it), counted."""
        if counting:
            self.state.gated_calls += 1
            self._outcomes[1] += 1
        if blocks:
            pairs = block_pairs(query, key)
            self.state.count_blocks(pairs, pairs)
        return exact if exact is not None else F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)

    def balance_status(self) -> str:
        """What this module does about the Q·Kᵀ balance, in words (``BalanceChoice.status``)."""
        return self.balance.status()

    @torch.compiler.disable  # reads the mask's values: outside a compiled graph (a graph break where it applies)
    def _key_prefix(self, query, key, value, attn_mask):
        """(key, value, attn_mask) of a sparse call, cut to the first n keys without the mask where the mask keeps
        exactly those (text padding at the end): the same computation, and one that can run block-sparse. The mask
        is read once per denoiser call (``Int8State.valid_prefix``), never while a CUDA graph is captured."""
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            return key, value, attn_mask
        n = self.state.valid_prefix(attn_mask, query.shape[0], query.shape[1], key.shape[2])
        return (key[:, :, :n], value[:, :, :n], None) if n else (key, value, attn_mask)

    @torch.compiler.disable  # reads the timestep, which a compiled graph would be guarded on (a recompile a step)
    def _carried(self, mode, query, key, value, scale, ranges, balance, tau: float, full_keys: int):
        """This call with its skipped blocks carried (``BlockCarry``): (output, kept block pairs), or None where
        the timestep is unknown (the call then runs as one that drops them)."""
        if not self._carry_ready():
            return None
        run = functools.partial(int8_core, mode, query, key, value, None, scale, ranges, qk_balance=balance,
                                qk_rotate=self.qk_rotate)
        return self.carry(run, query, key, tau=tau, scale=scale,
                          keep_kv_blocks=self._text_blocks(query, key, full_keys),
                          noise=noise_level(self.state.timestep, None, self.state.timestep_scale),
                          steps=self.state.steps, generation=self.state.generation)

    def _carry_ready(self) -> bool:
        """Whether the skipped blocks can be carried: the denoising step is known (else, one warning, and they
        are dropped)."""
        if self.state.timestep is not None:
            return True
        if not self._warned_carry:
            self._warned_carry = True
            warn_user("diffusion_int8: refresh_every needs the denoiser's timestep, which this processor has not "
                      "been given (diffusion_int8.enable() reads it); the skipped blocks are dropped instead")
        return False

    def block_mask_for(self, query, key, attn_mask, scale, tau: float | None,
                       full_keys: int | None = None) -> torch.Tensor | None:
        """The block mask this processor's INT8 calls (BHSD inputs) predict at level ``tau`` (bool (B, H, nQB,
        nKB); standalone, as the calibration measures it), or None where the call runs dense: no level or 1, an
        ``attn_mask``, or one key block. ``full_keys``: see ``_text_blocks``."""
        if not _sparse(tau, key, attn_mask):
            return None
        return predict_block_mask(query, key, tau, sm_scale=scale,
                                  keep_kv_blocks=self._text_blocks(query, key, full_keys))

    def _text_blocks(self, query, key, full_keys: int | None = None) -> torch.Tensor | None:
        """(nKB,) bool: the key blocks holding text tokens in joint text+image attention, else None. ``full_keys``:
        the keys of the call before its padded tail was cut off (``valid_prefix``), where the text was placed."""
        n_text, where = self._text
        sq, sk = query.shape[2], key.shape[2]
        full = full_keys or sk
        if not 0 < n_text < full or sq != full:  # no text, cross-attention (keys are all text) or not joint
            return None
        cache_key = (sk, full, n_text, where, key.device)
        keep = self._keep.get(cache_key)
        if keep is None:
            block = torch.arange(cdiv(sk, SPARSE_BLOCK), device=key.device)
            first = block < cdiv(n_text, SPARSE_BLOCK)
            last = block >= (full - n_text) // SPARSE_BLOCK
            keep = first if where == "first" else last if where == "last" else first | last
            if len(self._keep) < 64:
                self._keep[cache_key] = keep
        return keep


def _checked_observer(observer):
    """``observer`` if it can be called with one ``AttentionCall``; a clear ``TypeError`` otherwise (observers were
    once called with the processor and six tensors)."""
    if observer is None:
        return None
    if not callable(observer):
        raise TypeError(f"observer must be callable with one AttentionCall, got {type(observer).__name__}")
    try:
        inspect.signature(observer).bind(None)
    except TypeError:
        raise TypeError(f"observer {observer!r} cannot be called with one argument: an observer receives one "
                        f"diffusion_int8.AttentionCall (layer, step, timestep, noise, query, key, value, attn_mask, "
                        f"scale, out, keep_kv_blocks, block_mask(tau), steps)") from None
    except ValueError:  # a callable without an inspectable signature (a builtin): taken as it is
        pass
    return observer


MAX_UNDECIDED = 8


class _OutsideAttention(TorchFunctionMode):
    """Routes to ``sdpa``, and counts, the ``F.scaled_dot_product_attention`` calls made under it outside the
    functions ``skip`` wraps (the routes, whose own SDPA calls are theirs)."""

    def __init__(self, sdpa: Callable):
        super().__init__()
        self.sdpa = sdpa
        self.calls = 0
        self._inside = 0

    def skip(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inside(*args, **kwargs):
            self._inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= 1
        return inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and not self._inside:
            self.calls += 1
            return self.sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _warn_outside(inner) -> None:
    warn_user(f"diffusion_int8: {type(inner).__name__} reaches attention outside its module's F and "
              f"dispatch_attention_fn; routing it through a torch-function mode (more host "
              f"time per call)")


def _restore(state: dict) -> Int8DiffusionProcessor:
    """An unpickled processor: the declaring subclass of its stock processor's signature, with ``state``."""
    proc = object.__new__(_subclass_for(state.get("inner")))
    proc.__setstate__(state)
    return proc


class _StockWeights:
    """What a processor wrapping a stock processor that is an ``nn.Module`` (IP-Adapter's, with its image K/V
    projections) adds: it is an ``nn.Module`` holding the stock one's parameters, buffers and submodules (the same
    dicts, shared in ``__init__``), so diffusers keeps it registered as the attention module's ``processor``, and those
    weights keep their ``state_dict`` keys and follow ``.to()`` and offloading. Attributes it does not have are the
    stock processor's, read and written there (``set_ip_adapter_scale`` sets ``scale``)."""

    @property
    def training(self) -> bool:  # the stock processor's: ``model.train()``/``eval()`` reach this wrapper, not it
        inner = self.__dict__.get("inner")
        return inner.training if isinstance(inner, torch.nn.Module) else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        inner = self.__dict__.get("inner")
        if isinstance(inner, torch.nn.Module):
            inner.training = mode
        else:  # before ``__init__`` holds the stock processor, or wrapping none
            self.__dict__["_training"] = mode

    def __getattr__(self, name):  # only for attributes not found otherwise
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name, value):
        inner = self.__dict__.get("inner")
        own = self.__dict__.get("_own")  # the wrapper's attributes, once its __init__ has set them
        if inner is not None and own is not None and name not in own and name not in _WRAPPER_NAMES and hasattr(inner, name):
            setattr(inner, name, value)
        else:  # never registered as a submodule here: the stock processor is held, not owned
            object.__setattr__(self, name, value)


# names the wrapper's classes define (methods, properties such as ``_parallel_config``): set on the wrapper itself
_WRAPPER_NAMES = frozenset(n for c in (Int8DiffusionProcessor, DispatcherCalls, _StockWeights) for n in vars(c))


@functools.lru_cache(maxsize=None)
def _with_stock_weights(stock: type, subclass: bool = True) -> type:
    """``_StockWeights`` and ``stock``; with ``subclass=False`` an ``nn.Module`` in place of ``stock``: its weights
    kept, though ``isinstance`` no longer answers as for it."""
    base = stock if subclass else torch.nn.Module
    return type(stock.__name__, (_StockWeights, base), {"__module__": stock.__module__})


def _subclass_for(inner) -> type:
    """The class of a processor wrapping ``inner`` (None: inferred per module): declaring ``inner``'s signature, and a
    subclass of ``inner``'s type, so that ``isinstance`` answers as for the stock processor. diffusers' model code and
    loaders find processors of a kind that way (Qwen-Image 2.1 builds its flex BlockMask only for
    QwenImage21FlexAttnProcessor; ``set_ip_adapter_scale`` looks for IP-Adapter's) and would otherwise skip the work
    they do for it. A stock type that is an ``nn.Module`` comes with ``_StockWeights``."""
    return _inferring_subclass() if inner is None else _subclass_of(type(inner))


def _inferring_subclass() -> type:
    # made for the signature of every stock processor imported so far, which grows as diffusers loads model modules
    cls = declaring_subclass(Int8DiffusionProcessor, any_stock_signature())
    if cls not in _SKIP_REGISTERED:
        _SKIP_REGISTERED.add(cls)
        skip_metadata_inferred(cls)
    return cls


_SKIP_REGISTERED: set[type] = set()  # classes of processors made without inner= given a layer-skip entry


@functools.lru_cache(maxsize=None)
def _subclass_of(stock: type) -> type:
    # a property of the stock type could take an attribute the wrapper sets (none in diffusers): not a base then
    subclass = not any(isinstance(v, property) for c in stock.__mro__[:-1] if c.__module__ != "torch.nn.modules.module"
                       for v in vars(c).values())
    if issubclass(stock, torch.nn.Module):
        also = _with_stock_weights(stock, subclass)
    else:
        also = stock if subclass else None
    cls = declaring_subclass(Int8DiffusionProcessor, stock_signature(stock), also)
    _STOCK_OF[cls] = stock
    skip_metadata_as(cls, stock)
    return cls


_STOCK_OF: dict[type, type] = {}  # the class of a processor wrapping a stock type -> that type


def _rebuilt(cls: type) -> tuple[str, Any]:
    """The mode and stock processor of ``cls()``: diffusers rebuilding a processor by its class, as
    ``load_ip_adapter``, ``unload_ip_adapter`` and ``UNetMotionModel.from_unet2d`` do for the modules they do not
    adapt. Which ``enable()`` the class's processors came from, with which settings, the class does not know: the
    module runs its stock processor, exact (mode fp16), and a warning says so rather than running defaults the user
    never chose."""
    stock = _STOCK_OF.get(cls)
    warn_user(f"diffusion_int8: diffusers rebuilt an INT8 attention processor by its class (load_ip_adapter, "
              f"unload_ip_adapter or from_unet2d after enable()), which keeps none of enable()'s settings: that "
              f"module runs its stock processor{f' ({stock.__name__})' if stock else ''}, exact. Load adapters "
              f"before diffusion_int8.enable(), or call handle.disable() and enable() again after")
    return "fp16", None if stock is None else stock()


@torch.compiler.disable
def _scores_skipped() -> bool:
    """Whether diffusers' layer skip replaces attention by V around this call (``skip_attention_scores``: its
    ``AttentionScoreSkipFunctionMode`` intercepts SDPA, which the INT8 path never calls): the stock processor runs."""
    try:
        from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode
    except ImportError:
        return False
    modes = torch.overrides._get_current_function_mode_stack()
    return any(isinstance(m, AttentionScoreSkipFunctionMode) for m in modes)


def _sparse(tau: float | None, key, attn_mask) -> bool:
    """Whether an INT8 call (BHSD ``key``) runs block-sparse at level ``tau``: a level below 1, no ``attn_mask`` and
    more than one key block."""
    return tau is not None and tau < 1 and attn_mask is None and key.shape[2] > SPARSE_BLOCK
