"""Precisions, tile configuration and backend selection for the attention kernels.

Everything here is decided once per device and cached; on the hot path only the two environment
variables that override the backend and the 8-bit P·V format are read, as part of a call's cache key, so that a
changed setting takes effect at the next call.
"""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..caller import warn_user

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453  # the log-sum-exp comes back in natural-log units, as SDPA's
INT8_MAX = 127.0
# FP8 P·V: P is scaled by 2**FP8_P_SHIFT (through the softmax exponent's offset) before the e4m3
# cast, moving probabilities down to 2**-14 into e4m3's normal range; the row sum carries the same
# factor, so it cancels.
FP8_P_SHIFT = 8.0
FP8_MAX = 448.0
# Lower bound on a quantization range, so an all-zero block gets a finite scale.
AMAX_FLOOR = 1e-12
# Q·Kᵀ channel balance (``reference.balance_scales``): powers of two from 2**-15 to 2**15
BALANCE_MAX_LOG2 = 15
# ... applied to a channel only where Q's and K's ranges differ by more than this many binary orders
BALANCE_DEAD_BAND = 2
# Quantized Q/K/V buffers are padded to a multiple of this many tokens, so the attention
# kernel loads whole tiles without masks.
SEQ_PAD = 128
# Block-sparse attention: a block mask has one entry per SPARSE_BLOCK queries × SPARSE_BLOCK keys. Every kernel's
# query and key tiles divide it, so a skipped block is whole tiles that are never loaded.
SPARSE_BLOCK = 128
MAX_HEAD_DIM = 256
# Floor on a row's block maximum of P before INT8 P quantization (a fully masked block has max 0).
P_FLOOR = 1e-30
# Triton releases the kernels are tested with (pyproject.toml, docs/GUIDE.md "The attention op"); the sm_90 Gluon kernels
# fall back to the portable kernel, with a warning, on any release whose Gluon API they cannot use
TESTED_TRITON = "3.6.0 to 3.9.0"
# Compile with FMA contraction, as every Triton up to 3.9 does by default (3.9 warns that 3.10 will not):
# the kernels' rounding, which the emulation mirrors, is measured with it
FP_FUSION = True

ENV_BACKEND = "DIFFUSION_INT8_BACKEND"
ENV_PV8 = "DIFFUSION_INT8_PV8"


class Mode(str, enum.Enum):
    """Precision of one attention call."""

    INT8 = "int8"  # Q·Kᵀ INT8, P·V 8-bit (FP8 e4m3 on sm89+, INT8 elsewhere)
    INT8_FP16V = "int8_fp16v"  # Q·Kᵀ INT8, P·V in the input's 16-bit type
    FP16 = "fp16"  # exact: torch SDPA

    @classmethod
    def parse(cls, value: "str | Mode") -> "Mode":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"mode must be one of {[m.value for m in cls]}, got {value!r}"
            ) from None


class PV(str, enum.Enum):
    """Operand precision of the P·V product inside the kernel."""

    FP16 = "fp16"  # P cast to V's 16-bit type (fp16 or bf16), FP32 accumulation
    FP8 = "fp8"  # P·256 and per-channel-scaled V in e4m3, FP32 accumulation across blocks
    INT8 = "int8"  # P per row and block in INT8, per-channel-scaled V in INT8

    @property
    def code(self) -> int:
        """The kernels' constexpr for this format (0 fp16, 1 FP8, 2 INT8)."""
        return _PV_CODES[self]


_PV_CODES = {PV.FP16: 0, PV.FP8: 1, PV.INT8: 2}


class StaticRanges(NamedTuple):
    """Calibrated quantization inputs of one attention call (``Calibration.ranges`` gives them; float32 tensors
    broadcastable as ``int8_attention`` documents): Q's and K's ranges per head, (B, Hq) and (B, Hkv); V's per
    channel, (B, Hkv, D); K's smoothing vector, (B, Hkv, D); the Q·Kᵀ balance, (B, Hkv, D) (``int8_attention``'s
    ``qk_balance`` tensor; ``q_amax`` and ``k_amax`` are then of the balanced Q and K). Any may be None: measured in
    the call; for the balance, none (a call with static ranges measures none)."""

    q_amax: torch.Tensor | None = None
    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None
    qk_balance: torch.Tensor | None = None


class Backend(str, enum.Enum):
    TRITON = "triton"
    EMULATION = "emulation"


class Kernel(str, enum.Enum):
    """Every implementation an attention call can run (``kernel_info``'s ``kernel``). ``Backend.TRITON`` runs
    ``SM90_GLUON`` where it applies and can run, else ``TRITON``; ``Backend.EMULATION`` runs ``EMULATION``."""

    SM90_GLUON = "sm90_gluon"  # hopper.py: sm_90, no mask or a key mask, padded head dim 128, FP8 or 16-bit P·V
    TRITON = "triton"  # attention.py: the portable Triton kernel, every other call of the Triton backend
    EMULATION = "emulation"  # reference.emulate_attention: the kernels' numerics in PyTorch
    SDPA = "sdpa"  # mode fp16: torch's scaled_dot_product_attention


@dataclass(frozen=True)
class TileConfig:
    """Tiles of the portable attention kernel, and K's quantization, which follows them.

    K has ``k_groups`` scales per tile of ``block_n`` keys: 1, or 4 interleaved groups where key j of a
    tile is in group (j mod 8) div 2. Those are the columns one thread holds in the accumulator of an
    INT8 MMA (mma.sync m16n8k32 and wgmma alike give a thread columns 2t, 2t+1 of every 8), so a thread
    still multiplies its scores by one K scale per row (SageAttention2's per-thread quantization).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_groups: int


def fixed_answer(fn):
    """``functools.lru_cache(maxsize=None)`` for a question whose answer is fixed for the process (a device's
    capability, a type's signature; arguments and answer plain Python constants) or a warning given once, which
    ``torch.compile`` takes as a constant: dynamo calls it while tracing instead of tracing through the cache, which
    it warns about. ``cache_clear`` as lru_cache's. One Python frame (a warning's stack counts it); a dict of its own
    rather than a wrapped lru_cache, so an eager call pays one lookup, not two calls."""
    cache: dict = {}

    @torch.compiler.assume_constant_result
    @functools.wraps(fn)
    def answer(*args, **kwargs):
        key = (args, tuple(kwargs.items())) if kwargs else args
        try:
            return cache[key]
        except KeyError:
            cache[key] = value = fn(*args, **kwargs)
            return value

    answer.cache_clear = cache.clear
    return answer


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels compute with: the next power of two, at least 32 (INT8 MMA K-width)."""
    return max(32, 1 << (head_dim - 1).bit_length())


def tile_config(head_dim: int, pv: PV) -> TileConfig:
    """Tiles for one head dim and P·V precision.

    The table is fixed (not autotuned) because ``block_n`` and ``k_groups`` define K's quantization,
    which the emulation must reproduce; the entries come from same-run sweeps (``benchmarks/attention.py --sweep``).
    """
    dp = padded_head_dim(head_dim)
    if dp <= 64:
        # 4 K groups per tile: one scale per 64-key tile missed the accuracy bounds (tests/test_attention.py)
        # now and then at ~100 keys (a sink key inflates its tile's range), and per 128-key tile often; with 4
        # groups the worst of 300 draws keeps a margin at 128-key tiles too
        if pv is PV.FP16 and head_dim < 64:  # SD1.5's 40: 128-row tiles measured 8% faster
            return TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, k_groups=4)
        return TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, k_groups=4)
    if dp == 128:  # best at Flux (4608, 128); the sm_90 kernels read one K scale per tile
        if pv is PV.FP8:
            return TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, k_groups=1)
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, k_groups=1)
    return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, k_groups=1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@fixed_answer
def _triton_support(device_type: str, index: int | None, interpret: bool) -> str | None:
    """None when the Triton kernels can run on this device, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton ships with Linux torch
        return f"Triton is not importable ({exc})"
    if interpret:
        return None if device_type == "cpu" else "TRITON_INTERPRET=1 runs kernels on CPU tensors only"
    if device_type != "cuda":
        return f"the Triton kernels need a CUDA GPU, got a {device_type} tensor"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        name = torch.cuda.get_device_name(index)
        return f"{name} is sm_{major}{minor}; the INT8 kernels need sm_80 or newer"
    return None


@fixed_answer
def _warn_fallback(reason: str) -> None:
    warn_user(
        f"diffusion_int8: {reason}; using the PyTorch emulation of the INT8 kernel (same numerics, "
        f"much slower). Set {ENV_BACKEND}=emulation to silence this.")


def select_backend(device: torch.device, warn: bool = True) -> Backend:
    """The backend that runs INT8 modes on ``device``.

    ``DIFFUSION_INT8_BACKEND`` = ``triton`` | ``emulation`` | ``auto`` (default) overrides the choice.
    Asking for ``triton`` where it cannot run raises, naming the device and what is missing. Falling back to the
    emulation warns once, unless ``warn`` is False (a question about the backend, not a call).
    """
    requested = _requested_backend()
    if requested not in ("auto", "triton", "emulation"):
        raise ValueError(f"{ENV_BACKEND} must be auto, triton or emulation, got {requested!r}")
    if requested == "emulation":
        return Backend.EMULATION
    reason = _triton_support(device.type, device.index, interpreting())
    if reason is None:
        return Backend.TRITON
    if requested == "triton":
        raise RuntimeError(f"{ENV_BACKEND}=triton, but {reason}")
    if warn:
        _warn_fallback(reason)
    return Backend.EMULATION


def _requested_backend() -> str:
    return os.environ.get(ENV_BACKEND, "auto").lower()


def triton_unavailable(device: torch.device) -> str | None:
    """Why a Triton kernel should not run on ``device``'s tensors (``select_backend`` would not pick it), or None;
    never raises nor warns, for launches that have a stock alternative (``rope``)."""
    if _requested_backend() == "emulation":
        return f"{ENV_BACKEND}=emulation"
    return _triton_support(device.type, device.index, interpreting())


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA sm_90 GPU (H100, H200): the one the Gluon kernels and the tuned launch options
    are for. ROCm devices, whose capability can also read (9, 0), are not."""
    return device.type == "cuda" and _is_sm90(device.index)


@fixed_answer
def _is_sm90(index: int | None) -> bool:  # asked once per device, not per call
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


@fixed_answer
def _has_fp8(device_type: str, index: int | None) -> bool:
    return device_type != "cuda" or torch.cuda.get_device_capability(index) >= (8, 9)


def default_pv8(device: torch.device) -> PV:
    """The 8-bit P·V format of mode ``int8``: FP8 e4m3 on sm89+ (and on CPU), INT8 before that.

    ``DIFFUSION_INT8_PV8`` = ``fp8`` | ``int8`` (any case) overrides it.
    """
    forced = os.environ.get(ENV_PV8, "").lower()
    if forced:
        if forced not in ("fp8", "int8"):
            raise ValueError(f"{ENV_PV8} must be fp8 or int8, got {forced!r}")
        return PV(forced)
    return PV.FP8 if _has_fp8(device.type, device.index) else PV.INT8


def pv_for_mode(mode: Mode, device: torch.device) -> PV:
    if mode is Mode.INT8_FP16V:
        return PV.FP16
    if mode is Mode.INT8:
        return default_pv8(device)
    raise ValueError(f"{mode} has no quantized P·V")
