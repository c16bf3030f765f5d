"""The zoo's registry: tiny configs of every model class diffusers exports that has attention, with inputs.

A case is a function ``build(d, r) -> (model, inputs)``: ``d`` is the ``diffusers`` module, ``r(*shape)`` draws
seeded standard-normal values (fp32). The model comes back in fp32 and ``eval()`` mode with seeded weights; the
inputs are the keyword arguments of its ``forward``. Where the model takes an attention mask (a text padding mask
or similar), the inputs carry a padded one (zeros at the end of at least one sequence), named by ``mask=``.
``routable=False`` marks a model whose attention is computed in plain modules' own ``forward`` (no processor to
swap): ``enable`` must refuse it, saying so. ``cpu_only`` says why a case cannot move to a GPU as it is built. ``exclude`` names a class that is not run, with the reason.
"""

from __future__ import annotations

from typing import Callable

import torch

CASES: dict[str, tuple[Callable, str | None]] = {}  # class name -> (build, name of the padded-mask input or None)
UNROUTABLE: set[str] = set()  # cases whose attention has no processor to swap
CPU_ONLY: dict[str, str] = {}  # cases that hold CPU state outside their modules' tensors, with the reason
EXCLUDED: dict[str, str] = {}  # class name -> why it is not run


def case(class_name: str, mask: str | None = None, routable: bool = True, cpu_only: str | None = None):
    def register(build):
        if class_name in CASES or class_name in EXCLUDED:
            raise ValueError(f"{class_name} registered twice")
        CASES[class_name] = (build, mask)
        if not routable:
            UNROUTABLE.add(class_name)
        if cpu_only:
            CPU_ONLY[class_name] = cpu_only
        return build

    return register


def exclude(class_name: str, reason: str) -> None:
    if class_name in CASES or class_name in EXCLUDED:
        raise ValueError(f"{class_name} registered twice")
    EXCLUDED[class_name] = reason


def build(class_name: str):
    """(model, inputs) of a registered case: weights seeded with 0, inputs with 1."""
    import diffusers

    fn, _ = CASES[class_name]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model, inputs = fn(diffusers, lambda *shape: torch.randn(*shape, generator=g))
    return model.eval(), inputs


def tensors(out) -> list[torch.Tensor]:
    """Every tensor in a model's output (tensors, tuples, lists, dicts, diffusers' BaseOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # BaseOutput is an OrderedDict
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    return []


def to_device(obj, device):
    """Inputs (tensors in dicts, lists and tuples) moved to ``device``; None where something cannot move (a CPU
    random generator the model draws from)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, torch.Generator):
        return None
    if isinstance(obj, dict):
        moved = {k: to_device(v, device) for k, v in obj.items()}
        return None if any(m is None and v is not None for m, v in zip(moved.values(), obj.values())) else moved
    if isinstance(obj, (list, tuple)):
        moved = [to_device(v, device) for v in obj]
        return None if any(m is None and v is not None for m, v in zip(moved, obj)) else type(obj)(moved)
    return obj


def run(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return tensors(model(**inputs))
