"""What diffusion_int8 reads off a diffusers model: its denoiser, its attention modules, their head dims and the
processor diffusers' own code would give each."""

from __future__ import annotations

import functools
import inspect

import torch

def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The diffusers attention modules of ``model`` (anything with a settable ``processor``)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "processor") and hasattr(m, "set_processor")}


def head_dim_of(module: torch.nn.Module) -> int | None:
    heads, inner = getattr(module, "heads", None), getattr(module, "inner_dim", None)
    if heads and inner:
        return inner // heads
    return None


def stock_processor_for(attn: torch.nn.Module, called_with_context: bool):
    """The processor diffusers' own model code gives ``attn``, inferred from the module.

    New-style modules (Flux, Wan, …) name it in ``_default_processor_cls``. Legacy ``Attention`` modules
    take ``JointAttnProcessor2_0`` (SD3: added K/V projections), ``CogVideoXAttnProcessor2_0`` (self-
    attention that receives the text tokens to attend jointly) or ``AttnProcessor2_0``.
    """
    from diffusers.models import attention_processor as ap

    cls = getattr(type(attn), "_default_processor_cls", None)
    if cls is not None:
        return cls()
    if getattr(attn, "add_k_proj", None) is not None and getattr(attn, "context_pre_only", None) is not None:
        return ap.JointAttnProcessor2_0()
    if called_with_context and not getattr(attn, "is_cross_attention", True):
        return ap.CogVideoXAttnProcessor2_0()
    return ap.AttnProcessor2_0()


# Where stock processors that attend jointly over text and image tokens put the text (the encoder_hidden_states
# they receive) in the concatenated sequence
_TEXT_FIRST = frozenset({"FluxAttnProcessor", "FluxAttnProcessor2_0", "CogVideoXAttnProcessor2_0",
                         "FusedCogVideoXAttnProcessor2_0"})
_TEXT_LAST = frozenset({"JointAttnProcessor2_0", "FusedJointAttnProcessor2_0"})


def text_position(processor) -> str | None:
    """``"first"`` or ``"last"``: where ``processor``'s joint attention puts the text tokens it receives as
    ``encoder_hidden_states``; None where this is not known (then both ends are treated as text)."""
    name = type(processor).__name__
    return "first" if name in _TEXT_FIRST else "last" if name in _TEXT_LAST else None


@functools.lru_cache(maxsize=None)
def call_params(processor_type: type) -> tuple[frozenset[str], bool]:
    """A processor's keyword parameter names, and whether it takes ``**kwargs``."""
    params = inspect.signature(processor_type.__call__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(params) - {"self", "attn"}, var_kw


def denoiser(pipe_or_model) -> torch.nn.Module:
    """The denoiser of a diffusers pipeline (its ``transformer``, ``unet`` or ``prior``), or the model itself."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return pipe_or_model
    for attr in ("transformer", "unet", "prior"):
        model = getattr(pipe_or_model, attr, None)
        if isinstance(model, torch.nn.Module):
            return model
    raise TypeError(
        f"{type(pipe_or_model).__name__} has no denoiser (looked for .transformer, .unet, .prior); "
        f"pass the model itself"
    )
