"""Stock functions run as a one-launch twin once the twin has reproduced them bit for bit.

The rotary embeddings (``rotary``) and the query/key RMSNorm (``norms``) have Triton twins that compute what the stock
PyTorch code computes, rounding for rounding. Whether a twin gives the stock bits on this PyTorch, GPU and dtype is
checked on the first real call, as a kernel is compiled once; until then, and where it does not, the stock code runs.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

# (the stock code, the twin's form, dtypes, device, ...) -> the index of the first twin that gave the stock result, or
# None where none did (or a launch failed)
MATCHED: dict[tuple, int | None] = {}


def first_equal(key: tuple, x: torch.Tensor, twins: Sequence[Callable[[], torch.Tensor]],
                stock: Callable[[], torch.Tensor], what: str, detail: Callable[[], str],
                only_one: bool = False) -> torch.Tensor:
    """The first of ``twins`` (each computing the stock result of ``x``'s call its own way) that reproduced ``stock()``
    bit for bit for ``key``, else ``stock()``. The first call for a key checks them in turn (one host synchronization
    each, holding one more result-sized tensor; not while a CUDA graph is captured) and warns once if none does or a
    launch fails, saying of what with ``what`` and ``detail()`` (called only then: every call passes it).
    ``only_one``: the twins compute different things (choices of which one stock is), so every one is checked and a
    twin is kept only where it alone reproduced stock; where several did, the call's data could not tell them apart,
    and the next call checks again."""
    matched = MATCHED.get(key, -1)
    if matched is not None and matched >= 0:
        return twins[matched]()
    want = stock()
    if matched == -1 and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        MATCHED[key] = None
        bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
        nan = want.isnan()  # a NaN's payload may differ: where stock has one, the twin must have one too
        matches = []
        for i, twin in enumerate(twins):
            try:
                got = twin()
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: stock, as promised
                warnings.warn(f"diffusion_int8: the one-launch twin of {what} failed ({type(exc).__name__}: {exc}); "
                              f"{what} runs as it is", RuntimeWarning, stacklevel=3)
                return want
            if (got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), nan)
                    and torch.equal(got.view(bits).masked_fill(nan, 0), want.view(bits).masked_fill(nan, 0))):
                matches.append(i)
                if not only_one:
                    break
        if len(matches) == 1 or (matches and not only_one):
            MATCHED[key] = matches[0]
        elif matches:  # several, on data that cannot tell them apart: the next call checks again
            del MATCHED[key]
        else:
            warnings.warn(f"diffusion_int8: the one-launch twin of {what} did not reproduce it ({detail()}); "
                          f"{what} runs as it is", RuntimeWarning, stacklevel=3)
    return want
