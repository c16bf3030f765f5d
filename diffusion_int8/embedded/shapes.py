"""A procedural data set of coloured shapes on textured backgrounds, rendered on the fly.

Sixteen classes, ``"<colour> <shape>"`` for four colours and four shapes, each drawn at a random
position, size and rotation over a low-contrast striped background, anti-aliased through signed
distance functions. Everything is a function of the generator, so a seed fixes the data set.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

SHAPES = ("circle", "square", "triangle", "ring")
COLOURS = {"red": (0.9, 0.15, 0.1), "green": (0.15, 0.75, 0.2), "blue": (0.15, 0.3, 0.95), "yellow": (0.95, 0.85, 0.1)}
CLASSES = tuple(f"{c} {s}" for s in SHAPES for c in COLOURS)
NUM_CLASSES = len(CLASSES)


def label_ids(class_labels: int | str | Sequence[int | str]) -> list[int]:
    """Class indices of ``class_labels``: indices, class names, or prompts that name one class ("a red circle on
    white" is ``red circle``); one string or index is one label. ``ValueError`` names a label that is none."""
    if isinstance(class_labels, (str, int)):
        class_labels = [class_labels]
    ids = []
    for c in class_labels:
        if isinstance(c, str):
            c = CLASSES.index(_class_named_in(c))
        if not 0 <= int(c) < NUM_CLASSES:
            raise ValueError(f"class index {c} is out of range 0..{NUM_CLASSES - 1}")
        ids.append(int(c))
    return ids


def _class_named_in(text: str) -> str:
    """The class a label or prompt names: the class name itself, or the one class name the prompt contains."""
    if text in CLASSES:
        return text
    words = " ".join(text.lower().replace(",", " ").split())
    named = [c for c in CLASSES if f" {c} " in f" {words} "]
    if len(named) != 1:
        why = "names no class" if not named else f"names several classes ({', '.join(named)})"
        shown = repr(text) if len(text) <= 120 else f"{text[:100]!r}... ({len(text):,} characters)"
        raise ValueError(f"{shown} {why}; the classes are: {', '.join(CLASSES)}")
    return named[0]


def _sdf(shape: torch.Tensor, p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) of each sample's shape; p (B, H, W, 2) centred and rotated."""
    x, y = p[..., 0], p[..., 1]
    length = p.norm(dim=-1)
    circle = length - r
    ring = (length - r).abs() - 0.28 * r
    q = p.abs() - 0.82 * r[..., None]
    square = q.clamp(min=0).norm(dim=-1) + q.max(dim=-1).values.clamp(max=0)
    # equilateral triangle (Inigo Quilez's exact SDF), circumradius ~ r
    k, a = math.sqrt(3.0), 0.9 * r
    tx, ty = x.abs() - a, y + a / k
    flip = tx + k * ty > 0
    tx, ty = torch.where(flip, (tx - k * ty) / 2, tx), torch.where(flip, (-k * tx - ty) / 2, ty)
    tx = tx - torch.maximum(torch.minimum(tx, torch.zeros_like(tx)), -2 * a)
    triangle = -torch.sqrt(tx * tx + ty * ty) * torch.sign(ty)
    s = shape[:, None, None]
    return torch.where(s == 0, circle, torch.where(s == 1, square, torch.where(s == 2, triangle, ring)))


def render(labels: torch.Tensor, generator: torch.Generator, size: int = 32) -> torch.Tensor:
    """Images of the classes in ``labels``.

    Args:
        labels: (B,) int64 class indices into ``CLASSES``, on the device to render on.
        generator: drives every random choice; on ``labels``' device.
        size: image side in pixels.

    Returns:
        (B, 3, size, size) float32 in [0, 1].
    """
    dev, B = labels.device, labels.shape[0]
    u = lambda *s: torch.rand(*s, generator=generator, device=dev)  # noqa: E731
    shape, colour = labels // len(COLOURS), labels % len(COLOURS)
    palette = torch.tensor(list(COLOURS.values()), device=dev)

    lin = (torch.arange(size, device=dev) + 0.5) / size * 2 - 1
    yy, xx = torch.meshgrid(lin, lin, indexing="ij")
    grid = torch.stack([xx, yy], -1).expand(B, size, size, 2)

    # background: two tinted greys blended by stripes of random angle and frequency
    angle, freq, phase = u(B) * math.pi, 1.5 + 2.5 * u(B), u(B) * 2 * math.pi
    base = 0.35 + 0.3 * u(B, 1, 3)
    tint = base + 0.12 * (u(B, 1, 3) - 0.5)
    direction = torch.stack([angle.cos(), angle.sin()], -1)[:, None, None, :]
    stripes = 0.5 + 0.5 * torch.sin((grid * direction).sum(-1) * freq[:, None, None] * math.pi + phase[:, None, None])
    bg = base[:, :, None, :] * (1 - stripes[..., None]) + tint[:, :, None, :] * stripes[..., None]

    # the shape: random radius, centre (kept inside), rotation, and a small jitter of its colour
    r = 0.3 + 0.3 * u(B)
    centre = (u(B, 2) * 2 - 1) * (0.95 - r)[:, None]
    theta = u(B) * 2 * math.pi
    rot = torch.stack([torch.stack([theta.cos(), -theta.sin()], -1), torch.stack([theta.sin(), theta.cos()], -1)], -2)
    p = torch.einsum("bij,bhwj->bhwi", rot, grid - centre[:, None, None, :])
    d = _sdf(shape, p, r[:, None, None])
    alpha = (0.5 - d * size / 2).clamp(0, 1)[..., None]  # one pixel of anti-aliasing
    rgb = (palette[colour] + 0.08 * (u(B, 3) - 0.5)).clamp(0, 1)[:, None, None, :]
    img = bg * (1 - alpha) + rgb * alpha
    return img.permute(0, 3, 1, 2).contiguous()
