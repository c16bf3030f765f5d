"""diffusers' rotary position embeddings in one launch, equal to the stock functions bit for bit.

Two stock functions rotate Q and K with a dozen or so PyTorch ops per tensor (strided reads, four products, two sums,
float32 temporaries): the ``apply_rotary_emb`` nested in Wan's processors, and ``diffusers.models.embeddings.
apply_rotary_emb`` with real tables, which Flux, CogVideoX, HunyuanVideo and others call. At 480p × 81 frames Wan's
Q and K cost a quarter of an INT8 attention call. ``rotate_pairs`` reads each input once and writes the result once.
Every product and sum is rounded to the dtype PyTorch computes it in, and the kernel is compiled without fused
multiply-adds, so the result is the stock function's, bit for bit. The forms (``form``):

- ``WAN``: channel pairs (2j, 2j+1), both rotated by ``cos[2j]`` and ``sin[2j+1]``, in the promotion of the input's
  dtype and the tables'.
- ``INTERLEAVED``: ``embeddings.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-1)``: pairs (2j, 2j+1), each
  channel rotated by its own table entries, in float32 (the stock function upcasts ``x``).
- ``HALVES``: the same with ``use_real_unbind_dim=-2``: pairs (j, j + D/2).
- ``COMPLEX``: ``apply_rotary_emb(x, freqs_cis, use_real=False)`` and its copies (Lumina, Qwen-Image, Z-Image): pairs
  (2j, 2j+1) as complex numbers times a complex table, given as its float32 (re, im) pairs (``torch.view_as_real``)
  in both table arguments, in float32: (a + bi)(c + di) = (a·c - b·d) + (a·d + b·c)i. Which product of each sum the
  compiler of a PyTorch build fused into a multiply-add, if any, is its choice: ``fused`` names it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache import signature
from .config import triton_unavailable
from .launch import plan_or_run

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the dtypes taken, and the kernel's constexpr
WAN, INTERLEAVED, HALVES, COMPLEX = 0, 1, 2, 3  # the forms: see the module docstring


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """float32 ``x`` rounded to the compute dtype (ROUND: 0 float32, 1 bfloat16, 2 float16), as float32."""
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rotated(x1, x2, c1, c2, s1, s2, ROUND: tl.constexpr):
    """Channels (x1, x2) of each pair rotated, x1 by its entries (c1, s1) and x2 by (c2, s2): (x1·c1 - x2·s1,
    x2·c2 + x1·s2), each product and sum rounded as PyTorch rounds it (the sums' rounding is the store's where the
    compute dtype is 16-bit: both inputs are of it)."""
    return (_rounded(x1 * c1, ROUND) - _rounded(x2 * s1, ROUND),
            _rounded(x2 * c2, ROUND) + _rounded(x1 * s2, ROUND))


@triton.jit
def _fused_sum(p, q, r, s, FUSED: tl.constexpr):
    """p·q + r·s in float32: FUSED 0 each product rounded, 1 the first fused into the sum (fma(p, q, r·s)), 2 the
    second (fma(r, s, p·q))."""
    if FUSED == 1:
        return tl.fma(p, q, r * s)
    elif FUSED == 2:
        return tl.fma(r, s, p * q)
    else:
        return p * q + r * s


@triton.jit
def _rotate_pairs_kernel(
    X, COS, SIN, OUT, R, S, H, D,
    stride_xb, stride_xs, stride_xh, stride_xd, stride_cb, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_ss, stride_sh, stride_sd, stride_ob, stride_os, stride_oh, stride_od,
    ROWS: tl.constexpr, DP: tl.constexpr, ROUND: tl.constexpr, FORM: tl.constexpr, RE_FUSED: tl.constexpr,
    IM_FUSED: tl.constexpr,
):
    # ROWS rows (b, s, h) of X. Adjacent pairs (WAN, INTERLEAVED): each row loaded whole (DP columns) and split into
    # (x[2j], x[2j+1]), then joined and stored whole, so loads and stores run at full width. HALVES: the row's two
    # halves loaded apart (DP columns each).
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = (r // (S * H)).to(tl.int64)
    s = (r // H % S).to(tl.int64)
    h = (r % H).to(tl.int64)
    x_row = X + (b * stride_xb + s * stride_xs + h * stride_xh)[:, None]
    c_row = COS + (b * stride_cb + s * stride_cs + h * stride_ch)[:, None]
    s_row = SIN + (b * stride_sb + s * stride_ss + h * stride_sh)[:, None]
    o_row = OUT + (b * stride_ob + s * stride_os + h * stride_oh)[:, None]
    if FORM == 2:
        d = tl.arange(0, DP)[None, :]
        half = D // 2
        valid = (r[:, None] < R) & (d < half)
        xa = tl.load(x_row + d * stride_xd, mask=valid).to(tl.float32)
        xb = tl.load(x_row + (d + half) * stride_xd, mask=valid).to(tl.float32)
        ca = tl.load(c_row + d * stride_cd, mask=valid).to(tl.float32)
        cb = tl.load(c_row + (d + half) * stride_cd, mask=valid).to(tl.float32)
        sa = tl.load(s_row + d * stride_sd, mask=valid).to(tl.float32)
        sb = tl.load(s_row + (d + half) * stride_sd, mask=valid).to(tl.float32)
        out_a, out_b = _rotated(xa, xb, ca, cb, sa, sb, ROUND)
        tl.store(o_row + d * stride_od, out_a.to(OUT.dtype.element_ty), mask=valid)
        tl.store(o_row + (d + half) * stride_od, out_b.to(OUT.dtype.element_ty), mask=valid)
    else:
        d = tl.arange(0, DP)[None, :]
        valid = (r[:, None] < R) & (d < D)
        x = tl.load(x_row + d * stride_xd, mask=valid)
        c = tl.load(c_row + d * stride_cd, mask=valid)
        sn = tl.load(s_row + d * stride_sd, mask=valid)
        x1, x2 = tl.split(tl.reshape(x.to(tl.float32), [ROWS, DP // 2, 2]))
        c1, c2 = tl.split(tl.reshape(c.to(tl.float32), [ROWS, DP // 2, 2]))
        s1, s2 = tl.split(tl.reshape(sn.to(tl.float32), [ROWS, DP // 2, 2]))
        if FORM == 0:  # Wan's: both channels by cos[2j] and sin[2j+1]
            out_even, out_odd = _rotated(x1, x2, c1, c1, s2, s2, ROUND)
        elif FORM == 3:  # (x1 + x2 i)(re + im i), the table's (re, im) pairs in both: re = cos[2j], im = sin[2j+1]
            # Triton 3.6 computes -x2 as 0 - x2, +0 where x2 is +0: times -1 flips the sign, so zeros are signed as stock's
            out_even = _fused_sum(x1, c1, x2 * -1.0, s2, RE_FUSED)
            out_odd = _fused_sum(x1, s2, x2, c1, IM_FUSED)
        else:
            out_even, out_odd = _rotated(x1, x2, c1, c2, s1, s2, ROUND)
        out = tl.reshape(tl.join(out_even, out_odd), [ROWS, DP])
        tl.store(o_row + d * stride_od, out.to(OUT.dtype.element_ty), mask=valid)


def rotate_pairs_takes(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> bool:
    """Whether ``rotate_pairs`` runs these inputs (``_refusal``), in any form; never raises nor warns."""
    return _refusal(x, freqs_cos, freqs_sin) is None


def _refusal(x, freqs_cos, freqs_sin) -> str | None:
    """Why ``rotate_pairs`` does not run these inputs, or None where it does: a non-empty 4-D ``x`` of an even head dim,
    tables of its head dim that broadcast to it, float16/bfloat16/float32 tensors on one device the Triton kernels run
    on (``DIFFUSION_INT8_BACKEND`` not ``emulation``), and no gradient to keep."""
    if not (isinstance(freqs_cos, torch.Tensor) and isinstance(freqs_sin, torch.Tensor)):
        return "the tables are not tensors"
    if x.dim() != 4 or x.shape[-1] % 2 or x.numel() == 0:
        return f"x must be a non-empty (B, S, H, D) tensor with D even, got {tuple(x.shape)}"
    if any(t.dtype not in _ROUND for t in (x, freqs_cos, freqs_sin)) or freqs_cos.dtype != freqs_sin.dtype:
        return (f"x and the tables must be float16, bfloat16 or float32, the two tables of one dtype; got x {x.dtype}, "
                f"tables {freqs_cos.dtype} and {freqs_sin.dtype}")
    for t in (freqs_cos, freqs_sin):
        # broadcast to x without widening it: torch.broadcast_shapes(...) == x's, at a tenth of its host time
        fits = (t.device == x.device and 1 <= t.dim() <= 4 and t.shape[-1] == x.shape[-1]
                and all(n == 1 or n == m for n, m in zip(reversed(t.shape[:-1]), reversed(x.shape[:-1]))))
        if not fits:
            return (f"the tables must be (..., D) on x's device, broadcastable to x {tuple(x.shape)} on {x.device}; "
                    f"got {tuple(t.shape)} on {t.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, freqs_cos, freqs_sin)):
        return "it has no backward: call it without gradients (torch.no_grad())"
    return triton_unavailable(x.device)


def rotate_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                 out: torch.Tensor | None = None, form: int = WAN, fused: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """A stock rotary embedding in one launch, equal to it bit for bit: with ``form`` ``WAN`` diffusers' Wan
    ``apply_rotary_emb(x, freqs_cos, freqs_sin)`` (channel pairs (2j, 2j+1) rotated by ``freqs_cos[..., 2j]`` and
    ``freqs_sin[..., 2j+1]``), with ``INTERLEAVED`` and ``HALVES`` ``diffusers.models.embeddings.apply_rotary_emb`` on
    real tables, ``use_real_unbind_dim`` -1 and -2, given tables already shaped to broadcast; with ``COMPLEX`` that
    function on a complex table (``use_real=False``), given as ``torch.view_as_real(table).flatten(-2)`` in both
    table arguments, float32, and ``fused`` the multiply-adds it was compiled with: for the real part a·c - b·d and
    the imaginary a·d + b·c, 0 if each product is rounded, 1 if the first is fused into the sum, 2 if the second.

    x: (B, S, H, D) float16/bfloat16/float32, any strides, D even (any 4-D layout: the dims are only named so).
    freqs_cos, freqs_sin: (..., D) of one dtype, broadcastable to ``x`` (Wan's: (1, S, 1, D)).
    out: where to write (``x``'s shape and dtype); by default ``torch.empty_like(x)``, as the stock function's.
    Returns ``out``. Inputs ``rotate_pairs_takes`` refuses raise ``ValueError`` saying why.
    """
    reason = _refusal(x, freqs_cos, freqs_sin)
    if reason is not None:
        raise ValueError(f"rotate_pairs does not run these inputs: {reason}")
    if form not in (WAN, INTERLEAVED, HALVES, COMPLEX):
        raise ValueError(f"form must be rope.WAN, rope.INTERLEAVED, rope.HALVES or rope.COMPLEX, got {form!r}")
    if (not isinstance(fused, tuple) or len(fused) != 2 or any(f not in (0, 1, 2) for f in fused)
            or (fused != (0, 0) and form != COMPLEX)):
        raise ValueError(f"fused must be a pair of 0, 1 or 2, and (0, 0) but with rope.COMPLEX; got {fused!r} with "
                         f"form {form}")
    if form == COMPLEX and freqs_cos.dtype != torch.float32:
        raise ValueError(f"rope.COMPLEX takes a complex64 table's float32 (re, im) pairs, got {freqs_cos.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype}")
    return rotate_pairs_unchecked(x, freqs_cos, freqs_sin, out, form, fused)


def rotate_pairs_unchecked(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                           out: torch.Tensor | None = None, form: int = WAN,
                           fused: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``rotate_pairs`` for inputs ``rotate_pairs_takes`` has accepted, without checking them again."""
    shared = freqs_sin is freqs_cos  # the complex form's one table: a plan takes it once (inputs must not alias)
    key = ("rope", form, *fused, shared, *map(signature, (x, freqs_cos, freqs_sin, out)))
    if out is None:
        out = torch.empty_like(x)
    if x.is_cuda and torch.cuda.current_device() != x.device.index:
        with torch.cuda.device(x.device):  # Triton launches on the current device
            return rotate_pairs_unchecked(x, freqs_cos, freqs_sin, out, form, fused)

    def record(runner):
        B, S, H, D = x.shape
        cos, sin = freqs_cos.expand(x.shape), freqs_sin.expand(x.shape)
        rows = B * S * H
        dp = max(2, triton.next_power_of_2(D // 2 if form == HALVES else D))
        block_rows = max(1, 4096 // dp // (2 if form == HALVES else 1))
        # the generic function computes in float32 whatever x's dtype (it upcasts x), Wan's in x's and the tables'
        compute = torch.promote_types(x.dtype if form == WAN else torch.float32, freqs_cos.dtype)
        runner.launch(_rotate_pairs_kernel, (triton.cdiv(rows, block_rows),), (
            x, cos, sin, out, rows, S, H, D, *x.stride(), *cos.stride(), *sin.stride(), *out.stride(),
            block_rows, dp, _ROUND[compute], form, *fused), dict(enable_fp_fusion=False))

    # later calls of the signature replay the launch
    plan_or_run(key, [x, freqs_cos, None if shared else freqs_sin, out], record)
    return out
