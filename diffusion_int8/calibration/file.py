"""``Calibration``: measured per-layer, per-head ranges and errors over the noise schedule, as one file.

The file is safetensors (``calibration.safetensors``): tensors named ``{layer}::{stat}`` and the
global ``timesteps`` and ``noise``, with JSON metadata under the key ``diffusion_int8`` (model,
model class, diffusers version, scheduler, steps, prompt hash, schema version, and a sample of the calibrated
weights that ``validate`` compares with the model's, in files written since it was added) and a sha256 under
``diffusion_int8.sha256``: of the metadata and the tensors since schema 5 (``file_sha256``), of the tensors
alone in schemas 3 and 4 (``tensors_sha256``). Nothing is unpickled.

``load`` checks the whole file before returning: the checksum (required from schema 3 on; schemas 1 and 2
were written before it), every metadata field's type and range, every tensor's presence and shape, that the
measured errors are finite and in range, and that the fitted ranges are finite and positive, and K's mean
finite, over the whole noise interval [0, 1]. Anything wrong is a ``ValueError`` naming the file and the
tensor or field, raised at load rather than during generation.

Since schema 3 a file may also hold, per calibrated sparsity level tau (metadata ``sparsity_levels``), the error
of block-sparse attention at that level and the fraction of block pairs it computes: ``sparse.rel_l1@{tau}``,
``sparse.cos@{tau}`` and ``sparse.kept@{tau}`` (H, T).

Since schema 6 it may also hold, per calibrated (level tau, refresh interval K) pair (metadata ``carry``), the error
of carrying the blocks tau skips with a refresh every K steps and the fraction of block pairs computed at each
step: ``carry.rel_l1@{tau}/{K}``, ``carry.cos@{tau}/{K}`` and ``carry.kept@{tau}/{K}`` (H, T).

Since schema 4 it holds the per-channel maxima of |Q| and of |K - mean| (``q_cmax``, ``k_cmax`` (H, D, T)), from
which ``ranges(..., balance=True)`` makes a static Q·Kᵀ balance.

Ranges and K's mean are also fitted as quadratics in the noise level (``fit.q``, ``fit.k``, ``fit.qmax``,
``fit.kmax`` (H, 3), ``fit.v``, ``fit.m``, ``fit.qc``, ``fit.kc`` (H, D, 3), coefficients of 1, n, n²), so
``ranges`` gives static scales, the smoothing vector and the balance at any step of any schedule. Schema 1 files (before K's mean and the
Q/K maxima were recorded) still load; their ranges are the p99 ones, with the kernel's measured smoothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import jsonfile
from ..kernels import Mode, StaticRanges
from ..kernels.config import MAX_HEAD_DIM
from ..plugin.models import attention_modules, head_dim_of
from ..schedule import noise_level
from .stats import CARRY_STATS, SPARSE_STATS, carry_key, carry_stat, sparse_key, sparse_stat

SCHEMA_VERSION = 6
# 5: no carried levels; 4: the checksum covers the tensors alone; 3: nor channel maxima; 2: nor sparsity levels,
# nor a checksum; 1: nor Q/K maxima nor K's mean
READABLE_SCHEMAS = (1, 2, 3, 4, 5, 6)
FILE_NAME = "calibration.safetensors"
_META_KEY = "diffusion_int8"
_SHA_KEY = "diffusion_int8.sha256"
_RANGE_FITS = ("q", "k", "v", "qmax", "kmax", "qc", "kc")  # must stay finite and > 0; "m" (K's mean) finite
_NOISE_GRID = 65  # points of [0, 1], both ends included, at which load checks the fits
# fewer calibrated steps than this: the quadratic fits pass through (nearly) every measured level, so static ranges
# between and beyond them are guesses
MIN_FIT_STEPS = 6
_FIT_OF = {"q": "q_p99", "k": "k_p99", "v": "v_amax"}  # what the summary reports
# every fit: qmax, kmax and m since schema 2, qc and kc since schema 4
_FITS = {**_FIT_OF, "qmax": "q_max", "kmax": "k_max", "m": "k_mean", "qc": "q_cmax", "kc": "k_cmax"}


def fit_quadratic(noise: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Least-squares ``c0 + c1·n + c2·n²`` along the last dim of ``values`` (..., T) -> (..., 3), float64.

    With fewer than 3 steps the degree drops (missing coefficients are 0).
    """
    T = noise.numel()
    deg = min(2, T - 1)
    n = noise.double()
    A = torch.stack([n**i for i in range(deg + 1)], -1)  # (T, deg+1)
    y = values.double().reshape(-1, T).T  # (T, M)
    coef = torch.linalg.lstsq(A, y).solution.T  # (M, deg+1)
    coef = torch.cat([coef, coef.new_zeros(coef.shape[0], 2 - deg)], -1)
    return coef.reshape(*values.shape[:-1], 3)


def r_squared(values: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """Coefficient of determination along the last dim (1 = exact; can be negative)."""
    ss_res = ((values - predicted) ** 2).sum(-1)
    ss_tot = ((values - values.mean(-1, keepdim=True)) ** 2).sum(-1).clamp_min(1e-30)
    return 1 - ss_res / ss_tot


def evaluate_fit(coef: torch.Tensor, noise: torch.Tensor | float) -> torch.Tensor:
    """Quadratics ``coef`` (..., 3) at noise level(s) ``noise`` (scalar or (N,)) -> (..., 1) or (..., N). A Python
    number stays one (no copy to ``coef``'s device)."""
    n = noise if isinstance(noise, (int, float)) else torch.as_tensor(noise, dtype=coef.dtype, device=coef.device)
    return coef[..., 0:1] + coef[..., 1:2] * n + coef[..., 2:3] * n * n


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: each one's name, dtype and shape, then its bytes (schemas 3, 4)."""
    return _sha256(tensors).hexdigest()


def file_sha256(raw_meta: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the metadata as stored (its JSON text), then the tensors as ``tensors_sha256`` (schema 5 on)."""
    return _sha256(tensors, raw_meta.encode()).hexdigest()


def _sha256(tensors: dict[str, torch.Tensor], prefix: bytes = b""):
    h = hashlib.sha256(prefix)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h


def _expected_shapes(schema: int, H: int, D: int, T: int) -> dict[str, tuple[int, ...]]:
    """The per-layer tensors a file of ``schema`` must hold, and their shapes."""
    shapes = {"q_p99": (H, T), "k_p99": (H, T), "v_amax": (H, D, T), "fit.q": (H, 3), "fit.k": (H, 3), "fit.v": (H, D, 3)}
    if schema >= 2:
        shapes.update({"q_max": (H, T), "k_max": (H, T), "k_mean": (H, D, T), "fit.qmax": (H, 3), "fit.kmax": (H, 3),
                       "fit.m": (H, D, 3)})
    if schema >= 4:
        shapes.update({"q_cmax": (H, D, T), "k_cmax": (H, D, T), "fit.qc": (H, D, 3), "fit.kc": (H, D, 3)})
    return shapes


def _error_stat(stat: str) -> bool:
    """``err.{mode}.{rel_l1|cos}``: the measured errors, (H, T) for any mode."""
    parts = stat.split(".")
    return len(parts) == 3 and parts[0] == "err" and parts[1] in {m.value for m in Mode} and parts[2] in ("rel_l1", "cos")


@dataclass
class Calibration:
    """Measured statistics of one model's attention layers over a denoising schedule.

    Attributes:
        meta: provenance (see module docstring) and ``layers``: ``{name: {"heads": H, "head_dim": D}}``.
        timesteps: (T,) the timesteps the denoiser was called with, in order.
        noise: (T,) the same as noise levels in [0, 1] (``schedule.noise_level``).
        layers: ``{name: {stat: tensor}}``: ``q_p99``, ``k_p99``, ``q_max``, ``k_max`` (H, T); ``k_mean``,
            ``v_amax``, ``q_cmax``, ``k_cmax`` (H, D, T); ``err.{mode}.rel_l1`` and ``err.{mode}.cos`` (H, T);
            ``fit.q``, ``fit.k``, ``fit.qmax``, ``fit.kmax`` (H, 3), ``fit.v``, ``fit.m``, ``fit.qc``, ``fit.kc``
            (H, D, 3); per sparsity level tau,
            ``sparse.rel_l1@{tau}``, ``sparse.cos@{tau}`` and ``sparse.kept@{tau}`` (H, T).
    """

    meta: dict
    timesteps: torch.Tensor
    noise: torch.Tensor
    layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # where ``load`` read it: {"path": ..., "sha256": the checksum stored in the file}; empty for one made in memory
    origin: dict = field(default_factory=dict, repr=False, compare=False)
    # ranges_at's results and the stacked fits it evaluates
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_stats(cls, meta: dict, timesteps: list[float], stats: dict[str, dict[str, torch.Tensor]]) -> "Calibration":
        """Build from merged collector statistics, fitting the ranges against the noise level."""
        ntt = meta.get("num_train_timesteps")
        ts = torch.tensor(timesteps, dtype=torch.float64)
        noise = torch.tensor([noise_level(t, ntt, meta.get("timestep_scale")) for t in timesteps], dtype=torch.float64)
        layers = {}
        for name, st in stats.items():
            st = dict(st)
            for short, stat in _FITS.items():
                st[f"fit.{short}"] = fit_quadratic(noise, st[stat]).float()
            layers[name] = st
        levels = sorted({found[1] for st in stats.values() for found in map(sparse_stat, st) if found})
        carried = sorted({found[1:] for st in stats.values() for found in map(carry_stat, st) if found})
        meta = {**meta, "schema_version": SCHEMA_VERSION, "steps": len(timesteps), "sparsity_levels": levels,
                "carry": [list(pair) for pair in carried],
                "layers": {n: {"heads": int(s["q_p99"].shape[0]), "head_dim": int(s["v_amax"].shape[1])}
                           for n, s in layers.items()}}
        return cls(meta, ts.float(), noise.float(), layers)

    # ----------------------------------------------------------------------------------------- file
    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the calibration to ``path``, a file, or a directory (one that exists, or a path ending in "/",
        made if missing) to hold ``calibration.safetensors``; atomically (an interrupted save leaves the old file).
        ``FileExistsError`` where the file exists, unless ``overwrite``. Returns the file's path."""
        from safetensors.torch import save

        given = os.fspath(path)
        path = Path(path)
        if given.endswith(("/", os.sep, "/.", os.sep + ".")) or path.is_dir():  # pathlib drops a trailing / or /.
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(f"{given}: {path} is a file, not a folder to save {FILE_NAME} in")
            path.mkdir(parents=True, exist_ok=True)
            path = path / FILE_NAME
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
        tensors = {"timesteps": self.timesteps, "noise": self.noise}
        for name, st in self.layers.items():
            for key, t in st.items():
                tensors[f"{name}::{key}"] = t.contiguous()
        # serialized here and written as any other file of the user's, with its mode (safetensors' save_file makes
        # it owner-only)
        raw = json.dumps(jsonfile.finite(self.meta))  # a scheduler's config may hold -inf (DPMSolver's)
        jsonfile.write_bytes(path, save(tensors, metadata={_META_KEY: raw, _SHA_KEY: file_sha256(raw, tensors)}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Read a file written by ``save`` (or the directory holding ``calibration.safetensors``), checked whole:
        a ``ValueError`` naming the file and what is wrong with it (see the module docstring)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no calibration file at {path}; make one with `diffusion-int8 calibrate`")
        meta, tensors, checksum = _read(path)
        layers: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            if "::" in key:
                name, stat = key.split("::", 1)
                layers.setdefault(name, {})[stat] = t
            elif key not in ("timesteps", "noise"):
                raise ValueError(f"{path}: tensor {key!r} is not part of a calibration (layers' tensors are "
                                 f"named 'layer::statistic')")
        _check_structure(path, meta, tensors, layers)
        origin = {"path": str(path.resolve()), "sha256": checksum}
        cal = cls(meta, tensors["timesteps"], tensors["noise"], layers, origin)
        cal.check_ranges(source=str(path))
        if meta["schema_version"] == 1:
            warnings.warn(f"{path} is a schema 1 calibration: it has no Q/K maxima and no K mean, so static ranges "
                          f"are its p99 percentiles (which clip outliers; BENCHMARKS.md measured them well below "
                          f"the maxima in quality) and K's mean is measured per call. Run `diffusion-int8 "
                          f"calibrate` again to record them.", UserWarning, stacklevel=2)
        return cal

    def noise_levels(self) -> int:
        """How many distinct noise levels were measured (a second-order scheduler calls the denoiser twice at some),
        the points the range fits pass through."""
        return len(set(self.noise.tolist()))

    def provenance(self) -> dict:
        """What a report records of this calibration: the file it was loaded from and its stored checksum (None for
        one made in memory), and the model, steps, items and seed it was measured with."""
        keys = ("model", "steps", "items_kind", "num_items", "prompts_sha256", "seed", "schema_version")
        return {"path": self.origin.get("path"), "sha256": self.origin.get("sha256"),
                **{k: self.meta.get(k) for k in keys}}

    def check_ranges(self, source: str = "calibration", points: int = _NOISE_GRID) -> None:
        """Raise ``ValueError`` unless, at ``points`` noise levels spanning [0, 1], every layer's static ranges
        (as ``ranges`` gives them) are finite and > 0 and its fitted K mean is finite."""
        grid = torch.linspace(0, 1, points, dtype=torch.float64)
        for name, st in self.layers.items():
            checks = [(short, self._fitted(st, short, grid).float(), True) for short in _RANGE_FITS if f"fit.{short}" in st]
            if "fit.m" in st:
                checks.append(("m", evaluate_fit(st["fit.m"].double(), grid).float(), False))
            for short, values, positive in checks:
                bad = ~torch.isfinite(values) | (values <= 0 if positive else False)
                if bad.any():
                    where = bad.nonzero()[0].tolist()
                    value = float(values[tuple(where)])
                    what = "K mean" if short == "m" else f"{_FITS[short]} range"
                    raise ValueError(
                        f"{source}: layer {name!r}: the fitted {what} (tensor {name}::fit.{short}) is {value} at noise "
                        f"level {float(grid[where[-1]]):.3f}, head {where[0]}; static ranges must be finite"
                        f"{' and > 0' if positive else ''} over the noise interval [0, 1]. The file is damaged or "
                        f"its calibration diverged: run `diffusion-int8 calibrate` again")

    # ----------------------------------------------------------------------------------- applying
    def validate(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` unless ``model`` has exactly the calibrated attention layers, heads and head dims;
        warn where its weights are not those calibrated (``weights_sample``; files from before it are not told)."""
        problems = []
        cls_name = type(model).__name__
        if self.meta.get("model_class") not in (None, cls_name):
            problems.append(f"model class is {cls_name}, the calibration is for {self.meta['model_class']}")
        modules = {n: m for n, m in attention_modules(model).items() if (head_dim_of(m) or 0) <= MAX_HEAD_DIM}
        missing = sorted(set(self.layers) - set(modules))
        extra = sorted(set(modules) - set(self.layers))
        if missing:
            problems.append(f"layers not in the model: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
        if extra:
            problems.append(f"model layers not calibrated: {', '.join(extra[:5])}{' …' if len(extra) > 5 else ''}")
        for name in sorted(set(self.layers) & set(modules)):
            want = self.meta["layers"][name]
            heads, hd = getattr(modules[name], "heads", None), head_dim_of(modules[name])
            if (heads, hd) != (want["heads"], want["head_dim"]) and None not in (heads, hd):
                problems.append(f"{name}: model has {heads} heads of dim {hd}, "
                                f"the calibration {want['heads']} of dim {want['head_dim']}")
        if problems:
            raise ValueError(f"calibration of {self.meta.get('model', '?')} does not match this model: " + "; ".join(problems))
        sample, told = self.meta.get("weights_sample"), self._memo.setdefault("told_weights", [])
        differ = _sample_differs(model, sample) if sample is not None and id(model) not in told else None
        levels = self.noise_levels()
        if levels < MIN_FIT_STEPS and not self._memo.get("told_steps"):
            self._memo["told_steps"] = True
            warn_few_steps(levels, f"this calibration of {self.meta.get('model', '?')} measured", 3, "noise level")
        if differ:
            told.append(id(model))  # once, though eval and enable both validate
            warnings.warn(f"diffusion_int8: the calibration of {self.meta.get('model', '?')} was made with other "
                          f"weights than this {cls_name}'s ({differ} of {len(sample['values'])} values of "
                          f"{sample['param']} differ by over 5% of the largest): a model of the same layers, such "
                          f"as another checkpoint or a fine-tune, whose ranges and errors may not be these. Calibrate this "
                          f"model, or compare the images (diffusion-int8 eval)", RuntimeWarning, stacklevel=3)

    def has_channel_ranges(self) -> bool:
        """Whether the file holds per-channel Q and K maxima (schema 4 on), which ``ranges(balance=True)`` needs."""
        return all("fit.qc" in st for st in self.layers.values())

    def balanced_layers(self) -> list[str]:
        """The layers whose Q or K carries outlier channels of its own: where the Q·Kᵀ balance of the measured
        channel maxima (``reference.balance_from_ranges``) moves some channel at some calibrated step. Empty for
        files without per-channel maxima (before schema 4)."""
        if "balanced" not in self._memo:
            self._memo["balanced"] = [name for name in self.layers if self.layer_balanced(name)]
        return list(self._memo["balanced"])

    def layer_balanced(self, layer: str) -> bool:
        """Whether ``layer`` is one of ``balanced_layers``."""
        from ..kernels.reference import balance_from_ranges

        st = self.layers[layer]
        if _FITS["qc"] not in st:
            return False
        qc, kc = st[_FITS["qc"]].float(), st[_FITS["kc"]].float()  # (H, D, T), (H_kv, D, T)
        q_group = qc.unflatten(0, (kc.shape[0], qc.shape[0] // kc.shape[0])).amax(1)
        return bool((balance_from_ranges(q_group, kc) != 1).any())

    def ranges(self, layer: str, timestep: float, device: torch.device | str = "cpu",
               clip: str | None = None, balance: bool = False) -> StaticRanges:
        """``StaticRanges(q_amax (1, H), k_amax (1, H), v_amax (1, H, D), k_mean (1, H, D), qk_balance)`` at
        ``timestep``, float32 on ``device``: ``int8_attention``'s static inputs.

        ``clip``: Q's and K's ranges from their maxima (``"max"``: nothing clipped on the calibration's
        data) or from their recorded percentile (``"p99"``, which clips the outliers the kernel's
        per-token/per-block scales would follow); None (the default) takes the maxima where the file has
        them. Schema 1 files have neither the maxima nor K's mean: their ranges are the percentiles
        (``clip="max"`` raises) and ``k_mean`` is None.

        ``balance``: also a static Q·Kᵀ balance, (1, H, D) powers of two (``reference.balance_from_ranges`` of the
        fitted channel maxima), with ``q_amax`` and ``k_amax`` moved as the balance moves their largest channel;
        needs a schema 4 file (``has_channel_ranges``) and the maxima. Else ``qk_balance`` is None.

        Every layer's ranges at a timestep are evaluated together (``ranges_at``); this is one of them.
        """
        if layer not in self.layers:
            raise KeyError(f"the calibration has no layer {layer!r}")
        return self.ranges_at(timestep, device, clip, balance=bool(balance))[layer]

    def ranges_at(self, timestep: float, device: torch.device | str = "cpu", clip: str | None = None,
                  balance: bool | None = False) -> dict[str, StaticRanges]:
        """``{layer: ranges(layer, timestep, device, clip, ...)}`` for every layer, evaluated in one pass per group
        of layers of one shape and copied to ``device`` at once, and kept per (timestep, device, clip, balance):
        the steps of a generation's schedule cost one evaluation each, once. ``balance``: True balances every
        layer, False none, None the layers of ``balanced_layers`` (those with outlier channels of their own).
        The memo assumes ``layers`` is not changed after the first call."""
        if clip not in (None, "max", "p99"):
            raise ValueError(f"clip must be None, 'max' or 'p99', got {clip!r}")
        device = torch.device(device)
        key = (float(timestep), device, clip, balance)
        found = self._memo.get(key)
        if found is None:  # checked once, where the ranges are made
            if balance and clip == "p99":
                raise ValueError("a static Q·Kᵀ balance comes with ranges from the maxima: use clip=None or 'max'")
            if balance and not self.has_channel_ranges():
                raise ValueError(f"this calibration (schema {self.meta.get('schema_version')}) has no per-channel Q/K "
                                 f"maxima, which a static Q·Kᵀ balance is made from; run `diffusion-int8 calibrate` again")
            if clip == "max" and not all("fit.qmax" in st for st in self.layers.values()):
                raise ValueError(f"this calibration (schema {self.meta.get('schema_version')}) has no Q/K maxima; "
                                 f"use clip='p99' or None, or record them by running `diffusion-int8 calibrate` again")
            if len(self._memo) >= 4096:  # steps x devices of the schedules in use; bounded all the same
                self._memo.clear()
            found = self._memo[key] = self._evaluate(float(timestep), device, clip, balance)
        return found

    def _evaluate(self, timestep: float, device: torch.device, clip: str | None,
                  balance: bool | None) -> dict[str, StaticRanges]:
        """``ranges_at`` without the memo: each group of same-shaped layers' fits evaluated stacked, (L, H, ...)."""
        n = noise_level(timestep, self.meta.get("num_train_timesteps"), self.meta.get("timestep_scale"))
        if balance is None:
            balanced = set(self.balanced_layers())
        names, parts = [], []
        for group, st in self._stacked():
            shorts = ("qmax", "kmax", "v") if clip != "p99" and "fit.qmax" in st else ("q", "k", "v")
            out = [self._fitted(st, short, n)[..., 0] for short in shorts]
            out.append(evaluate_fit(st["fit.m"].double(), n)[..., 0] if "fit.m" in st else None)
            wanted = [balance is True or (balance is None and name in balanced) for name in group]
            bal = None
            if any(wanted):
                q_bal, k_bal, bal = self._balanced(st, n, out[0], out[1])
                which = torch.tensor(wanted)[:, None]
                out[0], out[1] = torch.where(which, q_bal, out[0]), torch.where(which, k_bal, out[1])
            for i, name in enumerate(group):
                names.append(name)
                parts += [None if t is None else t[i].float()[None] for t in out]
                parts.append(bal[i][None] if wanted[i] else None)
        moved = _to_device(parts, device)
        return {name: StaticRanges(*moved[5 * i:5 * i + 5]) for i, name in enumerate(names)}

    def _stacked(self) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
        """The layers grouped by the shapes of their fits, each group's fits and measured ranges stacked (L, ...)."""
        if "stacked" not in self._memo:
            wanted = [f"fit.{short}" for short in _FITS] + list(_FITS.values())
            groups: dict[tuple, list[str]] = {}
            for name, st in self.layers.items():
                groups.setdefault(tuple((k, tuple(st[k].shape)) for k in wanted if k in st), []).append(name)
            self._memo["stacked"] = [
                (group, {k: torch.stack([self.layers[name][k] for name in group]) for k, _ in shapes})
                for shapes, group in groups.items()]
        return self._memo["stacked"]

    @classmethod
    def _balanced(cls, st: dict[str, torch.Tensor], noise: float, q_amax: torch.Tensor, k_amax: torch.Tensor):
        """(q_amax, k_amax, balance) at ``noise``: the balance of the fitted channel maxima, and each head's range
        times what the balance does to its largest channel. ``st``'s fits may carry leading dims (stacked layers)."""
        from ..kernels.reference import balance_from_ranges

        qc, kc = (cls._fitted(st, short, noise)[..., 0].float() for short in ("qc", "kc"))  # (..., H, D), (..., H_kv, D)
        group = qc.shape[-2] // kc.shape[-2]
        # the balance from the fits as they are (a channel that was zero stays zero: balance 1), the ranges' ratios
        # from the floored ones
        raw_q, raw_k = (evaluate_fit(st[f"fit.{short}"].double(), noise)[..., 0].clamp_min(0).float()
                        for short in ("qc", "kc"))
        bal = balance_from_ranges(raw_q.unflatten(-2, (kc.shape[-2], group)).amax(-2), raw_k)
        q_bal = (qc / bal.repeat_interleave(group, -2)).amax(-1) / qc.amax(-1)
        k_bal = (kc * bal).amax(-1) / kc.amax(-1)
        return q_amax * q_bal.double(), k_amax * k_bal.double(), bal

    @staticmethod
    def _fitted(st: dict[str, torch.Tensor], short: str, noise) -> torch.Tensor:
        """The range fit ``fit.{short}`` at ``noise`` (scalar or (N,)), float64 (..., 1) or (..., N)."""
        measured = st[_FITS[short]]
        # the fit can undershoot between steps; never below a tenth of the smallest measured range
        floor = measured.amin(-1).clamp_min(1e-6) * 0.1
        return torch.maximum(evaluate_fit(st[f"fit.{short}"].double(), noise), floor.double()[..., None])

    # ------------------------------------------------------------------------------------ summary
    def modes(self) -> list[str]:
        return sorted({k.split(".")[1] for st in self.layers.values() for k in st if k.startswith("err.")})

    def error(self, mode: str, metric: str = "rel_l1") -> torch.Tensor:
        """(L, T) the error of ``mode``, averaged over heads, layers in ``self.layers`` order."""
        return torch.stack([st[f"err.{mode}.{metric}"].mean(0) for st in self.layers.values()])

    def sparsity_levels(self) -> list[float]:
        """The calibrated sparsity levels, ascending (the sparsest first); empty before schema 3 or without any."""
        return [float(t) for t in self.meta.get("sparsity_levels", [])]

    def sparse_error(self, tau: float, metric: str = "rel_l1") -> torch.Tensor:
        """(L, T) the error of block-sparse exact attention at level ``tau`` against dense exact attention
        (``rel_l1`` or ``cos``), averaged over heads."""
        return self._sparse(f"sparse.{metric}", tau)

    def kept(self, tau: float) -> torch.Tensor:
        """(L, T) the fraction of (query block, key block) pairs the predictor keeps at ``tau``, averaged over heads."""
        return self._sparse("sparse.kept", tau)

    def carry_settings(self) -> list[tuple[float, int]]:
        """The calibrated (level, refresh interval) pairs of carried skipped blocks; empty before schema 6 or
        without any."""
        return [(float(t), int(k)) for t, k in self.meta.get("carry", [])]

    def carry_error(self, tau: float, every: int, metric: str = "rel_l1") -> torch.Tensor:
        """(L, T) the error of exact attention with the blocks ``tau`` skips carried, refreshed every ``every``
        steps (``rel_l1`` or ``cos``), against dense exact attention, averaged over heads."""
        return self._carried(f"carry.{metric}", tau, every)

    def carry_kept(self, tau: float, every: int) -> torch.Tensor:
        """(L, T) the fraction of block pairs computed at each step when carrying (1 at a refresh)."""
        return self._carried("carry.kept", tau, every)

    def step_weights(self) -> torch.Tensor:
        """(T,) each calibrated step's share of the noise it removes: its noise level less the next lower level (the
        lowest: less 0), split evenly among steps at the same level, normalized to sum 1 (equal shares where every
        level is 0). A flow-matching Euler step moves the latents by that share of the noise times the prediction,
        so an error at one step reaches the image about in proportion to it; for DDPM-style models the noise level
        is the timestep's fraction (``schedule.noise_level``) and the shares are timestep gaps."""
        noise = self.noise.double()
        levels, which, count = torch.unique(noise, sorted=True, return_inverse=True, return_counts=True)  # ascending
        gaps = levels - torch.cat([levels.new_zeros(1), levels[:-1]])
        share = (gaps / count)[which].clamp_min(0)
        total = float(share.sum())
        return (share / total if total > 0 else torch.full_like(noise, 1 / max(len(noise), 1))).float()

    def carry_trajectory_error(self, tau: float, every: int, metric: str = "rel_l1",
                               steps: list[int] | None = None) -> float:
        """The error of ``tau`` carried with a refresh every ``every`` steps along the trajectory: the layers' mean
        at each of ``steps`` (None: all), weighted by ``step_weights`` renormalized over them (equal weights where
        they remove no noise). ``cos``: the weighted mean cosine similarity."""
        err = self.carry_error(tau, every, metric).mean(0)
        weights = self.step_weights()
        if steps is not None:
            err, weights = err[steps], weights[steps]
        total = float(weights.sum())
        weights = weights / total if total > 0 else torch.full_like(weights, 1 / max(len(weights), 1))
        return float((err * weights).sum())

    def _carried(self, what: str, tau: float, every: int) -> torch.Tensor:
        if (float(tau), int(every)) not in self.carry_settings():
            raise ValueError(f"level {tau} refreshed every {every} steps was not calibrated; the calibrated pairs are "
                             f"{self.carry_settings() or 'none (calibrate with refresh_every=...)'}")
        return torch.stack([st[carry_key(what, tau, every)].mean(0) for st in self.layers.values()])

    def _sparse(self, what: str, tau: float) -> torch.Tensor:
        if float(tau) not in self.sparsity_levels():
            raise ValueError(f"level {tau} was not calibrated; the calibrated sparsity levels are "
                             f"{self.sparsity_levels() or 'none (calibrate with sparsity_levels=...)'}")
        return torch.stack([st[sparse_key(what, tau)].mean(0) for st in self.layers.values()])

    def fit_report(self) -> dict:
        """How well ranges follow sigma: median R² over (layer, head) of the proportional model
        ``s = c·σ`` and of the stored quadratic, and the median ratio of the largest to smallest range."""
        report = {}
        n = self.noise.double()
        for short, stat in _FIT_OF.items():
            vals = torch.cat([st[stat].double().reshape(-1, n.numel()) for st in self.layers.values()])
            c = (vals * n).sum(-1, keepdim=True) / (n * n).sum().clamp_min(1e-30)
            coefs = torch.cat([st[f"fit.{short}"].double().reshape(-1, 3) for st in self.layers.values()])
            report[stat] = {
                "r2_proportional": float(r_squared(vals, c * n).median()),
                # through three points or fewer a quadratic fits exactly: no measure of anything
                "r2_quadratic": (float(r_squared(vals, evaluate_fit(coefs, n)).median()) if self.noise_levels() > 3
                                 else None),
                "max_over_min": float((vals.amax(-1) / vals.amin(-1).clamp_min(1e-30)).median()),
            }
        return report


def warn_few_steps(n: int, what: str, stacklevel: int = 2, unit: str = "denoising step") -> None:
    """The warning for a calibration of fewer than ``MIN_FIT_STEPS`` steps or noise levels (``what``: "... over")."""
    s = "s" if n != 1 else ""
    warnings.warn(f"diffusion_int8: {what} {n} {unit}{s}: its static ranges are quadratics in the noise level fitted "
                  f"through {n} point{s}, right there and a guess between and beyond them. Calibrate over "
                  f"{MIN_FIT_STEPS} steps or more (the demo's 10) for static ranges you can trust",
                  RuntimeWarning, stacklevel=stacklevel)


# ------------------------------------------------------------------------------------ reading
SAMPLED_WEIGHTS = 64


def weights_sample(model: torch.nn.Module) -> dict | None:
    """``{"param": name, "values": [...]}``: ``SAMPLED_WEIGHTS`` values spread over the first matrix of ``model``'s
    first attention module, which tell its weights from another checkpoint's of the same layers (``validate``);
    None where they cannot be read (weights on the meta device under offloading, quantized tensor types)."""
    name, module = next(iter(attention_modules(model).items()), (None, None))
    pname, p = next(((n, p) for n, p in (module.named_parameters() if module is not None else ()) if p.dim() == 2),
                    (None, None))
    values = None if p is None else _sampled(p)
    return None if values is None else {"param": f"{name}.{pname}", "values": values}


def _sampled(p: torch.Tensor) -> list[float] | None:
    try:
        flat = p.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, SAMPLED_WEIGHTS, dtype=torch.float64).long().to(flat.device)
        values = flat[idx].double().cpu().tolist()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    return values if all(math.isfinite(v) for v in values) else None


def _sample_differs(model: torch.nn.Module, sample: dict) -> int:
    """How many of ``sample``'s values ``model``'s weights miss by more than 5% of the largest (a cast to a 16-bit
    format moves each by under 0.4% of itself, to FP8 e4m3, as layerwise casting stores weights, by under 3.2%); 0
    where they cannot be read or most agree."""
    try:
        now = _sampled(model.get_parameter(sample["param"]))
    except AttributeError:
        return 0
    if now is None or len(now) != len(sample["values"]):
        return 0
    scale = max(abs(v) for v in sample["values"]) or 1.0
    differ = sum(abs(a - b) > 0.05 * scale for a, b in zip(now, sample["values"]))
    return differ if differ > len(now) // 4 else 0


def _holds_nonfinite(value) -> bool:
    if isinstance(value, dict):
        return any(_holds_nonfinite(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_nonfinite(v) for v in value)
    return isinstance(value, jsonfile.NonFinite)


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor], str | None]:
    """The metadata, tensors and stored checksum (None in schemas 1 and 2) of a calibration file, the checksum
    verified; ``ValueError`` for anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a calibration: not a readable safetensors file ({e})") from None
    raw = header.get(_META_KEY)
    if raw is None:
        raise ValueError(f"{path} is a safetensors file but not a diffusion-int8 calibration (no metadata {_META_KEY!r})")
    # non-finite numbers as text in the scheduler's config alone: earlier versions wrote DPMSolver's -inf as -Infinity
    meta = jsonfile.loads(raw, f"{path}: metadata {_META_KEY!r}", nonfinite_as_text=True)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: metadata {_META_KEY!r} must be a JSON object, got {type(meta).__name__}")
    bad = next((k for k, v in meta.items() if k != "scheduler_config" and _holds_nonfinite(v)), None)
    if bad is not None:
        raise ValueError(f"{path}: metadata field {bad} holds NaN or Infinity, which is not JSON (numbers must be "
                         f"finite); the file was changed after `diffusion-int8 calibrate` wrote it")
    if type(meta.get("schema_version")) is not int or meta["schema_version"] not in READABLE_SCHEMAS:  # not true, 1.0
        raise ValueError(f"{path} has calibration schema {meta.get('schema_version')} (metadata field schema_version); "
                         f"this version of diffusion-int8 reads schemas {READABLE_SCHEMAS}")
    schema, want = meta["schema_version"], header.get(_SHA_KEY)
    unknown = sorted(set(header) - {_META_KEY, _SHA_KEY})
    if unknown:
        raise ValueError(f"{path}: metadata key {unknown[0]!r} is not part of a calibration (the keys are "
                         f"{_META_KEY!r} and {_SHA_KEY!r}); the file was changed after `diffusion-int8 calibrate` wrote it")
    if want is None and schema >= 3:
        raise ValueError(f"{path}: a schema {schema} calibration without its checksum (metadata {_SHA_KEY!r}): the "
                         f"file was changed after `diffusion-int8 calibrate` wrote it; calibrate again or restore a copy")
    covered = "metadata or tensors" if schema >= 5 else "tensors"
    # ``save`` covers the metadata whatever the schema; schema 3 and 4 files written before cover the tensors
    if want is not None and want != file_sha256(raw, tensors) and (schema >= 5 or want != tensors_sha256(tensors)):
        raise ValueError(f"{path}: its {covered} do not match the checksum stored with them (metadata {_SHA_KEY!r}): "
                         f"the file was changed or damaged after `diffusion-int8 calibrate` wrote it; calibrate again "
                         f"or restore a copy")
    return meta, tensors, want


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# metadata field -> (what it must be, the check); "model" and "model_class" are required
_META_FIELDS = {
    "model": ("a non-empty string", lambda v: isinstance(v, str) and v != ""),
    "model_class": ("a non-empty string (the denoiser's class name)", lambda v: isinstance(v, str) and v != ""),
    "pipeline_class": ("a string", lambda v: isinstance(v, str)),
    "diffusers_version": ("a string", lambda v: isinstance(v, str)),
    "scheduler": ("a string", lambda v: isinstance(v, str)),
    "scheduler_config": ("a JSON object", lambda v: isinstance(v, dict)),
    "dtype": ("a string", lambda v: isinstance(v, str)),
    "items_kind": ("'prompt' or 'class_labels'", lambda v: v in ("prompt", "class_labels")),
    "prompts_sha256": ("a sha256 in hex", lambda v: isinstance(v, str) and len(v) == 64
                       and all(c in "0123456789abcdef" for c in v)),
    "num_items": ("an integer > 0", lambda v: _positive_int(v)),
    "processes": ("an integer > 0", lambda v: _positive_int(v)),
    "seed": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "percentile": ("a number in (0, 100]", lambda v: _number(v) and 0 < v <= 100),
    "guidance_scale": ("null or a finite number", lambda v: v is None or _number(v)),
    "num_train_timesteps": ("null or a number > 0", lambda v: v is None or (_number(v) and v > 0)),
    "timestep_scale": ("null, 1 or 1000 (what the denoiser's timesteps are out of)", lambda v: v is None or v in (1, 1000)),
    "weights_sample": (f"an object with param (a string) and values ({SAMPLED_WEIGHTS} finite numbers)",
                       lambda v: isinstance(v, dict) and set(v) == {"param", "values"} and isinstance(v["param"], str)
                       and isinstance(v["values"], list) and len(v["values"]) == SAMPLED_WEIGHTS
                       and all(_number(x) for x in v["values"])),
}


def _check_meta_fields(path: Path, meta: dict) -> None:
    for key in ("model", "model_class"):
        if key not in meta:
            raise ValueError(f"{path}: metadata field {key} is missing; a calibration names the model it was made "
                             f"on, which is checked against the model it is used with")
    for key, (what, ok) in _META_FIELDS.items():
        if key in meta and not ok(meta[key]):
            raise ValueError(f"{path}: metadata field {key} must be {what}, got {meta[key]!r}")


def _check_values(path: Path, name: str, stat: str, t: torch.Tensor) -> None:
    """Measured errors finite and in range (a schedule picks its modes and levels from them)."""
    what = stat.split("@")[0].rsplit(".", 1)[-1]
    bounds = _ERROR_BOUNDS.get(what)
    if bounds is None:
        return
    low, high, text = bounds
    bad = ~torch.isfinite(t) | (t < low) | (t > high)
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"{path}: tensor {name}::{stat} holds {float(t[tuple(where)])} (head {where[0]}, step "
                         f"{where[-1]}); a measured {what} must be finite and {text}")


_ERROR_BOUNDS = {"rel_l1": (0.0, math.inf, ">= 0"), "cos": (-1.001, 1.001, "in [-1, 1]"), "kept": (0.0, 1.0, "in [0, 1]")}


def _check_structure(path: Path, meta: dict, tensors: dict[str, torch.Tensor], layers: dict) -> None:
    """``ValueError`` naming ``path`` and the field or tensor unless metadata and tensors are what ``save`` writes."""
    for key in ("timesteps", "noise"):
        t = tensors.get(key)
        if t is None:
            raise ValueError(f"{path}: tensor {key!r} is missing; the file is damaged")
        if t.dim() != 1 or t.numel() == 0 or not t.is_floating_point() or not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {key!r} must be a non-empty 1-d float tensor of finite values, "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    T = tensors["noise"].numel()
    if tensors["timesteps"].numel() != T or meta.get("steps", T) != T:
        raise ValueError(f"{path}: tensors 'timesteps' and 'noise' and metadata field steps disagree on the number of "
                         f"steps: {tensors['timesteps'].numel()}, {T}, {meta.get('steps')}")
    _check_meta_fields(path, meta)
    noise = tensors["noise"].double()
    if "timestep_scale" in meta:  # the fields noise_level read when the file was written (since timestep_scale)
        ntt, scale = meta.get("num_train_timesteps"), meta["timestep_scale"]
        derived = torch.tensor([noise_level(t, ntt, scale) for t in tensors["timesteps"].tolist()], dtype=torch.float64)
        if not torch.allclose(derived, noise, rtol=1e-5, atol=1e-6):
            raise ValueError(f"{path}: tensor 'noise' does not follow from tensor 'timesteps' and metadata fields "
                             f"num_train_timesteps ({ntt}) and timestep_scale ({scale}), as static ranges are read at "
                             f"a step's noise level; the file was edited or damaged")
    declared = meta.get("layers")
    if not isinstance(declared, dict):
        raise ValueError(f"{path}: metadata field layers must map layer names to heads and head_dim, "
                         f"got {type(declared).__name__}")
    if set(declared) != set(layers):
        diff = sorted(set(declared) ^ set(layers))
        raise ValueError(f"{path}: metadata field layers and the tensors name different layers: {', '.join(diff[:5])}")
    schema = meta["schema_version"]
    levels = meta.get("sparsity_levels", [])
    if schema < 3 and levels:
        raise ValueError(f"{path}: metadata field sparsity_levels: schema {schema} files have no sparsity levels")
    if not (isinstance(levels, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1
                                             for t in levels) and len(set(levels)) == len(levels)):
        raise ValueError(f"{path}: metadata field sparsity_levels must be a list of distinct levels in (0, 1), "
                         f"got {levels!r}")
    carried = meta.get("carry", [])
    if schema < 6 and carried:
        raise ValueError(f"{path}: metadata field carry: schema {schema} files have no carried levels")
    if not (isinstance(carried, list) and all(
            isinstance(p, list) and len(p) == 2 and p[0] in levels and _positive_int(p[1]) and p[1] >= 2
            for p in carried) and len({tuple(p) for p in carried}) == len(carried)):
        raise ValueError(f"{path}: metadata field carry must be a list of distinct [level, refresh interval] pairs, "
                         f"each level one of sparsity_levels {levels} and each interval an integer >= 2, got {carried!r}")
    for name, st in layers.items():
        info = declared[name]
        if not (isinstance(info, dict) and _positive_int(info.get("heads")) and _positive_int(info.get("head_dim"))):
            raise ValueError(f"{path}: metadata field layers[{name!r}] must be {{\"heads\": H, \"head_dim\": D}} "
                             f"with H, D > 0, got {info!r}")
        H, D = info["heads"], info["head_dim"]
        shapes = _expected_shapes(schema, H, D, T)
        for tau in levels:
            shapes.update({sparse_key(what, tau): (H, T) for what in SPARSE_STATS})
        for tau, every in carried:
            shapes.update({carry_key(what, tau, every): (H, T) for what in CARRY_STATS})
        for stat, t in st.items():
            want = shapes.get(stat, (H, T) if _error_stat(stat) else None)
            if want is None:
                raise ValueError(f"{path}: tensor {name}::{stat} is not a calibration statistic of schema {schema}")
            if tuple(t.shape) != want or not t.is_floating_point():
                raise ValueError(f"{path}: tensor {name}::{stat} has shape {tuple(t.shape)} ({t.dtype}); "
                                 f"layer {name!r} ({H} heads of dim {D}, {T} steps) needs a float tensor of shape {want}")
            _check_values(path, name, stat, t)
        missing = sorted(set(shapes) - set(st))
        if missing:
            raise ValueError(f"{path}: layer {name!r} lacks tensor {name}::{missing[0]} "
                             f"(schema {schema} files have {', '.join(sorted(shapes))})")


def _to_device(tensors: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Small CPU tensors on ``device`` in one copy (from pageable memory, which an asynchronous copy to a GPU
    stages without waiting for the GPU's queue), each a view of the one buffer at a multiple of 16 bytes."""
    present = [t for t in tensors if t is not None]
    if device.type == "cpu" or not present:
        return tensors
    sizes = [-(-t.numel() // 4) * 4 for t in present]
    flat = torch.zeros(sum(sizes), dtype=torch.float32)
    for t, view in zip(present, flat.split(sizes)):
        view[:t.numel()] = t.reshape(-1)
    parts = iter(flat.to(device, non_blocking=True).split(sizes))
    return [None if t is None else next(parts)[:t.numel()].view(t.shape) for t in tensors]
