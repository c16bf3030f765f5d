"""Rule-based precision schedules: which attention mode runs at which noise level and layer.

A schedule maps the denoiser's timestep, normalized to a noise level in [0, 1], and the attention
module's name to a ``Mode``. Rules are tried in order; the first that matches wins, else ``default``.

    schedule = PrecisionSchedule(
        rules=[Rule("fp16", min_noise=0.98),              # the first, highest-noise step exact
               Rule("int8", min_noise=0.3),
               Rule("int8_fp16v", layers="*attn2*")],      # cross-attention at low noise
        default="int8_fp16v",
    )
    diffusion_int8.enable(pipe, schedule=schedule)

Schedules serialize to JSON (``save`` / ``load``). Schedules driven by calibration data come with
the calibration subsystem.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .kernels import Mode

SCHEMA_VERSION = 1


def noise_level(timestep: float, num_train_timesteps: float | None = None) -> float:
    """The denoiser's timestep as a noise level in [0, 1].

    Flow-matching models (Flux, SD3, Wan, …) pass timesteps as sigmas in [0, 1] or as sigma·1000;
    DDPM-style models pass integer timesteps in [0, num_train_timesteps). Without
    ``num_train_timesteps``, values above 1 are read as out of 1000.
    """
    if num_train_timesteps:
        return float(timestep) / float(num_train_timesteps)
    t = float(timestep)
    return t / 1000.0 if t > 1.0 else t


@dataclass(frozen=True)
class Rule:
    """``mode`` for noise levels in [min_noise, max_noise] and module names matching ``layers`` (fnmatch)."""

    mode: Mode
    min_noise: float = 0.0
    max_noise: float = 1.0
    layers: str = "*"

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if not 0.0 <= self.min_noise <= self.max_noise <= 1.0:
            raise ValueError(f"a rule needs 0 <= min_noise <= max_noise <= 1, got {self.min_noise}, {self.max_noise}")

    def matches(self, noise: float, layer: str | None) -> bool:
        if not self.min_noise <= noise <= self.max_noise:
            return False
        return self.layers == "*" or (layer is not None and fnmatch.fnmatchcase(layer, self.layers))


@dataclass(frozen=True)
class PrecisionSchedule:
    """An ordered list of rules and a default mode. Callable as ``schedule(timestep) -> Mode``."""

    rules: tuple[Rule, ...] = ()
    default: Mode = Mode.INT8
    num_train_timesteps: float | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.rules))
        object.__setattr__(self, "default", Mode.parse(self.default))

    def mode_for(self, timestep: float, layer: str | None = None) -> Mode:
        noise = noise_level(timestep, self.num_train_timesteps)
        for rule in self.rules:
            if rule.matches(noise, layer):
                return rule.mode
        return self.default

    def __call__(self, timestep: float) -> Mode:
        return self.mode_for(timestep)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "rules",
            "name": self.name,
            "default": self.default.value,
            "num_train_timesteps": self.num_train_timesteps,
            "rules": [{**asdict(r), "mode": r.mode.value} for r in self.rules],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "PrecisionSchedule":
        if data.get("schema_version") != SCHEMA_VERSION or data.get("kind") != "rules":
            raise ValueError(
                f"not a diffusion-int8 rule schedule of schema {SCHEMA_VERSION}: "
                f"schema_version={data.get('schema_version')!r}, kind={data.get('kind')!r}"
            )
        return cls(rules=tuple(Rule(**r) for r in data["rules"]), default=data["default"],
                   num_train_timesteps=data.get("num_train_timesteps"), name=data.get("name", "custom"))

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path_or_preset: str | Path) -> "PrecisionSchedule":
        """A preset name (``PRESETS``) or a JSON file written by ``save``."""
        if str(path_or_preset) in PRESETS:
            return PRESETS[str(path_or_preset)]
        path = Path(path_or_preset)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is neither a schedule file nor a preset ({', '.join(PRESETS)})")
        return cls.from_dict(json.loads(path.read_text()))


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
