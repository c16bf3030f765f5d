"""Train a shipped ``ShapesPipeline`` from a seed: ``python -m diffusion_int8.embedded.train --out DIR``.

    python -m diffusion_int8.embedded.train --out DIR                   # embedded: 32×32, 256 tokens
    python -m diffusion_int8.embedded.train --variant long --out DIR    # embedded-long: 64×64, 4,096 tokens

Rectified-flow training (x_t = (1 - t)·x0 + t·ε, the model predicts ε - x0, t logit-normal as in SD3 and
shifted by the variant's ``shift``, as its sampler is) on freshly rendered ``shapes.render`` batches at the
variant's image size, AdamW with warm-up, an EMA of the weights, bf16
autocast on CUDA, labels dropped 10% of the time for classifier-free guidance. It writes the EMA
pipeline in fp16 (``save_pretrained``), a sample grid and a loss log (``training.json``) to ``--out``;
copied to the variant's directory in the package (``variants.Variant.path``), it is the shipped model.
``--max-minutes`` bounds the training loop: after 120 steps it times them and shortens the run (and its
cosine learning rate) to fit. The same seed gives
the same data and initialization; GPU kernels are not bitwise deterministic, so weights may differ in
the last bits between runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler
from tqdm.auto import tqdm

from .pipeline import ShapesPipeline
from .shapes import CLASSES, NUM_CLASSES, render
from .variants import VARIANTS, get_variant, transformer_config

# per variant: --steps, --batch, --lr and --max-minutes where not given. A long image costs ~55× a base one
# in a training step (~480 against ~9 GFLOP forward and backward, 3/4 of it attention over 4,096 tokens):
# a smaller batch, and more steps than the budget allows, so --max-minutes decides how many run. The base
# defaults are the settings of the shipped model's run (its training.json: batch 384, lr 4e-4, 10,151 steps in
# 8.2 minutes on an H100, which --max-minutes 8.5 fits).
DEFAULTS = {
    "base": dict(steps=12000, batch=384, lr=4e-4, max_minutes=8.5),
    "long": dict(steps=30000, batch=32, lr=3e-4, max_minutes=8.0),
}


def train(out: Path, steps: int, batch: int, lr: float, seed: int, max_minutes: float, device: torch.device,
          variant: str = "base") -> dict:
    v = get_variant(variant)
    torch.manual_seed(seed)
    g = torch.Generator(device).manual_seed(seed)
    model = DiTTransformer2DModel(**transformer_config(variant)).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    total = [steps]  # shrunk after 120 steps if the time budget cannot fit them, so the cosine still ends
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, total[0]) / total[0]))))
    log, t0 = [], time.time()
    bar = tqdm(range(steps), desc="train", mininterval=5)
    for step in bar:
        if step == 20:
            t20 = time.time()
        if step == 120:  # time steps 20..120, past the first calls' warm-up
            per_step = (time.time() - t20) / 100
            total[0] = min(steps, int((max_minutes * 60 - (time.time() - t0)) / per_step * 0.97) + step)
            print(f"{per_step * 1e3:.1f} ms/step: training {total[0]} steps")
        if step >= total[0]:
            break
        labels = torch.randint(0, NUM_CLASSES, (batch,), generator=g, device=device)
        x0 = render(labels, g, size=v.image_size) * 2 - 1
        noise = torch.randn(x0.shape, generator=g, device=device)
        t = torch.sigmoid(torch.randn(batch, generator=g, device=device))
        t = v.shift * t / (1 + (v.shift - 1) * t)  # the sampler's shift (FlowMatchEulerDiscreteScheduler); 1: none
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        drop = torch.rand(batch, generator=g, device=device) < 0.1
        labels = torch.where(drop, torch.full_like(labels, NUM_CLASSES), labels)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = model(xt, timestep=t * 1000, class_labels=labels).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(0.999, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        if step % 100 == 0:
            log.append({"step": step, "loss": loss.item(), "minutes": (time.time() - t0) / 60})
            bar.set_postfix(loss=f"{loss.item():.4f}")
    pipe = ShapesPipeline(ema.to(torch.float16), FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=v.shift))
    pipe.save_pretrained(out, safe_serialization=True)
    return {"variant": v.key, "model": v.name, "tokens": v.tokens, "steps_done": min(step + 1, total[0]),
            "minutes": (time.time() - t0) / 60, "max_minutes": max_minutes, "seed": seed, "batch": batch, "lr": lr,
            "final_loss": log[-1]["loss"] if log else None, "log": log}


def sample_grid(path: Path, out_png: Path, device: torch.device, per_class: int = 4, seed: int = 0) -> None:
    """A grid with ``per_class`` samples of every class, one column per class, enlarged (nearest) to 128 pixels a
    sample: 4× for the base variant's 32, 2× for the long one's 64."""
    from PIL import Image

    from .pipeline import load_pipeline

    pipe = load_pipeline(path, device=device)
    labels = [c for _ in range(per_class) for c in range(NUM_CLASSES)]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))]
    imgs = pipe(labels, generator=gens, output_type="pt").images.cpu()
    s = imgs.shape[-1]
    grid = imgs.view(per_class, NUM_CLASSES, 3, s, s).permute(0, 3, 1, 4, 2).reshape(per_class * s, NUM_CLASSES * s, 3)
    img = Image.fromarray((grid * 255).round().byte().numpy())
    k = max(1, 128 // s)
    img.resize((img.width * k, img.height * k), Image.NEAREST).save(out_png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for the pipeline (must not exist)")
    p.add_argument("--variant", choices=list(VARIANTS), default="base",
                   help=", ".join(f"{v.key}: {v.name}, {v.tokens} tokens" for v in VARIANTS.values()) + " (default: %(default)s)")
    per = lambda k: "; ".join(f"{key} {d[k]}" for key, d in DEFAULTS.items())  # noqa: E731
    p.add_argument("--steps", type=int, default=None, help=f"default per variant: {per('steps')}")
    p.add_argument("--batch", type=int, default=None, help=f"default per variant: {per('batch')}")
    p.add_argument("--lr", type=float, default=None, help=f"default per variant: {per('lr')}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None,
                   help=f"fit the training loop in this time (timed after 120 steps); default per variant: {per('max_minutes')}")
    p.add_argument("--samples", type=int, default=4, help="samples per class in samples.png; 0: no grid (default: %(default)s)")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists; choose a new directory")
    for k, value in DEFAULTS[args.variant].items():
        if getattr(args, k) is None:
            setattr(args, k, value)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = train(args.out, args.steps, args.batch, args.lr, args.seed, args.max_minutes, device, args.variant)
    info["classes"] = list(CLASSES)
    (args.out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    if args.samples > 0:
        sample_grid(args.out, args.out / "samples.png", device, per_class=args.samples)
    print(f"trained {info['steps_done']} steps in {info['minutes']:.1f} min, final loss {info['final_loss']:.4f}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
