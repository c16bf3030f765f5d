"""The speed gate: INT8 attention only for call shapes where it beats SDPA on this GPU.

A crossover table holds, per INT8 mode, head dim and 16-bit dtype, the speed of the whole INT8 call (its
quantization included) relative to ``F.scaled_dot_product_attention`` on a grid of key lengths and query
rows (batch × heads × queries), measured on one GPU from CUDA-graph replays, for three kinds of call (``KINDS``):
lengths that are whole 128-key tiles, lengths that leave a partial tile, and a key mask (text padding), since SDPA
loses speed to the latter two and the INT8 kernels much less. A call runs INT8 when a
least-squares surface through the grid (``Grid``: it smooths the cells' few percent of scatter) gives its shape a
speed-up of at least ``margin``; elsewhere, and below the grid, it runs SDPA, which is exact. The cells are GPU time:
an eager call (not captured in a CUDA graph, not traced by torch.compile) must also save ``EAGER_SAVING_MS`` of it, for
the host time an INT8 call adds (``CrossoverTable.saved_ms`` estimates the saving from below). Tables ship for sm_90
(``tables/``: one for the architecture and one per GPU measured apart); ``diffusion-int8 tune`` measures one for any
other GPU and caches it (``cache_path``); a shipped or cached table measured with another Triton release than the
installed one judges calls with a wider margin (``for_this_triton``). The gate never benchmarks inside a call.
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
import re
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..caller import warn_user
from .. import jsonfile
from ..kernels.config import MAX_HEAD_DIM, Mode, padded_head_dim
from ..kernels.key_mask import is_key_mask

FORMAT = "diffusion-int8 crossover table"
VERSION = 2  # 2: grids of each kind of call (``Grid.kind``); version 1 files (plain grids only) still load
READS = (1, 2)
SHIPPED = Path(__file__).parent / "tables"
# The measured Q·Kᵀ balance's share of an INT8 call at 4,096 keys (tables are measured without it). It is one more
# pass over Q and K, O(S·D) against attention's O(S²·D), so its share falls as 1/keys; BENCHMARKS.md ("Outlier
# channels: the Q·Kᵀ balance") has the measurements this rounds up.
BALANCE_COST_4096 = 0.045
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # the dtypes a table measures, by their names
# The kinds of call a grid measures: "plain", no mask and lengths of whole 128-key tiles (the powers of two of the
# grid); "tail", no mask and lengths that leave a partial 128-key tile (the grid's plus ``TAIL_KEYS``); "key", a key
# mask (``MASKED_KEYS`` masked) at the plain lengths. On an H200 SDPA ran about 15% slower per multiply-add past whole
# tiles (median, head dim 64) and 1.4-1.7 times slower with a mask (BENCHMARKS.md, "The speed gate").
KINDS = ("plain", "tail", "key")
SDPA_TILE = 128
# Tail grids are measured and read at padded head dim 64 only. There SDPA's loss past whole tiles was steady at the
# remainders checked, 32, 64 and 77 tokens (INT8 1.13-1.19x SDPA at 4,128-4,685 tokens, 1.02-1.06x at 4,096-4,608 in
# whole tiles); at 128 it moved with the remainder (0.99-1.09x), so one measured remainder would not judge the others
# (BENCHMARKS.md).
TAIL_HEAD_DIM = 64
# Eager calls: an INT8 call spends more host time than SDPA's (its launches and their bookkeeping), from 25 µs more on
# an H100's host to 200 µs on the H200 machine's, whose host is slower (BENCHMARKS.md "Host time of an eager call"),
# and in eager mode an image model's step often waits on the host (SD3.5-medium at 1024² on that H200: 40 ms of GPU
# work a step, 46-99 ms of host time), where that time is the step's and a few hundredths of a millisecond of GPU
# time saved are not. Outside CUDA graphs and torch.compile a call therefore runs INT8 only if it also saves
# ``EAGER_SAVING_MS`` of GPU time as ``CrossoverTable.saved_ms`` estimates it, from below (SDPA ran SD3.5 Large's
# call at 406 TFLOPS on the H200, so its saving is 1.7 times the estimate).
EAGER_SAVING_MS = 0.1
# SDPA's fastest rate (TFLOPS) by architecture, for tables that do not record their own (``measured["sdpa_tflops"]``):
# above what SDPA reached on an H200 (680 at head dim 128, 8K tokens; less at 64 and on an H100), so that SDPA's time
# and a call's saving are estimated from below; elsewhere a rate above any GPU's so far.
SDPA_TFLOPS = {"sm_90": 700.0}
OTHER_SDPA_TFLOPS = 2000.0
# decisions a gate keeps (by call shape, dtype, device, kind and eager) before it forgets them all
_MAX_DECISIONS = 4096
# A table the gate finds (shipped or cached) that was measured with another Triton release (``measured["triton"]``,
# major.minor) judges calls at its margin times this, which keeps the margin over the speed a release can take away:
# on an H200, Triton 3.9 ran the whole head-dim-64 call 4% slower than 3.6, which measured the shipped tables (the
# head-dim-128 call within 3%; BENCHMARKS.md, "Triton 3.9"). TMA tiles closed that gap only for long FP8 P·V calls
# (``attention.tma_tiles``); shorter ones, the gate's crossovers among them, and ``int8_fp16v`` keep it.
OTHER_RELEASE_SLACK = 1.04


@dataclass(frozen=True)
class Grid:
    """Speed-ups of one (mode, head dim, dtype, kind of call): ``speedup[i][j]`` at ``keys[i]`` keys and ``rows[j]``
    query rows (SDPA's time over the INT8 call's, both on the same call; None where not measured). ``kind``: one of
    ``KINDS``, as ``measure`` times them (a "tail" grid's axes are the plain lengths its calls extend).

    Decisions read a least-squares surface through the measured cells, not the cells themselves: each cell is one
    median with a few percent of scatter, and a surface in (log2 keys, log2 rows), quadratic in keys, linear in
    rows, with their product, follows the trend (longer sequences amortize the quantization) without
    flipping on one noisy cell. Smaller grids get fewer terms: a 2 × 2 grid is interpolated bilinearly, one cell
    is a constant.
    """

    mode: str
    head_dim: int
    dtype: str
    keys: tuple[int, ...]
    rows: tuple[int, ...]
    speedup: tuple[tuple[float | None, ...], ...]
    kind: str = "plain"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {list(KINDS)}")
        terms, coef = _fit_surface(self)
        # the surface on a lattice of eighth-octave steps over the grid, so a call is judged by comparisons alone:
        # under torch.compile they guard on ranges of the shape, where arithmetic on it would fix each value
        key_edges, row_edges = _edges(self.keys), _edges(self.rows)
        values = tuple(tuple(sum(c * t for c, t in zip(coef, _terms(terms, _unit(n, self.keys), _unit(r, self.rows))))
                             for r in row_edges) for n in key_edges)
        # the same with the balance measured in the call: its cost at each key edge (at or below the call's keys,
        # so never less than the call's own)
        balanced = tuple(tuple(v / (1 + balance_cost(n)) for v in row) for n, row in zip(key_edges, values))
        object.__setattr__(self, "_lattice", (key_edges, row_edges, values, balanced))

    def at(self, sk: int, rows: int, balance: bool = False) -> float | None:
        """The fitted speed-up at ``sk`` keys and ``rows`` query rows (at the lattice point at or below them, an
        eighth of an octave apart); past the grid, that of its edge; None below it (fewer keys or rows than its
        first). ``balance``: of a call that measures the Q·Kᵀ balance (``balance_cost``). (Plain comparisons, which
        torch.compile traces into range guards.)"""
        key_edges, row_edges, values, balanced = self._lattice
        i = sum(1 for e in key_edges if e <= sk) - 1
        j = sum(1 for e in row_edges if e <= rows) - 1
        return None if i < 0 or j < 0 else (balanced if balance else values)[i][j]


def balance_cost(sk: float) -> float:
    """What measuring the Q·Kᵀ balance adds to an INT8 call with ``sk`` keys, as a fraction of the call."""
    return BALANCE_COST_4096 * 4096 / sk


def _edges(axis: tuple[int, ...], per_octave: int = 8) -> tuple[float, ...]:
    """Eighth-octave points from the axis' first value to its last (inclusive)."""
    steps = round(math.log2(axis[-1] / axis[0]) * per_octave)
    return tuple(axis[0] * 2 ** (i / per_octave) for i in range(steps + 1))


def _unit(n: float, axis: tuple[int, ...]) -> float:
    """log2(n) mapped to [0, 1] over the axis (0 for a one-point axis), which keeps the fit well conditioned."""
    lo, hi = math.log2(axis[0]), math.log2(axis[-1])
    return 0.0 if hi == lo else (math.log2(n) - lo) / (hi - lo)


def _terms(names: tuple[str, ...], x: float, y: float) -> list[float]:
    values = {"1": 1.0, "x": x, "xx": x * x, "y": y, "xy": x * y}
    return [values[n] for n in names]


def _fit_surface(g: Grid) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Least-squares coefficients of the speed-up over (x, y), log2 keys and log2 rows mapped to [0, 1], for the
    measured cells of ``g``, with the terms its size supports (at most as many as measured cells)."""
    cells = [(_unit(n, g.keys), _unit(r, g.rows), s) for n, row in zip(g.keys, g.speedup) for r, s in zip(g.rows, row)
             if s is not None]
    names = ["1"]
    if len(g.keys) >= 2:
        names.append("x")
    if len(g.keys) >= 3:
        names.append("xx")
    if len(g.rows) >= 2:
        names.append("y")
        if len(g.keys) >= 2:
            names.append("xy")
    for drop in ("xy", "xx", "y", "x"):  # too few measured cells for every term
        if len(names) > len(cells) and drop in names:
            names.remove(drop)
    if not cells:
        return ("1",), (0.0,)
    a = np.array([_terms(names, x, y) for x, y, _ in cells])
    coef = np.linalg.lstsq(a, np.array([s for _, _, s in cells]), rcond=None)[0]
    return tuple(names), tuple(float(c) for c in coef)


@dataclass(frozen=True)
class CrossoverTable:
    """Where INT8 attention pays on one GPU. ``device`` names it, ``arch`` is ``sm_XY``."""

    device: str
    arch: str
    grids: tuple[Grid, ...]
    margin: float = 1.03
    # torch / triton versions, the date and, from ``measure``, SDPA's fastest rate (``sdpa_tflops``), which eager
    # calls' decisions read
    measured: dict = field(default_factory=dict)

    def __post_init__(self):
        rate = self.measured.get("sdpa_tflops")
        if rate is not None and not (_number(rate) and rate > 0):
            raise ValueError(f"measured.sdpa_tflops must be a finite positive number (TFLOPS), got {rate!r}")

    def speedup(self, mode: str, head_dim: int, dtype: torch.dtype, rows: int, sk: int,
                balance: bool = False, kind: str = "plain") -> float | None:
        """The measured speed-up that judges a call (``balance``: one that measures the Q·Kᵀ balance, its cost
        taken off; ``kind``: the call's, ``kind_of_call``'s, judged by the grids of that kind where the table has
        them (tail grids at padded head dim ``TAIL_HEAD_DIM`` only), else by the plain ones, which understate what
        INT8 gains there), or None when no grid covers it."""
        dt = str(dtype).removeprefix("torch.")
        if kind == "tail" and padded_head_dim(head_dim) != TAIL_HEAD_DIM:
            kind = "plain"
        grid = self._grid(mode, head_dim, dt, kind) or self._grid(mode, head_dim, dt, "plain")
        return None if grid is None else grid.at(sk, rows, balance)

    def pays(self, mode: str, head_dim: int, dtype: torch.dtype, rows: int, sk: int, balance: bool = False,
             kind: str = "plain", min_saving_ms: float = 0.0) -> bool:
        """Whether the speed-up (``speedup``) reaches the table's margin and, with ``min_saving_ms``, the call also
        saves that much GPU time by ``saved_ms``'s estimate (the gate asks it of eager calls)."""
        s = self.speedup(mode, head_dim, dtype, rows, sk, balance, kind)
        if s is None or s < self.margin:
            return False
        return min_saving_ms <= 0 or self.saved_ms(s, head_dim, rows, sk) >= min_saving_ms

    @property
    def sdpa_tflops(self) -> float:
        """SDPA's fastest rate in this table's measurements, TFLOPS (``measure`` records it), else its
        architecture's (``SDPA_TFLOPS``)."""
        return self.measured.get("sdpa_tflops") or SDPA_TFLOPS.get(self.arch, OTHER_SDPA_TFLOPS)

    def saved_ms(self, speedup: float, head_dim: int, rows: int, sk: int) -> float:
        """The GPU time, ms, a call of ``rows`` query rows (batch × heads × queries) over ``sk`` keys saves at
        ``speedup``, estimated from below: SDPA's time as its FLOPs at ``sdpa_tflops``."""
        return attention_flops(rows, sk, head_dim) / (self.sdpa_tflops * 1e9) * (1 - 1 / speedup)

    def _grid(self, mode: str, head_dim: int, dtype: str, kind: str) -> Grid | None:
        # the same head dim, else one the kernel pads to the same width; the same dtype, else the other 16-bit one
        dp = padded_head_dim(head_dim)
        same = [g for g in self.grids if g.mode == mode and g.kind == kind and padded_head_dim(g.head_dim) == dp]
        exact = [g for g in same if g.head_dim == head_dim] or same
        return next((g for g in exact if g.dtype == dtype), exact[0] if exact else None)

    # -- files --
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "device": self.device, "arch": self.arch, "margin": self.margin,
                "measured": self.measured,
                "grids": [{"mode": g.mode, "head_dim": g.head_dim, "dtype": g.dtype, "kind": g.kind,
                           "keys": list(g.keys), "rows": list(g.rows), "speedup": [list(r) for r in g.speedup]}
                          for g in self.grids]}

    def save(self, path: str | Path) -> None:
        """Write atomically (``jsonfile.write``), making the directory if missing."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        jsonfile.write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "CrossoverTable":
        """Read and validate a table file; errors name the file and what is wrong."""
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a readable crossover table ({exc})") from None
        data = jsonfile.loads(text, f"{path}: not a crossover table")
        try:
            return cls._from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: invalid crossover table: {exc}") from None

    @classmethod
    def _from_json(cls, data) -> "CrossoverTable":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"expected a JSON object with \"format\": {FORMAT!r}")
        if data.get("version") not in READS:
            raise ValueError(f"version {data.get('version')!r} is not supported (this release reads "
                             f"{' and '.join(map(str, READS))})")
        if not isinstance(data.get("arch"), str) or not re.fullmatch(r"sm_\d+", data["arch"]):
            raise ValueError(f"arch must name a CUDA architecture such as 'sm_90', got {data.get('arch')!r}")
        if not isinstance(data.get("device"), str):
            raise ValueError(f"device must be the GPU's name, got {data.get('device')!r}")
        if not isinstance(data.get("grids"), list):
            raise ValueError(f"grids must be a list, got {type(data.get('grids')).__name__}")
        grids, seen = [], set()
        for n, g in enumerate(data["grids"]):
            if not isinstance(g, dict):
                raise ValueError(f"grid {n} must be a JSON object, got {type(g).__name__}")
            Mode.parse(g["mode"])
            if g["mode"] == "fp16":
                raise ValueError(f"grid {n}: mode 'fp16' needs no gate")
            if g["dtype"] not in DTYPES:
                raise ValueError(f"grid {n}: dtype {g['dtype']!r} is not one of {sorted(DTYPES)}")
            head_dim = g["head_dim"]
            if not _count(head_dim) or not head_dim <= MAX_HEAD_DIM:
                raise ValueError(f"grid {n}: head_dim {head_dim!r} is not an integer in 1..{MAX_HEAD_DIM}")
            extra = sorted(set(g) - _GRID_FIELDS)
            if extra:
                raise ValueError(f"grid {n}: unknown field(s) {extra} (a grid has {sorted(_GRID_FIELDS)})")
            kind = g.get("kind", "plain")
            if kind not in (KINDS if data["version"] >= 2 else ("plain",)):
                raise ValueError(f"grid {n}: kind {kind!r} is not one of {list(KINDS)}"
                                 + (" (version 1 files have plain grids only)" if kind in KINDS else ""))
            if (g["mode"], head_dim, g["dtype"], kind) in seen:
                raise ValueError(f"grid {n}: a second grid for mode {g['mode']!r}, head_dim {head_dim}, dtype "
                                 f"{g['dtype']!r}, kind {kind!r}; each may have one")
            seen.add((g["mode"], head_dim, g["dtype"], kind))
            for axis in ("keys", "rows"):
                values = g[axis]
                if not isinstance(values, list) or not values or not all(map(_count, values)) \
                        or values != sorted(set(values)):
                    raise ValueError(f"grid {n}: {axis} must be a non-empty, strictly increasing list of integers > 0, "
                                     f"got {values!r}")
            keys, rows = tuple(g["keys"]), tuple(g["rows"])
            speedup = g["speedup"]
            if not isinstance(speedup, list) or len(speedup) != len(keys) \
                    or any(not isinstance(r, list) or len(r) != len(rows) for r in speedup):
                raise ValueError(f"grid {n}: speedup must be {len(keys)} × {len(rows)} (keys × rows)")
            bad = next((x for r in speedup for x in r if x is not None and not (_number(x) and x > 0)), None)
            if bad is not None:
                raise ValueError(f"grid {n}: speed-ups must be finite positive numbers or null, got {bad!r}")
            grids.append(Grid(g["mode"], head_dim, g["dtype"], keys, rows,
                              tuple(tuple(None if x is None else float(x) for x in r) for r in speedup), kind))
        margin = data.get("margin", 1.03)
        if not (_number(margin) and margin > 0):
            raise ValueError(f"margin must be a finite positive number, got {margin!r}")
        measured = data.get("measured", {})
        if not isinstance(measured, dict):
            raise ValueError(f"measured must be a JSON object, got {type(measured).__name__}")
        return cls(data["device"], data["arch"], tuple(grids), float(margin), measured)


_GRID_FIELDS = {"mode", "head_dim", "dtype", "kind", "keys", "rows", "speedup"}


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def attention_flops(rows: int, sk: int, head_dim: int) -> int:
    """FLOPs of attention over ``rows`` query rows and ``sk`` keys: Q·Kᵀ and P·V, two per multiply-add."""
    return 4 * rows * sk * head_dim


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def device_slug(name: str) -> str:
    """A GPU's name as a file name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def cache_path(device: torch.device) -> Path:
    """Where ``diffusion-int8 tune`` keeps the table of this GPU (``$DIFFUSION_INT8_CACHE`` or ~/.cache)."""
    root = os.environ.get("DIFFUSION_INT8_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "diffusion_int8")
    return Path(root) / f"crossover-{device_slug(torch.cuda.get_device_name(device))}-{arch_of(device)}.json"


def shipped_path(arch: str, device_name: str | None = None) -> Path:
    """The table shipped for GPUs of ``arch`` (``tables/sm_90.json``), or for the one GPU named ``device_name``
    (``tables/sm_90-nvidia-h200.json``)."""
    return SHIPPED / (f"{arch}-{device_slug(device_name)}.json" if device_name else f"{arch}.json")


class SpeedGate:
    """Decides per call whether INT8 pays, from the table for the call's GPU (loaded once per device).

    ``table``: a ``CrossoverTable`` or its file for every device; None finds one per device: the table
    ``diffusion-int8 tune`` cached for this GPU, else the one shipped for its architecture, else none, and
    then every call runs SDPA (one warning, when the gate is made, says how to measure a table). Without a
    ``table``, calls on CPU tensors (the emulation, which exists for correctness and quality checks) are not
    gated; a given table gates every device.

    ``eager_saving_ms``: the GPU time a call made in eager mode (on a GPU, outside CUDA-graph capture and
    torch.compile) must also save to run INT8, as ``CrossoverTable.saved_ms`` estimates it (``EAGER_SAVING_MS``;
    0 judges eager calls by the speed-up alone).
    """

    def __init__(self, table: CrossoverTable | str | Path | None = None, eager_saving_ms: float = EAGER_SAVING_MS):
        if not (_number(eager_saving_ms) and eager_saving_ms >= 0):
            raise ValueError(f"eager_saving_ms must be a finite number >= 0 (milliseconds), got {eager_saving_ms!r}")
        self.eager_saving_ms = float(eager_saving_ms)
        if isinstance(table, (str, Path)):
            table = CrossoverTable.load(table)
        if table is not None and not isinstance(table, CrossoverTable):
            raise TypeError(f"table must be a CrossoverTable or its file, got {type(table).__name__}")
        if table is not None and torch.cuda.is_available():
            archs = {arch_of(torch.device("cuda", i)) for i in range(torch.cuda.device_count())}
            if table.arch not in archs:
                warnings.warn(f"diffusion_int8: the crossover table given was measured on {table.device} "
                              f"({table.arch}); this machine's GPUs are {', '.join(sorted(archs))}, where its "
                              f"speed-ups may not hold", RuntimeWarning, stacklevel=2)
        self._fixed = table
        self._tables: dict[int | None, CrossoverTable | None] = {}
        self._decisions: dict[tuple, bool] = {}
        if table is None and torch.cuda.is_available():  # read now: torch.compile cannot trace file reads
            for i in range(torch.cuda.device_count()):
                self._tables[i] = _find_table(torch.device("cuda", i))

    def table_for(self, device: torch.device) -> CrossoverTable | None:
        if self._fixed is not None:
            return self._fixed
        if device.index not in self._tables:
            self._tables[device.index] = _find_table(device)
        return self._tables[device.index]

    def pays(self, mode: Mode, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
             balance: bool = False, eager: bool | None = None) -> bool:
        """Whether ``mode`` beats SDPA for (B, H, S, D) ``q`` and ``k`` (BHSD views) with ``attn_mask`` on their
        device. The call is judged as it will run, by the table's grids of its kind (``kind_of_call``): unmasked,
        or with a key mask (the same for every query: a text padding mask), which the kernels run at their unmasked
        speed while SDPA loses its fastest kernels to it; with a mask that varies over the queries, which the
        kernels apply element by element (unmeasured, and far slower), never. ``balance``: the call measures the
        Q·Kᵀ balance, whose cost (``balance_cost``) the table's speed-up must cover too. In eager mode the call
        must also save ``eager_saving_ms`` of GPU time, for the host time it adds over SDPA's; ``eager``: whether
        the call is judged as an eager one (None: as it runs, ``eager_call``; False: as in a CUDA graph). A call
        torch.compile traces is judged by the table alone, whatever ``eager`` says."""
        if q.device.type != "cuda" and self._fixed is None:
            return True
        B, H, Sq, D = q.shape
        if attn_mask is not None and not is_key_mask(attn_mask.shape, B, H):
            return False
        kind = kind_of_call(Sq, k.shape[2], attn_mask is not None)
        if torch.compiler.is_compiling():  # traced once per graph; a dict keyed by the shape would fix its values
            table = self.table_for(q.device)
            return table is not None and table.pays(mode.value, D, q.dtype, B * H * Sq, k.shape[2], balance, kind)
        eager = eager_call(q) if eager is None else eager
        key = (mode, q.dtype, q.device, B * H * Sq, k.shape[2], D, balance, kind, eager)
        decision = self._decisions.get(key)
        if decision is None:
            if len(self._decisions) >= _MAX_DECISIONS:  # every shape of a long-running server: start again
                self._decisions.clear()
            table = self.table_for(q.device)
            decision = table is not None and table.pays(mode.value, D, q.dtype, B * H * Sq, k.shape[2], balance,
                                                        kind, self.eager_saving_ms if eager else 0.0)
            self._decisions[key] = decision
        return decision


def eager_call(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs eagerly on a GPU, where the host time of its launches can be the step's: not
    traced by torch.compile, not captured into a CUDA graph (a CPU build's fake CUDA tensors are not on a GPU).
    Under torch.compile it is False before anything else is asked: dynamo breaks the graph at the other checks."""
    return (not torch.compiler.is_compiling() and x.device.type == "cuda" and torch.backends.cuda.is_built()
            and not torch.cuda.is_current_stream_capturing())


def kind_of_call(sq: int, sk: int, key_mask: bool) -> str:
    """The kind of grid (``KINDS``) that judges a call with ``sq`` queries and ``sk`` keys: "key" with a key mask,
    "tail" where neither length is whole 128-key tiles (both, since the tail grids are measured on self-attention),
    else "plain". (Plain comparisons and a remainder, which torch.compile traces into guards.)"""
    if key_mask:
        return "key"
    return "tail" if sq % SDPA_TILE != 0 and sk % SDPA_TILE != 0 else "plain"


_KIND_WORDS = "plain: whole 128-key tiles; tail: a partial last tile; key: a key mask"


def _find_table(device: torch.device) -> CrossoverTable | None:
    if torch.version.hip is not None:  # ROCm reports capabilities that look like NVIDIA's (gfx90a as 9.0)
        return _no_table(device)
    path = cache_path(device)
    if path.exists():
        try:
            table = CrossoverTable.load(path)
            if table.arch != arch_of(device):
                raise ValueError(f"{path}: measured on {table.arch}, and this GPU is {arch_of(device)}")
            missing = [k for k in KINDS if not any(g.kind == k for g in table.grids) and (k != "tail" or any(
                g.kind == "plain" and padded_head_dim(g.head_dim) == TAIL_HEAD_DIM for g in table.grids))]
            lacks = []
            if missing:
                lacks.append(f"no cells of the kinds {', '.join(missing)} ({_KIND_WORDS}), so those calls are "
                             f"judged by its plain cells")
            if "sdpa_tflops" not in table.measured:
                lacks.append(f"no SDPA rate (measured.sdpa_tflops), so eager calls' savings are judged at "
                             f"{table.sdpa_tflops:.0f} TFLOPS")
            if lacks:
                warn_user(f"diffusion_int8: the cached crossover table {path} has {'; and '.join(lacks)}: calls may "
                          f"run SDPA where INT8 could pay. Run `diffusion-int8 tune --overwrite` to measure them.")
            return for_this_triton(table)
        except ValueError as exc:
            warn_user(f"diffusion_int8: ignoring the cached crossover table: {exc}. Run `diffusion-int8 tune "
                      f"--overwrite` to measure it again.")
    for shipped in (shipped_path(arch_of(device), torch.cuda.get_device_name(device)), shipped_path(arch_of(device))):
        if shipped.exists():
            return for_this_triton(CrossoverTable.load(shipped))
    return _no_table(device)


def for_this_triton(table: CrossoverTable) -> CrossoverTable:
    """``table``, with its margin times ``OTHER_RELEASE_SLACK`` where it was measured with another Triton release (its
    major.minor) than the one installed: the shipped tables and a cached one after an upgrade judge calls with room
    for the kernels' speed to have moved. ``diffusion-int8 tune --overwrite`` measures one with this release."""
    measured, installed = table.measured.get("triton"), _triton_release()
    if not isinstance(measured, str) or installed is None or measured.split(".")[:2] == installed.split(".")[:2]:
        return table
    return replace(table, margin=table.margin * OTHER_RELEASE_SLACK)


def _triton_release() -> str | None:
    try:
        import triton
    except ImportError:  # no kernels to gate
        return None
    return triton.__version__


def _no_table(device: torch.device) -> None:
    warn_user(
        f"diffusion_int8: no crossover table for {torch.cuda.get_device_name(device)} ({arch_of(device)}), so the speed "
        f"gate runs every attention call in SDPA. Run `diffusion-int8 tune` once to measure where INT8 pays on this "
        f"GPU (a few minutes), or pass speed_gate=False to enable() to force INT8.")
    return None


# -- measuring a table --

KEYS = (1024, 2048, 4096, 8192, 16384, 32768)
ROWS = (1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21)


# Keys a measured key mask masks, at the end: fewer than a key tile, so the INT8 kernels skip no tile for it (real text
# padding often lets them skip some) while SDPA takes its masked path all the same.
MASKED_KEYS = 48
# Keys a "tail" cell adds to the plain length: half a tile past the last whole one.
TAIL_KEYS = 64


def measure(device: torch.device, head_dims=(64, 128), dtypes=("float16", "bfloat16"),
            modes=("int8", "int8_fp16v"), keys=KEYS, rows=ROWS, kinds=KINDS, reps: int = 20,
            max_work: float = 2**41, progress=print) -> CrossoverTable:
    """Time SDPA and each INT8 mode on self-attention shapes (keys × rows grid; cells past ``max_work``
    multiply-adds are left unmeasured; the fitted surface covers them) and return the table. Inputs are
    laid out as diffusers passes them: (B, S, H, D) memory seen as (B, H, S, D). ``kinds`` (of ``KINDS``; ``tune``
    measures them all, and a table needs the plain ones: other kinds alone give grids to add to a table): "plain" at
    the grid's lengths; "tail" at each length plus ``TAIL_KEYS`` with the same heads, at head dims that pad to
    ``TAIL_HEAD_DIM`` (the only ones it judges); "key" at the grid's lengths with a bool key mask (1, 1, 1, keys)
    masking the last ``MASKED_KEYS``, as a padded prompt's joint attention carries."""
    import triton

    grids = []
    if not kinds or any(x not in KINDS for x in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must be some of {list(KINDS)}, each once, got {list(kinds)}")
    if "key" in kinds and min(keys) <= MASKED_KEYS:
        raise ValueError(f"a key mask masks the last {MASKED_KEYS} keys: every key length must exceed it, got "
                         f"{min(keys)}")
    if any(n % SDPA_TILE for n in keys):
        raise ValueError(f"the plain lengths must be whole {SDPA_TILE}-key tiles, got {list(keys)}")
    cells = [(d, dt, n, r) for d in head_dims for dt in dtypes for n in keys for r in rows]
    todo = [c for c in cells if c[3] >= c[2] and c[3] * c[2] * c[0] <= max_work]
    results: dict[tuple, dict[str, float]] = {}
    sdpa_tflops = 0.0  # SDPA's fastest rate over the cells (``CrossoverTable.sdpa_tflops``)
    t0 = time.time()
    for i, (d, dt, n, r) in enumerate(todo):
        line = []
        for kind in (k for k in kinds if k != "tail" or padded_head_dim(d) == TAIL_HEAD_DIM):
            sk = n + TAIL_KEYS if kind == "tail" else n
            times = _time_cell(device, d, DTYPES[dt], sk, r // n, kind == "key", modes, reps)
            results[(d, dt, n, r, kind)] = times
            sdpa_tflops = max(sdpa_tflops, attention_flops(r // n * sk, sk, d) / (times["sdpa"] * 1e9))
            line.append(f"{kind}: sdpa {times['sdpa']:.3f} ms, "
                        + ", ".join(f"{m} {times['sdpa'] / times[m]:.2f}×" for m in modes))
        progress(f"[{i + 1}/{len(todo)}] head dim {d}, {dt}, {n} keys × {r} rows: " + "; ".join(line)
                 + f"  ({time.time() - t0:.0f} s)")
    for kind in kinds:
        for m in modes:
            for d in (d for d in head_dims if kind != "tail" or padded_head_dim(d) == TAIL_HEAD_DIM):
                for dt in dtypes:
                    speedup = tuple(tuple(
                        round(results[c]["sdpa"] / results[c][m], 3) if (c := (d, dt, n, r, kind)) in results else None
                        for r in rows) for n in keys)
                    grids.append(Grid(m, d, dt, tuple(keys), tuple(rows), speedup, kind))
    measured = {"torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.date.today().isoformat(), "timing": f"median of {reps} CUDA-graph replays"}
    if sdpa_tflops > 0:
        measured["sdpa_tflops"] = round(sdpa_tflops, 1)
    return CrossoverTable(torch.cuda.get_device_name(device), arch_of(device), tuple(grids), measured=measured)


def _time_cell(device, d: int, dtype: torch.dtype, n: int, heads: int, key_mask: bool, modes, reps) -> dict[str, float]:
    """Milliseconds of SDPA and of each INT8 mode on self-attention of ``heads`` heads × ``n`` tokens (with the key
    mask ``measure`` describes, or none)."""
    import torch.nn.functional as F

    from ..kernels import int8_attention
    from ..timing import graph_ms

    # (B, S, H, D) memory viewed (B, H, S, D), as diffusers' processors hand attention its inputs
    q, k, v = (torch.randn(1, n, heads, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    k += 3.0 * torch.randn(1, heads, 1, d, device=device, dtype=dtype)  # a K channel bias, as in real models
    mask = None
    if key_mask:
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device=device)
        mask[..., n - MASKED_KEYS:] = False
    times = {"sdpa": graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps)}
    for m in modes:
        times[m] = graph_ms(lambda m=m: int8_attention(q, k, v, mode=m, attn_mask=mask), reps)
    return times
