"""Stock rotary embeddings run in one launch inside the copies of diffusers' processors that the plugin runs: the
routed copies (``routing.routed``) and those of calls the speed gate keeps on SDPA (``routing.rotary_only``).

Three stock functions rotate Q and K with a dozen or so PyTorch ops per tensor: at 480p × 81 frames Wan's cost a
quarter of what the INT8 attention call does. ``kernels.rope.rotate_pairs`` gives their result, bit for bit, in one
launch:

- the ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` that ``WanAttnProcessor`` (and the processors diffusers
  copied from it) define inside their ``__call__``: ``with_fast_rotary`` gives a copy's code a stand-in for that
  nested function, where its instructions are those of the installed diffusers' Wan function;
- ``diffusers.models.embeddings.apply_rotary_emb`` with real tables (Flux, CogVideoX, HunyuanVideo, ...), which a
  processor reads as a module global or imports inside its ``__call__``: the copy's globals map the name to a
  stand-in, and its builtins' ``__import__`` hands that ``from ..embeddings import apply_rotary_emb`` the stand-in,
  where the installed function has the signature it is known by;
- LTX-Video's module-level ``apply_rotary_emb(x, freqs)`` on (B, S, C) tokens, and its copies (LTX-2's
  ``apply_interleaved_rotary_emb``): the copy's globals map each to a stand-in;
- complex tables (``use_real=False``): the generic function's (Lumina-Next), Qwen-Image's module-level
  ``apply_rotary_emb_qwen`` and NucleusMoE's copy of it, and the ``apply_rotary_emb(x_in, freqs_cis)`` nested in
  Z-Image's processor, each as the stand-in of its kind above. QwenImage 2.1 calls its copy from a helper outside
  ``__call__``, which stays stock.

Each stand-in calls a ``Checked`` rotary: the one launch once it has reproduced the stock function bit for bit on a
real call's inputs, else the stock function (also where the launch fails). A compiled model runs the stock function,
which inductor fuses.
"""

from __future__ import annotations

import builtins
import dis
import functools
import importlib
import inspect
import types

from typing import Callable, Sequence

import torch

from ..kernels.config import triton_unavailable
from ..kernels.rope import COMPLEX, HALVES, INTERLEAVED, WAN, rotate_pairs_takes, rotate_pairs_unchecked
from . import checked
from .checked import first_equal

_NAME = "apply_rotary_emb"
# the generic function's parameters and defaults, as diffusers 0.42 defines it: a function of others is left alone
_GENERIC_SIGNATURE = (("x", inspect.Parameter.empty), ("freqs_cis", inspect.Parameter.empty), ("use_real", True),
                      ("use_real_unbind_dim", -1), ("sequence_dim", 2))
# the choices of fused multiply-adds in (a + bi)(c + di), (real, imaginary) as ``rope.rotate_pairs`` takes them; the
# check tries every one (a compilation each, the first time a process meets the form)
_FUSED_ORDER = ((1, 1), (2, 2), (0, 0), (1, 2), (2, 1), (1, 0), (0, 1), (2, 0), (0, 2))


def _detail(x: torch.Tensor, table: torch.Tensor) -> str:
    return f"{x.dtype} inputs, {table.dtype} tables"


class ComplexProduct:
    """``stock_fn``'s complex-table branch, ``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) *
    freqs_cis.unsqueeze(dim)).flatten(3).type_as(x)``, through ``rotate_pairs``'s ``COMPLEX`` form once checked
    (``checked.first_equal``): x (B, S, H, D), a complex64 table that broadcasts to it. Any other call, and every call
    torch.compile traces, runs the stock computation (``stock(x)``, the caller's).

    The check first finds which choice of fused multiply-adds PyTorch's complex product was compiled with, on x in
    float32 (per function, dim, head dim and device): every choice is tried, and one is kept only where it alone gives
    stock's bits (a 16-bit x's result rounds most of their differences away). Then that choice alone is checked on x's
    own dtype. The table view and the checks of the last accepted call are kept with its table (``_last``): Q and K,
    and every block of a forward, pass the same one. A later call with that table, its memory and x's shape, dtype and
    device as then, asks again only what can change: the gradient mode and the backend setting."""

    def __init__(self, stock_fn: types.FunctionType, dim: int):
        self.stock_fn, self.dim = stock_fn, dim
        self._last: tuple | None = None  # (freqs_cis, its memory and x's shape, dtype and device, the (re, im) table)

    def __call__(self, x, freqs_cis, stock: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if not (isinstance(x, torch.Tensor) and isinstance(freqs_cis, torch.Tensor)) or torch.compiler.is_compiling():
            return stock(x)
        if x.dtype == torch.float32 and not _complex_view_ok(x):  # stock's view_as_complex raises: let it
            return stock(x)
        table = self._table(x, freqs_cis)
        if table is None:
            return stock(x)
        key = (self.stock_fn.__code__, COMPLEX, self.dim, torch.float32, x.device, x.shape[-1])
        what, detail = self.stock_fn.__qualname__, functools.partial(_detail, x, freqs_cis)
        if x.dtype == torch.float32:
            return first_equal(key, x, _ComplexTwins(x, table, _FUSED_ORDER), lambda: stock(x), what, detail, True)
        if checked.MATCHED.get(key, -1) == -1:  # not yet found: found now, on x in float32 (not in a graph's capture)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return stock(x)
            x32 = x.float()
            first_equal(key, x32, _ComplexTwins(x32, table, _FUSED_ORDER), lambda: stock(x32), what, detail, True)
        found = checked.MATCHED.get(key, -1)
        if found is None or found < 0:
            return stock(x)
        return first_equal((*key[:3], x.dtype, *key[4:]), x, _ComplexTwins(x, table, _FUSED_ORDER[found:found + 1]),
                           lambda: stock(x), what, detail)

    def _table(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor | None:
        """The table's (re, im) pairs as ``rotate_pairs`` takes them (re = cos[2j], im = sin[2j+1]), or None where
        the twin does not take this call: a table other than complex64, conjugated or negated (``view_as_real``
        refuses those), or inputs ``rotate_pairs_takes`` refuses."""
        if freqs_cis.dtype != torch.complex64 or freqs_cis.is_conj() or freqs_cis.is_neg():
            return None
        # what the refusal read and the view depends on; the same tensor object may have been given other memory
        # (set_, .data =) and the backend setting may have changed since
        seen = (freqs_cis.data_ptr(), freqs_cis.device, freqs_cis.shape, freqs_cis.stride(), x.shape, x.dtype, x.device)
        last = self._last
        if last is not None and last[0] is freqs_cis and last[1] == seen:
            if not (torch.is_grad_enabled() and (x.requires_grad or freqs_cis.requires_grad)):
                return last[2] if triton_unavailable(x.device) is None else None
        if x.dim() != 4:
            return None
        table = torch.view_as_real(freqs_cis.unsqueeze(self.dim)).flatten(-2)
        if not rotate_pairs_takes(x, table, table):
            return None
        # kept only where the table is a view of freqs_cis (flatten copies a table whose pairs are not adjacent)
        shares = table.untyped_storage().data_ptr() == freqs_cis.untyped_storage().data_ptr()
        self._last = (freqs_cis, seen, table) if shares else None
        return table


def _complex_view_ok(x: torch.Tensor) -> bool:
    """Whether ``torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))`` takes float32 ``x`` (``x.float()`` is ``x``
    itself): unit channel stride, every other stride and the storage offset even."""
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1])


class _ComplexTwins(Sequence):
    """``rotate_pairs``'s ``COMPLEX`` form of x and a table, one for each choice of fused multiply-adds in ``fused``,
    made when asked for (a call that runs the twin found makes one)."""

    def __init__(self, x: torch.Tensor, table: torch.Tensor, fused: tuple[tuple[int, int], ...]):
        self.x, self.table, self.fused = x, table, fused

    def __len__(self) -> int:
        return len(self.fused)

    def __getitem__(self, i: int) -> Callable[[], torch.Tensor]:
        return functools.partial(rotate_pairs_unchecked, self.x, self.table, self.table, None, COMPLEX, self.fused[i])


class CheckedRotary:
    """A stock Wan ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` and ``rotate_pairs``: the one-launch twin
    runs for inputs it takes once it has given the stock result bit for bit for their dtypes and device
    (``checked.first_equal``), the stock function otherwise."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock

    def __call__(self, hidden_states, freqs_cos, freqs_sin):
        if not rotate_pairs_takes(hidden_states, freqs_cos, freqs_sin):
            return self.stock(hidden_states, freqs_cos, freqs_sin)
        key = (self.stock.__code__, WAN, hidden_states.dtype, freqs_cos.dtype, hidden_states.device)
        return first_equal(key, hidden_states, (lambda: rotate_pairs_unchecked(hidden_states, freqs_cos, freqs_sin),),
                           lambda: self.stock(hidden_states, freqs_cos, freqs_sin), self.stock.__qualname__,
                           functools.partial(_detail, hidden_states, freqs_cos))


class CheckedApplyRotary:
    """diffusers' ``embeddings.apply_rotary_emb(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)`` and
    ``rotate_pairs``: real (cos, sin) tables of shape (S, D), unbind dim -1 or -2 and sequence dim 1 or 2 run in one
    launch once checked (``checked.first_equal``, per form, sequence dim, dtypes and device), and so does a complex64
    table with ``use_real=False`` (``ComplexProduct``); any other call, and every call torch.compile traces, runs the
    stock function."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock
        self._complex = ComplexProduct(stock, 2)

    def __call__(self, x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        def stock():
            return self.stock(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

        if use_real is False:
            return self._complex(x, freqs_cis,
                                 lambda x: self.stock(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim))
        # plain ints only: anything else (a 0-d tensor, a list) goes to stock, which raises what it raises for it
        form = None
        if use_real and type(use_real_unbind_dim) is int and type(sequence_dim) is int:
            form = INTERLEAVED if use_real_unbind_dim == -1 else HALVES if use_real_unbind_dim == -2 else None
        if (form is None or sequence_dim not in (1, 2) or not isinstance(x, torch.Tensor)
                or not isinstance(freqs_cis, (tuple, list)) or len(freqs_cis) != 2
                or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in freqs_cis)
                or torch.compiler.is_compiling()):
            return stock()
        # the stock function's broadcast: (S, D) tables against x's sequence dim, moved to x's device as it moves them
        # (CogView4 makes its tables on the CPU)
        cos, sin = ((t[None, :, None, :] if sequence_dim == 1 else t[None, None]).to(x.device) for t in freqs_cis)
        if not rotate_pairs_takes(x, cos, sin):
            return stock()
        key = (self.stock.__code__, form, sequence_dim, x.dtype, cos.dtype, x.device)
        return first_equal(key, x, (lambda: rotate_pairs_unchecked(x, cos, sin, None, form),), stock,
                           self.stock.__qualname__, functools.partial(_detail, x, cos))


class CheckedTokenRotary:
    """LTX-Video's ``apply_rotary_emb(x, freqs)`` (LTX-2's ``apply_interleaved_rotary_emb`` is the same function) and
    ``rotate_pairs``: x (B, S, C) with channel pairs (2j, 2j+1) each rotated by its own entries of (cos, sin) tables
    (B, S, C) or broadcastable to x, in float32, run in one launch once checked (``checked.first_equal``, per dtypes
    and device); any other call, and every call torch.compile traces, runs the stock function."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock

    def __call__(self, x, freqs):
        if (not isinstance(x, torch.Tensor) or x.dim() != 3 or not isinstance(freqs, (tuple, list)) or len(freqs) != 2
                or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in freqs)
                or torch.compiler.is_compiling()):
            return self.stock(x, freqs)
        x4, cos, sin = (t.unsqueeze(2) for t in (x, *freqs))  # (B, S, 1, C): one head of all the channels
        if not rotate_pairs_takes(x4, cos, sin):
            return self.stock(x, freqs)
        key = (self.stock.__code__, INTERLEAVED, x.dtype, cos.dtype, x.device)
        return first_equal(key, x, (lambda: rotate_pairs_unchecked(x4, cos, sin, None, INTERLEAVED).squeeze(2),),
                           lambda: self.stock(x, freqs), self.stock.__qualname__,
                           functools.partial(_detail, x, cos))


class CheckedQwenRotary:
    """Qwen-Image's ``apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1)`` (and its copies) and
    ``rotate_pairs``: x (B, S, H, D) and a complex64 table (S, D/2) with ``use_real=False``, as Qwen-Image's processor
    calls it, through ``ComplexProduct``; any other call runs the stock function."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock
        self._complex = ComplexProduct(stock, 1)

    def __call__(self, x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        def stock(x):
            return self.stock(x, freqs_cis, use_real, use_real_unbind_dim)

        return self._complex(x, freqs_cis, stock) if use_real is False else stock(x)


class CheckedNestedComplexRotary:
    """Z-Image's ``apply_rotary_emb(x_in, freqs_cis)``, nested in its processor's ``__call__`` (complex64 tables,
    unsqueezed at dim 2), and ``rotate_pairs``, through ``ComplexProduct``."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock
        self._complex = ComplexProduct(stock, 2)

    def __call__(self, x_in, freqs_cis):
        return self._complex(x_in, freqs_cis, lambda x: self.stock(x, freqs_cis))


def _nested(processor: str, module: str) -> types.FunctionType | None:
    """The ``apply_rotary_emb`` nested in the installed diffusers' ``processor.__call__`` (in ``module``), as a function
    of its own; None without one."""
    try:
        fn = getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), processor).__call__
    except (ImportError, AttributeError):
        return None
    code = next((c for c in fn.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == _NAME), None)
    return None if code is None else types.FunctionType(code, fn.__globals__, _NAME)


@functools.lru_cache(maxsize=1)
def stock_wan_rotary() -> types.FunctionType | None:
    """The installed diffusers' Wan rotary embedding, ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` nested
    in ``WanAttnProcessor.__call__``, as a function of its own (what ``rotate_pairs`` reproduces); None without one."""
    return _nested("WanAttnProcessor", "transformer_wan")


@functools.lru_cache(maxsize=1)
def stock_zimage_rotary() -> types.FunctionType | None:
    """The installed diffusers' Z-Image rotary embedding, ``apply_rotary_emb(x_in, freqs_cis)`` nested in
    ``ZSingleStreamAttnProcessor.__call__``, as a function of its own; None without one."""
    return _nested("ZSingleStreamAttnProcessor", "transformer_z_image")


@functools.lru_cache(maxsize=1)
def stock_qwen_rotary() -> types.FunctionType | None:
    """The installed diffusers' ``transformer_qwenimage.apply_rotary_emb_qwen``; None without one."""
    try:
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
    except ImportError:
        return None
    return apply_rotary_emb_qwen


@functools.lru_cache(maxsize=1)
def generic_rotary() -> CheckedApplyRotary | None:
    """The stand-in for the installed ``diffusers.models.embeddings.apply_rotary_emb``, or None where that function is
    missing or has other parameters than ``_GENERIC_SIGNATURE`` (a release that changed it keeps its own)."""
    try:
        from diffusers.models.embeddings import apply_rotary_emb
    except ImportError:
        return None
    params = tuple((p.name, p.default) for p in inspect.signature(apply_rotary_emb).parameters.values())
    return CheckedApplyRotary(apply_rotary_emb) if params == _GENERIC_SIGNATURE else None


@functools.lru_cache(maxsize=1)
def stock_token_rotary() -> types.FunctionType | None:
    """The installed diffusers' LTX-Video rotary embedding, ``transformer_ltx.apply_rotary_emb(x, freqs)``; None
    without one."""
    try:
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb
    except ImportError:
        return None
    return apply_rotary_emb


def _same_code(code: types.CodeType, reference: types.FunctionType | None) -> bool:
    """Whether ``code`` is ``reference``'s, instruction for instruction, whatever its name, and takes no closure."""
    fields = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_kwonlyargcount", "co_flags",
              "co_freevars")
    return (reference is not None and not code.co_freevars
            and all(getattr(code, f) == getattr(reference.__code__, f) for f in fields))


def _same_function(fn: types.FunctionType, reference: types.FunctionType | None) -> bool:
    """Whether ``fn`` is ``reference`` instruction for instruction (``_same_code``) with the same defaults: a stand-in
    takes the reference's."""
    return (_same_code(fn.__code__, reference) and fn.__defaults__ == reference.__defaults__
            and fn.__kwdefaults__ == reference.__kwdefaults__)


def _nested_stand_in(code: types.CodeType) -> type | None:
    """The stand-in class for nested ``code`` where it is a stock rotary embedding, instruction for instruction: Wan's
    (WanAttnProcessor's own, or a processor's copy of it: SkyReels-V2, ChronoEdit, ...) or Z-Image's; else None."""
    if code.co_name != _NAME:
        return None
    if _same_code(code, stock_wan_rotary()):
        return CheckedRotary
    return CheckedNestedComplexRotary if _same_code(code, stock_zimage_rotary()) else None


class _ModuleView:
    """A module as ``from module import ...`` reads it, with ``apply_rotary_emb`` the stand-in."""

    __slots__ = ("_module", "_stand_in")

    def __init__(self, module: types.ModuleType, stand_in: CheckedApplyRotary):
        self._module, self._stand_in = module, stand_in

    def __getattr__(self, name):
        return self._stand_in if name == _NAME else getattr(self._module, name)


def _builtins_importing(stand_in: CheckedApplyRotary) -> dict:
    """Builtins whose ``__import__`` gives ``from ... import apply_rotary_emb`` of the stock function's module the
    stand-in instead, and imports everything else as it is. A snapshot of the builtins module taken now (a frame reads
    its builtins from a dict): a builtin added to the module later, by a profiler say, is not seen by the copy."""
    views: dict[int, _ModuleView] = {}

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        module = builtins.__import__(name, globals, locals, fromlist, level)
        if fromlist and _NAME in fromlist and getattr(module, _NAME, None) is stand_in.stock:
            view = views.get(id(module))
            if view is None:
                view = views[id(module)] = _ModuleView(module, stand_in)
            return view
        return module

    return {**builtins.__dict__, "__import__": __import__}


def with_fast_rotary(code: types.CodeType, globals_: dict) -> tuple[types.CodeType, dict]:
    """``code`` (a stock processor's ``__call__``) with its rotary embeddings in one launch, and the globals that takes
    (to add to the copy's globals, which the stand-ins are made with); ``code``, {} where there is none.

    Each nested function that is Wan's or Z-Image's rotary embedding is replaced by a stand-in that calls a
    ``CheckedRotary`` or ``CheckedNestedComplexRotary`` of it. Where the code reads diffusers' generic
    ``apply_rotary_emb`` as a module global, the globals map it to ``generic_rotary()``; where it imports it, the
    globals' builtins give the import that stand-in. A module global that is LTX-Video's or Qwen-Image's function,
    instruction for instruction, maps to a ``CheckedTokenRotary`` or ``CheckedQwenRotary`` of it. Only ``code``'s own
    instructions are read: a read or an import inside a function nested in it stays stock."""
    consts, names = list(code.co_consts), {}
    for i, nested in enumerate(consts):
        stand_in = _nested_stand_in(nested) if isinstance(nested, types.CodeType) else None
        if stand_in is None:
            continue
        name = f"__diffusion_int8_rotary_{i}__"
        names[name] = stand_in(types.FunctionType(nested, globals_, _NAME))
        args = ", ".join(nested.co_varnames[:nested.co_argcount])
        # on one line, so that a traceback through the stand-in shows the stock function's first line
        stub = compile(f"def {_NAME}({args}): return {name}({args})\n", nested.co_filename, "exec")
        stub = next(c for c in stub.co_consts if isinstance(c, types.CodeType))
        where = {"co_firstlineno": nested.co_firstlineno}
        if hasattr(nested, "co_qualname"):  # Python 3.11+: a nested function takes its qualified name from its code
            where["co_qualname"] = nested.co_qualname
        consts[i] = stub.replace(**where)
    reads = {(ins.opname, ins.argval) for ins in dis.get_instructions(code)}
    generic = generic_rotary() if _NAME in code.co_names else None
    if generic is not None:
        if ("LOAD_GLOBAL", _NAME) in reads and globals_.get(_NAME) is generic.stock:
            names[_NAME] = generic
        if ("IMPORT_FROM", _NAME) in reads:
            names["__builtins__"] = _builtins_importing(generic)
    for op, name in reads:  # LTX-Video's or Qwen-Image's function (or a copy: LTX-2's, NucleusMoE's) as a module global
        fn = globals_.get(name) if op == "LOAD_GLOBAL" and name not in names else None
        if not isinstance(fn, types.FunctionType):
            continue
        if _same_function(fn, stock_token_rotary()):
            names[name] = CheckedTokenRotary(fn)
        elif _same_function(fn, stock_qwen_rotary()):
            names[name] = CheckedQwenRotary(fn)
    if not names:
        return code, {}
    return code.replace(co_consts=tuple(consts)), names
