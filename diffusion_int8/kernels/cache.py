"""The kernels' one cache by call signature, bounded, with a public ``clear()``.

``int8_attention`` keeps what its checks decided for a signature (``("call", ...)`` keys) and the Triton path the
launch plan it recorded for it (``("plan", ...)`` keys, ``launch.Plan``): a call whose signature was seen before
skips both the checks and the recording. A signature names the inputs' shapes, strides, dtypes, devices and
alignment and the call's options, never tensor values. ``clear()`` forgets every entry: benchmarks that time
first calls call it, and so does anything that changes what a signature would plan (the tile table, the
environment's backend choice).
"""

from __future__ import annotations

import torch

MAX_ENTRIES = 4096
ENTRIES: dict[tuple, object] = {}


def remember(key: tuple, value: object) -> None:
    """Keep ``value`` for ``key``; a full cache is emptied first (signatures come back as they are used)."""
    if len(ENTRIES) >= MAX_ENTRIES:
        ENTRIES.clear()
    ENTRIES[key] = value


def clear() -> None:
    """Forget every checked call and recorded launch plan."""
    ENTRIES.clear()


def signature(t: torch.Tensor | None):
    """What a launch is specialized on, of one input: shape, strides, dtype, device, 16-byte alignment."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0
