"""Attention speed and accuracy: INT8 modes against SDPA cuDNN / flash fp16, timed in one run.

    python benchmarks/attention.py --out bench_out/attention.json [--sweep] [--shapes flux,sdxl]
    python benchmarks/attention.py --masked --dtype bfloat16 --out bench_out/attention_masked.json
    python benchmarks/attention.py --ranges --shapes flux,wan,cogvideox    # measured against static ranges

Times are medians of ``triton.testing.do_bench`` (warm-up, L2 flushed between runs); the rows replayed
from CUDA graphs are timed in two rounds, the second in reverse order, and show their mean ± spread. The INT8 times
include quantization and K smoothing; the quantization kernels are also timed on their own line, and the
attention kernel alone on inputs quantized beforehand (how published INT8 kernels report their speed).
The ``[eager]`` rows call the public ``int8_attention`` back to back, as a pipeline does, against SDPA's default
backend (their "vs cuDNN*" column is against that row); the median of three rounds. The ``[sustained]`` rows replay
the graphs of cuDNN and of both INT8 modes back to back for 1.5 s each after 0.5 s of warm-up (no L2 flush), in two
rounds taking turns, against cuDNN sustained the same way: the GPU's clock then settles where its power cap holds
it, which is not the same for every kernel. TFLOPS count 4·B·H·Sq·Sk·D. Accuracy is cosine / relative L1 against float32 attention on 2 heads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusion_int8 import int8_attention
from diffusion_int8.kernels import attention as kattn, clear_cache
from diffusion_int8.kernels import quantize as tq
from diffusion_int8.kernels.config import PV, TileConfig, padded_head_dim
from diffusion_int8.kernels.reference import attention_ref, token_mean
from diffusion_int8.compare import cos_l1
from diffusion_int8.inputs import realistic_qkv
from diffusion_int8.timing import back_to_back, graphed, median

SHAPES = {  # name: (B, H, N, D), from ../shared/ANCHORS.md
    "flux": (2, 24, 4608, 128),
    "long": (1, 16, 16384, 128),
    "cogvideox": (1, 24, 17550, 64),
    "sdxl": (2, 10, 4096, 64),
    "dit": (4, 16, 1024, 72),
    "sd15": (2, 8, 4096, 40),
    "short": (8, 16, 1024, 64),
    "wan": (1, 12, 32760, 128),
    "sd35": (2, 38, 4429, 64),
}
# The speed targets at long sequences: the whole call replayed from a CUDA graph against cuDNN replayed the same
# way (int8, int8_fp16v), and the attention kernel alone in TOPS by head dim (from 4K tokens on)
# Key-padding masks (the same for every query): (B, H, N, D, text tokens at the end of the sequence), a quarter of
# the text masked: HunyuanVideo's joint attention (544x960x61 frames + 256 text), an image model's joint attention
# at batch 2 (4096 + 256), LTX-Video's (6144 + 128)
MASKED_SHAPES = {"hunyuanvideo": (1, 24, 32896, 128, 256), "joint-2x4352": (2, 24, 4352, 128, 256),
                 "ltx": (1, 32, 6272, 64, 128)}
TARGETS = {"flux": (1.35, 1.15), "long": (1.5, 1.15), "wan": (1.5, 1.15), "cogvideox": (1.45, 1.25), "sd35": (1.3, None)}
KERNEL_TOPS = {128: 900, 64: 620}


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def run_shape(name, shape, dtype, sweep):
    B, H, N, D = shape
    q, k, v = realistic_qkv(B, H, N, N, D, dtype=dtype, device="cuda")
    flops = 4 * B * H * N * N * D
    ref = attention_ref(q[:, :2], k[:, :2], v[:, :2], dtype=torch.float32)
    rows, graphs = {}, {}

    def add(label, fn, acc=True):
        try:
            ms = bench(fn)
        except Exception as exc:  # a baseline that rejects the shape is reported, not fatal
            rows[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            return
        row = {"ms": ms, "tflops": flops / ms / 1e9}
        if acc:
            out = fn()
            row["cos"], row["rel_l1"] = cos_l1(out[:, :2], ref)
        rows[label] = row
        if label.startswith("[graph]"):
            graphs[label] = fn

    for label, backend in (("sdpa_cudnn_fp16", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash_fp16", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        add(label, sdpa)

    scale = D**-0.5
    for label, pv in (("int8_fp16v", PV.FP16), ("int8 (fp8 P·V)", PV.FP8), ("int8 (int8 P·V)", PV.INT8)):
        add(label, lambda pv=pv: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale))
    if kattn.hopper is not None and kattn.hopper.supports(q, v, PV.FP8, padded_head_dim(D), False):
        # the portable Triton kernel where the sm_90 Gluon kernel takes the calls above
        for label, pv in (("int8_fp16v, portable kernel", PV.FP16), ("int8 (fp8 P·V), portable kernel", PV.FP8)):
            add(label, lambda pv=pv: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale, sm90=False))

    def quant_only(pv=PV.FP8):
        return tq.quantize_qkv(q, k, v, scale, pv)
    add("quantization only (statistics, then Q/K/V, fp8)", quant_only, acc=False)
    add("[graph] quantization only", graphed(quant_only), acc=False)
    # the attention launch alone on inputs quantized beforehand, as published INT8 kernels are timed
    out = torch.empty_like(q)
    for label, pv in (("int8_fp16v", PV.FP16), ("int8 (fp8 P·V)", PV.FP8)):
        quantized = tq.quantize_qkv(q, k, v, scale, pv)
        add(f"[graph] {label}, attention kernel alone", graphed(
            lambda pv=pv, quantized=quantized: kattn.attend(quantized, v, out, pv=pv) or out), acc=False)
    # static ranges and K mean, as a calibration gives them: no statistics pass
    static = static_ranges(q, k, v)
    add("int8 (fp8 P·V), static ranges", lambda: kattn.triton_attention(
        q, k, v, layout="BHSD", pv=PV.FP8, sm_scale=scale, **static))
    add("[graph] quantization only, static ranges", graphed(
        lambda: tq.quantize_qkv(q, k, v, scale, PV.FP8, **static)), acc=False)

    # the same calls replayed from CUDA graphs (as under torch.compile mode="reduce-overhead")
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    add("[graph] sdpa_cudnn_fp16", graphed(cudnn), acc=False)
    for label, pv in (("[graph] int8_fp16v", PV.FP16), ("[graph] int8 (fp8 P·V)", PV.FP8)):
        add(label, graphed(lambda pv=pv: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale)), acc=False)
        add(f"{label}, static ranges", graphed(
            lambda pv=pv: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale, **static)), acc=False)
        add(f"{label}, Q·Kᵀ balance", graphed(  # what the optional balance's read of Q costs
            lambda pv=pv: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale, qk_balance=True)),
            acc=False)

    try:
        from sageattention import sageattn

        add("sageattention 1.0.6", lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False))
    except ImportError:
        pass

    # Eager: the public op called back to back as a pipeline calls it, each call's host time overlapping the GPU
    # work of the one before (a host-bound call shows its host time); compared with SDPA's default backend
    eager_calls = {"[eager] sdpa (default backend)": lambda: F.scaled_dot_product_attention(q, k, v)}
    eager_calls.update({f"[eager] int8_attention {m}": (lambda m=m: int8_attention(q, k, v, mode=m))
                        for m in ("int8_fp16v", "int8")})
    for label in eager_calls:
        rows[label] = {"ms_rounds": []}
    for _ in range(3):  # rounds taking turns, so the host's drift reaches every row alike
        for label, fn in eager_calls.items():
            rows[label]["ms_rounds"].append(back_to_back(fn))
    for label in eager_calls:
        rows[label]["ms"] = median(rows[label]["ms_rounds"])
        rows[label]["tflops"] = flops / rows[label]["ms"] / 1e9

    # Sustained: cuDNN and both INT8 modes replayed back to back, as a denoising loop runs them
    held = tuple(label for label in ("[graph] sdpa_cudnn_fp16", "[graph] int8_fp16v", "[graph] int8 (fp8 P·V)")
                 if label in graphs)
    for label in held:
        rows[label.replace("[graph]", "[sustained]")] = {"ms_rounds": []}
    for r in range(2):
        for label in (held if r == 0 else held[::-1]):
            rows[label.replace("[graph]", "[sustained]")]["ms_rounds"].append(back_to_back(graphs[label], seconds=1.5))
    for label in held:
        row = rows[label.replace("[graph]", "[sustained]")]
        row["ms"] = sum(row["ms_rounds"]) / 2
        row["tflops"] = flops / row["ms"] / 1e9

    # The graph rows, whose ratios the targets use, are timed again in reverse order and averaged: a
    # row's time can drift with its place in the sequence (clocks, power), and the two rounds show it.
    for label in reversed(graphs):
        row = rows[label]
        row["ms_rounds"] = [row["ms"], bench(graphs[label])]
        row["ms"] = sum(row["ms_rounds"]) / 2
        row["tflops"] = flops / row["ms"] / 1e9
    graphs.clear()

    base = rows["sdpa_cudnn_fp16"].get("ms")
    base_graph = rows["[graph] sdpa_cudnn_fp16"].get("ms")
    flash = rows["sdpa_flash_fp16"].get("ms")
    base_eager = rows["[eager] sdpa (default backend)"]["ms"]
    base_held = rows.get("[sustained] sdpa_cudnn_fp16", {}).get("ms")
    for label, row in rows.items():
        if "ms" in row:
            ref_ms = base_graph if label.startswith("[graph]") else base  # graph rows vs graphed cuDNN
            if label.startswith("[eager]"):
                ref_ms = base_eager
            elif label.startswith("[sustained]"):
                ref_ms = base_held
            row["vs_cudnn"] = ref_ms / row["ms"] if ref_ms else None
            row["vs_flash"] = flash / row["ms"] if flash else None

    result = {"shape": dict(B=B, H=H, N=N, D=D), "rows": rows}
    if sweep:
        result["sweep"] = sweep_tiles(q, k, v, D, scale, sweep)
    return result


def static_ranges(q, k, v) -> dict:
    """Static ranges and K's mean as a calibration gives them (here the maxima of the inputs themselves)."""
    k_mean = token_mean(k)
    return dict(q_amax=q.float().abs().amax((2, 3)), k_amax=(k.float() - k_mean[:, :, None]).abs().amax((2, 3)),
                v_amax=v.float().abs().amax(2), k_mean=k_mean)


def run_ranges(name, shape, dtype, rounds=3):
    """Measured against static ranges only: the whole call in both INT8 modes replayed from CUDA graphs, the
    variants taking turns in each round (median of the rounds), with the static call's ratio to the measured one."""
    B, H, N, D = shape
    q, k, v = realistic_qkv(B, H, N, N, D, dtype=dtype, device="cuda")
    static, scale = static_ranges(q, k, v), D**-0.5
    graphs = {f"{mode}, {how}": graphed(lambda pv=pv, kw=kw: kattn.triton_attention(
                  q, k, v, layout="BHSD", pv=pv, sm_scale=scale, **kw))
              for mode, pv in (("int8_fp16v", PV.FP16), ("int8", PV.FP8)) for how, kw in (("measured", {}),
                                                                                        ("static", static))}
    times = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, fn in graphs.items():
            times[label].append(bench(fn))
    rows = {label: {"ms": median(t), "ms_rounds": t} for label, t in times.items()}
    print(f"\n## {name} (B={B}, H={H}, N={N}, D={D}): measured against static ranges, graph-replayed, median of "
          f"{rounds} rounds\n| mode | measured ms | static ms | static / measured |\n|---|---|---|---|")
    for mode in ("int8_fp16v", "int8"):
        m, st = rows[f"{mode}, measured"]["ms"], rows[f"{mode}, static"]["ms"]
        rows[f"{mode}, static"]["vs_measured"] = st / m
        print(f"| {mode} | {m:.3f} | {st:.3f} | {st / m:.3f} |")
    return {"shape": dict(B=B, H=H, N=N, D=D), "rows": rows}


def run_masked(name, shape, dtype):
    """One key-padding-masked shape: SDPA and both INT8 modes unmasked, with a bool (B, 1, 1, N) mask and with the
    same mask additive (0 / -inf in the call's dtype), each eager (the public ops back to back) and replayed from a
    CUDA graph; accuracy of the masked INT8 calls against float32 attention with the mask on 2 heads."""
    B, H, N, D, n_text = shape
    q, k, v = realistic_qkv(B, H, N, N, D, dtype=dtype, device="cuda")
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
    keep[..., N - n_text // 4:] = False  # the last quarter of the text is padding
    masks = {"none": None, "bool": keep, "float": torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(
        ~keep, float("-inf"))}
    flops = 4 * B * H * N * N * D
    n_calls = 30 if N > 16384 else 100  # back-to-back calls per eager round: a few hundred ms each
    rows = {}
    for kind, mask in masks.items():
        ref = attention_ref(q[:, :2], k[:, :2], v[:, :2], attn_mask=mask, dtype=torch.float32)
        calls = {"sdpa": lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
        calls.update({m: (lambda m=m, mask=mask: int8_attention(q, k, v, mode=m, attn_mask=mask))
                      for m in ("int8", "int8_fp16v")})
        for op, fn in calls.items():
            row = rows[f"{op}, mask {kind}"] = {}
            out = fn()
            if op != "sdpa":
                row["cos"], row["rel_l1"] = cos_l1(out[:, :2], ref)
            row["eager_ms"] = median([back_to_back(fn, calls=n_calls) for _ in range(3)])
            row["graph_ms"] = bench(graphed(fn))
    for label, row in rows.items():
        op, kind = label.split(", mask ")
        sdpa, unmasked = rows[f"sdpa, mask {kind}"], rows[f"{op}, mask none"]
        for t in ("eager", "graph"):
            row[f"{t}_vs_sdpa"] = sdpa[f"{t}_ms"] / row[f"{t}_ms"]  # against SDPA with the same mask
            row[f"{t}_vs_unmasked"] = unmasked[f"{t}_ms"] / row[f"{t}_ms"]  # the same op without the mask
            row[f"{t}_tflops"] = flops / row[f"{t}_ms"] / 1e9
    return {"shape": dict(B=B, H=H, N=N, D=D, text=n_text, masked=n_text // 4), "rows": rows}


def print_masked(name, res):
    s = res["shape"]
    print(f"\n## {name}, key-padding mask (B={s['B']}, H={s['H']}, N={s['N']}, D={s['D']}; last {s['masked']} of "
          f"{s['text']} text keys masked)")
    print("| call | eager ms | vs SDPA same mask | vs unmasked | graph ms | vs SDPA same mask | vs unmasked | cos |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in res["rows"].items():
        cos = f"{r['cos']:.5f}" if "cos" in r else "—"
        print(f"| {label} | {r['eager_ms']:.3f} | {r['eager_vs_sdpa']:.2f} | {r['eager_vs_unmasked']:.2f} | "
              f"{r['graph_ms']:.3f} | {r['graph_vs_sdpa']:.2f} | {r['graph_vs_unmasked']:.2f} | {cos} |")


def sweep_tiles(q, k, v, D, scale, block_ns):
    """Time tile configs of the portable kernel (the sm_90 kernels have tiles of their own) for each P·V
    precision; the best go into ``config.tile_config``."""
    found = {}
    original = kattn.tile_config  # the quantization launch reads the same table: both are patched
    programs = ((64, 4), (128, 4), (128, 8))  # (block_m, num_warps)
    try:
        for pv in (PV.FP16, PV.FP8):
            timings = []
            for (bm, warps), bn, stages in itertools.product(programs, block_ns, (2, 3)):
                cfg = TileConfig(bm, bn, warps, stages, original(D, pv).k_groups)
                kattn.tile_config = tq.tile_config = lambda *_, cfg=cfg: cfg
                clear_cache()  # a plan replays the tiles it was recorded with, which its key does not name
                try:
                    ms = bench(lambda: kattn.triton_attention(q, k, v, layout="BHSD", pv=pv, sm_scale=scale,
                                                              sm90=False))
                except Exception as exc:
                    timings.append({"cfg": asdict(cfg), "error": type(exc).__name__})
                    continue
                timings.append({"cfg": asdict(cfg), "ms": ms})
            ok = sorted((t for t in timings if "ms" in t), key=lambda t: t["ms"])
            found[pv.value] = ok[:5]
    finally:
        kattn.tile_config = tq.tile_config = original
        clear_cache()
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--masked", nargs="?", const=",".join(MASKED_SHAPES), default=None,
                    help=f"instead, the key-padding-masked shapes (a comma-separated subset of {list(MASKED_SHAPES)})")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--sweep", action="store_true", help="also time tile configs")
    ap.add_argument("--ranges", action="store_true", help="instead, only measured against static ranges, per shape")
    ap.add_argument("--sweep-block-n", default="64,128", help="BLOCK_N values the sweep tries (K's quantization block)")
    ap.add_argument("--out", default="bench_out/attention.json", help="JSON file to write")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")

    dtype = getattr(torch, args.dtype)
    meta = {
        "device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
    }
    import triton

    meta["triton"] = triton.__version__
    results = {}
    for name in (args.masked.split(",") if args.masked else []):
        results[f"masked {name}"] = run_masked(name, MASKED_SHAPES[name], dtype)
        torch.cuda.empty_cache()
        print_masked(name, results[f"masked {name}"])
    for name in (args.shapes.split(",") if args.ranges and not args.masked else []):
        results[f"ranges {name}"] = run_ranges(name, SHAPES[name], dtype)
        torch.cuda.empty_cache()
    for name in (args.shapes.split(",") if not (args.masked or args.ranges) else []):
        block_ns = tuple(int(b) for b in args.sweep_block_n.split(",")) if args.sweep else None
        results[name] = run_shape(name, SHAPES[name], dtype, block_ns)
        torch.cuda.empty_cache()
        print_shape(name, results[name])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"\n{meta}\nwrote {args.out}")


def print_shape(name, res):
    """Markdown table; *[graph] rows are compared with cuDNN replayed from a graph too, [eager] rows with SDPA eager."""
    s = res["shape"]
    print(f"\n## {name} (B={s['B']}, H={s['H']}, N={s['N']}, D={s['D']})")
    print(f"| {'kernel':44s} | ms | TFLOPS | vs cuDNN* | vs flash | cos | rel L1 |")
    print("|---|---|---|---|---|---|---|")
    for label, r in res["rows"].items():
        if "error" in r:
            print(f"| {label:44s} | {r['error']} |")
            continue
        acc = f"{r['cos']:.5f} | {r['rel_l1']:.4f}" if "cos" in r else "— | —"
        ms = f"{r['ms']:.3f}"
        if "ms_rounds" in r and len(r["ms_rounds"]) == 2:  # mean of two rounds, ± half their difference
            ms += f" ±{abs(r['ms_rounds'][0] - r['ms_rounds'][1]) / 2 / r['ms']:.0%}"
        print(f"| {label:44s} | {ms} | {r['tflops']:.0f} | {r['vs_cudnn']:.2f} | {r['vs_flash']:.2f} | {acc} |")
    print_targets(name, res)
    for pv, best in res.get("sweep", {}).items():
        print(f"  best tiles {pv}: " + "; ".join(f"{t['cfg']} {t['ms']:.3f}ms" for t in best[:3]))


def print_targets(name, res):
    """The shape's speed targets beside what this run measured."""
    rows, D, N = res["rows"], res["shape"]["D"], res["shape"]["N"]
    checks = []
    for label, target in zip(("[graph] int8 (fp8 P·V)", "[graph] int8_fp16v"), TARGETS.get(name, (None, None))):
        if target is not None and "vs_cudnn" in rows.get(label, {}):
            checks.append((f"{label} vs cuDNN", f"≥ {target:.2f}×", f"{rows[label]['vs_cudnn']:.2f}×",
                           rows[label]["vs_cudnn"] >= target))
    alone = rows.get("[graph] int8 (fp8 P·V), attention kernel alone", {})
    if N >= 4096 and D in KERNEL_TOPS and "tflops" in alone:
        checks.append(("int8 attention kernel alone", f"≥ {KERNEL_TOPS[D]} TOPS", f"{alone['tflops']:.0f} TOPS",
                       alone["tflops"] >= KERNEL_TOPS[D]))
    if checks:
        print(f"\n| {name}: target | wanted | measured | met |\n|---|---|---|---|")
        for what, want, got, met in checks:
            print(f"| {what} | {want} | {got} | {'yes' if met else 'no'} |")
    res["targets"] = [dict(zip(("what", "wanted", "measured", "met"), c)) for c in checks]


if __name__ == "__main__":
    main()
