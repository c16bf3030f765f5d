"""``ShapesPipeline``: the project's own small class-conditional diffusion transformers, in pixel space.

A ``DiTTransformer2DModel`` (6 layers, 4 heads of dim 64) trained by flow matching on ``shapes.render``
data (``python -m diffusion_int8.embedded.train``), sampled with ``FlowMatchEulerDiscreteScheduler`` and
classifier-free guidance, in two variants (``variants.VARIANTS``): ``base``, 256 tokens of 2×2 patches of a
32×32 RGB image, and ``long``, 4,096 tokens of one pixel each of a 64×64 image. The trained weights ship in
the package (``Variant.path``, fp16 safetensors) and load offline:

    from diffusion_int8.embedded import load_pipeline
    pipe = load_pipeline(device="cuda")                    # load_pipeline(variant="long"): 4,096 tokens
    images = pipe(["red circle", "blue ring"], generator=torch.Generator().manual_seed(0)).images
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
from diffusers import DiffusionPipeline, DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler, ImagePipelineOutput
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.utils.torch_utils import randn_tensor

from .shapes import CLASSES, NUM_CLASSES, label_ids
from .variants import get_variant


class ShapesPipeline(DiffusionPipeline):
    """Class-conditional pixel-space DiT; labels are ``CLASSES`` names or indices."""

    model_cpu_offload_seq = "transformer"
    labels = CLASSES
    _callback_tensor_inputs = ["latents"]

    def __init__(self, transformer: DiTTransformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def label_ids(self, class_labels: int | str | Sequence[int | str]) -> list[int]:
        """Class indices of ``class_labels`` (``shapes.label_ids``)."""
        return label_ids(class_labels)

    @property
    def interrupt(self) -> bool:
        """Whether a step-end callback stopped this run (``pipe._interrupt = True``), as in diffusers."""
        return getattr(self, "_interrupt", False)

    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | str | Sequence[int | str] | None = None,
        num_inference_steps: int = 20,
        guidance_scale: float = 3.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        prompt: str | Sequence[str] | None = None,
        callback_on_step_end: Callable | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ):
        """Generate one image per label.

        Args:
            class_labels: class names (``pipe.labels``), prompts that name a class, or indices; one string
                is one label, as diffusers pipelines take one prompt.
            prompt: the same, by the name text-to-image pipelines use (give one of the two).
            num_inference_steps: Euler steps of the flow.
            guidance_scale: classifier-free guidance; 1 turns it off (and halves the batch).
            generator: one generator, or one per image (the noise of image i then depends only on its own).
            output_type: ``"pil"``, ``"np"`` (B, S, S, 3) float, or ``"pt"`` (B, 3, S, S) float in [0, 1], where S
                is the model's image side (``transformer.config.sample_size``: 32 for ``base``, 64 for ``long``).
            callback_on_step_end: as in diffusers, called after every denoising step as
                ``callback_on_step_end(pipe, step, timestep, callback_kwargs)``; ``callback_kwargs`` holds the
                tensors named in ``callback_on_step_end_tensor_inputs`` (``"latents"``: the current sample, in
                [-1, 1] pixel space), and a ``"latents"`` entry of the dict it returns replaces the sample.
                Setting ``pipe._interrupt = True`` there skips the steps left, as in diffusers' pipelines.
        """
        if (class_labels is None) == (prompt is None):
            raise ValueError("give the labels either as class_labels or as prompt (class names or prompts naming "
                             f"one): {', '.join(CLASSES)}")
        ids = self.label_ids(class_labels if prompt is None else prompt)
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        unknown = [k for k in callback_on_step_end_tensor_inputs if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs has to be in {self._callback_tensor_inputs}, "
                             f"but found {unknown}")
        device, dtype = self._execution_device, self.transformer.dtype
        size = self.transformer.config.sample_size
        x = randn_tensor((len(ids), 3, size, size), generator=generator, device=device, dtype=torch.float32)
        labels = torch.tensor(ids, device=device)
        cfg = guidance_scale > 1
        if cfg:
            labels = torch.cat([torch.full_like(labels, NUM_CLASSES), labels])
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        self._interrupt = False
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            if self.interrupt:
                continue
            model_in = torch.cat([x, x]) if cfg else x
            v = self.transformer(model_in.to(dtype), timestep=t.expand(model_in.shape[0]), class_labels=labels).sample
            v = v.float()
            if cfg:
                v_uncond, v_cond = v.chunk(2)
                v = v_uncond + guidance_scale * (v_cond - v_uncond)
            x = self.scheduler.step(v, t, x).prev_sample
            if callback_on_step_end is not None:
                tensors = {"latents": x}
                outputs = callback_on_step_end(self, i, t, {k: tensors[k] for k in callback_on_step_end_tensor_inputs})
                x = (outputs or {}).pop("latents", x)
        images = (x / 2 + 0.5).clamp(0, 1)
        self.maybe_free_model_hooks()
        if output_type == "pt":
            out = images
        else:
            out = images.cpu().permute(0, 2, 3, 1).numpy()
            if output_type == "pil":
                out = self.numpy_to_pil(out)
        return ImagePipelineOutput(images=out) if return_dict else (out,)


def load_pipeline(path: str | Path | None = None, *, variant: str = "base", device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None) -> ShapesPipeline:
    """A shipped pipeline, or one saved by the training script at ``path``, offline.

    Args:
        path: a directory written by ``python -m diffusion_int8.embedded.train --out DIR``; default: the
            weights of ``variant`` in the package.
        variant: ``"base"`` (256 tokens) or ``"long"`` (4,096 tokens), when ``path`` is not given.
        device: default: CUDA if there is a GPU, else the CPU.
        dtype: default: fp16 on CUDA and fp32 on the CPU (where fp16 matmuls are slow).

    Raises ``FileNotFoundError`` where the directory holds no pipeline, saying how to train one.
    """
    shipped = get_variant(variant) if path is None else None
    path = Path(path) if path is not None else shipped.path
    if not (path / "model_index.json").is_file():
        train = f"python -m diffusion_int8.embedded.train --variant {shipped.key if shipped else 'base'} --out DIR"
        if shipped is not None:
            raise FileNotFoundError(
                f"the {shipped.key} model's weights ({shipped.name}) are not in this install: {path} holds no "
                f"model_index.json. Train them on a GPU with `{train}`, then load DIR (load_pipeline(DIR), "
                f"--model DIR) or copy it to {path}")
        raise FileNotFoundError(f"no ShapesPipeline at {path} (model_index.json missing); train one with `{train}`")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    pipe = ShapesPipeline.from_pretrained(path, dtype=dtype)
    return pipe.to(device)
