"""What ``calibrate`` and ``eval`` share: the model and prompt arguments, read and checked as user errors."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import pipelines
from ..embedded.variants import describe, shipped
from .usage import (UsageError, check_input_file, check_readable, device_arg, int_at_least, nonnegative_float, path_arg,
                    text_path, user_errors)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by ``calibrate`` and ``eval``."""
    p.add_argument("--model", type=text_path, default=pipelines.EMBEDDED,
                   help=f"local diffusers pipeline directory, or a shipped shapes model: {describe()} "
                        f"(default: {pipelines.EMBEDDED})")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", type=path_arg, help="text file, one prompt per line")
    src.add_argument("--class-labels", nargs="+", help="class names or ids, for class-conditional pipelines")
    add_run_args(p, batch_size=8)
    p.add_argument("--guidance-scale", type=nonnegative_float, default=None, help="default: the pipeline's")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cuda, cuda:N or cpu (default: the process's GPU, else cpu)")
    p.add_argument("--out", type=path_arg, required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs in --out")


def add_run_args(p: argparse.ArgumentParser, batch_size: int, steps: int | None = 20, steps_default: str = "%(default)s") -> None:
    """``--steps``, ``--batch-size`` and ``--seed``: ``calibrate``'s, ``eval``'s and ``demo``'s (whose ``--steps``
    default depends on the device: ``steps`` None, ``steps_default`` says what it is)."""
    p.add_argument("--steps", type=int_at_least(1, pipelines.MAX_STEPS), default=steps,
                   help=f"denoising steps, at most {pipelines.MAX_STEPS} (default: {steps_default})")
    p.add_argument("--batch-size", type=int_at_least(1, pipelines.MAX_BATCH_SIZE), default=batch_size,
                   help=f"images per pipeline call, at most {pipelines.MAX_BATCH_SIZE} (default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0, pipelines.MAX_SEED), default=0,
                   help="image i is seeded with seed + i (default: %(default)s)")


WEIGHTS = {"--lpips-weights": "torchvision's AlexNet weights file (alexnet-owt-7be5be79.pth)",
           "--fid-weights": "torch-fidelity's Inception weights file (weights-inception-2015-12-05-6726825d.pth)"}


def check_weights(lpips_weights: str | None, fid_weights: str | None) -> None:
    """The metric weights the user named: files that exist and can be read, checked before any work."""
    for flag, path in (("--lpips-weights", lpips_weights), ("--fid-weights", fid_weights)):
        if path is not None:
            check_input_file(path, flag, WEIGHTS[flag])


def check_model(model: str) -> None:
    """``--model``: a shipped name, or a directory whose model index is sound, checked before anything loads."""
    with user_errors():
        pipelines.check_model(model)


def read_items(prompts: Path | None, class_labels: list[str] | None, model: str) -> pipelines.Items | None:
    """``--prompts`` or ``--class-labels``, read before the model loads (None: the pipeline's default); for a
    shipped model, each checked to name one of its classes then too."""
    if prompts is None and class_labels is None:
        return None
    if prompts is not None:
        check_readable(prompts)
    with user_errors():
        items = pipelines.read_items(prompts, class_labels)
    if shipped(model) is not None:
        from ..embedded.shapes import label_ids

        with user_errors(ValueError):
            label_ids(items.values)
    return items


def items_for(model: str, pipe, items: pipelines.Items | None) -> pipelines.Items:
    """``items``, or the pipeline's default; class labels checked against the pipeline."""
    if items is None:
        if not (hasattr(pipe, "labels") and isinstance(pipe.labels, (list, tuple))):
            raise UsageError(f"{model} has no default labels: give --prompts FILE or --class-labels ...")
        items = pipelines.default_items(pipe)
    with user_errors(ValueError):
        pipelines.check_labels(pipe, items)
    return items


def item_kwargs(items: pipelines.Items) -> dict:
    """``items`` as the library functions take them: ``prompts=`` or ``class_labels=``."""
    return {"prompts" if items.kind == "prompt" else "class_labels": items.values}


def load_pipeline(model: str, device):
    """``--model`` on ``device``; a directory that is not a pipeline is the user's error."""
    with user_errors(FileNotFoundError, ValueError):
        return pipelines.load(model, device)
