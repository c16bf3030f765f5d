"""Save a full-size diffusers pipeline with random weights, for running the CLIs on a real architecture offline.

    python benchmarks/random_pipeline.py --arch dit-xl-2-512 --out /tmp/dit-xl
    diffusion-int8 eval --model /tmp/dit-xl --class-labels 1 2 3 4 --out report/

Random weights make noise, not pictures; what this exercises is the path (loading, hooks, schedules,
calibration, metrics) and the speed at the real shapes. ``dit-xl-2-512``: DiT-XL/2 (28 blocks,
16 heads × 72, 1024 tokens) with an SD-style VAE (512-channel mid-block attention, left on SDPA).
"""

from __future__ import annotations

import argparse

import torch


def dit_xl_2_512():
    import diffusers as d

    torch.manual_seed(0)
    transformer = d.DiTTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                          num_layers=28, sample_size=64, patch_size=2, num_embeds_ada_norm=1000)
    vae = d.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                          down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                          layers_per_block=2, sample_size=512)
    return d.DiTPipeline(transformer=transformer, vae=vae, scheduler=d.DPMSolverMultistepScheduler())


ARCHS = {"dit-xl-2-512": dit_xl_2_512}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="dit-xl-2-512")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pipe = ARCHS[args.arch]().to(torch.float16)
    pipe.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.arch} with random weights to {args.out}")


if __name__ == "__main__":
    main()
