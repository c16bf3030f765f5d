"""Test set-up: without a GPU, the real Triton kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
import sys

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


# The package's own settings as the session found them: a test or fixture that changes one must restore it (tests use
# monkeypatch), or the tests after it silently run another backend
_SETTINGS = ("DIFFUSION_INT8_",)
_SETTINGS_AT_START = {k: v for k, v in os.environ.items() if k.startswith(_SETTINGS)}


@pytest.fixture(autouse=True)
def _no_leaked_settings(request):
    yield
    now = {k: v for k, v in os.environ.items() if k.startswith(_SETTINGS)}
    if now != _SETTINGS_AT_START:
        for k in now:
            os.environ.pop(k)
        os.environ.update(_SETTINGS_AT_START)  # restored for the tests after this one, which then run as they should
        pytest.fail(f"{request.node.nodeid} (or a fixture it used) left environment settings changed: "
                    f"{now} instead of {_SETTINGS_AT_START}", pytrace=False)


@pytest.fixture(autouse=True)
def _seed():
    # Fresh inputs every run: realistic_qkv draws its seed from torch's generator, seeded at random;
    # TEST_SEED=N replays the seed a failure's captured output shows.
    seed = int(os.environ.get("TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    yield
