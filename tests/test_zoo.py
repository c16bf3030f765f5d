"""Conformance over every model class the installed diffusers exports or holds in its pipelines' modules: each is a
zoo case (a tiny config, padded masks where the model takes one) or an exclusion with its reason, and every case holds
the plugin's promises.

For each case: ``fp16`` mode reproduces stock bit for bit, and so does ``int8`` with every call sent to SDPA by the
speed gate (a model whose attention has no processor to swap is refused with a ValueError that says so); every attention call the INT8 kernel can take runs INT8
(none is left on SDPA by an unrouted module or a dropped keyword); the INT8 output is close to stock (cos >= 0.99);
``disable()`` restores stock bit for bit, and two enable/disable cycles leave no state behind. CPU, emulation
backend (the kernels' equivalence with the emulation is tested in test_attention.py).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import diffusion_int8
from diffusion_int8.plugin.install import TIMESTEP_ARGUMENTS
from diffusion_int8.plugin.models import attention_modules
from diffusion_int8.plugin.routing import kernel_takes
from diffusion_int8.plugin.speed_gate import CrossoverTable, SpeedGate
from zoo import CASES, EXCLUDED, build, run
from zoo.registry import CPU_ONLY, UNROUTABLE, to_device

COS = 0.99
NO_TABLE = CrossoverTable(device="none", arch="none", grids=())  # INT8 pays nowhere


def model_classes_by_name() -> dict[str, set[type]]:
    """Every ModelMixin subclass diffusers exports at top level, and every one the modules of ``diffusers.pipelines``
    hold (defined there, such as WuerstchenPrior or LTX2TextConnectors, or imported there from ``diffusers.models``
    without a top-level export, such as MultiControlNetUnionModel): class name -> the classes of that name (more than
    one is a name clash the zoo's tables, keyed by name, cannot tell apart)."""
    import importlib
    import pkgutil

    import diffusers
    import diffusers.pipelines

    base = {diffusers.ModelMixin, diffusers.models.modeling_utils.LegacyModelMixin}
    found: dict[str, set[type]] = {}

    def collect(namespace, names):
        for name in names:
            try:
                obj = getattr(namespace, name)
            except Exception:  # noqa: BLE001 - an optional dependency missing: not a model this install can run
                continue
            if inspect.isclass(obj) and issubclass(obj, diffusers.ModelMixin) and obj not in base:
                found.setdefault(obj.__name__, set()).add(obj)

    collect(diffusers, dir(diffusers))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation warnings of the deprecated pipelines' modules
        for info in pkgutil.walk_packages(diffusers.pipelines.__path__, diffusers.pipelines.__name__ + "."):
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - an optional dependency missing (cv2, note-seq, PyAV): skipped as above
                continue
            collect(module, list(vars(module)))
    return found


def model_classes() -> list[str]:
    """The names of the model classes above, sorted."""
    return sorted(model_classes_by_name())


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


class SDPACalls(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call made under it (``model``'s forward): whether the INT8
    kernel takes it, and the names of the modules whose forward it was made in."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.calls: list[tuple[bool, tuple[str, ...]]] = []

    def __enter__(self):
        from torch.nn.modules import module

        def enter(m, args):
            self.stack.append(self.names.get(m, "?"))

        def leave(m, args, out):
            self.stack.pop()

        self._hooks = [module.register_module_forward_pre_hook(enter), module.register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            given = {**dict(zip(names, args)), **kwargs}
            taken = kernel_takes(given["query"], given["key"], given.get("attn_mask"), given.get("dropout_p", 0.0),
                                 given.get("is_causal", False), given.get("enable_gqa", False))
            self.calls.append((taken, tuple(self.stack)))
        return func(*args, **kwargs)

    def taken(self) -> list[tuple[str, ...]]:
        """The module stacks of the calls the kernel takes."""
        return [stack for taken, stack in self.calls if taken]


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(F.cosine_similarity(a, b, dim=0)) if a.norm() * b.norm() > 0 else float(torch.equal(a, b))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_every_exported_model_class_is_a_case_or_excluded_with_a_reason():
    """Exported at top level or held only by a pipelines module: every model class is in a zoo table."""
    classes = model_classes_by_name()
    clashes = {n: sorted(f"{c.__module__}.{c.__qualname__}" for c in cs) for n, cs in classes.items() if len(cs) > 1}
    assert not clashes, f"model classes of one name in diffusers {__import__('diffusers').__version__}: {clashes}"
    names = model_classes()
    missing = [n for n in names if n not in CASES and n not in EXCLUDED]
    assert not missing, (f"model classes of diffusers {__import__('diffusers').__version__} (exported or in its "
                         f"pipelines' modules) in no zoo table: {missing}")
    stale = sorted(n for n in {*CASES, *EXCLUDED} if n not in names)
    assert not stale, f"zoo entries that diffusers neither exports nor holds in its pipelines' modules: {stale}"
    assert all(len(why) > 20 for why in EXCLUDED.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_conformance(name):
    conformance(*build(name), name, cos_bound=COS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(CASES))
def test_conformance_on_gpu(name, monkeypatch):
    """The same on the GPU, through the Triton kernels (fp32 models: the INT8 op computes in fp16)."""
    monkeypatch.delenv("DIFFUSION_INT8_BACKEND")
    if name in CPU_ONLY:
        pytest.skip(CPU_ONLY[name])
    model, x = build(name)
    x = to_device(x, "cuda")
    if x is None:
        pytest.skip("the model draws noise from a CPU generator inside its forward")
    model.cuda()
    first = run(model, x)  # bit-for-bit claims need a reproducible stock forward: four alike (NucleusMoE's differ
    if not all(same(first, run(model, x)) for _ in range(3)):  # now and then, two in a row were seen alike)
        pytest.skip("stock forwards differ on this GPU (non-deterministic kernels in the model itself)")
    conformance(model, x, name, cos_bound=COS)


def conformance(model, x, name: str, cos_bound: float) -> None:
    mask = CASES[name][1]
    if mask is not None:  # a padded mask: some positions off
        m = x[mask]
        assert bool((m == 0).any() or (m < -1e3).any()), f"{mask} has no padding"
    stock_procs = {n: m.processor for n, m in attention_modules(model).items()}
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    calls = SDPACalls(model)
    with calls:
        stock = run(model, x)

    if name in UNROUTABLE:  # attention in plain modules' forward only: refused, saying where, and nothing changed
        with pytest.raises(ValueError, match="own forward, with no processor"):
            diffusion_int8.enable(model, "int8")
        assert "_diffusion_int8_handle" not in model.__dict__ and same(run(model, x), stock)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = diffusion_int8.enable(model, "fp16")
    summary = handle.summary()
    assert set(handle.originals) | set(summary["left_stock"]) >= set(stock_procs)
    assert sum(summary["routed"].values()) == len(handle.originals)
    left = [w for w in caught if "stock processor" in str(w.message)]
    assert len(left) == (1 if summary["left_stock"] else 0)
    assert all(name in str(w.message) for w in left)
    assert same(run(model, x), stock), "fp16 mode differs from stock"
    handle.disable()
    # every call sent to SDPA by the speed gate (a table that covers nothing): stock bit for bit, no keyword lost;
    # and the timestep read from the model's own argument for it (what schedules and carrying go by)
    handle = diffusion_int8.enable(model, "int8", speed_gate=SpeedGate(NO_TABLE), record=True)
    assert same(run(model, x), stock), "int8 with every call gated differs from stock"
    assert handle.state.int8_calls == 0
    given = next((x[n] for n in TIMESTEP_ARGUMENTS if n in x), None)
    if isinstance(given, torch.Tensor):  # per-token timesteps: the first sample's highest level
        given = float(given.reshape(given.shape[0], -1)[0].amax() if given.dim() > 1 else given.reshape(-1)[0])
    assert handle.state.timestep == (None if given is None else float(given)), "the timestep was not read"
    handle.disable()

    for cycle, mode in enumerate(("int8", "int8_fp16v")):
        handle = diffusion_int8.enable(model, mode, speed_gate=False)  # INT8 wherever the kernel takes the call
        after = SDPACalls(model)
        with after:
            out = run(model, x)
        # every call the kernel takes runs INT8, but in the modules enable() says it left stock, and why
        stayed = [stack for stack in after.taken() if not set(stack) & set(summary["left_stock"])]
        assert not stayed, f"{mode}: {len(stayed)} attention call(s) the kernel takes stayed on SDPA, in {stayed[:3]}"
        assert handle.state.int8_calls == len(calls.taken()) - len(after.taken())
        worst = min((cos(o, s) for o, s in zip(out, stock) if s.is_floating_point()), default=1.0)
        assert worst >= cos_bound, f"{mode}: cos {worst:.5f} against stock"
        handle.disable()
        assert {n: m.processor for n, m in attention_modules(model).items()} == stock_procs
        assert "_diffusion_int8_handle" not in model.__dict__
        assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
        assert same(run(model, x), stock), f"not stock after disable() (cycle {cycle + 1})"


# Models whose code gives their legacy ``Attention`` modules a processor of their own that nothing in the module or
# its call tells apart from the one inferred from its class: through ``set_attn_processor`` they compute something
# else (the warning and the GUIDE name them). Every other model there runs stock's bits or is refused.
INFERRED_DIFFERS = {
    "AuraFlowTransformer2DModel": "AuraFlowAttnProcessor2_0 (text first, not JointAttnProcessor2_0's last)",
    "SanaTransformer2DModel": "SanaLinearAttnProcessor2_0 (linear attention)",
    "SanaControlNetModel": "SanaLinearAttnProcessor2_0 (linear attention)",
}
ADVICE = "diffusion_int8.enable(model) wraps the processors the model has"


@pytest.mark.parametrize("name", sorted(n for n in CASES if n not in UNROUTABLE))
def test_set_attn_processor_runs_stock_or_refuses(name):
    """The diffusers way, ``model.set_attn_processor(Int8DiffusionProcessor("fp16"))``: each module runs the stock
    processor inferred from its class. Where the model passes it something it does not take, or it fails, the error
    says to call ``enable``; otherwise the output is stock's bit for bit."""
    model, x = build(name)
    if not hasattr(model, "set_attn_processor"):
        pytest.skip(f"{name} has no set_attn_processor")
    stock = run(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_attn_processor(diffusion_int8.Int8DiffusionProcessor("fp16"))
        try:
            out = run(model, x)
        except Exception as e:  # noqa: BLE001 - whatever the inferred processor raised, with the note added
            assert ADVICE in str(e) + "".join(getattr(e, "__notes__", [])), repr(e)
            return
    assert same(out, stock) != (name in INFERRED_DIFFERS), name


def test_a_processor_the_model_finds_by_isinstance_keeps_its_path():
    # Qwen-Image 2.1 builds its block-causal flex BlockMask (and keeps the text padding) only where
    # isinstance(processor, QwenImage21FlexAttnProcessor): a wrapped one must still answer so
    qwen21 = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage21")
    if qwen21.BlockMask is None:
        pytest.skip("this torch has no flex attention")
    model, x = build("QwenImage21Transformer2DModel")
    model.set_attn_processor(qwen21.QwenImage21FlexAttnProcessor())
    stock = run(model, x)
    for mode, options in (("fp16", {}), ("int8", {"speed_gate": SpeedGate(NO_TABLE)})):
        handle = diffusion_int8.enable(model, mode, **options)
        assert same(run(model, x), stock), mode
        handle.disable()


def test_wuerstchens_noise_ratio_is_read_as_the_timestep():
    model, x = build("WuerstchenDiffNeXt")  # forward(x, r, effnet, ...), called with r= by its pipeline
    handle = diffusion_int8.enable(model, "int8", record=True)
    run(model, x)
    assert handle.state.timestep == pytest.approx(float(x["r"].flatten()[0]))
    handle.disable()


def test_a_model_without_attention_is_refused():
    with pytest.raises(ValueError, match="Linear has no attention module to route"):
        diffusion_int8.enable(torch.nn.Linear(4, 4))


def test_the_handle_says_what_was_installed_where():
    model, _ = build("SanaTransformer2DModel")  # cross-attention routed, linear self-attention left stock
    with pytest.warns(RuntimeWarning, match="SanaTransformer2DModel: left 2 attention module"):
        handle = diffusion_int8.enable(model, "int8")
    summary = handle.summary()
    assert summary["model"] == "SanaTransformer2DModel"
    assert summary["routed"] == {"SanaAttnProcessor2_0": 2}
    assert set(summary["left_stock"]) == {"transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}
    assert all("linear attention" in why for why in summary["left_stock"].values())
    assert "2 attention module(s) routed" in str(handle) and "transformer_blocks.0.attn1" in str(handle)
    handle.disable()
    assert handle.summary()["routed"] == {}


def test_an_untested_diffusers_release_warns_once(monkeypatch):
    import diffusers

    from diffusion_int8 import versions

    monkeypatch.setattr(diffusers, "__version__", "9.9.9")
    versions.check_diffusers_version.cache_clear()
    try:
        model, _ = build("DiTTransformer2DModel")
        with pytest.warns(RuntimeWarning, match="diffusers 9.9.9 is untested"):
            diffusion_int8.enable(model, "int8").disable()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            diffusion_int8.enable(model, "int8").disable()  # once per process
    finally:
        versions.check_diffusers_version.cache_clear()


def test_pyproject_states_the_tested_diffusers_releases():
    from pathlib import Path

    from diffusion_int8.versions import TESTED_DIFFUSERS

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if "tested:" in ln and "test_zoo" in ln)
    assert all(v in line for v in TESTED_DIFFUSERS)
