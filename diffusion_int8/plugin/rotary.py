"""The stock rotary embedding of Wan's processors, run in one launch inside their routed copies.

``WanAttnProcessor`` (and the processors diffusers copied from it) define ``apply_rotary_emb(hidden_states,
freqs_cos, freqs_sin)`` inside their ``__call__``, a dozen PyTorch ops per tensor; at 480p × 81 frames Q's and K's
cost a quarter of what the INT8 attention call does. ``with_fast_rotary`` gives a routed copy's code a stand-in for
that nested function which calls ``CheckedRotary``: ``kernels.rope.rotate_pairs`` once it has reproduced the stock
function bit for bit on a real call's inputs, else the stock function. Only a nested function whose instructions are
those of the installed diffusers' Wan function is replaced; any other stays as it is.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from ..kernels.rope import rotate_pairs_takes, rotate_pairs_unchecked

_NAME = "apply_rotary_emb"
_ARGS = ("hidden_states", "freqs_cos", "freqs_sin")
# (the nested function's code, x's dtype, the tables' dtype, device) -> whether rotate_pairs gave the stock result:
# checked once, as a kernel is compiled once
_CHECKED: dict[tuple, bool] = {}


class CheckedRotary:
    """A stock Wan ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` and ``rotate_pairs``: the one-launch twin
    runs for inputs it takes once it has given the stock result bit for bit for their dtypes and device (checked on
    the first such call of the process, one host synchronization, holding one more Q-sized tensor for it; not while
    a CUDA graph is captured), the stock function otherwise."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock

    def __call__(self, hidden_states, freqs_cos, freqs_sin):
        if not rotate_pairs_takes(hidden_states, freqs_cos, freqs_sin):
            return self.stock(hidden_states, freqs_cos, freqs_sin)
        key = (self.stock.__code__, hidden_states.dtype, freqs_cos.dtype, hidden_states.device)
        equal = _CHECKED.get(key)
        if equal:
            return rotate_pairs_unchecked(hidden_states, freqs_cos, freqs_sin)
        stock = self.stock(hidden_states, freqs_cos, freqs_sin)
        if equal is None and not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            fast = rotate_pairs_unchecked(hidden_states, freqs_cos, freqs_sin)
            bits = {2: torch.int16, 4: torch.int32}[stock.element_size()]
            nan = stock.isnan()  # a NaN's payload may differ: where stock has one, fast must have one too
            equal = _CHECKED[key] = bool(torch.equal(fast.isnan(), nan) and torch.equal(
                fast.view(bits).masked_fill(nan, 0), stock.view(bits).masked_fill(nan, 0)))
            if not equal:
                warnings.warn(f"diffusion_int8: the one-launch rotary embedding did not reproduce "
                              f"{self.stock.__qualname__} ({hidden_states.dtype} inputs, {freqs_cos.dtype} tables); "
                              f"it runs as it is", RuntimeWarning, stacklevel=2)
        return stock


@functools.lru_cache(maxsize=1)
def stock_wan_rotary() -> types.FunctionType | None:
    """The installed diffusers' Wan rotary embedding, ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` nested
    in ``WanAttnProcessor.__call__``, as a function of its own (what ``rotate_pairs`` reproduces); None without one."""
    try:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    except ImportError:
        return None
    fn = WanAttnProcessor.__call__
    code = next((c for c in fn.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == _NAME), None)
    return None if code is None else types.FunctionType(code, fn.__globals__, _NAME)


def _is_wan_rotary(code: types.CodeType) -> bool:
    """Whether nested ``code`` is Wan's rotary embedding, instruction for instruction (WanAttnProcessor's own, or a
    processor's copy of it: SkyReels-V2, ChronoEdit, ...)."""
    wan = stock_wan_rotary()
    fields = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_kwonlyargcount", "co_flags",
              "co_freevars")
    return (wan is not None and code.co_name == _NAME and not code.co_freevars  # a stand-in takes no closure
            and all(getattr(code, f) == getattr(wan.__code__, f) for f in fields))


def with_fast_rotary(code: types.CodeType, globals_: dict) -> tuple[types.CodeType, dict]:
    """``code`` (a stock processor's ``__call__``) with each nested function that is Wan's rotary embedding
    (``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)``) replaced by a stand-in that calls a ``CheckedRotary`` of
    it, and the globals the stand-ins read (to add to the copy's globals, which the stand-ins are made with);
    ``code``, {} where there is none."""
    consts, names = list(code.co_consts), {}
    for i, nested in enumerate(consts):
        if not (isinstance(nested, types.CodeType) and _is_wan_rotary(nested)):
            continue
        name = f"__diffusion_int8_rotary_{i}__"
        names[name] = CheckedRotary(types.FunctionType(nested, globals_, _NAME))
        # on one line, so that a traceback through the stand-in shows the stock function's first line
        stub = compile(f"def {_NAME}({', '.join(_ARGS)}): return {name}({', '.join(_ARGS)})\n",
                       nested.co_filename, "exec")
        stub = next(c for c in stub.co_consts if isinstance(c, types.CodeType))
        where = {"co_firstlineno": nested.co_firstlineno}
        if hasattr(nested, "co_qualname"):  # Python 3.11+: a nested function takes its qualified name from its code
            where["co_qualname"] = nested.co_qualname
        consts[i] = stub.replace(**where)
    if not names:
        return code, {}
    return code.replace(co_consts=tuple(consts)), names
