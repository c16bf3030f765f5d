"""One shape's ``int8_attention`` call, repeated, for a profiler to catch: Nsight Compute reads the attention kernel's
scheduler, pipe and stall counters with, for example (Flux's shape, the sm_90 ping-pong kernel; CogVideoX's
``1,24,17550,64`` runs the portable ``_attn_fwd_kernel``):

    ncu --kernel-name regex:_attn_fwd --launch-skip 2 --launch-count 1 --section SchedulerStats \\
        --section WarpStateStats --section ComputeWorkloadAnalysis python benchmarks/profile_call.py 2,24,4608,128

BENCHMARKS.md's table takes these, with ``--metrics`` instead of the sections:
``smsp__issue_active.avg.pct_of_peak_sustained_active`` (issue slots busy),
``smsp__warps_eligible.avg.per_cycle_active``, ``sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active`` (MUFU)
and the stalls per issued instruction ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``
(``barrier``, ``wait``, ``long_scoreboard``, ``not_selected``, ...). Times under ``ncu`` are at its locked clocks:
read them against each other, not against the benchmarks'.
"""

import argparse

import torch

from diffusion_int8 import int8_attention
from diffusion_int8.inputs import realistic_qkv


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", help="B,H,N,D (fp16 self-attention, realistic_qkv inputs)")
    p.add_argument("--mode", default="int8", choices=("int8", "int8_fp16v"))
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    B, H, N, D = (int(x) for x in args.shape.split(","))
    q, k, v = realistic_qkv(B, H, N, N, D, device="cuda")
    for _ in range(args.calls):
        int8_attention(q, k, v, mode=args.mode)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
