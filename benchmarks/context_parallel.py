"""Denoiser steps under diffusers' context parallelism, stock against INT8, each against one GPU.

    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --models wan,ltx --out bench_out/cp.json
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --split ring     # ring attention instead of Ulysses
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --compile  # both variants under torch.compile
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --tiny     # CPU processes on gloo, the tiny Wan

Every process builds the same random-weight model (``pipeline.py``'s full-size configs, seeded) and first runs it
whole on its own GPU: the one-GPU step time and output of stock and of ``enable(model, "int8")``. Then the model is
split with ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))`` (or ``ring_degree=N``) and the same
two variants run over all the GPUs, taking turns over ``--rounds``. The table gives each variant's median step
time, its speed-up over stock on one GPU and over stock split the same way, and its output's relative L2 error
against the one-GPU output of the same variant (Ulysses attends over every token, so the split changes only the
order of sums; ring quantizes each K/V block on its own). Stock under ring needs a backend with ring attention:
the stock rows then run diffusers' ``_native_cudnn`` (with ``--tiny``, the processor's exact ring in mode fp16).

Only models diffusers can split run: those with a context-parallel plan (``_cp_plan``: Wan, LTX-Video, Flux,
Qwen-Image, ...). CogVideoX and HunyuanVideo have none in diffusers 0.42, and CogVideoX's processor calls SDPA
itself, so no plan could split it; they are reported and skipped. Ring skips models with masked attention:
diffusers' ring template hands every K/V block the local mask.

``--compile`` times the split variants under ``torch.compile`` (the one-GPU rows stay eager). Ulysses only: the
compiled processor catches the SDPA call diffusers' template makes on each device's heads, but a ring split's
per-block calls need a backend with a log-sum-exp, so compiled ring calls stay with diffusers' backend in both
variants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def _build(name: str, tiny: bool, device: torch.device):
    torch.manual_seed(0)
    if tiny:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from tiny_models import build

        model, x = build(name)
        x["encoder_hidden_states"] = x["encoder_hidden_states"][:, :6]  # text tokens split over the devices too
        return model, x, torch.float32
    sys.path.insert(0, HERE)
    from pipeline import cast, models

    with torch.device(device):
        model, x, dtype, _ = models()[name]()
    return model.to(dtype).eval(), cast(x, dtype), dtype


def _step_ms(model, x, steps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median wall ms of ``steps`` denoiser calls after two warm-up calls (every process in step, then synchronized)."""
    times = []
    with torch.no_grad():
        for i in range(steps + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            out = model(**x, return_dict=False)[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out.float()


def _cannot_split(model, x: dict, split: str, compiled: bool) -> str | None:
    """Why ``model`` cannot be compared split this way (None: it can)."""
    if model._cp_plan is None:
        return (f"diffusers gives {type(model).__name__} no context-parallel plan"
                + (" (and its processor calls SDPA itself)" if "CogVideoX" in type(model).__name__ else ""))
    if split == "ring" and any("mask" in k and v is not None for k, v in x.items()):
        return "masked attention: diffusers' ring hands every K/V block the local mask"
    if split == "ring" and compiled:
        return "compiled, a ring split stays with diffusers' backend in both variants"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="wan", help="comma-separated, from pipeline.py's builders (Ulysses needs "
                                                    "the heads divisible by the number of processes)")
    ap.add_argument("--steps", type=int, default=5, help="timed denoiser calls per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--split", choices=("ulysses", "ring"), default="ulysses")
    ap.add_argument("--tiny", action="store_true", help="the tiny Wan on CPU processes (gloo): checks the script")
    ap.add_argument("--compile", action="store_true", help="the split variants under torch.compile")
    ap.add_argument("--out", default="bench_out/context_parallel.json")
    args = ap.parse_args()

    import diffusion_int8
    from diffusers import ContextParallelConfig

    if args.tiny:
        os.environ.setdefault("DIFFUSION_INT8_BACKEND", "emulation")
        # diffusers gives each rank the device rank % torch.accelerator.device_count(), 0 on a CPU machine
        torch.accelerator.device_count = lambda: 1
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"meta": {"device": "cpu" if args.tiny else torch.cuda.get_device_name(device), "processes": world,
                        "split": args.split, "compiled": args.compile, "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d")}}
    lines = [f"| model | variant | step ms | × stock, 1 GPU | × stock, {world} GPUs | rel L2 vs 1 GPU | INT8 / gated calls |",
             "|---|---|---|---|---|---|---|"]
    for name in ["wan"] if args.tiny else args.models.split(","):
        model, x, _ = _build(name, args.tiny, device)
        why = _cannot_split(model, x, args.split, args.compile)
        if why:
            lines.append(f"| {name} | skipped: {why} | | | | | |")
            results[name] = {"skipped": why}
            del model, x
            continue
        one = {}
        for variant in ("stock", "int8"):
            handle = diffusion_int8.enable(model, "int8") if variant == "int8" else None
            one[variant] = _step_ms(model, x, args.steps, device)
            if handle is not None:
                handle.disable()
        ring = args.split == "ring"
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=world) if ring else
                                 ContextParallelConfig(ulysses_degree=world))
        split = {v: [] for v in one}
        outs, failed, calls = {}, {}, "—"
        for r in range(args.rounds):
            for variant in (("stock", "int8") if r % 2 == 0 else ("int8", "stock")):
                if variant in failed:
                    continue
                handle = stock_ring = None
                if variant == "int8":
                    handle = diffusion_int8.enable(model, "int8")
                elif ring and args.tiny:  # no CPU backend has ring attention: the processor's exact ring stands in
                    stock_ring = diffusion_int8.enable(model, "fp16")
                elif ring:  # diffusers' native backend has no ring attention
                    model.set_attention_backend("_native_cudnn")
                if args.compile:
                    torch._dynamo.reset()
                try:
                    ms, outs[variant] = _step_ms(torch.compile(model) if args.compile else model, x, args.steps, device)
                    split[variant].append(ms)
                except Exception as exc:  # noqa: BLE001 - a variant diffusers cannot run split is reported
                    failed[variant] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                if handle is not None:
                    handle.disable()
                    calls = ("not counted in a compiled graph" if args.compile else
                             f"{handle.state.int8_calls} / {handle.state.gated_calls}")
                elif stock_ring is not None:
                    stock_ring.disable()
                elif ring:
                    model.set_attention_backend("native")
        rows = {}
        for variant in one:
            ref_ms, ref = one[variant]
            rows[f"{variant}, 1 GPU"] = {"ms": ref_ms, "vs_stock_one_gpu": one["stock"][0] / ref_ms}
            lines.append(f"| {name} | {variant}, 1 GPU | {ref_ms:.1f} | {one['stock'][0] / ref_ms:.2f}× | — | — | — |")
        stock_split = statistics.median(split["stock"]) if "stock" not in failed else None
        for variant in one:
            label = f"{variant}, {world} GPUs"
            if variant in failed:
                rows[label] = {"error": failed[variant]}
                lines.append(f"| {name} | {label} | fails: {failed[variant]} | | | | |")
                continue
            ms, ref = statistics.median(split[variant]), one[variant][1]
            row = rows[label] = {"ms": ms, "ms_rounds": split[variant], "vs_stock_one_gpu": one["stock"][0] / ms,
                                 "vs_stock_split": stock_split / ms if stock_split else None,
                                 "rel_l2_vs_one_gpu": ((outs[variant] - ref).norm() / ref.norm()).item()}
            lines.append(f"| {name} | {label} | {ms:.1f} | {row['vs_stock_one_gpu']:.2f}× | "
                         + (f"{row['vs_stock_split']:.2f}× | " if stock_split else "— | ")
                         + f"{row['rel_l2_vs_one_gpu']:.1e} | " + (calls if variant == "int8" else "—") + " |")
        results[name] = rows
        del model, x
    if rank == 0:
        print("\n".join(lines))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
