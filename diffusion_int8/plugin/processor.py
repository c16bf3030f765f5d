"""The diffusers attention processor whose attention core runs in INT8.

``Int8DiffusionProcessor`` runs the module's own stock processor, with its norms, RoPE, projections and
residuals, as a copy of its ``__call__`` whose attention call is routed to the INT8 op (``routing``); the
precision and the sparsity level come from a constant mode and level or a per-step schedule, the speed gate
decides whether INT8 pays for the call's shape, and a calibration gives static ranges.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .carry import BlockCarry
from .config import Int8Config
from .kernels import Mode, StaticRanges
from .kernels.api import sdpa_with_lse
from .kernels.config import SPARSE_BLOCK
from .kernels.layout import BALANCE_MIN_QUERIES, cdiv
from .kernels.reference import needs_balance
from .kernels.sparsity import predict_block_mask
from .models import any_stock_signature, call_params, stock_processor_for, stock_signature, text_position
from .routing import (RouteToInt8, attention_dispatch, context_split, int8_core, keeps_stock, kernel_takes, other_backend,
                      routed, ulysses_share)
from .schedule import PrecisionSchedule, noise_level



@dataclass
class Int8State:
    """The denoising position the processors read, held by the user's handle (no module globals).

    ``timestep`` is the value the denoiser was last called with (first element for CFG batches),
    ``step`` counts denoiser calls since ``reset()``; ``trace``, when a list, records
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
    int8_calls: int = 0  # attention calls that ran an INT8 mode
    gated_calls: int = 0  # calls the schedule gave an INT8 mode and the speed gate sent to SDPA
    # step -> [pairs computed (a device tensor where a mask was predicted: no host sync per call), all pairs]
    block_counts: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.timestep, self.step, self.timestep_scale = None, -1, None
        self.int8_calls = self.gated_calls = 0
        self.block_counts.clear()
        if self.trace is not None:
            self.trace.clear()

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


class Int8DiffusionProcessor:
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
        observer: a callable ``observer(processor, query, key, value, attn_mask, scale, out)`` given every
            attention call's BHSD inputs and exact output (``out``); the calibration collector is one.
        options: keywords of ``Int8Config``, when ``mode`` is not a config.
    """

    def __new__(cls, *args, inner: Any = None, **kwargs):
        if cls is not Int8DiffusionProcessor:  # a declaring subclass already (copies, pickles)
            return super().__new__(cls)
        sig = stock_signature(type(inner)) if inner is not None else any_stock_signature()
        return super().__new__(_declaring_class(sig))

    def __init__(self, mode: "Int8Config | str | Mode" = "int8", *, inner: Any = None, state: Int8State | None = None,
                 name: str | None = None, observer: Callable | None = None, **options):
        config = self.config = Int8Config.of(mode, **options)
        self.mode, self.gate, self.schedule = config.mode, config.speed_gate, config.schedule
        self.sparsity, self.qk_balance, self.qk_rotate = config.sparsity, config.qk_balance, config.qk_rotate
        self.carry = None if config.refresh_every is None else BlockCarry(config.refresh_every)
        attention_dispatch()  # imported now, not while torch.compile traces a call
        self._warned_carry = False
        self.inner = inner
        self.state = state if state is not None else Int8State()
        self.name = name
        calibration = self.calibration = config.calibration
        if calibration is not None and name not in calibration.layers:
            raise ValueError(f"the calibration has no layer {name!r}: pass the module's name (enable() does)")
        qk_balance, schedule = config.qk_balance, config.schedule
        # the calibration's static balance: asked for, or by default where the calibration saw outlier channels
        # (the policy ``Calibration.ranges_at`` takes for every layer, and what it comes to in this one)
        self._range_balance = qk_balance if calibration is not None and calibration.has_channel_ranges() else False
        self._static_balance = bool(calibration is not None and (
            self._range_balance or (self._range_balance is None and calibration.layer_balanced(name))))
        # whether calls that measure their ranges measure the balance too: given, from the schedule, or from the
        # module's first call (None until then: ``_balance_for``); and where the decision came from
        self._balance, self._balance_from = qk_balance, "asked"
        if qk_balance is None and isinstance(schedule, PrecisionSchedule) and schedule.balance_layers is not None:
            self._balance, self._balance_from = name in schedule.balance_layers, "schedule"
        self.observer = observer
        self._inferred: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_infer = False
        self._routed_calls: dict[type, Callable] = {}  # stock processor type -> its routed __call__
        self._routed_hit = False  # set by the routes: did the first routed call reach them
        self._text: tuple[int, str | None] = (0, None)  # text tokens of the current call and where they are
        self._keep: dict = {}  # (keys, text tokens, where, device) -> always-kept key blocks
        # module -> {(mode, input shapes, dtype, device): gated calls} for inputs whose every attention call was gated
        self._stock_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # attention calls of this processor that ran INT8, were gated, or went to another backend: what one
        # routed call did, for the stock fast path (the shared Int8State counts every processor's)
        self._outcomes = [0, 0, 0]
        self._parallel = None  # a context-parallel config diffusers gave this processor, for inferred stock ones
        self._backend = None  # likewise an attention backend (set_attention_backend)
        # ring attention on diffusers' native backend, which has none: every call runs here, INT8 or exact
        self._ring = context_split(getattr(inner, "_parallel_config", None)) == "ring"
        self._lock = threading.RLock()

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

    # What depends on the timestep is looked up outside any compiled graph (``torch.compiler.disable``: a graph
    # break where a schedule or a calibration is in use). Traced, each step's timestep would be a constant the graph
    # is guarded on, and every step would recompile it; the graph is guarded on what the lookup returns instead (a
    # mode or a level: a few values), and static ranges reach it as tensors.

    def current_mode(self) -> Mode:
        return self.mode if self.schedule is None else self._scheduled_mode()

    @torch.compiler.disable
    def _scheduled_mode(self) -> Mode:
        if self.state.timestep is None:
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
        # diffusers passes them: ``_declaring_class``). An eager call holds the processor's lock: what a call
        # plans (its text tokens, what its routed copy did) lives on the processor until it returns, so threads
        # sharing a model take turns on the host side (the GPU work they queue is not waited for).
        if torch.compiler.is_compiling():
            return self._call(attn, hidden_states, *args, **kwargs)
        with self._lock:
            return self._call(attn, hidden_states, *args, **kwargs)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.RLock())

    def _call(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        inner = self.inner
        if inner is None:
            inner = self._inferred.get(attn)
            if inner is None:
                inner = self._infer_stock(attn, args, kwargs)
        params, var_kw = call_params(type(inner))
        if not var_kw:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
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
                return inner(attn, hidden_states, *args, **kwargs)
            sdpa = self._attention if share is None else functools.partial(self._attention, share=share)
            with RouteToInt8(sdpa):
                return inner(attn, hidden_states, *args, **kwargs)
        # Inputs whose every attention call the speed gate sent to SDPA last time go straight to the stock
        # processor: the gate decides by the call's mode, shapes, dtype and device, which follow from the module
        # and its inputs' shapes, so this is what the routed copy would run, without its host time (image models
        # at 1-4K tokens, every call gated). A backend change clears what was learnt. Not under a context-parallel
        # split, where the routed copy also mends what diffusers' split gets wrong (per-head masks, ring).
        key = shapes = None
        if self.gate is not None and self.observer is None and not tracing and self._parallel_config is None:
            shapes = self._stock_shapes.get(attn)
            key = (mode, hidden_states.shape, hidden_states.dtype, hidden_states.get_device(),
                   tuple(a.shape if isinstance(a, torch.Tensor) else None for a in args),
                   tuple((k, v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
            gated = None if shapes is None else shapes.get(key)
            if gated is not None:
                self.state.gated_calls += gated
                return inner(attn, hidden_states, *args, **kwargs)
        before = tuple(self._outcomes)
        call = self._routed_calls.get(type(inner))
        if call is not None:
            out = call(inner, attn, hidden_states, *args, **kwargs)
            int8, gated, other = (a - b for a, b in zip(self._outcomes, before))
            if key is not None and gated > 0 and int8 == 0 and other == 0:
                shapes = self._stock_shapes.setdefault(attn, {})
                if len(shapes) < 64:
                    shapes[key] = gated
            return out
        # first call of this processor type: check that the routed copy reaches the INT8 path; where it
        # cannot (attention reached another way), route through a torch-function mode instead
        route = routed(type(inner).__call__, self._attention, self._dispatch)
        call = route or self._mode_call
        self._routed_hit = False
        out = call(inner, attn, hidden_states, *args, **kwargs)
        if route is None or (not self._routed_hit and not other_backend(inner)):
            warnings.warn(f"diffusion_int8: {type(inner).__name__} reaches attention outside its module's F and "
                          f"dispatch_attention_fn; routing it through a torch-function mode (more host time per call)",
                          RuntimeWarning, stacklevel=2)
            if route is not None:
                call = self._mode_call
                out = call(inner, attn, hidden_states, *args, **kwargs)
        self._routed_calls[type(inner)] = call
        return out

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
            warnings.warn(f"diffusion_int8: an Int8DiffusionProcessor made without inner= runs the stock processor "
                          f"inferred from each module's class ({type(inner).__name__} for {type(attn).__name__}); "
                          f"models that give their attention modules processors of their own (Qwen-Image, "
                          f"HunyuanVideo, Sana, ...) then compute something else. diffusion_int8.enable(pipe) wraps "
                          f"the processors the model has.", RuntimeWarning, stacklevel=4)
        return inner

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
        ranges = self.calibration.ranges_at(self.state.timestep, device, balance=self._range_balance)[self.name]
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
            self.observer(self, query, key, value, attn_mask, scale, exact)
        # the counts are kept in eager mode only: torch.compile guards on an int it reads, so counting inside a
        # compiled graph would recompile it at every call
        counting = not torch.compiler.is_compiling()
        blocks = counting and self.state.trace is not None
        if mode is Mode.FP16 or not kernel_takes(query, key, attn_mask, dropout_p, is_causal):
            if blocks:
                pairs = _block_pairs(query, key)
                self.state.count_blocks(pairs, pairs)
            return exact if exact is not None else F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
        if self.gate is not None and not self.gate.pays(mode, query, key, attn_mask):
            return self._gated(query, key, value, attn_mask, scale, enable_gqa, exact, counting, blocks)
        ranges = self._static_ranges(query.device)
        if ranges is not None and share is not None:
            ranges = heads_share(ranges, *share)
        balance = self._balance_for(query, key, ranges)
        # a call that measures the Q·Kᵀ balance pays only if INT8's lead covers the balance too
        if balance and self.gate is not None and not self.gate.pays(mode, query, key, attn_mask, balance=True):
            return self._gated(query, key, value, attn_mask, scale, enable_gqa, exact, counting, blocks)
        if counting:
            self.state.int8_calls += 1
            self._outcomes[0] += 1
        tau = self.current_tau()
        if not _sparse(tau, key, attn_mask):
            tau = None
        if tau is not None and self.carry is not None and self._carry_ready():
            run = functools.partial(int8_core, mode, query, key, value, None, scale, ranges,
                                    qk_balance=balance, qk_rotate=self.qk_rotate)
            out, kept = self.carry(run, query, key, tau=tau, scale=scale, keep_kv_blocks=self._text_blocks(query, key),
                                   noise=noise_level(self.state.timestep, None, self.state.timestep_scale))
            if blocks:
                self.state.count_blocks(kept, _block_pairs(query, key))
            return out
        res = int8_core(mode, query, key, value, attn_mask, scale, ranges, qk_balance=balance,
                        qk_rotate=self.qk_rotate, sparsity=tau,
                        keep_kv_blocks=None if tau is None else self._text_blocks(query, key),
                        return_block_mask=blocks and tau is not None)
        out, block_mask = res if isinstance(res, tuple) else (res, None)
        if blocks:
            total = _block_pairs(query, key)
            self.state.count_blocks(total if block_mask is None else block_mask.sum(), total)
        return out

    def _gated(self, query, key, value, attn_mask, scale, enable_gqa, exact, counting: bool, blocks: bool):
        """A call the speed gate sends to SDPA (``exact`` if the observer already ran it), counted."""
        if counting:
            self.state.gated_calls += 1
            self._outcomes[1] += 1
        if blocks:
            pairs = _block_pairs(query, key)
            self.state.count_blocks(pairs, pairs)
        return exact if exact is not None else F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)

    def _balance_for(self, query: torch.Tensor, key: torch.Tensor, ranges: StaticRanges | None) -> bool:
        """Whether this INT8 call (BHSD) measures the Q·Kᵀ balance: never with a calibration's ``ranges`` (its
        balance, if any, comes with them; a static K mean alone already keeps the kernel from measuring one); else
        as decided (``__init__``), else by this call if it has the queries the balance needs, reading once whether
        any channel of its Q and K would move (``needs_balance``)."""
        if ranges is not None and any(t is not None for t in (ranges.q_amax, ranges.k_amax, ranges.k_mean,
                                                               ranges.qk_balance)):
            return False
        if self._balance is not None:
            return self._balance
        if query.shape[2] * (query.shape[1] // key.shape[1]) < BALANCE_MIN_QUERIES:
            return False  # the kernel would not balance this call: decided by a later one
        if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            return True  # no read from the GPU here: measured, it moves only the channels that need it
        self._balance, self._balance_from = needs_balance(query, key), "first call"
        return self._balance

    def balance_status(self) -> str:
        """What this module does about the Q·Kᵀ balance, in words (``Int8Handle.summary`` groups modules by it)."""
        if self._static_balance:
            return "on (calibration)"
        if self.calibration is not None:  # its static ranges (K's mean at least) leave no measured balance
            if self.qk_balance is False:
                return "off (asked)"
            if self.calibration.has_channel_ranges():
                return "off (calibration: no outlier channels)"
            return "off (calibration without per-channel maxima)"
        if self._balance is None:  # compiled or graph-captured calls before an eager one measure it in each call
            return "undecided (no INT8 call of 1,024+ queries per head yet)"
        if self._balance_from == "first call":
            return "on (outlier channels at the first call)" if self._balance else "off (no outlier channels at the first call)"
        return f"{'on' if self._balance else 'off'} ({self._balance_from})"

    def _carry_ready(self) -> bool:
        """Whether the skipped blocks can be carried: the denoising step is known (else, one warning, and they
        are dropped)."""
        if self.state.timestep is not None:
            return True
        if not self._warned_carry:
            self._warned_carry = True
            warnings.warn("diffusion_int8: refresh_every needs the denoiser's timestep, which this processor has not "
                          "been given (diffusion_int8.enable() reads it); the skipped blocks are dropped instead",
                          RuntimeWarning, stacklevel=4)
        return False

    def block_mask_for(self, query, key, attn_mask, scale, tau: float | None) -> torch.Tensor | None:
        """The block mask this processor's INT8 calls (BHSD inputs) predict at level ``tau`` (bool (B, H, nQB,
        nKB); standalone, as the calibration measures it), or None where the call runs dense: no level or 1, an
        ``attn_mask``, or one key block."""
        if not _sparse(tau, key, attn_mask):
            return None
        return predict_block_mask(query, key, tau, sm_scale=scale, keep_kv_blocks=self._text_blocks(query, key))

    def _text_blocks(self, query, key) -> torch.Tensor | None:
        """(nKB,) bool: the key blocks holding text tokens in joint text+image attention, else None."""
        n_text, where = self._text
        sq, sk = query.shape[2], key.shape[2]
        if not 0 < n_text < sk or sq != sk:  # no text, cross-attention (keys are all text) or not joint
            return None
        cache_key = (sk, n_text, where, key.device)
        keep = self._keep.get(cache_key)
        if keep is None:
            block = torch.arange(cdiv(sk, SPARSE_BLOCK), device=key.device)
            first = block < cdiv(n_text, SPARSE_BLOCK)
            last = block >= (sk - n_text) // SPARSE_BLOCK
            keep = first if where == "first" else last if where == "last" else first | last
            if len(self._keep) < 64:
                self._keep[cache_key] = keep
        return keep

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
        if (attention_kwargs or keeps_stock(backend, None) or (parallel_config is not None and split is None)
                or (split == "ring" and attn_mask is not None)):
            if not torch.compiler.is_compiling():
                self._outcomes[2] += 1
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
            mode = self._ring_mode(query.transpose(1, 2), key.transpose(1, 2), dropout_p, is_causal)
            forward = functools.partial(self._ring_block, mode)
        else:
            out = self._attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                                  dropout_p, is_causal, scale, enable_gqa)
            return out.transpose(1, 2)
        return dispatch._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, forward_op=forward,
            backward_op=dispatch._native_attention_backward_op, _parallel_config=parallel_config)

    def _ring_mode(self, query, key, dropout_p, is_causal) -> Mode:
        """The mode an unmasked ring-split call (BHSD: this device's queries, one K/V block) runs: the schedule's
        INT8 mode where the kernel takes the call and the gate lets it, else ``fp16``; counted as ``_attention``
        counts."""
        mode = self.current_mode()
        if mode is Mode.FP16 or not kernel_takes(query, key, None, dropout_p, is_causal):
            return Mode.FP16
        counting = not torch.compiler.is_compiling()
        if self.gate is not None and not (self.gate.pays(mode, query, key) and (
                not self._balance_for(query, key, self._static_ranges(query.device))
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
            out, lse = int8_core(mode, q, k, v, None, scale, ranges, qk_balance=self._balance_for(q, k, ranges),
                                 qk_rotate=self.qk_rotate, return_lse=True)
        return out.transpose(1, 2), lse.transpose(1, 2)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as the plain tensor it wraps, once the collective is done: diffusers' ring
    passes each K/V block on as a view of an all-gather's ``AsyncCollectiveTensor``, a tensor subclass with no
    storage of its own, which a kernel cannot read; other tensors unchanged."""
    return t.trigger_wait() if type(t) is not torch.Tensor and callable(getattr(t, "trigger_wait", None)) else t


def _sparse(tau: float | None, key, attn_mask) -> bool:
    """Whether an INT8 call (BHSD ``key``) runs block-sparse at level ``tau``: a level below 1, no ``attn_mask`` and
    more than one key block."""
    return tau is not None and tau < 1 and attn_mask is None and key.shape[2] > SPARSE_BLOCK


def skipped_fractions(totals: dict[int, tuple[float, int]]) -> dict | None:
    """``Int8State.block_totals`` (or their sums over generations) as skipped fractions per step and overall."""
    if not totals:
        return None
    steps = sorted(totals)
    kept, total = sum(totals[s][0] for s in steps), sum(totals[s][1] for s in steps)
    return {"steps": steps, "per_step": [1 - totals[s][0] / max(totals[s][1], 1) for s in steps],
            "overall": 1 - kept / max(total, 1)}


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


def _block_pairs(query: torch.Tensor, key: torch.Tensor) -> int:
    """(query block, key block) pairs of an attention call, over its batch and heads (BHSD, or any with S at -2)."""
    batch_heads = query.numel() // max(query.shape[-2] * query.shape[-1], 1)
    return batch_heads * cdiv(query.shape[-2], SPARSE_BLOCK) * cdiv(key.shape[-2], SPARSE_BLOCK)


# diffusers passes a processor only the keyword arguments its ``__call__`` declares (``inspect.signature``) and drops
# the rest with a log line, so an INT8 processor declares what the stock processor it runs declares: it is an
# instance of a subclass whose ``__call__`` (the same code) carries that signature, one subclass per signature.
_DECLARING: dict[tuple, type] = {}


def _declaring_class(sig: inspect.Signature) -> type:
    """The ``Int8DiffusionProcessor`` subclass whose ``__call__`` declares ``sig`` (a bound method's, without self)."""
    key = tuple((p.name, p.kind) for p in sig.parameters.values())
    cls = _DECLARING.get(key)
    if cls is None:
        base = Int8DiffusionProcessor.__call__
        call = types.FunctionType(base.__code__, base.__globals__, base.__name__, base.__defaults__, base.__closure__)
        call.__kwdefaults__, call.__doc__, call.__qualname__ = base.__kwdefaults__, base.__doc__, base.__qualname__
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        call.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()], return_annotation=Any)
        cls = _DECLARING[key] = type(Int8DiffusionProcessor.__name__, (Int8DiffusionProcessor,),
                                     {"__call__": call, "__module__": __name__,
                                      "__qualname__": Int8DiffusionProcessor.__qualname__})
    return cls
