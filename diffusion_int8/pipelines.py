"""Running pipelines for calibration and evaluation: what to generate, batching, seeding and sharding, and
loading a local pipeline for the command line.

Under ``accelerate launch`` (or ``torchrun``) batches are dealt round-robin to the processes and the
records gathered back; every image's seed is ``seed + its index``, so the images and statistics do
not depend on how many processes ran them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from . import jsonfile
from .embedded.variants import VARIANTS, describe, shipped
from .plugin.models import denoiser

EMBEDDED = VARIANTS["base"].name  # the default --model; every shipped name is in embedded.variants


@dataclass
class Items:
    """What to generate: text prompts, or class labels for class-conditional pipelines."""

    values: list
    kind: str  # "prompt" or "class_labels"

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([self.kind, self.values]).encode()).hexdigest()

    def batches(self, batch_size: int) -> list[tuple[int, list, list[int]]]:
        """``(batch index, items, image indices)`` in order."""
        out = []
        for b, start in enumerate(range(0, len(self.values), batch_size)):
            idx = list(range(start, min(start + batch_size, len(self.values))))
            out.append((b, [self.values[i] for i in idx], idx))
        return out


def read_items(prompts: str | Path | None, class_labels: Sequence[str] | None) -> Items:
    """Prompts from a text file (one per line; blank lines and ``#`` comments skipped), or class labels."""
    if (prompts is None) == (class_labels is None):
        raise ValueError("give exactly one of --prompts FILE or --class-labels ...")
    if class_labels is not None:
        labels = [int(c) if str(c).isdigit() else str(c) for c in class_labels]
        return Items(labels, "class_labels")
    path = Path(prompts)
    kind = path.stat().st_mode if path.exists() else None
    # a pipe (/dev/stdin, <(...)) is not a regular file but reads as one; a device (/dev/zero) may never end
    if kind is None or not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
        what = ("does not exist" if kind is None else "is a directory" if stat.S_ISDIR(kind)
                else "is neither a file nor a pipe")
        raise FileNotFoundError(f"prompt file {path} {what}; give a UTF-8 text file, one prompt per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                         f"save it as UTF-8, one prompt per line") from None
    if "\x00" in text:  # valid UTF-8 all the same, but a binary file, not prompts
        raise ValueError(f"prompt file {path} holds NUL bytes: a binary file, not text; give one prompt per line")
    lines = [ln.strip() for ln in text.splitlines()]
    values = [ln for ln in lines if ln and not ln.startswith("#")]
    if not values:
        raise ValueError(f"prompt file {path} holds no prompts (one per line; blank lines and # comments are skipped)")
    return Items(values, "prompt")


def check_labels(pipe, items: Items) -> None:
    """Raise ``ValueError`` now, not at the first generation, for class labels the pipeline does not know (or
    prompts naming none, for a class-conditional pipeline that takes prompts: the shipped one)."""
    if items.kind != "class_labels":
        if hasattr(pipe, "label_ids"):
            pipe.label_ids(items.values)
        return
    if hasattr(pipe, "label_ids"):
        pipe.label_ids(items.values)
    elif any(isinstance(c, str) for c in items.values) and hasattr(pipe, "get_label_ids"):
        pipe.get_label_ids(items.values)  # as generate() calls it


def resolve_items(pipe, prompts=None, class_labels=None) -> Items:
    """``Items`` of ``prompts`` or ``class_labels`` (not both), checked against ``pipe``; neither: the pipeline's
    default (one image of each of its ``labels``). ``ValueError`` for labels ``pipe`` does not know."""
    if prompts is not None and class_labels is not None:
        raise ValueError("give prompts or class_labels, not both")
    if isinstance(prompts, str) or isinstance(class_labels, str):
        raise ValueError("prompts and class_labels are lists (one image each), not a single string")
    if prompts is not None:
        items = Items(list(prompts), "prompt")
    elif class_labels is not None:
        items = Items(list(class_labels), "class_labels")
    elif hasattr(pipe, "labels") and isinstance(pipe.labels, (list, tuple)):
        items = default_items(pipe)
    else:
        raise ValueError(f"{type(pipe).__name__} has no default labels: give prompts or class_labels")
    if not items.values:
        raise ValueError("no prompts or class labels to generate")
    check_labels(pipe, items)
    return items


def default_items(pipe) -> Items:
    """For the embedded pipeline without prompts: one image of every class."""
    return Items(list(pipe.labels), "class_labels")


def load(model: str | Path, device: torch.device, dtype: torch.dtype | None = None):
    """A diffusers pipeline from a local directory (never a hub download), or a shipped model by name
    (``embedded``, ``embedded-long``: ``embedded.variants``).

    ``dtype`` defaults to fp16 on CUDA and fp32 on the CPU. ``FileNotFoundError`` for a directory that holds
    no pipeline, or a shipped model whose weights are not in this install; ``ValueError`` for a directory
    whose pipeline cannot be loaded from it (see ``check_model``).
    """
    from .embedded import load_pipeline

    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    variant = shipped(model)
    if variant is not None:
        return load_pipeline(variant=variant.key, device=device, dtype=dtype)
    path = Path(model)
    index = check_model(path)
    try:
        if index["_class_name"] == "ShapesPipeline":
            return load_pipeline(path, device=device, dtype=dtype)
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:  # diffusers' for missing or mismatched files: the directory's fault
        raise ValueError(f"{path} cannot be loaded: {' '.join(str(e).split())}") from e
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def check_model(model: str | Path) -> dict:
    """The model index of the pipeline directory ``model``, checked without loading anything:
    ``FileNotFoundError`` for no index or a component directory it lists that is missing, ``ValueError`` for
    an index that is not one. A shipped model's name passes (returns ``{}``)."""
    if shipped(model) is not None:
        return {}
    path = Path(model)
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{path} is not a local diffusers pipeline (no model_index.json); "
                                f"pass a directory saved with save_pretrained, or a shipped model: {describe()}")
    try:
        data = jsonfile.loads(index.read_text(encoding="utf-8"), str(index))
    except UnicodeDecodeError as e:
        raise ValueError(f"{index} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not (isinstance(data, dict) and isinstance(data.get("_class_name"), str)):
        raise ValueError(f"{index} is not a diffusers model index (a JSON object with _class_name)")
    if data["_class_name"] != "ShapesPipeline":
        import diffusers

        if not hasattr(diffusers, data["_class_name"]):
            raise ValueError(f"{index} names the pipeline class {data['_class_name']!r}, which diffusers "
                             f"{diffusers.__version__} does not have (a newer release's, or a typo)")
    for name, entry in data.items():
        # a component: ["library", "Class"]; [null, null] marks an optional one that is absent
        if (not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and None not in entry
                and not (path / name).is_dir()):
            raise FileNotFoundError(f"{path} has no {name}/ (model_index.json lists it): not a complete pipeline")
    return data


def model_id(model: str | Path) -> str:
    """``--model`` as calibration files and reports record it: a shipped name (``embedded``), or the absolute
    path."""
    return str(model) if shipped(model) else str(Path(model).resolve())


def pipeline_id(pipe) -> str:
    """A loaded pipeline's name for the records: a shipped name for a shipped one (``embedded``), else where it
    was loaded from, else its class name."""
    path = getattr(pipe, "name_or_path", None)
    if path:
        for v in VARIANTS.values():
            if Path(path).resolve() == v.path.resolve():
                return v.name
    return str(path or type(pipe).__name__)


def generate(pipe, items: Items, batch_items: list, indices: list[int], *, steps: int, seed: int,
             guidance_scale: float | None = None, on_step: Callable[[int], object] | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) float32 in [0, 1] on the CPU; image i is seeded with ``seed + i``.

    ``on_step(n)`` is called as denoising advances, ``steps`` in all per call (a progress bar's ``update``):
    from the pipeline's ``callback_on_step_end`` where it has one, else whenever the timestep that the
    denoiser receives changes.
    """
    gens = [torch.Generator().manual_seed(seed + i) for i in indices]
    kwargs = {"num_inference_steps": steps, "generator": gens, "output_type": "np"}
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    # the caller shows progress (on_step): a diffusers pipeline's own bar would print beside it
    bar = dict(getattr(pipe, "_progress_bar_config", {})) if hasattr(pipe, "set_progress_bar_config") else None
    if bar is not None:
        pipe.set_progress_bar_config(**{**bar, "disable": True})
    with _step_progress(pipe, kwargs, steps, on_step), _restored(pipe, bar):
        if items.kind == "class_labels":
            ids = batch_items
            if hasattr(pipe, "label_ids"):
                ids = pipe.label_ids(ids)
            elif any(isinstance(c, str) for c in ids):
                ids = pipe.get_label_ids(ids)  # DiTPipeline's names -> ids
            out = pipe(class_labels=ids, **kwargs).images
        else:
            out = pipe(prompt=batch_items, **kwargs).images
    return torch.from_numpy(np.asarray(out, dtype=np.float32)).permute(0, 3, 1, 2).contiguous()


@contextmanager
def _restored(pipe, bar: dict | None):
    try:
        yield
    finally:
        if bar is not None:
            pipe._progress_bar_config = bar


@contextmanager
def _step_progress(pipe, kwargs: dict, steps: int, on_step: Callable[[int], object] | None):
    """Report denoising steps to ``on_step``: exactly ``steps`` of them, the rest at the end if fewer were seen
    (a scheduler of higher order, a pipeline that skips steps), none beyond."""
    if on_step is None:
        yield
        return
    done = 0

    def advance():
        nonlocal done
        if done < steps:
            done += 1
            on_step(1)

    hook = None
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        def callback(_pipe, _i, _t, _tensors):
            advance()
            return {}

        kwargs.update(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=[])
    else:  # DiTPipeline and others without the callback: count the distinct timesteps the denoiser sees
        last = [None]

        def pre_hook(_module, args, kw):
            t = kw.get("timestep", args[1] if len(args) > 1 else None)
            t = float(t.reshape(-1)[0]) if torch.is_tensor(t) else t
            if t != last[0]:
                last[0] = t
                advance()

        hook = denoiser(pipe).register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
    if done < steps:
        on_step(steps - done)


class Shards:
    """The process's share of the work under ``accelerate launch``/``torchrun``; one process otherwise."""

    def __init__(self, device: str | None = None):
        from accelerate import PartialState

        cuda = torch.cuda.is_available() and device != "cpu"
        self.state = PartialState(cpu=not cuda)
        self.rank, self.world = self.state.process_index, self.state.num_processes
        self.device = torch.device(device) if device else (self.state.device if cuda else torch.device("cpu"))
        self.is_main = self.state.is_main_process

    def mine(self, work: list) -> list:
        return work[self.rank::self.world]

    def gather(self, records: list) -> list:
        if self.world == 1:
            return records
        from accelerate.utils import gather_object

        return gather_object(records)

    def barrier(self) -> None:
        if self.world > 1:
            self.state.wait_for_everyone()


MAX_STEPS = 10_000  # far more than any diffusion scheduler is run with
MAX_BATCH_SIZE = 4096
MAX_SEED = 2**63 - 1  # image i takes seed + i, which torch.Generator.manual_seed takes up to 2**64 - 1


def check_run(steps, batch_size, seed, guidance_scale) -> None:
    """``ValueError`` (``TypeError`` for a wrong type) naming the argument unless these describe a run: integers
    1..``MAX_STEPS`` steps and 1..``MAX_BATCH_SIZE`` images a batch, an integer seed 0..``MAX_SEED``, and a finite
    guidance scale or None. Checked before any work (a typo's 10**9 steps would grow until the OOM killer stops it)."""
    for name, value, high in (("steps", steps, MAX_STEPS), ("batch_size", batch_size, MAX_BATCH_SIZE)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if not 1 <= value <= high:
            raise ValueError(f"{name} must be from 1 to {high}, got {value}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer from 0 to {MAX_SEED} (2**63 - 1), got {seed!r}")
    if guidance_scale is not None and (isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float))
                                       or not math.isfinite(guidance_scale)):
        raise ValueError(f"guidance_scale must be a finite number or None, got {guidance_scale!r}")
