"""Compile kernel variants for sm_90 on a machine without a GPU (run by test_compile.py).

The interpreter accepts code that the compiler rejects (branch-dependent types, non-constexpr globals);
this catches it in CI. Usage: python tests/compile_sm90.py [all]; against another Triton release than the
installed one, put it first on the path:

    pip install --no-deps --target /tmp/triton-3.6.0 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6.0:. python tests/compile_sm90.py
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # must precede the kernels' import

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from diffusion_int8.kernels import attention as A  # noqa: E402
from diffusion_int8.kernels import hopper as Hp  # noqa: E402
from diffusion_int8.kernels import merge as Mg  # noqa: E402
from diffusion_int8.kernels import pool as Pool  # noqa: E402
from diffusion_int8.kernels import quantize as Qz  # noqa: E402
from diffusion_int8.kernels.config import FP_FUSION, PV, padded_head_dim, tile_config  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_PV_PTR = {PV.FP16: None, PV.FP8: "*fp8e4nv", PV.INT8: "*i8"}


def compile_kernel(fn, ptrs: dict, floats: set, constexprs: dict, divisible=(), ones=(), options=None):
    """Compile ``fn`` with the specialization the launcher gets at run time: pointers (PyTorch allocations)
    and the integers in ``divisible`` marked multiples of 16, those in ``ones`` (unit strides) the constant 1.
    Without it the code differs from what runs (unvectorized loads, spills), so its SASS would mislead."""
    constexprs = dict(constexprs, **dict.fromkeys(ones, 1))
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n) or ("fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *divisible)}
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=TARGET, options=dict(enable_fp_fusion=FP_FUSION, **(options or {})))


def quantize_variant(D, v_fmt, smooth, static, dt="fp16", rotate=False):
    """The quantization kernel and the statistics pass, or (not ``static``) the one-launch kernel for short
    sequences too; every one with and without the Q·Kᵀ balance where it applies."""
    ptrs = {n: "*fp32" for n in ("QAMAX", "QS", "KMEAN", "KAMAX", "KS", "VRANGE", "VAMAX", "VS", "BAL", "QSUM", "QSQ",
                                 "KSUM", "KSQ", "OFF")}
    ptrs.update(Q="*" + dt, K="*" + dt, V="*" + dt, Q8="*i8", K8="*i8", V8="*fp8e4nv" if v_fmt == 1 else "*i8", HAD="*i8")
    # contiguous (B, H, S, D) inputs, as most calls give them: unit channel strides
    ones, divisible = ("stride_qd", "stride_kd", "stride_vd"), ("SQ_PAD", "SK_PAD") + (("D",) if D % 16 == 0 else ())
    dp = padded_head_dim(D)
    cfg = tile_config(D, {pv.code: pv for pv in PV}[v_fmt])  # the K tile the launcher uses for this V
    block = Qz.stats_block(dp)
    n = 0
    for balance in (False, True):  # static: a calibrated balance; else measured
        compile_kernel(Qz._quant_qkv_kernel, ptrs, {"scale_mult", "off_scale"}, dict(
            Q_BLOCK=64, K_BLOCK=cfg.block_n, K_GROUPS=cfg.k_groups, DP=dp, SMOOTH=smooth, Q_STATIC=static,
            K_STATIC=static, V_FMT=v_fmt, V_STATIC=static, BALANCE=balance, ROTATE=rotate,
            Q_TILES=1 if rotate else cfg.block_n // 64, POOL=not balance,  # the predictor's sums in half of them
            OFFSET=smooth and balance == static),  # the smoothing offset (a log-sum-exp), with and without them
            divisible=divisible, ones=ones)
        stats = dict(Q="*" + dt, K="*" + dt, V="*" + dt, PART="*fp32", DONE="*i32", MOM="*fp32")
        compile_kernel(Qz._stats_kernel, stats, set(), dict(BLOCK=block, DP=dp, HAS_K=smooth or balance,
                                                            HAS_V=v_fmt != 0, SMOOTH=smooth, BALANCE=balance),
                       divisible=divisible[2:], ones=ones)
        n += 2
        if not static and rotate:  # the calibrated rotated call: V's range and K's mean given, Q's and K's measured
            compile_kernel(Qz._quant_qkv_kernel, ptrs, {"scale_mult", "off_scale"}, dict(
                Q_BLOCK=64, K_BLOCK=cfg.block_n, K_GROUPS=cfg.k_groups, DP=dp, SMOOTH=True, Q_STATIC=False,
                K_STATIC=False, V_FMT=v_fmt, V_STATIC=True, BALANCE=balance, ROTATE=True, Q_TILES=1, POOL=False,
                OFFSET=False), divisible=divisible, ones=ones)
            n += 1
        if not static:
            fused = dict(stats, Q8="*i8", QS="*fp32", K8="*i8", KS="*fp32", V8=ptrs["V8"], VS="*fp32", HAD="*i8",
                         DUMMY="*fp32", OFF="*fp32")
            fused.pop("DONE")
            compile_kernel(Qz._quant_fused_kernel, fused, {"scale_mult", "off_scale"}, dict(
                BLOCK=block, Q_BLOCK=64, K_BLOCK=cfg.block_n, K_GROUPS=cfg.k_groups, DP=dp, HAS_K=smooth or balance,
                SMOOTH=smooth, V_FMT=v_fmt, BALANCE=balance, ROTATE=rotate, OFFSET=smooth and not balance),
                divisible=divisible, ones=ones)
            n += 1
    return n


def attention_variant(D, pv, mask, dt="fp16", sparse=False, split=False, contiguous=False, tma=None):
    """The portable kernel, compiled; ``mask`` 0 none, 1 bool, 2 additive, 3 a key mask's bias and tile lists;
    ``split``: a block mask's skipped blocks written apart (``sparse`` too); ``contiguous``: specialized as a launch
    with V and the output channels-contiguous and their other strides and the head dim multiples of 16 (most calls);
    ``tma``: K and V tiles by tensor descriptors (None: as the launcher chooses on sm_90 for a long call,
    ``attention.tma_tiles``)."""
    dp, cfg = padded_head_dim(D), tile_config(D, pv)
    if tma is None:
        tma = A.tma_tiles(pv, dp, mask, A.TMA_MIN_SCORES)  # as a long call
    v_ptr = _PV_PTR[pv] or "*" + dt
    ptrs = dict(Q8="*i8", QS="*fp32", K8="*i8", KS="*fp32", V=v_ptr, VS="*fp32",
                K_DESC=f"tensordesc<i8[{cfg.block_n}, {dp}]>" if tma else "*i8",
                V_DESC=f"tensordesc<fp8e4nv[{dp}, {cfg.block_n}]>" if tma else v_ptr,
                MASK_PTR={0: "*fp32", 1: "*u8", 2: "*" + dt, 3: "*fp32"}[mask], KB_CNT="*i32", KB_CLEAN="*i32",
                KB_IDX="*i32", O="*" + dt, LSE="*fp32", OS="*" + dt, LSES="*fp32")
    return compile_kernel(A._attn_fwd_kernel, ptrs, set(), dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DP=dp, PV=pv.code, MASK=mask,
        V_ALIGN8=pv is PV.FP16 and D % 8 == 0, K_GROUPS=cfg.k_groups, SPARSE=sparse, ABLATE=0, RETURN_LSE=False,
        SPLIT=split, TMA=tma),
        divisible=("SQ_PAD", "SK_PAD", "N_FULL") + (
            ("stride_vb", "stride_vh", "stride_vs", "stride_ob", "stride_oh", "stride_os") if contiguous else ())
        + (("D",) if contiguous and D % 16 == 0 else ()),
        ones=("stride_vd", "stride_od") if contiguous else (),
        options=A.launch_options(pv, dp, mask, tma))


def local_memory_bytes(kernel) -> int:
    """Bytes of local memory (spilled registers) a thread of the compiled ``kernel`` uses (``cuobjdump``'s STACK)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def sparse_variants() -> int:
    """The block lists and the standalone predictor's pooling, and the prediction from pooled sums."""
    for split in (False, True):
        compile_kernel(A._block_list_kernel, dict(MASK="*u8", CNT="*i32", IDX="*i32"), set(),
                       dict(NKB_P2=256, SPLIT=split))
    for is_bool, mask in ((True, "*u8"), (False, "*bf16")):  # a key mask's bias and kinds, then its tile lists
        compile_kernel(A._key_bias_kernel, dict(MASK=mask, BIAS="*fp32", KIND="*i32"), set(),
                       dict(IS_BOOL=is_bool, BLOCK_N=128))
    compile_kernel(A._key_list_kernel, dict(KIND="*i32", CNT="*i32", CLEAN="*i32", IDX="*i32"), set(), dict(NT_P2=512))
    for channels_first in (False, True):
        compile_kernel(Pool._pool_kernel, dict(X="*fp16", SUM="*fp32", SQ="*fp32"), set(),
                       dict(DP=128, CHANNELS_FIRST=channels_first))
    sums = dict(QSUM="*fp32", QSQ="*fp32", KSUM="*fp32", KSQ="*fp32", LOGITS="*fp32", SIM_Q="*fp32", SIM_K="*fp32")
    for dp in (64, 128):
        compile_kernel(Pool._scores_kernel, sums, {"scale"}, dict(DP=dp, BM=64, BN=64, DC=16))
    ptrs = dict(LOGITS="*fp32", SIM_Q="*fp32", SIM_K="*fp32", KEEP="*u8", MASK="*i8", CNT="*i32", IDX="*i32")
    for lists in (False, True):
        compile_kernel(Pool._select_kernel, ptrs, {"tau", "min_sim"}, dict(NKB_P2=256, GUARD=True, HAS_KEEP=lists,
                                                                          LISTS=lists))
    # the carried blocks' merge, with and without the forecast, into fp16 and bf16
    for forecast, dt in ((False, "fp16"), (True, "bf16")):
        compile_kernel(Mg._merge_kernel, dict(A=f"*{dt}", LA="*fp32", B=f"*{dt}", LB="*fp32", P=f"*{dt}", LP="*fp32",
                                              O=f"*{dt}"), {"step"}, dict(FORECAST=forecast, BLOCK_S=16, DP=128))
    return 13


def hopper_variant(pv, dt="fp16", lists=0, lse=False):
    """A Gluon sm_90 kernel, with its tensor descriptors typed as the launcher builds them."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    dp = 128
    plan = Hp._plan(dp, pv)
    block_n = tile_config(dp, pv).block_n
    gl_v = {"fp16": gl.float16, "bf16": gl.bfloat16}[dt]

    def desc(ty, block, gl_dtype):
        return f"tensordesc<{ty}{list(block)},{Hp._smem_layout(tuple(block), gl_dtype)!r}>"

    if pv is PV.FP8:
        fn, v_desc = Hp._attn_fwd_sm90_pingpong, desc("fp8e4nv", [dp, block_n], gl.float8e4nv)
        options = dict(maxnreg=Hp._PINGPONG_MAXNREG)
    else:
        fn, v_desc = Hp._attn_fwd_sm90, desc(dt, [1, 1, block_n, dp], gl_v)
        options = {}
    constexprs = dict(STAGES=plan.stages, LISTS=lists, RETURN_LSE=lse, num_warps=plan.num_warps)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(q_desc=desc("i8", [plan.block_m, dp], gl.int8), k_desc=desc("i8", [block_n, dp], gl.int8),
               v_desc=v_desc, QS="*fp32", KS="*fp32", VS="*fp32", KB_CNT="*i32", KB_CLEAN="*i32", KB_IDX="*i32",
               BIAS="*fp32", O="*" + dt, LSE="*fp32", OS="*" + dt, LSES="*fp32")
    sig.update({n: "constexpr" for n in constexprs})
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=dict(num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION, **options))


def main(everything: bool) -> int:
    if everything:
        quant = list(itertools.product((40, 64, 72, 128, 256), (0, 1, 2), (True, False), (True, False), ("fp16", "bf16"),
                                       (False, True)))
        attn = list(itertools.product((40, 64, 72, 128, 256), list(PV), (0, 1, 2, 3), ("fp16", "bf16")))
        attn += [(d, PV.FP8, 0, "fp16", False, False, False, False) for d in (40, 64)]  # short calls: cp.async tiles
    else:  # every branch at least once
        quant = [(40, 1, True, False), (72, 2, False, True, "bf16"), (128, 0, True, False), (128, 1, True, False),
                 (256, 1, True, True),
                 (64, 1, True, False, "fp16", True), (128, 0, True, False, "bf16", True)]
        attn = [(40, PV.FP16, 0), (36, PV.FP16, 1), (64, PV.FP8, 1, "bf16"), (72, PV.INT8, 2), (128, PV.FP8, 0), (256, PV.INT8, 0),
                (64, PV.FP8, 0, "fp16", True), (128, PV.FP16, 1, "bf16", True), (40, PV.INT8, 0, "fp16", True),
                (64, PV.FP16, 3), (128, PV.FP8, 3, "bf16"), (72, PV.INT8, 3),
                (64, PV.FP8, 0, "bf16", True, True), (128, PV.FP16, 0, "fp16", True, True),
                (64, PV.FP8, 0, "fp16", False, False, True, False)]
    n_quant = sum(quantize_variant(*args) for args in quant)
    for args in attn:
        attention_variant(*args)
    n_sparse = sparse_variants()
    hopper = [(PV.FP8,), (PV.FP16,), (PV.FP16, "bf16"), (PV.FP8, "fp16", 1), (PV.FP16, "fp16", 1),
              (PV.FP8, "bf16", 1, True), (PV.FP16, "fp16", 0, True), (PV.FP8, "bf16", 2), (PV.FP16, "bf16", 2, True),
              (PV.FP8, "bf16", 3), (PV.FP8, "fp16", 3, True)]
    for args in hopper:
        hopper_variant(*args)
    print(f"compiled {n_quant + len(attn) + n_sparse + len(hopper)} kernels for {TARGET} with Triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] == ["all"]))
