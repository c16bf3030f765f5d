"""The stock rotary embedding of Wan's processors, run in one launch inside their routed copies.

``WanAttnProcessor`` (and the processors diffusers copied from it) define ``apply_rotary_emb(hidden_states,
freqs_cos, freqs_sin)`` inside their ``__call__``, a dozen PyTorch ops per tensor; at 480p × 81 frames Q's and K's
cost a quarter of what the INT8 attention call does. ``with_fast_rotary`` gives a routed copy's code a stand-in for
that nested function which calls ``CheckedRotary``: ``kernels.rope.rotate_pairs`` once it has reproduced the stock
function bit for bit on a real call's inputs, else the stock function. A nested function of that name that computes
something else fails the check and keeps running as it is (one warning), so the copy computes what stock does.
"""

from __future__ import annotations

import types
import warnings

import torch

from ..kernels.rope import rotate_pairs, rotate_pairs_takes

_NAME = "apply_rotary_emb"
_ARGS = ("hidden_states", "freqs_cos", "freqs_sin")


class CheckedRotary:
    """A stock ``apply_rotary_emb(hidden_states, freqs_cos, freqs_sin)`` and ``rotate_pairs``: the one-launch twin runs
    for inputs it takes once it has given the stock result bit for bit for their dtypes and device (checked on the
    first such call, one host synchronization; not while a CUDA graph is captured), the stock function otherwise."""

    def __init__(self, stock: types.FunctionType):
        self.stock = stock
        self.checked: dict[tuple, bool] = {}  # (dtype of x, dtype of the tables, device) -> equal to stock

    def __call__(self, hidden_states, freqs_cos, freqs_sin):
        if not rotate_pairs_takes(hidden_states, freqs_cos, freqs_sin):
            return self.stock(hidden_states, freqs_cos, freqs_sin)
        key = (hidden_states.dtype, freqs_cos.dtype, hidden_states.device)
        equal = self.checked.get(key)
        if equal:
            return rotate_pairs(hidden_states, freqs_cos, freqs_sin)
        stock = self.stock(hidden_states, freqs_cos, freqs_sin)
        if equal is None and not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            equal = self.checked[key] = torch.equal(rotate_pairs(hidden_states, freqs_cos, freqs_sin), stock)
            if not equal:
                warnings.warn(f"diffusion_int8: {self.stock.__qualname__} computes something else than Wan's rotary "
                              f"embedding; it runs as it is (without the one-launch rotation)", RuntimeWarning,
                              stacklevel=2)
        return stock


def with_fast_rotary(code: types.CodeType, globals_: dict) -> tuple[types.CodeType, dict]:
    """``code`` (a stock processor's ``__call__``) with each nested ``apply_rotary_emb(hidden_states, freqs_cos,
    freqs_sin)`` replaced by a stand-in that calls a ``CheckedRotary`` of it, and the globals the stand-ins read
    (to add to the copy's ``globals_``, which the nested function is also made with); ``code``, {} where there is none."""
    consts, names = list(code.co_consts), {}
    for i, nested in enumerate(consts):
        if not (isinstance(nested, types.CodeType) and nested.co_name == _NAME and nested.co_argcount == 3
                and nested.co_varnames[:3] == _ARGS and not nested.co_freevars):
            continue
        name = f"__diffusion_int8_rotary_{i}__"
        names[name] = CheckedRotary(types.FunctionType(nested, globals_, _NAME))
        stub = compile(f"def {_NAME}({', '.join(_ARGS)}):\n    return {name}({', '.join(_ARGS)})\n",
                       nested.co_filename, "exec")
        stub = next(c for c in stub.co_consts if isinstance(c, types.CodeType))
        names_kept = {"co_firstlineno": nested.co_firstlineno}
        if hasattr(nested, "co_qualname"):  # Python 3.11+: a nested function takes its qualified name from its code
            names_kept["co_qualname"] = nested.co_qualname
        consts[i] = stub.replace(**names_kept)
    if not names:
        return code, {}
    return code.replace(co_consts=tuple(consts)), names
