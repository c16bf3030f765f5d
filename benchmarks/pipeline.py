"""Denoiser step latency, peak memory and output deviation: stock SDPA against each INT8 mode.

    python benchmarks/pipeline.py --out bench_out/pipeline.json [--models flux,wan,sdxl,dit,pixart,sd35,cogvideox,
        hunyuanvideo,ltx,qwenimage,lumina2]

Full-size architecture configs with random weights (no downloads), built directly on the GPU in fp16
or bf16. Where a model is cut to fewer blocks, the table says so: every block has the same attention
shape, so a cut model's step speedup is the full model's minus the share of embeddings and output
layers. Deviation is the PSNR against stock of one denoiser output on the same inputs, and of the final
latents of a short Euler trajectory from the same start (``--denoise-steps``), where errors accumulate.
Times are medians of CUDA-event-timed steps after warm-up; with ``--graph``, of replays of one step
captured in a CUDA graph (the GPU time alone, as under ``torch.compile(mode="reduce-overhead")``).
A second table gives the stock step's share of GPU time in attention kernels (one profiled step) and the
attention speedup a 1.15x or 1.3x step would need by Amdahl's law (inf: none is enough).
With ``--calibrated``, a further ``int8`` row runs with static ranges and K means from a calibration
recorded on the same Euler trajectory (in-sample: the best case for its deviation), so no statistics
pass runs.

A variant ``<mode> sparse=F`` runs block-sparse attention skipping the fraction F of each query block's key
blocks in every INT8 call: every call predicts its mask (``enable(..., sparsity=0.9)``), whose cost stays in the
time, but random weights have no attention structure to predict, so the benchmark hands the kernel a fixed mask
skipping exactly F (drawn once per shape) instead of the predicted one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time

import torch

from diffusion_int8.timing import graphed


def models():
    import diffusers as d

    def flux():
        # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128; cut to 2 + 4 blocks. 1024px: 4096 + 512 tokens.
        m = d.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
                                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                                     guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        g = lambda *s: torch.randn(*s)  # noqa: E731
        x = dict(hidden_states=g(1, 4096, 64), encoder_hidden_states=g(1, 512, 4096), pooled_projections=g(1, 768),
                 timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=g(4096, 3), txt_ids=g(512, 3))
        return m, x, torch.bfloat16, "2 of 19 double + 4 of 38 single blocks"

    def wan():
        # Wan2.1-T2V-1.3B, full: 30 blocks, 12 heads x 128. 480p x 49 frames: latent 13 x 60 x 104 -> 20280 tokens.
        m = d.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                                    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
        x = dict(hidden_states=torch.randn(1, 16, 13, 60, 104), timestep=torch.tensor([500]),
                 encoder_hidden_states=torch.randn(1, 512, 4096))
        return m, x, torch.bfloat16, "full (30 blocks)"

    def sdxl():
        # SDXL base UNet, full; 1024px: 128 x 128 latents; batch 2 (CFG).
        m = d.UNet2DConditionModel(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                                   block_out_channels=(320, 640, 1280), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                   up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                   transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                                   use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                                   projection_class_embeddings_input_dim=2816)
        x = dict(sample=torch.randn(2, 4, 128, 128), timestep=torch.tensor(500), encoder_hidden_states=torch.randn(2, 77, 2048),
                 added_cond_kwargs={"text_embeds": torch.randn(2, 1280), "time_ids": torch.randn(2, 6)})
        return m, x, torch.float16, "full"

    def dit():
        # DiT-XL/2 at 512px: 64 x 64 latents -> 1024 tokens, 16 heads x 72, 28 blocks; batch 4.
        m = d.DiTTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                    num_layers=28, sample_size=64, patch_size=2, num_embeds_ada_norm=1000)
        x = dict(hidden_states=torch.randn(4, 4, 64, 64), timestep=torch.tensor([500] * 4), class_labels=torch.tensor([1, 2, 3, 4]))
        return m, x, torch.float16, "full"

    def pixart():
        # PixArt-Sigma 1024px: 128 x 128 latents -> 4096 tokens, 16 heads x 72, 28 blocks, 300 text tokens.
        m = d.PixArtTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                       num_layers=28, sample_size=128, patch_size=2, cross_attention_dim=1152, caption_channels=4096,
                                       use_additional_conditions=False)
        x = dict(hidden_states=torch.randn(1, 4, 128, 128), timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 300, 4096),
                 added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        return m, x, torch.float16, "full"

    def sd35():
        # SD3.5-medium at 1024px: 128 x 128 latents -> 4096 tokens + 333 text tokens, 24 heads x 64, 24 MMDiT-X blocks
        # (dual attention in blocks 0-12), q/k RMSNorm; full.
        m = d.SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                                    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                                    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                                    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
        x = dict(hidden_states=torch.randn(1, 16, 128, 128), timestep=torch.tensor([500]),
                 encoder_hidden_states=torch.randn(1, 333, 4096), pooled_projections=torch.randn(1, 2048))
        return m, x, torch.float16, "full (24 blocks)"

    def cogvideox():
        # CogVideoX-5B, 720x480 x 49 frames: latent 13 x 60 x 90 -> 17550 tokens + 226 text, 48 heads x 64, 42 blocks;
        # cut to 8 blocks. Its rotary embeddings as CogVideoXPipeline computes them (float32, on the GPU): 13 frames of
        # 30 x 45 patches, the grid equal to the base size (no crop).
        m = d.CogVideoXTransformer3DModel(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
                                          time_embed_dim=512, text_embed_dim=4096, num_layers=8, sample_width=90,
                                          sample_height=60, sample_frames=49, use_rotary_positional_embeddings=True)
        rope = d.models.embeddings.get_3d_rotary_pos_embed(64, ((0, 0), (30, 45)), (30, 45), 13, device="cuda")
        x = dict(hidden_states=torch.randn(1, 13, 16, 60, 90), timestep=torch.tensor([500]),
                 encoder_hidden_states=torch.randn(1, 226, 4096), image_rotary_emb=rope)
        return m, x, torch.bfloat16, "8 of 42 blocks"

    def padded(n_text, n_valid, dtype=torch.bool):
        """A text mask of one prompt padded to ``n_text`` tokens, ``n_valid`` of them real (batch 1)."""
        mask = torch.zeros(1, n_text, dtype=dtype)
        mask[:, :n_valid] = 1
        return mask

    def hunyuanvideo(double=2, single=4):
        # HunyuanVideo: 20 double + 40 single blocks, 24 heads x 128; cut to 2 + 4 unless asked for more. 544x960 x
        # 61 frames: latent 16 x 68 x 120 -> 32640 video tokens + 256 text (a 180-token prompt: 76 padded), joint
        # attention masked.
        m = d.HunyuanVideoTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=24,
                                             attention_head_dim=128, num_layers=double, num_single_layers=single,
                                             num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                                             qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                                             pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56))
        x = dict(hidden_states=torch.randn(1, 16, 16, 68, 120), timestep=torch.tensor([500.0]),
                 encoder_hidden_states=torch.randn(1, 256, 4096), encoder_attention_mask=padded(256, 180, torch.long),
                 pooled_projections=torch.randn(1, 768), guidance=torch.tensor([6000.0]))
        return m, x, torch.bfloat16, f"{double} of 20 double + {single} of 40 single blocks; 76 of 256 text tokens padding"

    def ltx():
        # LTX-Video 0.9: 28 blocks, 32 heads x 64; cut to 8. 768x512 x 121 frames: latent 16 x 16 x 24 -> 6144
        # tokens; cross-attention over 128 text tokens (a 60-token prompt), masked.
        m = d.LTXVideoTransformer3DModel(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1,
                                         num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048,
                                         num_layers=8, caption_channels=4096)
        x = dict(hidden_states=torch.randn(1, 6144, 128), encoder_hidden_states=torch.randn(1, 128, 4096),
                 timestep=torch.tensor([500.0]), encoder_attention_mask=padded(128, 60, torch.long), num_frames=16,
                 height=16, width=24, rope_interpolation_scale=(8 / 25, 32, 32))
        return m, x, torch.bfloat16, "8 of 28 blocks; 68 of 128 text tokens padding"

    def qwenimage():
        # Qwen-Image: 60 blocks, 24 heads x 128; cut to 6. 1024px: 4096 image tokens + 256 text (a 200-token prompt
        # padded, as a batch of prompts of different lengths pads them), joint attention masked.
        m = d.QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=6,
                                          attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                          axes_dims_rope=(16, 56, 56))
        x = dict(hidden_states=torch.randn(1, 4096, 64), encoder_hidden_states=torch.randn(1, 256, 3584),
                 encoder_hidden_states_mask=padded(256, 200, torch.long), timestep=torch.tensor([0.5]),
                 img_shapes=[[(1, 64, 64)]])
        return m, x, torch.bfloat16, "6 of 60 blocks; 56 of 256 text tokens padding"

    def lumina2():
        # Lumina-Image 2.0: 26 blocks + 2 + 2 refiners, 24 heads x 96 (8 K/V heads); cut to 6. 1024px: 4096 image
        # tokens + 256 text (a 120-token prompt), joint attention masked.
        m = d.Lumina2Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=6,
                                        num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                                        norm_eps=1e-5, axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512),
                                        cap_feat_dim=2304)
        x = dict(hidden_states=torch.randn(1, 16, 128, 128), timestep=torch.tensor([0.5]),
                 encoder_hidden_states=torch.randn(1, 256, 2304), encoder_attention_mask=padded(256, 120))
        return m, x, torch.bfloat16, "6 of 26 blocks; 136 of 256 text tokens padding"

    return dict(flux=flux, wan=wan, sdxl=sdxl, dit=dit, pixart=pixart, sd35=sd35, cogvideox=cogvideox,
                hunyuanvideo=hunyuanvideo, ltx=ltx, qwenimage=qwenimage, lumina2=lumina2)


def _enable(model, variant: str):
    """Install the processor for a variant name: '<mode>', '<mode> forced' or '<mode> sparse=F'."""
    import diffusion_int8

    mode, *opts = variant.split()
    kw = dict(speed_gate="forced" not in opts)
    skip = next((float(o.split("=")[1]) for o in opts if o.startswith("sparse=")), None)
    if skip is not None:
        kw["sparsity"] = 0.9
    handle = diffusion_int8.enable(model, mode, **kw)
    if skip is not None:
        _fix_sparsity(skip)
    return handle


def _fix_sparsity(skip: float) -> None:
    """Every INT8 call that predicts a block mask keeps round((1 - skip) · blocks) key blocks per query block, at
    random (fixed per shape): the call's predictor still runs (its launch stays in the call's launch plan, so its cost
    is in the time), and the attention kernel then gets the fixed mask's block lists instead of the predicted ones."""
    from diffusion_int8.kernels import attention, clear_cache, pool

    if hasattr(pool.predict, "skip"):  # installed by an earlier round of this variant
        if pool.predict.skip != skip:
            raise SystemExit("one sparse=F per run: the fixed masks replace the predictor's for every sparse call")
        return
    predict, masks = pool.predict, {}

    def fixed(pooled, B, Hq, Sq, Sk, *args, runner, **kwargs):
        predict(pooled, B, Hq, Sq, Sk, *args, runner=runner, **kwargs)
        shape = (B, Hq, -(-Sq // 128), -(-Sk // 128))
        if shape not in masks:
            order = torch.rand(shape, generator=torch.Generator().manual_seed(0)).argsort(-1)
            masks[shape] = (order < max(1, round((1 - skip) * shape[-1]))).to(pooled.qsum.device)
        return attention.block_lists(runner.constant(masks[shape]), B, Hq, Sq, Sk, runner)

    fixed.skip = skip
    pool.predict = fixed
    clear_cache()


def to_dtype(model, dtype, device=None):
    """``model`` in ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` gives it: the parameters of its
    ``_keep_in_fp32_modules`` (Wan's norms and time embedding, ...) in float32, and the buffers it makes itself
    rather than loads (Wan's rotary tables, ...) as it made them, values and dtype."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    kept = {name: p.data.float() for name, p in model.named_parameters() if any(k in name.split(".") for k in keep)}
    made = {(module, b): getattr(module, b) for module in model.modules() for b in module._non_persistent_buffers_set
            if getattr(module, b) is not None}
    model = model.to(device, dtype)
    for name, p in model.named_parameters():
        if name in kept:
            p.data = kept[name].to(p.device)
    for (module, b), t in made.items():
        setattr(module, b, t.to(device if device is not None else t.device))
    return model


def cast(x, dtype):
    if isinstance(x, dict):
        return {k: cast(v, dtype) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        x = x.cuda()
        return x.to(dtype) if x.is_floating_point() else x
    return x


def _time(model, x, n, graph=False, compiled=False):
    """Median ms of ``n`` denoiser calls after warm-up; ``graph``: of replays of one captured call; ``compiled``: of
    ``torch.compile(model)`` (default mode) after it compiled. Also the median CPU time (ms) the host thread spent
    issuing a call: where the GPU waits on the host (eager image models), that is the step's cost, and unlike the
    wall time it does not count the moments another tenant of the shared CPU holds the core."""
    times, host = [], []
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model)
    with torch.no_grad():
        for _ in range(3):
            model(**x, return_dict=False)
        step = lambda: model(**x, return_dict=False)[0]  # noqa: E731
        if graph:
            step = graphed(step)
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.thread_time()
            a.record()
            out = step()
            b.record()
            host.append((time.thread_time() - t0) * 1e3)
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times), out.clone(), statistics.median(host)


def _denoise(model, x, steps):
    """Final latents of ``steps`` Euler steps from the inputs' latents, σ going 1 → 0 in equal steps.

    The update x ← x + (σ_next − σ)·f(x, σ) is the flow-matching Euler step; for ε- or v-predicting
    models with random weights it is simply a fixed, deterministic trajectory on which the modes'
    errors accumulate as they would over a generation. Outputs with extra channels (a learned
    variance) are cut to the latents' channels. The timestep is σ in the scale the inputs use (× 1000
    unless the given timestep is at most 1).
    """
    key = "sample" if "sample" in x else "hidden_states"  # UNets name their latents "sample"
    lat, t0 = x[key], x["timestep"]
    scale = 1.0 if float(t0.max()) <= 1.0 else 1000.0
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            t = torch.full_like(t0, round(s * scale) if not t0.is_floating_point() else s * scale)
            out = model(**{**x, key: lat, "timestep": t}, return_dict=False)[0]
            for d, (n_out, n_lat) in enumerate(zip(out.shape, lat.shape)):
                if n_out != n_lat:
                    out = out.narrow(d, 0, n_lat)
            lat = (lat.float() + (s_next - s) * out.float()).to(lat.dtype)
    return lat


def _calibrate(model, x, steps):
    """A ``Calibration`` of ``model`` recorded on ``_denoise``'s trajectory (ranges and K means only)."""
    import diffusion_int8
    from diffusion_int8.calibration import Calibration, Collector, merge

    col = Collector(modes=())
    handle = diffusion_int8.enable(model, mode="fp16", observer=col)
    try:
        _denoise(model, x, steps)
    finally:
        handle.disable()
    timesteps, stats = merge([col.record(0)])
    meta = {"model_class": type(model).__name__, "timestep_scale": 1000.0 if timesteps[0] > 1.0 else 1.0}
    return Calibration.from_stats(meta, timesteps, stats)


def _profile(model, x, label):
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(**x, return_dict=False)
        torch.cuda.synchronize()
    print(f"--- {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


_SDPA_KERNELS = re.compile(r"sdpa|flash|fmha|attention", re.IGNORECASE)


def _attention_share(model, x):
    """Stock step's GPU time in attention kernels: (attention ms, all kernels ms, attention kernel names).

    From one profiled step (kernels only, so host overhead is out). With attention a fraction f of the
    GPU time, an attention k times faster gives at most a step 1 / (1 − f + f / k) times faster."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(**x, return_dict=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(**x, return_dict=False)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    attn = [e for e in kernels if _SDPA_KERNELS.search(e.name)]
    us = lambda evs: sum(e.time_range.elapsed_us() for e in evs)  # noqa: E731
    return us(attn) / 1e3, us(kernels) / 1e3, sorted({e.name[:60] for e in attn})


def needed_speedup(share: float, target: float) -> float:
    """The attention speedup k at which 1 / (1 − share + share / k) reaches ``target`` (inf if none does)."""
    rest = 1 / target - (1 - share)
    return math.inf if rest <= 0 else share / rest


def psnr(out, ref):
    mse = (out.float() - ref.float()).pow(2).mean().item()
    peak = ref.float().abs().max().item()
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def main():
    import diffusion_int8

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flux,wan,sdxl,dit,pixart,sd35,cogvideox")
    ap.add_argument("--steps", type=int, default=10, help="timed denoiser calls per variant")
    ap.add_argument("--out", default="bench_out/pipeline.json")
    ap.add_argument("--denoise-steps", type=int, default=10,
                    help="Euler steps from the same start whose final latents are compared with stock's (0: skip)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step per INT8 mode")
    ap.add_argument("--graph", action="store_true",
                    help="time replays of a CUDA graph of the step (no host overhead), as torch.compile's "
                         "reduce-overhead mode would run it")
    ap.add_argument("--calibrated", action="store_true",
                    help="also int8 with static ranges and K means calibrated on the trajectory (no statistics pass)")
    ap.add_argument("--compile", action="store_true",
                    help="time torch.compile(model) (default mode) of each variant, enabled before compiling")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds; the variants take turns (reversed every other round); each row's time is the "
                         "median of its rounds' medians and its speed-up the median of its rounds' ratios to stock")
    ap.add_argument("--variants", default="stock,int8_fp16v,int8,int8_fp16v forced,int8 forced",
                    help="comma-separated: stock, a mode (speed gate on, the default of enable), '<mode> forced' "
                         "(speed_gate=False: INT8 for every call) or '<mode> sparse=F' (block-sparse, F of the blocks "
                         "skipped in every INT8 call)")
    args = ap.parse_args()
    builders = models()
    results = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d"), "cuda_graph": args.graph, "compiled": args.compile}}
    print(f"| model | config | mode | step ms | speedup | host CPU ms | host speedup | INT8 / gated calls | peak GiB | "
          f"PSNR of one step vs stock (dB) | PSNR of the final latents after {args.denoise_steps} steps (dB) |\n"
          f"|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        with torch.device("cuda"):
            model, x, dtype, note = builders[name]()
        model = to_dtype(model, dtype).eval()
        x = cast(x, dtype)
        if args.graph:
            try:
                _time(model, x, 1, graph=True)
            except Exception as exc:  # noqa: BLE001 - a forward that reads values back on the host cannot be captured
                print(f"| {name} | {note} | — | CUDA graph capture fails: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]} |", flush=True)
                results[name] = {"config": note, "graph_error": f"{type(exc).__name__}: {exc}"}
                del model, x
                torch.cuda.empty_cache()
                continue
        rows = {}
        variants = tuple(args.variants.split(",")) + (("int8+calibration",) if args.calibrated else ())
        for mode in variants:
            if mode == "stock":
                handle = None
            elif mode == "int8+calibration":
                cal = _calibrate(model, x, max(args.denoise_steps, 3))
                handle = diffusion_int8.enable(model, "int8", calibration=cal)
            else:
                handle = _enable(model, mode)
            torch.cuda.reset_peak_memory_stats()
            ms, out, host_ms = _time(model, x, args.steps, args.graph, args.compile)
            peak = torch.cuda.max_memory_allocated() / 2**30
            final = _denoise(model, x, args.denoise_steps) if args.denoise_steps else None
            if args.profile and handle is not None:
                _profile(model, x, f"{name} {mode}")
            calls = "—"
            if handle is not None:
                handle.disable()
                # a compiled model's calls are not counted (the counters would recompile its graph at every call)
                calls = ("not counted (compiled)" if args.compile
                         else f"{handle.state.int8_calls} / {handle.state.gated_calls}")
            if mode == "stock":
                ref, ref_final = out, final
                attn_ms, gpu_ms, names = _attention_share(model, x)
                share = attn_ms / gpu_ms
                results.setdefault("attention_share", {})[name] = {
                    "attention_ms": attn_ms, "gpu_ms": gpu_ms, "share": share, "kernels": names,
                    "needed_for_1.15x": needed_speedup(share, 1.15), "needed_for_1.3x": needed_speedup(share, 1.3)}
            stock = mode == "stock"
            rows[mode] = {"ms": ms, "host_ms": host_ms, "peak_gib": peak, "psnr": None if stock else psnr(out, ref),
                          "psnr_final": None if stock or final is None else psnr(final, ref_final),
                          "int8_calls": None if stock or args.compile else handle.state.int8_calls,
                          "gated_calls": None if stock or args.compile else handle.state.gated_calls}
            rows[mode]["calls"] = calls
        # more timing rounds, the variants taking turns (reversed every other round): each row is the median of its
        # rounds, so the host's drift (eager steps on the shared machine move by tens of percent) reaches all alike
        for r in range(1, args.rounds):
            for mode in (variants[::-1] if r % 2 else variants):
                handle = None
                if mode == "int8+calibration":
                    handle = diffusion_int8.enable(model, "int8", calibration=cal)
                elif mode != "stock":
                    handle = _enable(model, mode)
                ms, _, host_ms = _time(model, x, args.steps, args.graph, args.compile)
                rows[mode].setdefault("ms_rounds", [rows[mode]["ms"]]).append(ms)
                rows[mode].setdefault("host_ms_rounds", [rows[mode]["host_ms"]]).append(host_ms)
                if handle is not None:
                    handle.disable()
        for mode in variants:
            row = rows[mode]
            # speed-ups are the median of each round's ratio to stock's time in the same round (the two ran next to
            # each other), which the host's drift between rounds moves far less than a ratio of the medians
            for key in ("ms", "host_ms"):
                runs, base = row.get(f"{key}_rounds", [row[key]]), rows["stock"].get(f"{key}_rounds", [rows["stock"][key]])
                row[key] = statistics.median(runs)
                row["speedup" if key == "ms" else "host_speedup"] = statistics.median(b / r for b, r in zip(base, runs))
            p, pf = ("—", "—") if mode == "stock" else (
                f"{row['psnr']:.1f}", "—" if row["psnr_final"] is None else f"{row['psnr_final']:.1f}")
            print(f"| {name} | {note} | {mode} | {row['ms']:.1f} | {row['speedup']:.2f}x | {row['host_ms']:.1f} | "
                  f"{row['host_speedup']:.2f}x | {row.pop('calls')} | "
                  f"{row['peak_gib']:.1f} | {p} | {pf} |", flush=True)
        results[name] = {"config": note, "dtype": str(dtype), "rows": rows}
        del model, x, ref, out, ref_final, final
        torch.cuda.empty_cache()
    print("\n| model | stock GPU ms per step | attention ms | attention share | attention speedup a 1.15x / 1.3x step "
          "needs | attention kernels |\n|---|---|---|---|---|---|")
    for name, a in results.get("attention_share", {}).items():
        print(f"| {name} | {a['gpu_ms']:.1f} | {a['attention_ms']:.1f} | {a['share']:.0%} | {a['needed_for_1.15x']:.2f}x / "
              f"{a['needed_for_1.3x']:.2f}x | {', '.join(a['kernels'])} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
