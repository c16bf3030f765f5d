"""``diffusion-int8 check``: run every mode on attention inputs shaped like a diffusion model's and
report which kernel ran, its accuracy against float64 attention and, on a GPU, its speed."""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from .. import jsonfile
from ..kernels import Mode, attention_ref, int8_attention, kernel_info
from ..kernels.config import MAX_HEAD_DIM
from ..compare import cos_l1
from ..inputs import realistic_qkv
from .outputs import check_out_file, command
from .usage import UsageError, check_fits, device_arg, positive_int, text_path, user_errors


def check_shape(shape: list[int], device: torch.device) -> None:
    """``UsageError`` for a shape the kernel does not take, or whose attention this machine cannot hold."""
    B, H, S, D = shape
    if D > MAX_HEAD_DIM:
        raise UsageError(f"--shape: head dim {D} is not supported; accepted: 1 to {MAX_HEAD_DIM}")
    shown = f"--shape {B} {H} {S} {D}"
    remedy = "choose a smaller B, H or S"
    # the float64 reference holds B·H·S² scores twice (logits and softmax), beside the inputs in float64
    check_fits(16 * B * H * S * S + 64 * B * H * S * D, device, f"{shown} (float64 reference attention)", remedy)
    if device.type == "cuda":  # the inputs are drawn in float32 on the host first
        check_fits(16 * B * H * S * D, torch.device("cpu"), f"{shown} (inputs drawn on the host)", remedy)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    B, H, S, D = args.shape
    check_shape(args.shape, device)
    if args.json:
        check_out_file(args.json, "--json", overwrite=args.overwrite)
    q, k, v = realistic_qkv(B, H, S, S, D, dtype=torch.float16, layout="BSHD", device=device, seed=0)
    ref = attention_ref(q, k, v, layout="BSHD")
    print(f"attention (B={B}, H={H}, S={S}, D={D}) fp16 on {device}"
          + ("" if device.type == "cuda" else " — no GPU: INT8 modes run the PyTorch emulation of the kernel"))
    warnings.filterwarnings("ignore", message="diffusion_int8: .*using the PyTorch emulation")  # said just above
    rows = []
    for mode in Mode:
        info = kernel_info(device, mode, head_dim=D)
        out = int8_attention(q, k, v, mode=mode, layout="BSHD")
        row = dict(info)
        row["cos"], row["rel_l1"] = cos_l1(out, ref)
        if device.type == "cuda":
            for _ in range(5):
                int8_attention(q, k, v, mode=mode, layout="BSHD")
            torch.cuda.synchronize()
            t0, n = time.perf_counter(), 20
            for _ in range(n):
                int8_attention(q, k, v, mode=mode, layout="BSHD")
            torch.cuda.synchronize()
            row["ms"] = (time.perf_counter() - t0) / n * 1e3
        rows.append(row)
        speed = f"  {row['ms']:.3f} ms" if "ms" in row else ""
        print(f"  {mode.value:11s} kernel={info['kernel']:10s} P·V={str(info['pv']):5s} "
              f"cos={row['cos']:.6f} rel_L1={row['rel_l1']:.4f}{speed}")
        if info["reason"]:
            print(f"  {'':11s} ({info['reason']})")
    if args.json:
        check_out_file(args.json, "--json", overwrite=args.overwrite)  # again: it may have appeared meanwhile
        with user_errors(OSError):
            jsonfile.write(args.json, rows)
        print(f"wrote {args.json}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="run every attention mode on an example and report accuracy (and speed on a GPU)",
                       description="Run every attention mode (int8, int8_fp16v, fp16) on one set of Q, K, V shaped like "
                                   "a diffusion model's (a K channel bias, a few outlier channels) and print, per mode, "
                                   "which implementation ran, its cosine similarity and relative L1 error against "
                                   "float64 attention and, on a GPU, its time per call. Without a GPU the INT8 modes "
                                   "run the kernel's PyTorch emulation and no time is shown.")
    p.add_argument("--shape", type=positive_int, nargs=4, default=[1, 4, 1024, 64], metavar=("B", "H", "S", "D"),
                   help="batch, heads, sequence length, head dim (default: 1 4 1024 64)")
    p.add_argument("--device", type=device_arg, default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--json", type=text_path, default=None,
                   help="also write the results to this JSON file (its directory must exist)")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    p.set_defaults(func=command(run))
