"""Check zoo cases as plain diffusers models, before any plugin: ``python tests/zoo/check.py [module or class ...]``.

For each case: builds it, runs the stock forward twice (the outputs must be equal and finite), counts the
F.scaled_dot_product_attention calls the forward makes (diffusers' native attention backend ends in it), the
attention modules (``diffusion_int8.plugin.models.attention_modules``) and their processor classes, and checks
that a declared mask input has zeros. Prints one line a case; exit status 1 if any failed.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffusion_int8.plugin.models import attention_modules  # noqa: E402
from zoo import registry  # noqa: E402

PARTS = ["images_a", "images_b", "videos_a", "videos_b", "unets", "controlnets", "audio_other", "autoencoders"]


class CountSDPA(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask")
            given = {**dict(zip(names, args)), **kwargs}
            q, k, m = given["query"], given["key"], given.get("attn_mask")
            self.calls.append((tuple(q.shape), tuple(k.shape), None if m is None else (tuple(m.shape), str(m.dtype))))
        return func(*args, **kwargs)


def check(name: str) -> bool:
    t0 = time.time()
    try:
        model, x = registry.build(name)
        _, mask = registry.CASES[name]
        if mask is not None:
            m = x[mask] if mask in x else None
            assert isinstance(m, torch.Tensor), f"mask input {mask!r} missing"
            assert bool((m == 0).any() or (m < -1e3).any()), f"mask input {mask!r} has no padding"
        counter = CountSDPA()
        with counter:
            a = registry.run(model, x)
        b = registry.run(model, x)
        assert a, "the forward returned no tensor"
        assert all(torch.equal(u, v) for u, v in zip(a, b)), "two stock forwards differ"
        assert all(torch.isfinite(u).all() for u in a if u.is_floating_point()), "non-finite output"
        mods = {n: type(m.processor).__name__ for n, m in attention_modules(model).items()}
        procs = sorted(set(mods.values()))
        masks = sorted({c[2] for c in counter.calls if c[2] is not None})
        print(f"ok   {name}: {time.time() - t0:.2f}s, {len(counter.calls)} SDPA calls, {len(mods)} attention modules "
              f"{procs}, masks {masks}, q {counter.calls[0][0] if counter.calls else None}")
        return True
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=3)
        return False


def main(argv):
    names = []
    for arg in argv or PARTS:
        if arg in PARTS:
            importlib.import_module(f"zoo.{arg}")
        else:
            for part in PARTS:
                try:
                    importlib.import_module(f"zoo.{part}")
                except ModuleNotFoundError:
                    pass
            names.append(arg)
    names = names or list(registry.CASES)
    ok = all([check(n) for n in names])
    for n, why in registry.EXCLUDED.items():
        print(f"excl {n}: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
