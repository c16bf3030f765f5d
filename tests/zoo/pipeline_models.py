"""Zoo cases: models diffusers does not export at top level, only from the modules of ``diffusers.pipelines`` (the
pipelines' own encoders, priors and heads, and the deprecated pipelines' denoisers). Each build imports its class from
its pipelines module; ``d`` is still the diffusers module."""

from __future__ import annotations

import torch

from zoo.audio_other import _ace_step_sizes
from zoo.controlnets import _UNET, _padded, _unzero
from zoo.registry import case, exclude


@case("AceStepLyricEncoder", mask="attention_mask")
def ace_step_lyric_encoder(d, r):
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepLyricEncoder

    # Layer 0 sliding-window (window 4 over 16 tokens), layer 1 full attention; both carry the padding mask.
    m = AceStepLyricEncoder(**_ace_step_sizes(), text_hidden_dim=24, num_lyric_encoder_hidden_layers=2,
                            sliding_window=4)
    return m, dict(inputs_embeds=r(2, 16, 24), attention_mask=_padded(16, 10, dtype=torch.bool))


@case("AceStepTimbreEncoder")
def ace_step_timbre_encoder(d, r):
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepTimbreEncoder

    # Three packed reference clips, the first two of song 0, the third of song 1 (unpacked into a (2, 2) batch with a
    # presence mask). No padding mask on the packed input: layer 0 sliding-window (4 of 16), layer 1 unmasked.
    m = AceStepTimbreEncoder(**_ace_step_sizes(), timbre_hidden_dim=8, num_timbre_encoder_hidden_layers=2,
                             sliding_window=4)
    x = dict(refer_audio_acoustic_hidden_states_packed=r(3, 16, 8), refer_audio_order_mask=torch.tensor([0, 0, 1]))
    return m, x


@case("LTX2TextConnectors", mask="attention_mask")
def ltx2_text_connectors(d, r):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    # LTX-2.3 layout (per-modality projections, gated attention on the video side). The video connector swaps padding
    # for learnable registers (its attention mask becomes all zeros, as shipped); the audio one has no registers, so
    # the padded additive mask reaches its attention.
    m = LTX2TextConnectors(caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
                           video_connector_attention_head_dim=16, video_connector_num_layers=1,
                           video_connector_num_learnable_registers=4, video_gated_attn=True,
                           audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=16,
                           audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
                           per_modality_projections=True, video_hidden_dim=32, audio_hidden_dim=32)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # Gemma pads on the left: the second prompt's first 3 tokens are padding
    return m, dict(text_encoder_hidden_states=r(2, 8, 16, 3), attention_mask=mask)


@case("LTX2DurationHead")
def ltx2_duration_head(d, r):
    from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead

    # 2 learnable queries cross-attend the 8 video + 8 audio connector tokens (its own processor, called (attn, tokens))
    m = LTX2DurationHead(video_cross_attention_dim=32, audio_cross_attention_dim=16, pooler_hidden_dim=32,
                         num_queries=2, num_pooler_heads=2, mlp_hidden_dim=16)
    return m, dict(video_tokens=r(2, 8, 32), audio_tokens=r(2, 8, 16))


@case("MultiControlNetUnionModel", mask="attention_mask")
def multi_controlnet_union(d, r):
    from diffusers.models.controlnets.multicontrolnet_union import MultiControlNetUnionModel

    def net():  # as the ControlNetUnionModel case (SDXL-style)
        return _unzero(d.ControlNetUnionModel(**_UNET, addition_embed_type="text_time", addition_time_embed_dim=8,
                                              projection_class_embeddings_input_dim=32 + 6 * 8, num_trans_channel=32,
                                              num_trans_head=2, num_proj_channel=32))

    m = MultiControlNetUnionModel([net(), net()])
    types = torch.zeros(2, 2, 6)
    types[0, :, [1, 3]] = 1
    types[1, :, 2] = 1
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2)
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32),
             controlnet_cond=[[r(2, 3, 64, 64), r(2, 3, 64, 64)], [r(2, 3, 64, 64)]], control_type=[types[0], types[1]],
             control_type_idx=[[1, 3], [2]], conditioning_scale=[1.0, 0.5],
             added_cond_kwargs=dict(text_embeds=r(2, 32), time_ids=time_ids), attention_mask=_padded(16, 12),
             return_dict=False)  # with return_dict=True each net's output would be unpacked by its keys
    return m, x


@case("UNetFlatConditionModel", mask="encoder_attention_mask")
def unet_flat_condition(d, r):
    from diffusers.pipelines.deprecated.versatile_diffusion.modeling_text_unet import UNetFlatConditionModel

    # Versatile Diffusion's text UNet: "convolutions" are LinearMultiDim over (channels, 4, 1), so the sample is
    # (B, 4, 4, 1) and every attention runs over 4 tokens; attention_head_dim is the head count here.
    m = UNetFlatConditionModel(in_channels=4, out_channels=4,
                               down_block_types=("CrossAttnDownBlockFlat", "DownBlockFlat"),
                               up_block_types=("UpBlockFlat", "CrossAttnUpBlockFlat"), block_out_channels=(32, 64),
                               layers_per_block=1, norm_num_groups=8, cross_attention_dim=32, attention_head_dim=2)
    x = dict(sample=r(2, 4, 4, 1), timestep=torch.tensor(999), encoder_hidden_states=r(2, 10, 32),
             encoder_attention_mask=_padded(10, 6))
    return m, x


@case("UTransformer2DModel")
def u_transformer(d, r):
    from diffusers.pipelines.deprecated.unidiffuser.modeling_uvit import UTransformer2DModel

    # U-ViT: in block, mid block, out block (with a skip), self-attention over 16 patches; no cross-attention, as
    # UniDiffuserModel builds it (with cross_attention_dim set the mid block is called without encoder_hidden_states
    # and its cross-attention fails on the width)
    m = UTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2,
                            sample_size=8, patch_size=2, norm_num_groups=8)
    return m, dict(hidden_states=r(2, 4, 8, 8))


@case("WuerstchenPrior")
def wuerstchen_prior(d, r):
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    # Each AttnBlock attends over its own 16 tokens plus the 8 text tokens (self_attn=True concatenates them as K/V).
    m = WuerstchenPrior(c_in=4, c=32, c_cond=16, c_r=8, depth=2, nhead=2, dropout=0.0)
    return m, dict(x=r(2, 4, 4, 4), r=torch.tensor([0.6, 0.6]), c=r(2, 8, 16))


@case("WuerstchenDiffNeXt")
def wuerstchen_diffnext(d, r):
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt

    # Two levels, attention at the second (4x4 = 16 tokens + 8 CLIP tokens); the EfficientNet latents are injected
    # there. Its init zeroes the output convolution and the timestep mappers, so the output would not depend on
    # attention at all: re-draw them.
    m = _unzero(WuerstchenDiffNeXt(c_in=4, c_out=4, c_r=8, patch_size=2, c_cond=16, c_hidden=[16, 32], nhead=[-1, 2],
                                   blocks=[1, 1], level_config=["CT", "CTA"], inject_effnet=[False, True],
                                   effnet_embd=8, clip_embd=24, dropout=0.0))
    return m, dict(x=r(2, 4, 16, 16), r=torch.tensor([0.5, 0.5]), effnet=r(2, 8, 4, 4), clip=r(2, 8, 24))


exclude("IFWatermarker", "no attention modules and no forward: apply_watermark pastes a fixed watermark image onto "
        "the PIL output images")
exclude("LTX2LatentUpsamplerModel", "no attention modules: convolutional residual blocks with a pixel-shuffle "
        "upsampler")
exclude("LTX2Vocoder", "no attention modules: a BigVGAN-style convolutional vocoder (transposed convolutions, "
        "anti-aliased Snake-beta residual blocks)")
exclude("LTX2VocoderWithBWE", "no attention modules: the convolutional LTX2Vocoder plus an STFT/mel convolutional "
        "bandwidth-extension vocoder")
exclude("LTXLatentUpsamplerModel", "no attention modules: convolutional residual blocks with a pixel-shuffle upsampler")
exclude("LearnedClassifierFreeSamplingEmbeddings", "no attention modules: a learned embedding table for VQ-Diffusion's "
        "unconditional text")
exclude("MLPNeRSTFModel", "no attention modules: the Shap-E NeRF/STF multilayer perceptron")
exclude("PaellaVQModel", "no attention modules: Wuerstchen's convolutional VQ-GAN (mixing residual blocks)")
exclude("ShapEParamsProjModel", "no attention modules: linear projections of the Shap-E latent to MLP weights")
exclude("ShapERenderer", "no attention modules: a NeRF/STF renderer (projection, MLP, volume and mesh rendering)")
exclude("SpectrogramContEncoder", "no diffusers attention modules: stacks transformers T5Block layers, whose "
        "attention has no diffusers processor")
exclude("SpectrogramNotesEncoder", "no diffusers attention modules: stacks transformers T5Block layers, whose "
        "attention has no diffusers processor")
exclude("StableUnCLIPImageNormalizer", "no attention modules: a learned mean and standard deviation (scale/unscale)")
exclude("UnCLIPTextProjModel", "no attention modules: linear projections of CLIP embeddings into the decoder's "
        "context tokens")
