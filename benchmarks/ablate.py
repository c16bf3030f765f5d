"""Where the attention loop's time goes: the kernel timed with one piece of its work removed at a time.

    python benchmarks/ablate.py [--shapes flux,cogvideox] [--out bench_out/ablate.json]

Each variant is the real kernel source with one text substitution (the results are wrong by design;
only the time matters), written to a temporary module and imported, so nothing here touches the
shipped kernel. Times are medians of ``triton.testing.do_bench`` on the whole call (the quantization
prologue is the same in every variant), and every variant is timed in the same run as the baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

import torch
import triton

import diffusion_int8.kernels.attention as kattn
from diffusion_int8.kernels.config import PV
from diffusion_int8.testing import realistic_qkv

SHAPES = {"flux": (2, 24, 4608, 128), "long": (1, 16, 16384, 128), "cogvideox": (1, 24, 17550, 64), "sdxl": (2, 10, 4096, 64)}

_FAST_PATH_EXP = ("        p4 = tl.math.exp2(qk4.to(tl.float32) * qsk[:, None, :, None] - (m_safe - P_SHIFT)[:, None, None, None])\n")
VARIANTS = {  # name: (what is removed, [(old, new), ...])
    "baseline": ("nothing", []),
    "no_exp2": ("exp2 of the scores (MUFU): p = the exponent's argument",
                [(_FAST_PATH_EXP, "        p4 = qk4.to(tl.float32) * qsk[:, None, :, None] - (m_safe - P_SHIFT)[:, None, None, None]\n")]),
    "no_rowmax": ("the running max: m = 0 (no reduction, no alpha rescale)",
                  [("        m_new = tl.maximum(m_i, tl.max(gmax, 1))\n",
                    "        m_new = m_i * 0.0\n")]),
    "no_pv_mma": ("the P·V MMA and V loads: the FP8 P row sums go into acc instead",
                  [("        v = tl.load(v_ptrs)\n        p8 = p.to(tl.float8e4nv)  # already scaled by 2^P_SHIFT through the exponent\n"
                    "        acc = acc * alpha[:, None] + tl.dot(p8, v)\n",
                    "        p8 = p.to(tl.float8e4nv)\n"
                    "        acc = acc * alpha[:, None] + tl.sum(p8.to(tl.float32), 1)[:, None]\n")]),
    "no_fp8_cast": ("P's FP8 conversion: P·V multiplies a P derived from the scores' bits",
                    [("        p8 = p.to(tl.float8e4nv)  # already scaled by 2^P_SHIFT through the exponent\n",
                      "        p8 = (p.to(tl.int32, bitcast=True) >> 23).to(tl.int8).to(tl.float8e4nv, bitcast=True)\n")]),
}


def load_variant(name: str, subs, tmp: str):
    src = open(kattn.__file__).read()
    src = src.replace("from . import quantize as tq", "from diffusion_int8.kernels import quantize as tq")
    src = src.replace("from .quantize import", "from diffusion_int8.kernels.quantize import")
    src = src.replace("from .config import", "from diffusion_int8.kernels.config import")
    src = src.replace("from .reference import", "from diffusion_int8.kernels.reference import")
    for old, new in subs:
        if old not in src:
            raise SystemExit(f"variant {name}: the kernel source changed, update the substitution:\n{old}")
        src = src.replace(old, new)
    path = os.path.join(tmp, f"attn_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"attn_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="flux,cogvideox")
    ap.add_argument("--out", default="bench_out/ablate.json")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        mods = {n: load_variant(n, subs, tmp) for n, (_, subs) in VARIANTS.items()}
        for shape in args.shapes.split(","):
            B, H, N, D = SHAPES[shape]
            q, k, v = realistic_qkv(B, H, N, N, D, dtype=torch.float16, device="cuda")
            print(f"\n## {shape} (B={B}, H={H}, N={N}, D={D}), int8 (FP8 P·V)\n| variant | removed | ms | saved ms |\n|---|---|---|---|")
            rows = {}
            for n, mod in mods.items():
                fn = lambda mod=mod: mod.triton_attention(q, k, v, layout="BHSD", pv=PV.FP8, sm_scale=D**-0.5)  # noqa: E731
                fn()
                rows[n] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            for n, ms in rows.items():
                print(f"| {n} | {VARIANTS[n][0]} | {ms:.3f} | {rows['baseline'] - ms:+.3f} |")
            results["shapes"][shape] = {"shape": [B, H, N, D], "ms": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
