"""The Python blocks of the README and then of the user guide run as written, in order and in one namespace, on
the shipped model.

A block that needs something the machine may lack says so in a comment line of its own, ``# needs: cuda``;
it is skipped, with that reason, where the need is not met. Any other need is an error here, so that a
misspelt marker cannot skip a block silently. The shipped pipeline is held to 2 denoising steps whatever
a block asks for, to keep this test to seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "GUIDE.md")
BLOCKS = [b for doc in DOCUMENTS for b in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)]
NEEDS = {"cuda": torch.cuda.is_available}
MARKER = re.compile(r"^# needs: *(.+?) *$", re.M)


def needs(block: str) -> list[str]:
    return [n.strip() for m in MARKER.findall(block) for n in m.split(",")]


def test_readme_has_python_blocks_with_known_needs():
    assert len(BLOCKS) >= 4, "the documents' ```python blocks were not found"
    assert any("load_pipeline()" in b for b in BLOCKS) and any("enable(pipe" in b for b in BLOCKS)
    for block in BLOCKS:
        unknown = set(needs(block)) - set(NEEDS)
        assert not unknown, f"unknown '# needs:' marker {unknown} in:\n{block}"


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    """One namespace for all blocks (they build on each other), in a fresh working directory, with the
    emulation backend and the shipped pipeline at 2 steps."""
    from diffusion_int8.embedded.pipeline import ShapesPipeline

    real = ShapesPipeline.__call__

    def two_steps(self, *args, num_inference_steps: int = 20, **kwargs):
        return real(self, *args, num_inference_steps=min(num_inference_steps, 2), **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFUSION_INT8_BACKEND", "emulation")
        mp.chdir(tmp_path_factory.mktemp("readme"))
        mp.setattr(ShapesPipeline, "__call__", two_steps)
        yield {"__name__": "readme"}


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index, namespace):
    block = BLOCKS[index]
    missing = [n for n in needs(block) if n in NEEDS and not NEEDS[n]()]
    if missing:
        pytest.skip(f"block {index} is marked '# needs: {', '.join(missing)}'")
    exec(compile(block, f"README.md / docs/GUIDE.md python block {index}", "exec"), namespace)
