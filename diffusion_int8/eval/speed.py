"""Where INT8 attention pays on this GPU: attention calls at real models' shapes and whole denoiser steps, each
timed against stock in one run, with the speed gate's decision beside it (``measure``).

The attention calls are replayed from CUDA graphs (the GPU's time alone), the three variants taking turns
(``timing.interleaved_rounds``), on inputs with real structure (``inputs.realistic_qkv``: a K channel bias and a
sink token) laid out as diffusers hands them over ((B, S, H, D) memory). The denoiser steps are eager, as a
pipeline runs them, medians of CUDA-event-timed steps after warm-up: the shipped models, and Wan2.1-T2V-1.3B's
real configuration with random weights (no download). "What you get" is what ``enable()`` does by default: INT8
where the gate lets it, SDPA elsewhere.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..inputs import realistic_qkv
from ..plugin.install import enable
from ..kernels import Mode, int8_attention
from ..plugin.speed_gate import EAGER_SAVING_MS, SpeedGate, kind_of_call
from ..timing import interleaved_rounds, median, take_turns


@dataclass(frozen=True)
class Call:
    """One attention call of a real model: (B, H, S, D) self- or joint attention, ``masked_text`` text tokens at the
    end of the sequence of which a quarter are padding (a key mask), in ``dtype``."""

    model: str
    what: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype = torch.bfloat16
    masked_text: int = 0


CALLS = (
    Call("SDXL", "1024², 64×64 self-attention, CFG batch", (2, 10, 4096, 64), torch.float16),
    Call("SD3.5 Large", "1024², joint image + text, CFG batch", (2, 38, 4429, 64)),
    Call("Flux.1", "1024², joint image + text", (1, 24, 4608, 128)),
    Call("CogVideoX-5B", "720×480×49 frames, joint, CFG batch", (2, 48, 17776, 64)),
    Call("Wan2.1", "480p×81 frames, self-attention", (1, 12, 32760, 128)),
    Call("HunyuanVideo", "544×960×61 frames, joint, text padded", (1, 24, 32896, 128), masked_text=256),
)
MODES = ("int8_fp16v", "int8")


def measure(device: torch.device, progress: Callable[[str], None] = print, reps: int = 10, rounds: int = 3,
            steps: bool = True) -> dict:
    """The speed section of a report: ``{"device", "date", "calls", "steps", "pays_from", "pays_from_tail",
    "pays_from_masked", "headline"}`` (see ``call_rows``, ``step_rows``, ``pays_from``, ``headline``; the last two
    crossovers None where the table has no cells of their kind). ``steps=False`` leaves the denoiser steps out."""
    gate = SpeedGate()
    calls = call_rows(device, gate, progress, reps, rounds)
    step = step_rows(device, progress) if steps else []
    table = gate.table_for(device)
    kinds = {g.kind for g in table.grids} if table is not None else set()
    # the other kinds' crossovers where the table has their cells (else the gate judges those calls as plain ones)
    crossover, tail, masked = (pays_from(device, gate, kind) if kind == "plain" or kind in kinds else None
                               for kind in ("plain", "tail", "key"))
    return {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
            "calls": calls, "steps": step, "pays_from": crossover, "pays_from_tail": tail, "pays_from_masked": masked,
            "headline": headline(calls, step, crossover, masked, tail, gate.eager_saving_ms)}


def call_rows(device: torch.device, gate: SpeedGate, progress=print, reps: int = 10, rounds: int = 3) -> list[dict]:
    """Per ``CALLS`` entry: SDPA's ms, each INT8 mode's ms and speed-up (SDPA's time over its own, the median of
    ``rounds`` paired rounds), the gate's decision for the default mode in an eager call (``gate_int8``) and in a
    CUDA graph or a compiled model (``gate_int8_graphs``), and the speed-up ``enable()`` gives an eager call."""
    rows = []
    for i, call in enumerate(CALLS):
        B, H, S, D = call.shape
        q, k, v = realistic_qkv(B, H, S, S, D, dtype=call.dtype, layout="BSHD", device=device, seed=i)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # BHSD views of (B, S, H, D) memory, as diffusers passes
        mask = None
        if call.masked_text:
            mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=device)
            mask[..., S - call.masked_text // 4:] = False
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
        for m in MODES:
            fns[m] = lambda m=m: int8_attention(q, k, v, mode=m, attn_mask=mask)
        times = interleaved_rounds(fns, reps, rounds)
        sdpa = median(times["sdpa"])
        row = {"model": call.model, "what": call.what, "shape": list(call.shape), "dtype": str(call.dtype)[6:],
               "masked_text": call.masked_text, "sdpa_ms": sdpa}
        for m in MODES:
            row[f"{m}_ms"] = median(times[m])
            row[f"{m}_speedup"] = median([a / b for a, b in zip(times["sdpa"], times[m])])
        default = Mode.parse("int8")
        row["gate_int8"] = bool(gate.pays(default, q, k, mask))  # by the grids of the call's kind, as an eager call
        row["gate_int8_graphs"] = bool(gate.pays(default, q, k, mask, eager=False))  # captured or compiled
        row["you_get"] = row["int8_speedup"] if row["gate_int8"] else 1.0
        rows.append(row)
        progress(f"[{i + 1}/{len(CALLS)}] {call.model} {call.shape}: SDPA {sdpa:.2f} ms, "
                 + ", ".join(f"{m} {row[f'{m}_speedup']:.2f}×" for m in MODES)
                 + f"; the gate: {'INT8' if row['gate_int8'] else 'SDPA'}")
        del q, k, v, fns
        torch.cuda.empty_cache()
    return rows


def step_rows(device: torch.device, progress=print, steps: int = 5, rounds: int = 3) -> list[dict]:
    """Eager denoiser steps, stock against ``enable()``'s defaults (INT8 where the gate lets it): the shipped
    models and Wan2.1-T2V-1.3B at 480p × 49 frames (random weights). Per model: both step times (medians over
    ``rounds`` rounds, taking turns, of the median of ``steps`` after two warm-up steps), the speed-up (the median
    of the rounds' ratios), and the INT8 / gated attention calls of one step."""
    from ..embedded import load_pipeline  # diffusers, loaded where the steps are timed

    models = []
    for variant, name in (("base", "shipped embedded, 256 tokens"), ("long", "shipped embedded-long, 4,096 tokens")):
        try:
            pipe = load_pipeline(variant=variant, device=device)
        except FileNotFoundError as exc:  # an install without the long model's weights
            progress(f"{name}: skipped ({exc})")
            continue
        model = pipe.transformer
        x = dict(hidden_states=torch.randn(32, model.config.in_channels, model.config.sample_size,
                                           model.config.sample_size, device=device, dtype=model.dtype),
                 timestep=torch.full((32,), 500, device=device), class_labels=torch.zeros(32, dtype=torch.long, device=device))
        models.append((name + ", batch 32", model, x))
    models.append(("Wan2.1-T2V-1.3B, 480p×49 frames, 30 blocks (random weights)", *_wan(device)))
    rows = []
    for name, model, x in models:
        with torch.no_grad():
            handle = enable(model)
            _step_ms(model, x, 1)  # the gate's decisions and the kernels' compilation, before counting
            handle.state.reset()
            model(**x)
            int8, gated = handle.state.int8_calls, handle.state.gated_calls
            handle.disable()
            # stock and INT8 take turns, so a drift of the host's speed (eager steps of small models wait on it)
            # reaches both alike; the ratio is the median of the rounds' own
            times = take_turns(("stock", "int8"), functools.partial(_variant_step_ms, model, x, steps), rounds)
        stock, ms = median(times["stock"]), median(times["int8"])
        speedup = median([a / b for a, b in zip(times["stock"], times["int8"])])
        rows.append({"model": name, "stock_ms": stock, "int8_ms": ms, "speedup": speedup, "int8_calls": int8,
                     "gated_calls": gated})
        progress(f"{name}: stock {stock:.1f} ms, INT8 (defaults) {ms:.1f} ms a step, {speedup:.2f}×; "
                 f"{int8} INT8 / {gated} gated attention calls")
        del model, x
        torch.cuda.empty_cache()
    return rows


def _wan(device: torch.device):
    """Wan2.1-T2V-1.3B's transformer (30 blocks, 12 heads × 128), random bf16 weights made on ``device``, and one
    step's inputs at 480p × 49 frames (13 × 60 × 104 latents: 20,280 tokens; 512 text tokens)."""
    import diffusers

    with torch.device(device):
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6).to(torch.bfloat16).eval()
        x = dict(hidden_states=torch.randn(1, 16, 13, 60, 104, dtype=torch.bfloat16), timestep=torch.tensor([500]),
                 encoder_hidden_states=torch.randn(1, 512, 4096, dtype=torch.bfloat16))
    return model, x


def _variant_step_ms(model, x: dict, steps: int, variant: str) -> float:
    """``_step_ms`` of ``model`` as stock ("stock") or with ``enable()``'s defaults ("int8")."""
    handle = enable(model) if variant == "int8" else None
    try:
        return _step_ms(model, x, steps)
    finally:
        if handle is not None:
            handle.disable()


def _step_ms(model, x: dict, steps: int) -> float:
    for _ in range(2):
        model(**x)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def pays_from(device: torch.device, gate: SpeedGate, kind: str = "plain") -> dict[str, int | None]:
    """Per head dim (64, 128): the fewest tokens from which the gate runs the default mode's self-attention
    with 24 heads, batch 1, bf16 (eighth-octave steps from 1,024 to 131,072), or None where it never does, for
    calls of ``kind`` (``speed_gate.KINDS``): lengths of whole 128-key tiles ("plain"), those lengths plus half a
    tile ("tail": head dim 64 alone, the only one the gate judges apart), or whole tiles with a padded prompt's key
    mask ("key")."""
    table = gate.table_for(device)
    out = {}
    for d in (64,) if kind == "tail" else (64, 128):
        found = None
        if table is not None:
            for i in range(0, 7 * 8 + 1):
                s = int(1024 * 2 ** (i / 8)) // 128 * 128 + (64 if kind == "tail" else 0)
                if table.pays("int8", d, torch.bfloat16, 24 * s, s, kind=kind_of_call(s, s, kind == "key")):
                    found = s
                    break
        out[str(d)] = found
    return out


def headline(calls: list[dict], steps: list[dict], crossover: dict, masked: dict | None = None,
             tail: dict | None = None, eager_saving_ms: float = EAGER_SAVING_MS) -> str:
    """The honest summary: from how many tokens INT8 pays on this GPU in GPU time (with a text padding mask, and at
    lengths past whole 128-key tiles, where the gate knows those to differ) and what eager calls must save besides
    (``eager_saving_ms``), which of the calls it speeds up, which only in CUDA graphs, and that the others run at
    stock speed."""
    fast = [r for r in calls if r["gate_int8"]]
    graphs = [r for r in calls if not r["gate_int8"] and r.get("gate_int8_graphs")]
    slow = [r["model"] for r in calls if not r["gate_int8"] and not r.get("gate_int8_graphs")]

    def lengths(found):
        return " and ".join(f"about {n:,} tokens at head dim {d}" for d, n in found.items() if n)

    text = f"On this GPU INT8 attention pays from {lengths(crossover) or 'no length measured'}."
    if tail and lengths(tail):
        text += f" At lengths that leave a partial 128-key tile, where SDPA slows down, it pays from {lengths(tail)}."
    if masked and masked != crossover and lengths(masked):
        text += f" With a text padding mask, which slows SDPA down, it pays from {lengths(masked)}."
    text += (f" That is in GPU time: an eager call must also save {eager_saving_ms:g} ms of it, for the host time "
             f"INT8 adds.")
    if fast:
        text += " " + ", ".join(f"{r['model']}'s attention runs {r['you_get']:.2f}× faster" for r in fast) + "."
    if graphs:
        text += (" " + ", ".join(f"{r['model']}'s ({r['int8_speedup']:.2f}×)" for r in graphs)
                 + f" {'runs' if len(graphs) == 1 else 'run'} INT8 in CUDA graphs and compiled models only: an eager "
                   f"call saves less than that.")
    if slow:
        text += (f" {', '.join(slow)} {'stays' if len(slow) == 1 else 'stay'} on SDPA (too short for INT8 to pay): "
                 f"stock speed, stock images.")
    video = [r for r in steps if r["int8_calls"] and not r["model"].startswith("shipped")]
    if video:
        text += " " + "; ".join(f"{r['model'].split(',')[0]}: a whole denoiser step runs {r['speedup']:.2f}× stock"
                                for r in video) + "."
    return text

