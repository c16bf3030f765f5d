"""What diffusion_int8 reads off a diffusers model: its denoiser, its attention modules, their head dims, the
processor diffusers' own code would give each, and what a stock processor's ``__call__`` declares and reaches."""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing

import torch

from ..kernels.config import fixed_answer

# The calls a stock processor reaches attention through: ``routing`` sends both to the INT8 op
_ATTENTION_CALLS = frozenset({"scaled_dot_product_attention", "dispatch_attention_fn"})
# ... and the ones attention without a processor is computed through (torch's multi-head attention, transformers'
# attention functions), which stay stock
_OTHER_ATTENTION_CALLS = _ATTENTION_CALLS | {"multi_head_attention_forward", "ALL_ATTENTION_FUNCTIONS",
                                             "eager_attention_forward", "sdpa_attention_forward"}


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The attention modules of ``model``: every submodule whose ``processor`` is a callable (diffusers' ``Attention``,
    ``AttentionModuleMixin`` modules, and model-specific ones such as ``MochiAttention``, which has no
    ``set_processor``)."""
    return {name: m for name, m in model.named_modules()
            if callable(getattr(m, "processor", None)) and not isinstance(m.processor, type)}


def set_processor(module: torch.nn.Module, processor) -> None:
    """Install ``processor`` on an attention module: through its ``set_processor`` where it has one (which keeps
    diffusers' bookkeeping), else as its ``processor`` attribute."""
    if callable(getattr(module, "set_processor", None)):
        module.set_processor(processor)
    else:
        module.processor = processor


def head_dim_of(module: torch.nn.Module) -> int | None:
    heads, inner = getattr(module, "heads", None), getattr(module, "inner_dim", None)
    if heads and inner:
        return inner // heads
    return None


def stock_processor_for(attn: torch.nn.Module, called_with_context: bool):
    """The processor diffusers' own model code gives ``attn``, inferred from the module.

    New-style modules (Flux, Wan, …) name it in ``_default_processor_cls``. Legacy ``Attention`` modules
    take ``JointAttnProcessor2_0`` (SD3's added K/V projections), ``AttnAddedKVProcessor2_0`` (the UNets' added
    K/V projections), ``CogVideoXAttnProcessor2_0`` (self-attention that receives the text tokens to attend
    jointly) or ``AttnProcessor2_0``.
    """
    from diffusers.models import attention_processor as ap

    cls = getattr(type(attn), "_default_processor_cls", None)
    if cls is not None:
        return cls()
    if getattr(attn, "add_k_proj", None) is not None:  # SD3's joint blocks; the UNets of Kandinsky 2, IF, unCLIP
        return (ap.JointAttnProcessor2_0() if getattr(attn, "context_pre_only", None) is not None
                else ap.AttnAddedKVProcessor2_0())
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


@fixed_answer
def call_params(processor_type: type) -> tuple[tuple[str, ...], bool]:
    """A processor's parameter names but ``self`` and ``attn`` (a tuple: dynamo keeps it as a constant), and
    whether it takes ``**kwargs``."""
    params = inspect.signature(processor_type.__call__).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return tuple(name for name in params if name not in ("self", "attn")), var_kw


@functools.lru_cache(maxsize=None)
def stock_signature(processor_type: type) -> inspect.Signature:
    """The signature of a processor type's ``__call__`` as its bound method shows it (without ``self``): what
    diffusers reads to decide which keyword arguments the processor receives."""
    sig = inspect.signature(processor_type.__call__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


_P = inspect.Parameter
_LEADING = ("encoder_hidden_states", "attention_mask", "temb", "image_rotary_emb")
_NAMED = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)


def any_stock_signature() -> inspect.Signature:
    """A signature that declares every parameter of every processor type of the diffusers modules loaded so far: a
    processor that infers its stock processor per module receives whatever any of them would (and passes each
    module's stock processor what that one declares)."""
    return _any_stock_signature(len(sys.modules))


@functools.lru_cache(maxsize=4)
def _any_stock_signature(_loaded: int) -> inspect.Signature:
    names: dict[str, None] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("diffusers.models") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == mod_name and _is_processor_type(obj):
                names.update(dict.fromkeys(n for n, p in stock_signature(obj).parameters.items()
                                           if p.kind in _NAMED and n not in ("attn", "hidden_states")))
    params = [_P("attn", _P.POSITIONAL_OR_KEYWORD), _P("hidden_states", _P.POSITIONAL_OR_KEYWORD)]
    params += [_P(n, _P.POSITIONAL_OR_KEYWORD, default=None) for n in _LEADING]
    params += [_P(n, _P.KEYWORD_ONLY, default=None) for n in names if n not in _LEADING]
    return inspect.Signature(params + [_P("kwargs", _P.VAR_KEYWORD)])


def _is_processor_type(cls: type) -> bool:
    call = cls.__dict__.get("__call__")
    if not isinstance(call, types.FunctionType):
        return False
    params = list(inspect.signature(call).parameters)
    return len(params) >= 3 and params[1] == "attn"


def reaches_attention(processor) -> bool:
    """Whether ``processor``'s ``__call__`` reaches ``F.scaled_dot_product_attention`` or diffusers'
    ``dispatch_attention_fn``, read from its code and the functions and methods it calls (two levels deep): a
    processor that reaches neither (linear attention, explicit softmax) has nothing the INT8 op can take."""
    call = getattr(type(processor), "__call__", None)
    return isinstance(call, types.FunctionType) and _reaches(call, type(processor), 3)


def attention_outside_processors(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` that are not attention modules but whose own ``forward`` computes attention
    (``F.scaled_dot_product_attention``, ``dispatch_attention_fn``, torch's multi-head attention, transformers'
    attention functions): attention with no processor to swap (a VAE's plain attention block, a text encoder's
    layer), which stays stock."""
    found = []
    for name, m in model.named_modules():
        cls = type(m)
        forward = getattr(cls, "forward", None)
        if (isinstance(forward, types.FunctionType) and not callable(getattr(m, "processor", None))
                and not cls.__module__.startswith("torch.nn.modules.container")
                and _reaches(forward, cls, 1, _OTHER_ATTENTION_CALLS)):
            found.append(name)
    return found


def _reaches(fn: types.FunctionType, owner: type, depth: int, calls: frozenset[str] = _ATTENTION_CALLS) -> bool:
    """Whether ``fn`` (a method of ``owner`` or a function) names one of ``calls``, or calls a function of its own
    package or a method that does, ``depth`` levels down. A method is the one an instance of ``owner`` calls by that
    name (``_resolve``: ``super().<fn's name>(...)`` included), or a method of a processor class ``fn`` names
    (``AttnProcessor2_0.__call__(self, ...)``)."""
    names = _code_names(fn.__code__)
    if names & calls:
        return True
    if depth == 0:
        return False
    package = fn.__module__.partition(".")[0] if fn.__module__ else ""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    for name in names | cells.keys():
        target = fn.__globals__.get(name) if name not in cells else _cell_contents(cells[name])
        if isinstance(target, type) and _is_processor_type(target):
            methods = (_resolve(target, n, fn) for n in names)
            if any(_reaches(m, target, depth - 1, calls) for m in methods if m is not None):
                return True
        elif isinstance(target, types.FunctionType):
            if (target is not fn and package and (target.__module__ or "").partition(".")[0] == package
                    and _reaches(target, owner, depth - 1, calls)):
                return True
        else:
            method = _resolve(owner, name, fn)
            if method is not None and _reaches(method, owner, depth - 1, calls):
                return True
    return False


def _resolve(cls: type, name: str, fn: types.FunctionType) -> types.FunctionType | None:
    """The function an instance of ``cls`` calls as ``name`` from ``fn``: for ``fn``'s own name, the one after the
    class defining ``fn`` (``super()``); None where that is no function."""
    mro = cls.__mro__
    if name == fn.__name__:
        defining = [i for i, c in enumerate(mro) if _function(c.__dict__.get(name)) is fn]
        mro = mro[defining[0] + 1:] if defining else mro
    found = next((c.__dict__[name] for c in mro if name in c.__dict__), None)
    found = _function(found)
    return found if isinstance(found, types.FunctionType) and found is not fn else None


def _function(attr):
    return getattr(attr, "__func__", attr)  # a staticmethod's or classmethod's function


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _code_names(code: types.CodeType) -> frozenset[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return frozenset(names)


# the names diffusers' denoisers give their timestep argument, the first one a model's forward declares taken:
# timesteps (HiDream), timestep_ratio (Stable Cascade), timestep_img (UniDiffuser's image), vision_timesteps (Cosmos 3),
# r (Würstchen's prior and decoder: the noise ratio)
TIMESTEP_ARGUMENTS = ("timestep", "timesteps", "timestep_ratio", "timestep_img", "vision_timesteps", "r")


def denoiser(pipe_or_model) -> torch.nn.Module:
    """The denoiser of a diffusers pipeline (its ``transformer``, ``unet`` or ``prior``, else the first of
    ``other_denoisers``: Würstchen's and Stable Cascade's ``decoder``, Versatile Diffusion's ``image_unet``), or the
    model itself."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return pipe_or_model
    for attr in ("transformer", "unet", "prior"):
        model = getattr(pipe_or_model, attr, None)
        if isinstance(model, torch.nn.Module):
            return model
    found = other_denoisers(pipe_or_model) if hasattr(pipe_or_model, "__dict__") else []
    if found:
        return found[0][1]
    raise TypeError(
        f"{type(pipe_or_model).__name__} has no denoiser (looked for .transformer, .unet, .prior, and any model of it "
        f"with attention whose forward takes a timestep); pass the model itself"
    )


# diffusers passes a processor only the keyword arguments its ``__call__`` declares (``inspect.signature``) and drops
# the rest with a log line, so an INT8 processor declares what the stock processor it runs declares: it is an
# instance of a subclass whose ``__call__`` (the same code) carries that signature, one subclass per signature.
_DECLARING: dict[tuple, type] = {}


def declaring_subclass(base: type, sig: inspect.Signature, also: type | None = None) -> type:
    """The subclass of ``base`` (and of ``also``, after it in the MRO) whose ``__call__`` (``base.__call__``'s code)
    declares ``sig`` (a bound method's, without self), made once per signature and ``also``; it has ``base``'s name,
    module and qualified name (``base`` pickles name ``base`` and make the subclass again)."""
    key = (base, also, *((p.name, p.kind) for p in sig.parameters.values()))
    cls = _DECLARING.get(key)
    if cls is None:
        fn = base.__call__
        call = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        call.__kwdefaults__, call.__doc__, call.__qualname__ = fn.__kwdefaults__, fn.__doc__, fn.__qualname__
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        call.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()],
                                         return_annotation=typing.Any)
        body = {"__call__": call, "__module__": base.__module__, "__qualname__": base.__qualname__}
        try:
            cls = type(base.__name__, (base, also) if also is not None else (base,), body)
        except TypeError:  # no consistent MRO (``also`` derives from ``base``) or layouts that do not combine
            cls = type(base.__name__, (base,), body)
        _DECLARING[key] = cls
    return cls


def skip_metadata_as(cls: type, stock: type) -> None:
    """Register ``cls`` (a processor class wrapping ``stock``) where diffusers' layer-skip hooks look processors up
    by their exact class (``apply_layer_skip``: SkipLayerGuidance, PerturbedAttentionGuidance), with ``stock``'s
    entry; nothing where ``stock`` has none (the hooks refuse it stock too) or diffusers has no such registry."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
        metadata = AttentionProcessorRegistry.get(stock)
    except (ImportError, ValueError):
        return
    AttentionProcessorRegistry.register(cls, metadata)


def skip_metadata_inferred(cls: type) -> None:
    """Register ``cls`` (processors made without ``inner``, which infer their stock processor per module) for
    diffusers' layer-skip hooks, with an entry that defers, at the call, to the entry of the stock processor
    ``stock_processor_for`` infers for the module at hand. Where that one has none, diffusers' "not registered" error
    comes at the module's first skipped forward instead of at ``apply_layer_skip``."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorMetadata, AttentionProcessorRegistry
    except ImportError:
        return

    def skip_output(attn, *args, **kwargs):  # the module's forward arguments: hidden_states first
        context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        stock = type(stock_processor_for(attn, context is not None))
        return AttentionProcessorRegistry.get(stock).skip_processor_output_fn(attn, *args, **kwargs)

    AttentionProcessorRegistry.register(cls, AttentionProcessorMetadata(skip_processor_output_fn=skip_output))


def other_denoisers(pipe, main: torch.nn.Module | None = None) -> list[tuple[str, torch.nn.Module]]:
    """(component name, model) of each model of ``pipe`` but ``main`` that runs at the denoising steps and has
    attention modules: one whose ``forward`` takes a timestep (``TIMESTEP_ARGUMENTS``), such as Wan 2.2's second
    expert ``transformer_2``, a ControlNet, Ideogram's unconditional transformer or unCLIP's decoder. Text and image
    encoders and VAEs take none."""
    found, seen = [], {id(main)}
    for name, m in list(vars(pipe).items()):
        if name.startswith("_") or not isinstance(m, torch.nn.Module) or id(m) in seen:
            continue
        core = getattr(m, "_orig_mod", m)  # torch.compile's wrapper forwards (*args, **kwargs)
        try:
            params = inspect.signature(core.forward).parameters
        except (TypeError, ValueError):
            continue
        if any(n in params for n in TIMESTEP_ARGUMENTS) and attention_modules(core):
            seen.add(id(m))
            found.append((name, m))
    return found


def scheduler_of(pipe, model: torch.nn.Module) -> str:
    """The attribute of ``pipe`` holding the scheduler of ``model``'s denoising loop: ``<prefix>_scheduler`` where the
    model's component is named ``<prefix>`` or ``<prefix>_...`` (the longest such prefix: Kandinsky's combined
    pipelines run ``prior_prior`` on ``prior_scheduler``, unCLIP its ``decoder`` on ``decoder_scheduler`` and
    ``super_res_first`` on ``super_res_scheduler``), else ``scheduler``."""
    attrs = getattr(pipe, "__dict__", {})
    names = [n for n, m in attrs.items() if m is model]
    prefixes = [a[: -len("_scheduler")] for a in attrs if a.endswith("_scheduler") and not a.startswith("_")]
    fits = [p for p in prefixes for n in names if n == p or n.startswith(p + "_")]
    return max(fits, key=len) + "_scheduler" if fits else "scheduler"
