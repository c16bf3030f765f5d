"""Launch plans: an INT8 attention call worked out once per call signature, then replayed with little host time.

Triton's ``kernel[grid](...)`` binds and specializes every argument, looks the compiled kernel up and builds
its launch metadata on each call, tens of microseconds a launch, and a call makes up to three. A ``Plan``
records the first call of a signature (the kernels it launched, with what arguments, and the buffers it
allocated), lays those buffers out in one workspace, and replays later calls as one allocation and one
direct call of each compiled kernel's launcher, with only the pointers changed. The signature (shapes,
strides, dtypes, 16-byte alignment of every input, options) fixes everything else the kernels were
specialized for, so a replay launches exactly what the first call compiled.

The functions that launch kernels (``quantize.quantize_qkv``, ``attention.attend`` ...) take a ``Runner``:
``EAGER`` allocates and launches through Triton as usual; a ``Recorder`` does the same and remembers it.
"""

from __future__ import annotations

import copy
import ctypes
import functools
from typing import Any, Callable, NamedTuple

import torch

from . import cache
from .config import interpreting

_ALIGN = 256  # workspace buffers start on 256-byte boundaries, so their pointers keep any alignment


class Runner:
    """Allocates buffers and launches kernels for the launching functions."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)

    def launch(self, fn, grid: tuple[int, ...], args: tuple, options: dict) -> None:
        fn[grid](*args, **options)

    def constant(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, a tensor that outlives every call (a lookup table kept per device), to pass to a launch."""
        return t


EAGER = Runner()


class _Launch(NamedTuple):
    fn: Any
    grid: tuple[int, int, int]
    args: tuple
    options: dict
    kernel: Any  # the CompiledKernel the JIT returned (None in the interpreter)


class Recorder(Runner):
    """A ``Runner`` that also keeps what was allocated and launched, to build a ``Plan`` from."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, bool]] = []
        self.launches: list[_Launch] = []
        self.constants: dict[int, torch.Tensor] = {}  # ``constant`` tensors by data pointer: replayed as they are

    def constant(self, t):
        self.constants[t.data_ptr()] = t
        return t

    def empty(self, shape, dtype, device, zero=False):
        t = super().empty(shape, dtype, device, zero)
        self.buffers.append((t, zero))
        return t

    def launch(self, fn, grid, args, options):
        kernel = fn[grid](*args, **options)  # raises before anything is recorded if it cannot compile
        grid = tuple(grid) + (1,) * (3 - len(grid))
        # the launcher takes every parameter in order: those given by name too (Gluon's num_warps)
        args = tuple(args) + tuple(options[n] for n in fn.arg_names[len(args):])
        self.launches.append(_Launch(fn, grid, args, {k: v for k, v in options.items() if k not in fn.arg_names}, kernel))


class _Ptr(int):
    """A device address where a tensor is expected (tensor descriptors' ``base``)."""

    def data_ptr(self) -> int:
        return int(self)


class _Hole(NamedTuple):
    """An argument that changes between calls: a pointer into input ``ref`` or into the workspace (ref = -1)."""

    pos: int
    ref: int
    offset: int  # bytes from the input's data_ptr / the workspace's start
    view: tuple  # (shape, stride, dtype) of the tensor the first call passed, to rebuild it in the interpreter
    desc: Any  # the tensor descriptor whose base this is, or None


class _Step(NamedTuple):
    launch: _Launch
    holes: tuple[_Hole, ...]


class NotReplayable(Exception):
    """The first call passed a pointer the plan cannot derive from the inputs or the workspace."""


class InputsShareMemory(NotReplayable):
    """Two of this call's inputs start at one address (``int8_attention(x, x, x)``): a plan could not tell their
    pointers apart, but another call of the key may have distinct inputs."""


class Plan:
    """Replays a recorded call: ``plan(inputs)`` launches the recorded kernels on new inputs of the same signature.

    ``inputs`` is the same list of tensors (or None) the recorded call was given, in the same order.
    """

    def __init__(self, rec: Recorder, inputs: list[torch.Tensor | None]):
        self.device = next(t.device for t in inputs if t is not None)
        # zero-initialized buffers first, so one memset clears them all
        order = sorted(rec.buffers, key=lambda b: not b[1])
        offsets, size, self.zero_bytes = {}, 0, 0
        for t, zero in order:
            offsets[t.data_ptr()] = (size, t.untyped_storage().nbytes())
            size += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
            if zero:
                self.zero_bytes = size
        self.workspace_bytes = size  # 0: the kernels write only into the inputs (a one-launch twin's plan)
        starts = [None if t is None else t.data_ptr() for t in inputs]
        if len({s for s in starts if s is not None}) != sum(s is not None for s in starts):
            raise InputsShareMemory("two inputs share a data pointer")

        def hole(pos, t, desc=None):
            p = t.data_ptr()
            if p in starts:
                return _Hole(pos, starts.index(p), 0, (t.shape, t.stride(), t.dtype), desc)
            for start, (off, nbytes) in offsets.items():
                if start <= p < start + nbytes:
                    return _Hole(pos, -1, off + p - start, (t.shape, t.stride(), t.dtype), desc)
            raise NotReplayable(f"argument {pos} points at memory that is neither an input nor a buffer")

        self.interpret = interpreting()
        self.constants = tuple(rec.constants.values())  # kept alive here: the replay passes their pointers
        steps = []
        for launch in rec.launches:
            holes, args = [], list(launch.args)
            for pos, a in enumerate(launch.args):
                if isinstance(a, torch.Tensor) and a.data_ptr() in rec.constants:
                    args[pos] = a if self.interpret else a.data_ptr()
                elif isinstance(a, torch.Tensor):
                    holes.append(hole(pos, a))
                    args[pos] = None  # the plan keeps no input or buffer alive
                elif hasattr(a, "base") and isinstance(getattr(a, "base", None), torch.Tensor):  # tensor descriptor
                    desc = copy.copy(a)
                    desc.base = None
                    holes.append(hole(pos, a.base, desc))
                    args[pos] = None
            steps.append(_Step(launch._replace(args=tuple(args)), tuple(holes)))
        self.steps = tuple(steps)
        # what a replay reads, flattened: the kernel, its grid, the argument template and the holes to fill
        self._fast = tuple((st.launch.kernel, st.launch.grid, list(st.launch.args),
                            tuple((h.pos, h.ref, h.offset) for h in st.holes if h.desc is None),
                            tuple((h.pos, h.ref, h.offset, h.desc) for h in st.holes if h.desc is not None))
                           for st in steps)
        if not self.interpret:
            from triton import knobs
            from triton.runtime import driver

            self._hooks = knobs.runtime
            self._stream = driver.active.get_current_stream

    def __call__(self, inputs: list[torch.Tensor | None]) -> None:
        if not self.interpret and torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):  # the recorded kernels are loaded in the inputs' device's context
                return self(inputs)
        ws = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device) if self.workspace_bytes else None
        if self.interpret:
            if self.zero_bytes:
                ws[: self.zero_bytes].zero_()
            return self._interpret(ws, inputs)
        base = 0 if ws is None else ws.data_ptr()
        ptrs = [None if t is None else t.data_ptr() for t in inputs]
        stream = self._stream(self.device.index)
        if self.zero_bytes:
            _zero(ws, base, self.zero_bytes, stream)
        enter, leave = _active(self._hooks.launch_enter_hook), _active(self._hooks.launch_exit_hook)
        for k, grid, template, ptr_holes, desc_holes in self._fast:
            args = template.copy()
            for pos, ref, offset in ptr_holes:
                args[pos] = (base if ref < 0 else ptrs[ref]) + offset
            for pos, ref, offset, desc in desc_holes:
                args[pos] = d = copy.copy(desc)
                d.base = _Ptr((base if ref < 0 else ptrs[ref]) + offset)
            meta = k.launch_metadata(grid, stream, *args) if enter is not None else None
            k.run(grid[0], grid[1], grid[2], stream, k.function, k.packed_metadata, meta, enter, leave, *args)

    def _interpret(self, ws: torch.Tensor, inputs: list[torch.Tensor | None]) -> None:
        # The interpreter has no compiled launcher: each tensor argument is rebuilt as a view of the new input
        # or workspace, so the CPU tests run the plan's layout and pointer bookkeeping.
        for launch, holes in self.steps:
            args = list(launch.args)
            for h in holes:
                shape, stride, dtype = h.view
                src = ws if h.ref < 0 else inputs[h.ref]
                start = src.storage_offset() * src.element_size() + h.offset
                t = torch.empty(0, dtype=dtype, device=src.device).set_(
                    src.untyped_storage(), start // dtype.itemsize, shape, stride)
                if h.desc is not None:
                    desc = copy.copy(h.desc)
                    desc.base = t
                    t = desc
                args[h.pos] = t
            launch.fn[launch.grid](*args, **launch.options)


def _zero(ws: torch.Tensor, ptr: int, nbytes: int, stream: int) -> None:
    """Zero ``nbytes`` at device address ``ptr`` (inside ``ws``) on ``stream``: one driver memset, a few µs of host time
    less than ``Tensor.zero_``'s fill kernel; ``zero_`` where the CUDA driver library is not at hand (ROCm)."""
    memset = _driver_memset()
    if memset is None or memset(ptr, 0, nbytes, stream):
        # no driver library, or it refused: e.g. no current context on a thread whose CUDA calls so far all hit
        # the allocator's cache (zero_ makes it current; a real fault raises there)
        ws[:nbytes].zero_()


@functools.lru_cache(maxsize=None)
def _driver_memset():
    """The CUDA driver's ``cuMemsetD8Async`` through ctypes, or None where libcuda cannot be loaded."""
    if torch.version.hip is not None:
        return None
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemsetD8Async
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def _active(hook):
    """A launch hook, or None when there is none to call (Triton >= 3.4 keeps an empty ``HookChain``)."""
    return None if hook is None or (hasattr(hook, "calls") and not hook.calls) else hook


def plan_or_run(key: tuple, inputs: list, record: Callable[[Runner], None]) -> None:
    """Run one call: replay the plan ``cache`` holds for ``key`` if there is one, else run ``record(runner)``
    (which allocates and launches through the runner), keeping a plan of it for the next call with this key when
    it can be replayed."""
    plan = cache.ENTRIES.get(key)
    if plan is not None:
        return record(EAGER) if plan is _NO_PLAN else plan(inputs)
    rec = Recorder()
    record(rec)
    try:
        plan = Plan(rec, inputs)
    except InputsShareMemory:  # this call's, not the key's: a later call records again
        return
    except NotReplayable:  # remembered, so later calls of the key skip the recording
        plan = _NO_PLAN
    cache.remember(key, plan)


_NO_PLAN = object()  # a key whose calls cannot be replayed: they run through Triton's launcher
