"""Test set-up: without a GPU, the real Triton kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is created.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

sys.path.insert(0, os.path.dirname(__file__))
if INTERPRET:
    from interpreter_fixes import patch_interpreter

    patch_interpreter()

# One parameter per place the kernels run: the interpreter on CPU (CI) or the GPU (`pytest -m gpu`).
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set when no GPU)"), id="interp"),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")], id="gpu"),
]


@pytest.fixture(params=KERNEL_DEVICES)
def kdev(request) -> str:
    return request.param


# The package's own settings (DIFFUSION_INT8_*): a test, or a fixture, that changes one must restore it (monkeypatch
# does), or the tests after it silently run another backend. Checked around every test, and around every module
# (a module-scoped fixture may hold a setting for its module's tests, and must restore it when the module ends).
def _settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("DIFFUSION_INT8_")}


def _check_settings(before: dict[str, str], where: str) -> None:
    now = _settings()
    if now != before:
        for k in now:
            os.environ.pop(k)
        os.environ.update(before)  # restored, so the tests after this one run as they should
        pytest.fail(f"{where} left environment settings changed: {now} instead of {before}", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _no_settings_leaked_by_a_module(request):
    before = _settings()
    yield
    _check_settings(before, f"{request.node.nodeid} (a module-scoped fixture)")


@pytest.fixture(autouse=True)
def _no_settings_leaked_by_a_test(request):
    before = _settings()
    yield
    _check_settings(before, f"{request.node.nodeid} (or a fixture it used)")


@pytest.fixture(autouse=True)
def _seed():
    # Fresh inputs every run: realistic_qkv draws its seed from torch's generator, seeded at random;
    # TEST_SEED=N replays the seed a failure's captured output shows.
    seed = int(os.environ.get("TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    yield


@pytest.fixture
def dynamo_warnings(monkeypatch):
    """The warnings raised while the test runs, dynamo's once-per-process ones included (its cache emptied)."""
    import torch._dynamo.utils

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
