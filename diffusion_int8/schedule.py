"""Rule-based precision schedules: which attention mode runs at which noise level and layer, and how sparse.

A schedule maps the denoiser's timestep, normalized to a noise level in [0, 1], and the attention
module's name to a ``Mode`` and a sparsity level ``tau`` (the attention mass kept per query block by the
block-sparse predictor, ``kernels.sparsity``; None = dense). Rules are tried in order; the first that matches
wins, else ``default`` and ``default_tau``.

    schedule = PrecisionSchedule(
        rules=[Rule("fp16", min_noise=0.98),              # the first, highest-noise step exact
               Rule("int8", min_noise=0.3),
               Rule("int8_fp16v", layers="*attn2*")],      # cross-attention at low noise
        default="int8_fp16v",
    )
    diffusion_int8.enable(pipe, schedule=schedule)

Schedules serialize to JSON (``save`` / ``load``); ``load`` checks every field, so a bad file fails there,
with a ``ValueError`` naming the file and the field, not during generation. Files of schema 1 (before sparsity
levels) still load, as dense schedules. ``PrecisionSchedule.from_calibration`` derives the rules from measured
errors: at each calibrated step (and, optionally, layer) the cheapest mode whose error stays under a budget,
and with a ``sparsity_budget`` the sparsest calibrated level whose error stays under that, either dropped per step
or, where the calibration measured carrying (``refresh_every``) and it computes fewer blocks, one level whose
skipped blocks are carried with a refresh every ``refresh_every`` steps, its error averaged along the trajectory
within a ``carry_budget``.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from . import jsonfile
from .caller import warn_user
from .kernels import Mode
from .kernels.sparsity import check_tau

SCHEMA_VERSION = 5
# from_calibration's budget, and the calibrate command's
BUDGET = 0.02
# the sparsity budget `diffusion-int8 calibrate` applies where it measured sparsity levels (from_calibration takes it
# as given: None there is dense)
SPARSITY_BUDGET = 0.05
# from_calibration's carry_budget: about the 30 dB line against FP16 on the long shipped model at 20 and 50 steps
# (BENCHMARKS.md "The setting calibration chooses")
CARRY_BUDGET = 0.12
# from_calibration carries only where the calibration ran at least this many steps: with fewer, each step moves the
# latents further, and settings within CARRY_BUDGET lost more on the long shipped model (the calibrated choice at 4, 12,
# 20, 30 steps: 21.6, 26.4, 29.9, 30.6 dB against FP16; BENCHMARKS.md "The setting calibration chooses")
MIN_CARRY_STEPS = 20
# 1: no sparsity levels (no default_tau, no rule tau); 2: no balance_layers; 3: no refresh_every; 4: no calibrated_steps
READABLE_SCHEMAS = (1, 2, 3, 4, 5)
_FIELDS = ("schema_version", "kind", "name", "default", "default_tau", "num_train_timesteps", "rules",
           "balance_layers", "refresh_every", "calibrated_steps")  # to_dict's
_SINCE = {"default_tau": 2, "balance_layers": 3, "refresh_every": 4, "calibrated_steps": 5}  # fields newer than schema 1


def _is_number(x) -> bool:
    """A finite real number (NumPy's included); JSON's true/false are not numbers here."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _json_type(x) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(x), "a number")


def denoising_steps(timesteps: torch.Tensor) -> int | None:
    """The denoising steps in a run's (T,) timesteps, which hold one entry per call of the denoiser: the distinct
    consecutive values, as the carry and ``enable``'s step count see them (CFG as two calls and second-order schedulers
    call it twice at a level); None for an empty run."""
    t = timesteps.reshape(-1)
    return int((t[1:] != t[:-1]).sum()) + 1 if t.numel() else None


def noise_level(timestep: float, num_train_timesteps: float | None = None, scale: float | None = None) -> float:
    """The denoiser's timestep as a noise level in [0, 1].

    Flow-matching models (Flux, SD3, Wan, …) pass timesteps as sigmas in [0, 1] or as sigma·1000;
    DDPM-style models pass timesteps in [0, num_train_timesteps). The divisor is ``num_train_timesteps``
    when given, else ``scale`` (``Int8State.timestep_scale``: 1000 when a generation's first timestep
    exceeds 1, which settles the last steps' t ≈ 1), else 1000 for values above 1 and 1 otherwise.
    """
    t = float(timestep)
    divisor = num_train_timesteps or scale or (1000.0 if t > 1.0 else 1.0)
    return t / float(divisor)


@dataclass(frozen=True)
class Rule:
    """``mode`` and sparsity level ``tau`` for noise levels in [min_noise, max_noise] and module names matching
    ``layers`` (fnmatch). ``tau`` in (0, 1]: the attention mass the block-sparse predictor keeps per query block
    (INT8 modes only); None: dense."""

    mode: Mode
    min_noise: float = 0.0
    max_noise: float = 1.0
    layers: str = "*"
    tau: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.tau is not None:
            object.__setattr__(self, "tau", check_tau(self.tau))
        for name in ("min_noise", "max_noise"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number in [0, 1], got {getattr(self, name)!r}")
        if not 0.0 <= self.min_noise <= self.max_noise <= 1.0:
            raise ValueError(f"a rule needs 0 <= min_noise <= max_noise <= 1, got {self.min_noise}, {self.max_noise}")
        if not isinstance(self.layers, str):
            raise ValueError(f"layers must be a module-name pattern (a string such as '*attn2*'), got {self.layers!r}")

    def matches(self, noise: float, layer: str | None) -> bool:
        if not self.min_noise <= noise <= self.max_noise:
            return False
        return self.layers == "*" or (layer is not None and fnmatch.fnmatchcase(layer, self.layers))


@dataclass(frozen=True)
class PrecisionSchedule:
    """An ordered list of rules, a default mode and a default sparsity level (None: dense). Callable as
    ``schedule(timestep) -> Mode``. ``balance_layers``: the modules whose Q and K a calibration found to carry
    outlier channels of their own, where the processor's default ``qk_balance`` balances Q·Kᵀ (and nowhere
    else); None where not known (the processor then looks at each module's first call). ``refresh_every``: the
    blocks the schedule's one sparsity level skips are carried across steps, computed every ``refresh_every``-th
    sparse step (``plugin.carry.BlockCarry``); None drops them. ``calibrated_steps``: the step count of the
    calibration it was chosen from (``from_calibration``), else None; ``enable(pipe, schedule=...)`` warns once where
    the pipeline's scheduler is set to another count while the schedule's own refresh interval, chosen at this one,
    runs."""

    rules: tuple[Rule, ...] = ()
    default: Mode = Mode.INT8
    num_train_timesteps: float | None = None
    name: str = field(default="custom", compare=False)
    default_tau: float | None = None
    balance_layers: tuple[str, ...] | None = None
    refresh_every: int | None = None
    calibrated_steps: int | None = field(default=None, compare=False)
    _memo: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.rules))
        object.__setattr__(self, "default", Mode.parse(self.default))
        if self.default_tau is not None:
            object.__setattr__(self, "default_tau", check_tau(self.default_tau, "default_tau"))
        if self.balance_layers is not None:
            names = self.balance_layers
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"balance_layers must be a list of module names or None, got {names!r}")
            object.__setattr__(self, "balance_layers", tuple(names))
        ntt = self.num_train_timesteps
        if ntt is not None and not (_is_number(ntt) and ntt > 0):
            raise ValueError(f"num_train_timesteps must be null or a number > 0 (the timesteps' scale), got {ntt!r}")
        n = self.calibrated_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"calibrated_steps must be null or an integer >= 1 (the calibration's step count), got {n!r}")
        every = self.refresh_every
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 2:
                raise ValueError(f"refresh_every must be null or an integer >= 2 (the skipped blocks are computed "
                                 f"every that many sparse steps), got {every!r}")
            if self.carried_tau() is None:
                raise ValueError("refresh_every carries the blocks of one sparsity level: the schedule's rules and "
                                 f"default must set one level below 1 (or none, dense), got "
                                 f"{sorted({t for t in (self.default_tau, *(r.tau for r in self.rules)) if t is not None})}")

    def __hash__(self):
        return hash((self.rules, self.default, self.default_tau, self.num_train_timesteps, self.balance_layers,
                     self.refresh_every))

    def carried_tau(self) -> float | None:
        """The one sparsity level below 1 that the rules and the default set (dense steps aside), else None."""
        levels = {t for t in (self.default_tau, *(r.tau for r in self.rules)) if t is not None and t < 1}
        return levels.pop() if len(levels) == 1 else None

    @property
    def sparse(self) -> bool:
        """Whether any rule, or the default, sets a sparsity level below 1."""
        return any(t is not None and t < 1 for t in (self.default_tau, *(r.tau for r in self.rules)))

    def _decide(self, timestep: float, layer: str | None, scale: float | None) -> tuple[Mode, float | None]:
        key = (timestep, layer, scale)
        found = self._memo.get(key)
        if found is None:
            noise = noise_level(timestep, self.num_train_timesteps, scale)
            rule = next((r for r in self.rules if r.matches(noise, layer)), None)
            found = (self.default, self.default_tau) if rule is None else (rule.mode, rule.tau)
            if len(self._memo) < 65536:  # steps × layers of one schedule; bounded all the same
                self._memo[key] = found
        return found

    def mode_for(self, timestep: float, layer: str | None = None, scale: float | None = None) -> Mode:
        """The mode at ``timestep`` for module ``layer``; ``scale``: see ``noise_level``."""
        return self._decide(timestep, layer, scale)[0]

    def tau_for(self, timestep: float, layer: str | None = None, scale: float | None = None) -> float | None:
        """The sparsity level at ``timestep`` for module ``layer`` (None: dense); ``scale``: see ``noise_level``."""
        return self._decide(timestep, layer, scale)[1]

    @classmethod
    def from_calibration(cls, calibration, budget: float = BUDGET, *, metric: str = "rel_l1",
                         per_layer: bool = False, sparsity_budget: float | None = None,
                         carry_budget: float | None = CARRY_BUDGET, name: str | None = None) -> "PrecisionSchedule":
        """The cheapest mode per calibrated step (and layer) whose measured attention error is within ``budget``,
        and with ``sparsity_budget``, the sparsest calibrated level within that.

        Args:
            calibration: a ``Calibration`` (``diffusion-int8 calibrate``).
            budget: the largest accepted error: relative L1 of the attention output against exact attention
                (``metric="rel_l1"``), or 1 - cosine similarity (``metric="cos"``).
            per_layer: decide per layer; otherwise per step, for the worst layer at that step.
            sparsity_budget: the largest accepted error of block-sparse attention (exact attention over the
                predicted blocks against all blocks, same metric): the smallest calibrated ``tau``
                (``calibrate(..., sparsity_levels=...)``) within it, else dense. The two errors add up roughly,
                so the attention's error is about ``budget + sparsity_budget`` where both are spent. None: dense
                (the ``calibrate`` command uses ``SPARSITY_BUDGET``, 0.05, where it measured levels).
            carry_budget: with ``sparsity_budget``, where the calibration also measured carrying
                (``calibrate(..., refresh_every=...)``): the largest accepted error of a level carried at an
                interval (same metric; the default is a relative L1), averaged along the trajectory (over the
                layers and the INT8 steps, each step weighted by the noise it removes:
                ``Calibration.carry_trajectory_error``). Of the settings within it, the one whose steps compute
                the fewest blocks (a refresh computes all of them) is taken over dropping if it computes fewer than
                dropping does. Along the trajectory rather
                than at the worst step: the forecast's error peaks at the noisiest steps and at the last, nearly
                noiseless ones, and on the long shipped model the trajectory's mean ranks the settings' PSNR where
                the worst step does not (BENCHMARKS.md, "The setting calibration chooses"). None: never carry.
                Only where the calibration ran ``MIN_CARRY_STEPS`` (20) steps or more; at fewer the budget does not
                hold image quality, and the schedule drops the levels with a warning.

        Each calibrated step, decided by the worst of the denoiser's calls at its noise level (CFG's two, a
        second-order scheduler's), covers the noise levels half-way to its neighbours, so the schedule applies
        to any number of steps. Modes are tried in the order ``int8``, ``int8_fp16v``, ``fp16``; sparsity
        applies where the mode is an INT8 one. ``balance_layers`` are the calibration's ``balanced_layers()``
        (None for a file without per-channel maxima).
        """
        if isinstance(calibration, (str, os.PathLike)):
            raise TypeError(f"calibration must be a Calibration, got the path {str(calibration)!r}: "
                            f"diffusion_int8.calibration.Calibration.load(path) reads it")
        if not (_is_number(budget) and budget >= 0):
            raise ValueError(f"budget must be a number >= 0 (an attention error, relative L1 or 1 - cosine), "
                             f"got {budget!r}")
        if metric not in ("rel_l1", "cos"):
            raise ValueError(f"metric must be 'rel_l1' or 'cos', got {metric!r}")
        if not (carry_budget is None or (_is_number(carry_budget) and carry_budget > 0)):
            raise ValueError(f"carry_budget must be a number > 0 or None (never carry), got {carry_budget!r}")
        levels = []
        if sparsity_budget is not None:
            if not (_is_number(sparsity_budget) and sparsity_budget > 0):
                raise ValueError(f"sparsity_budget must be a number > 0 or None, got {sparsity_budget!r}")
            levels = calibration.sparsity_levels()
            if not levels:
                raise ValueError("sparsity_budget needs a calibration with sparsity levels: run "
                                 "`diffusion-int8 calibrate --sparsity-levels ...` (calibrate(sparsity_levels=...))")
        noise = [float(n) for n in calibration.noise]
        # the calibrated calls by noise level, ascending: a level's calls are one denoising step (CFG's two calls,
        # a second-order scheduler's two), and a run's calls at that level all take the level's rule, so each
        # level is decided by the worst of its calls
        order = sorted(set(noise))
        calls = {n: [t for t, m in enumerate(noise) if m == n] for n in order}
        bounds = [0.0] + [(a + b) / 2 for a, b in zip(order, order[1:])] + [1.0]
        interval = {n: (bounds[j], bounds[j + 1]) for j, n in enumerate(order)}
        names = list(calibration.layers)
        cheapest = [Mode.INT8, Mode.INT8_FP16V]

        def err(mode: Mode) -> torch.Tensor:  # (L, T)
            e = calibration.error(mode.value, metric)
            return 1 - e if metric == "cos" else e

        errs = {m: err(m) for m in cheapest if m.value in calibration.modes()}
        sparse_errs = {tau: calibration.sparse_error(tau, metric) for tau in levels}  # tau ascending: sparsest first
        if metric == "cos":
            sparse_errs = {tau: 1 - e for tau, e in sparse_errs.items()}

        def choose(values: dict) -> Mode:
            return next((m for m in cheapest if m in values and values[m] <= budget), Mode.FP16)

        def choose_tau(values: dict, mode: Mode) -> float | None:
            if mode is Mode.FP16:
                return None
            return next((tau for tau, e in values.items() if e <= sparsity_budget), None)

        def worst(e: torch.Tensor, idx: list[int], n: float) -> float:  # e (L, T): layers idx, the calls at level n
            return float(e[idx][:, calls[n]].max())

        rules = []
        groups = [(n, [i]) for i, n in enumerate(names)] if per_layer else [("*", list(range(len(names))))]
        # the calls at the levels where some layer runs INT8 (a carried setting's error is averaged over them)
        int8_steps = [t for t in range(len(noise))
                      if any(choose({m: worst(e, [i], noise[t]) for m, e in errs.items()}) is not Mode.FP16
                             for i in range(len(names)))]
        steps = denoising_steps(calibration.timesteps)
        may_carry = bool(levels) and carry_budget is not None and bool(calibration.carry_settings())
        if may_carry and (steps or 0) < MIN_CARRY_STEPS:
            warn_user(f"diffusion_int8: the calibration ran {steps} denoising steps; a schedule carries skipped "
                      f"blocks only from {MIN_CARRY_STEPS} (on the long shipped model the setting chosen within the "
                      f"carry budget gave 21.6 dB against FP16 at 4 steps, 26.4 at 12, 29.9 at 20), so this one drops "
                      f"them. Calibrate at the step count you run, {MIN_CARRY_STEPS} or more, to carry.")
            may_carry = False
        carried = (_carried_choice(calibration, sparsity_budget, carry_budget, metric, int8_steps, sparse_errs,
                                   [calls[n] for n in noise])
                   if may_carry else None)
        for pattern, idx in groups:
            modes = {n: choose({m: worst(e, idx, n) for m, e in errs.items()}) for n in order}
            if carried is None:
                taus = {n: choose_tau({tau: worst(e, idx, n) for tau, e in sparse_errs.items()}, modes[n])
                        for n in order}
            else:  # one level, carried, wherever the step runs INT8
                taus = {n: None if modes[n] is Mode.FP16 else carried[0] for n in order}
            # merge neighbouring levels that chose the same mode and sparsity into one noise interval
            run_start = None
            for j, n in enumerate(order):
                if run_start is None:
                    run_start = n
                nxt = order[j + 1] if j + 1 < len(order) else None
                if nxt is None or (modes[nxt], taus[nxt]) != (modes[n], taus[n]):
                    rules.append(Rule(modes[n], interval[run_start][0], interval[n][1], pattern, taus[n]))
                    run_start = None
        sparse = f", sparsity<={sparsity_budget}" if sparsity_budget is not None else ""
        if carried is not None:
            sparse += f", carried every {carried[1]}, trajectory<={carry_budget}"
        balance = tuple(calibration.balanced_layers()) if calibration.has_channel_ranges() else None
        return cls(rules=tuple(rules), default=Mode.FP16, balance_layers=balance,
                   refresh_every=None if carried is None else carried[1],
                   calibrated_steps=steps,
                   num_train_timesteps=calibration.meta.get("num_train_timesteps") or calibration.meta.get("timestep_scale"),
                   name=name or f"calibrated({metric}<={budget}{sparse}{', per layer' if per_layer else ''})")

    def __call__(self, timestep: float) -> Mode:
        return self.mode_for(timestep)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "rules",
            "name": self.name,
            "default": self.default.value,
            "default_tau": self.default_tau,
            "num_train_timesteps": self.num_train_timesteps,
            "rules": [{**asdict(r), "mode": r.mode.value} for r in self.rules],
            "balance_layers": None if self.balance_layers is None else list(self.balance_layers),
            "refresh_every": self.refresh_every,
            "calibrated_steps": self.calibrated_steps,
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "schedule") -> "PrecisionSchedule":
        """The schedule ``to_dict`` wrote; anything else raises ``ValueError`` naming ``source`` and the field."""

        def bad(where: str, what: str) -> ValueError:
            return ValueError(f"{source}: {where}: {what}")

        if not isinstance(data, dict):
            raise ValueError(f"{source}: a schedule is a JSON object (as PrecisionSchedule.save writes), "
                             f"got {_json_type(data)}")
        schema = data.get("schema_version")
        if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
            raise bad("schema_version", f"{schema!r} is not a diffusion-int8 schedule schema; "
                                        f"this version reads schemas {', '.join(map(str, READABLE_SCHEMAS))}")
        if data.get("kind") != "rules":
            raise bad("kind", f"{data.get('kind')!r}; a schedule file has kind \"rules\"")
        known = tuple(f for f in _FIELDS if schema >= _SINCE.get(f, 1))
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise bad(unknown[0], f"unknown field{f' in schema {schema}' if schema < SCHEMA_VERSION else ''}; the "
                                  f"fields are {', '.join(known)}")
        if "default" not in data:
            raise bad("default", f"missing; give the mode where no rule matches: {', '.join(m.value for m in Mode)}")
        try:
            default = Mode.parse(data["default"])
        except ValueError as e:
            raise bad("default", str(e)) from None
        if not isinstance(data.get("rules"), list):
            raise bad("rules", f"must be a list of rules (it may be empty), got {_json_type(data.get('rules'))}")
        rule_fields = _RULE_FIELDS if schema >= 2 else tuple(f for f in _RULE_FIELDS if f != "tau")
        rules = tuple(_rule_from_dict(r, f"rules[{i}]", bad, rule_fields) for i, r in enumerate(data["rules"]))
        if not isinstance(data.get("name", ""), str):
            raise bad("name", f"must be a string, got {_json_type(data['name'])}")
        default_tau = data.get("default_tau")
        if default_tau is not None:
            try:
                default_tau = check_tau(default_tau, "default_tau")
            except ValueError as e:
                raise bad("default_tau", f"{e} or null (dense)") from None
        balance = data.get("balance_layers")
        if balance is not None and not (isinstance(balance, list) and all(isinstance(n, str) for n in balance)):
            raise bad("balance_layers", f"must be a list of module names or null, got {_json_type(balance)}")
        every = data.get("refresh_every")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 2):
            raise bad("refresh_every", f"must be null or an integer >= 2, got {every!r}")
        steps = data.get("calibrated_steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise bad("calibrated_steps", f"must be null or an integer >= 1 (the calibration's step count), got {steps!r}")
        try:
            return cls(rules=rules, default=default, num_train_timesteps=data.get("num_train_timesteps"),
                       name=data.get("name", "custom"), default_tau=default_tau,
                       balance_layers=None if balance is None else tuple(balance), refresh_every=every,
                       calibrated_steps=steps)
        except ValueError as e:  # what is left to check: the scale, and refresh_every against the levels
            raise bad("refresh_every" if "refresh_every" in str(e) else "num_train_timesteps", str(e)) from None

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the schedule as JSON to the file ``path`` (``FileExistsError`` where it exists, unless
        ``overwrite``); ``load`` reads it back."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory; give the schedule's file name, e.g. "
                                    f"{path / 'schedule.json'}")
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        jsonfile.write(path, self.to_dict(), indent=2)
        return path

    @classmethod
    def load(cls, path_or_preset: str | Path) -> "PrecisionSchedule":
        """A preset name (``PRESETS``) or a JSON file written by ``save``, checked whole (see ``from_dict``)."""
        if str(path_or_preset) in PRESETS:
            return PRESETS[str(path_or_preset)]
        path = Path(path_or_preset)
        if not path.is_file():
            if path.suffix or len(path.parts) > 1:  # meant as a file
                raise FileNotFoundError(f"no schedule file at {path} (nor is it a preset: {', '.join(PRESETS)})")
            raise FileNotFoundError(f"{path} is neither a schedule file nor a preset ({', '.join(PRESETS)})")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a schedule: not UTF-8 text (byte {e.start}: {e.reason}); "
                             f"a schedule is the JSON that PrecisionSchedule.save writes") from None
        return cls.from_dict(jsonfile.loads(text, str(path)), source=str(path))


def _carried_choice(calibration, budget: float, carry_budget: float, metric: str, steps: list[int],
                    sparse_errs: dict, step_calls: list[list[int]]) -> tuple[float, int] | None:
    """(level, refresh interval) of carried skipped blocks that computes the fewest block pairs over the calibrated
    ``steps`` that run INT8, with its error averaged along them within ``carry_budget`` (each step weighted by the
    noise it removes), if it computes fewer than dropping the per-step levels within ``budget`` would; else None
    (drop them). Only where those steps are the first ones of the trajectory (0, 1, ...): the calibration carried
    from step 0 at every step, and at run time the carry sees the INT8 steps alone, so any other run of steps
    would refresh on other steps than measured. ``step_calls[t]``: the calls at call ``t``'s noise level."""
    if not steps or steps != list(range(len(steps))) or not calibration.carry_settings():
        return None

    def cost(kept: torch.Tensor) -> float:  # (L, T) fractions computed: mean over the layers and the INT8 steps
        return float(kept[:, steps].mean())

    dropped_kept = []
    for t in steps:  # the level the schedule drops at this call's step: within budget at every call of the step
        tau = next((tau for tau, e in sparse_errs.items() if float(e[:, step_calls[t]].max()) <= budget), None)
        dropped_kept.append(1.0 if tau is None else float(calibration.kept(tau)[:, t].mean()))
    best, best_cost = None, sum(dropped_kept) / len(dropped_kept)
    for tau, every in calibration.carry_settings():
        err = calibration.carry_trajectory_error(tau, every, metric, steps)
        if (1 - err if metric == "cos" else err) > carry_budget:
            continue
        c = cost(calibration.carry_kept(tau, every))
        if c < best_cost - 1e-9 or (best is not None and abs(c - best_cost) <= 1e-9 and every > best[1]):
            best, best_cost = (tau, every), c
    return best


_RULE_FIELDS = tuple(f.name for f in fields(Rule))


def _rule_from_dict(data, where: str, bad, rule_fields: tuple[str, ...] = _RULE_FIELDS) -> Rule:
    """One rule of a schedule file with the fields ``rule_fields`` (its schema's); ``bad(where, what)`` makes the
    error."""
    if not isinstance(data, dict):
        raise bad(where, f"a rule is an object with {', '.join(rule_fields)}, got {_json_type(data)}")
    unknown = sorted(set(data) - set(rule_fields))
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"unknown field; a rule's fields are {', '.join(rule_fields)}")
    if "mode" not in data:
        raise bad(f"{where}.mode", f"missing; give one of {', '.join(m.value for m in Mode)}")
    try:
        return Rule(**data)
    except ValueError as e:
        raise bad(where, str(e)) from None


# Starting points, not measured optima: calibration-driven schedules will replace guesses with data.
PRESETS = {
    "int8": PrecisionSchedule(default=Mode.INT8, name="int8"),
    "int8_fp16v": PrecisionSchedule(default=Mode.INT8_FP16V, name="int8_fp16v"),
    "fp16": PrecisionSchedule(default=Mode.FP16, name="fp16"),
    # INT8 where noise is high, FP16 P·V in the middle, exact attention for the last, detail-setting steps
    "balanced": PrecisionSchedule(
        rules=(Rule(Mode.INT8, min_noise=0.5), Rule(Mode.INT8_FP16V, min_noise=0.1)),
        default=Mode.FP16, name="balanced",
    ),
}
