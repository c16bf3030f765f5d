"""Soak test of the op on a GPU: many eager calls of mixed shapes, modes, masks, layouts and dtypes, with no memory
growth and every sampled result right, then two threads on two CUDA streams calling it at once.

    python benchmarks/soak.py --calls 10000 --out bench_out/soak.json

A sampled call (every ``--check-every``-th) must match the emulation of the same numerics (cosine ≥ 0.999; the
cosine against float64 attention, which the quantization itself sets, is reported); the two-thread phase compares every result with the same call made alone (bit for bit).
Memory: ``torch.cuda.memory_allocated`` after the first round of signatures against the end (launch plans and the
caching allocator's blocks must not grow with the number of calls).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import threading
import time

import torch

from diffusion_int8 import int8_attention
from diffusion_int8.kernels import attention_ref, emulate_attention
from diffusion_int8.kernels.config import pv_for_mode, Mode
from diffusion_int8.compare import cosine
from diffusion_int8.inputs import realistic_qkv

SHAPES = [(1, 2, 70, 90, 64), (2, 4, 256, 256, 64), (1, 3, 130, 77, 128), (2, 2, 33, 150, 40), (1, 8, 1024, 1024, 128),
          (2, 5, 300, 300, 72), (1, 4, 2048, 226, 64)]
MODES = ("int8", "int8_fp16v")
DTYPES = (torch.float16, torch.bfloat16)
MASKS = (None, "bool", "float")
LAYOUTS = ("BHSD", "BSHD")


def make_case(shape, dtype, mask, layout, seed):
    B, H, Sq, Sk, D = shape
    q, k, v = realistic_qkv(B, H, Sq, Sk, D, dtype=dtype, layout=layout, device="cuda", seed=seed)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, 1, Sk, device="cuda") > 0.2
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(B, 1, Sq, Sk, device="cuda", dtype=dtype).clamp(-2, 2)
    return q, k, v, m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--check-every", type=int, default=50)
    ap.add_argument("--thread-calls", type=int, default=1000)
    ap.add_argument("--out", default="bench_out/soak.json")
    args = ap.parse_args()
    rng = random.Random(0)
    combos = list(itertools.product(range(len(SHAPES)), MODES, DTYPES, MASKS, LAYOUTS))
    cases = {}  # inputs per combination, drawn again now and then so pointers and values change
    worst = {"vs_emulation": 1.0, "vs_float64": 1.0}
    failures, mem, t0 = [], {}, time.time()
    for i in range(args.calls):
        combo = combos[i % len(combos)] if i < len(combos) else rng.choice(combos)
        s, mode, dtype, mask, layout = combo
        if combo not in cases or rng.random() < 0.05:
            cases[combo] = make_case(SHAPES[s], dtype, mask, layout, seed=rng.randrange(2**31))
        q, k, v, m = cases[combo]
        out = int8_attention(q, k, v, mode=mode, layout=layout, attn_mask=m)
        if i % args.check_every == 0:
            emu = emulate_attention(q, k, v, layout=layout, pv=pv_for_mode(Mode(mode), q.device), attn_mask=m)
            ref = attention_ref(q, k, v, layout=layout, attn_mask=m)
            c_emu, c_ref = cosine(out, emu).item(), cosine(out, ref).item()
            worst["vs_emulation"] = min(worst["vs_emulation"], c_emu)
            worst["vs_float64"] = min(worst["vs_float64"], c_ref)
            if not torch.isfinite(out).all() or c_emu < 0.999:  # float64's cosine is the numerics' own (tests/)
                failures.append({"call": i, "combo": str(combo), "cos_emulation": c_emu, "cos_float64": c_ref})
        del out
        if i == len(combos) - 1:  # every combination's inputs are held from here on
            torch.cuda.synchronize()
            mem["after_first_round"] = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    mem["end"] = torch.cuda.memory_allocated()
    cases.clear()
    serial_s = time.time() - t0

    # two threads, each on its own stream, alternating signatures; each result must equal the call made alone
    work = []
    for j in range(8):
        s, mode, dtype, mask, layout = combos[(7 * j) % len(combos)]
        q, k, v, m = make_case(SHAPES[s], dtype, mask, layout, seed=j)
        work.append((q, k, v, m, mode, layout, int8_attention(q, k, v, mode=mode, layout=layout, attn_mask=m)))
    torch.cuda.synchronize()
    mismatches = [0, 0]

    def worker(t):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for n in range(args.thread_calls):
                q, k, v, m, mode, layout, alone = work[(2 * n + t) % len(work)]
                got = int8_attention(q, k, v, mode=mode, layout=layout, attn_mask=m)
                stream.synchronize()
                mismatches[t] += not torch.equal(got, alone)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "calls": args.calls, "signatures": len(combos), "checked": args.calls // args.check_every + 1,
              "worst_cos": worst, "failures": failures, "memory_bytes": mem,
              "memory_growth_bytes": mem["end"] - mem["after_first_round"], "serial_seconds": round(serial_s, 1),
              "threads": {"threads": 2, "calls_each": args.thread_calls, "mismatches": mismatches}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    ok = not failures and result["memory_growth_bytes"] <= 0 and mismatches == [0, 0]
    print("soak:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
