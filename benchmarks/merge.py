"""The forecast merge of a carried call's steps between refreshes (``kernels.merge.merge_forecast``) against a copy of
the same number of bytes, at Wan2.1's 480p × 81 frames (1, 12, 32760, 128) bfloat16: the outputs and log-sum-exps
of real ``int8_attention`` calls (the kept blocks' and, at two refreshes, the skipped blocks'), BHSD views of
(B, S, H, D) memory as the processor's calls give them.

    python benchmarks/merge.py [--out bench_out/merge.json]

The merge reads three outputs and writes one; the copy moves 200 MB each way, the same 400 MB. Times are medians
of ``triton.testing.do_bench_cudagraph``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from diffusion_int8 import int8_attention
from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.kernels.merge import merge_forecast, merge_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    S, H, D = 32760, 12, 128
    q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    blocks = -(-S // SPARSE_BLOCK)
    keep = torch.rand(1, H, blocks, blocks, device="cuda") < 0.2  # 80% of the blocks skipped
    kept, kept_lse = int8_attention(q, k, v, mode="int8", block_mask=keep, return_lse=True)
    _, skipped, skipped_lse = int8_attention(q, k, v, mode="int8", block_mask=keep, return_skipped=True)
    _, before, before_lse = int8_attention(q * 1.01, k, v, mode="int8", block_mask=keep, return_skipped=True)
    merge_args = (kept, kept_lse, skipped, skipped_lse, before, before_lse, 0.5)
    error = (merge_forecast(*merge_args).float() - merge_reference(*merge_args)).abs().max().item()
    src = torch.randn(2 * S * H * D, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shape": [1, H, S, D],
               "merge us": 1e3 * triton.testing.do_bench_cudagraph(lambda: merge_forecast(*merge_args), rep=300),
               "copy us": 1e3 * triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=300),
               "max abs error against merge_reference": error}
    print(f"{results['device']}: merge {results['merge us']:.1f} us, copy of the same bytes {results['copy us']:.1f} us, "
          f"max abs error against the float32 reference {error:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
