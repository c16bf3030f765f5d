"""Zoo cases: ControlNets and adapters."""

from __future__ import annotations

import torch

from zoo.registry import case, exclude


def _unzero(model):
    # ControlNets zero-initialise their output projections (and some input ones) so that training starts as a no-op;
    # left at zero, every output is exactly 0 and would hide any attention error. Re-draw them (seeded like the rest).
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and not m.weight.any():
            m.reset_parameters()
    return model


def _padded(n, keep, dtype=torch.long):
    """A (2, n) padding mask: the first sample keeps all n positions, the second only its first `keep`."""
    mask = torch.ones(2, n, dtype=dtype)
    mask[1, keep:] = 0
    return mask


# --- UNet ControlNets (SD / SDXL) ------------------------------------------------------------------------------------
# Attention only at the 4x4 level (16 tokens): their `attention_mask` is documented as a text mask but is handed to
# the *self*-attention of every transformer block (as a (B, 1, S) bias), so it must be as long as the image sequence
# there, which rules out attention at two resolutions. No pipeline passes it; the padded one here exercises that path.

_UNET = dict(block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), layers_per_block=1,
             norm_num_groups=32, cross_attention_dim=32, attention_head_dim=2,  # = 2 heads (diffusers' legacy naming)
             conditioning_embedding_out_channels=(16, 16, 16, 16))  # 3 downsamplings: 64x64 image -> 8x8 latent


def _sd_controlnet(d):
    return _unzero(d.ControlNetModel(**_UNET))


@case("ControlNetModel", mask="attention_mask")
def controlnet(d, r):
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32),
             controlnet_cond=r(2, 3, 64, 64), attention_mask=_padded(16, 12))
    return _sd_controlnet(d), x


@case("MultiControlNetModel", mask="attention_mask")
def multi_controlnet(d, r):
    m = d.MultiControlNetModel([_sd_controlnet(d), _sd_controlnet(d)])
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32),
             controlnet_cond=[r(2, 3, 64, 64), r(2, 3, 64, 64)], conditioning_scale=[1.0, 0.5],
             attention_mask=_padded(16, 12), return_dict=False)  # with return_dict=True it unpacks the output's keys
    return m, x


@case("ControlNetUnionModel", mask="attention_mask")
def controlnet_union(d, r):
    # SDXL-style (text_time embedding); its condition fuser is a torch nn.MultiheadAttention (no processor).
    m = _unzero(d.ControlNetUnionModel(**_UNET, addition_embed_type="text_time", addition_time_embed_dim=8,
                                       projection_class_embeddings_input_dim=32 + 6 * 8, num_trans_channel=32,
                                       num_trans_head=2, num_proj_channel=32))
    control_type = torch.zeros(2, 6)
    control_type[:, [1, 3]] = 1
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2)
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32),
             controlnet_cond=[r(2, 3, 64, 64), r(2, 3, 64, 64)], control_type=control_type, control_type_idx=[1, 3],
             added_cond_kwargs=dict(text_embeds=r(2, 32), time_ids=time_ids), attention_mask=_padded(16, 12))
    return m, x


@case("UNetControlNetXSModel", mask="attention_mask")
def unet_controlnet_xs(d, r):
    m = _unzero(d.UNetControlNetXSModel(sample_size=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(32, 64),
                                        norm_num_groups=32, cross_attention_dim=32, num_attention_heads=2,
                                        ctrl_block_out_channels=(16, 32), ctrl_num_attention_heads=2,
                                        ctrl_conditioning_embedding_out_channels=(16, 16, 16, 16)))
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32),
             controlnet_cond=r(2, 3, 64, 64), attention_mask=_padded(16, 12))
    return m, x


@case("SparseControlNetModel", mask="attention_mask")
def sparse_controlnet(d, r):
    # AnimateDiff SparseCtrl conditioned on latents (4 channels, the frame mask concatenated by the model). Its blocks
    # run on batch*frames images, so the (self-attention) mask has batch*frames rows; prompts are repeated per frame
    # as the pipeline does.
    m = _unzero(d.SparseControlNetModel(down_block_types=("DownBlockMotion", "CrossAttnDownBlockMotion"),
                                        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=32,
                                        cross_attention_dim=32, attention_head_dim=2, motion_num_attention_heads=2))
    cond_mask = torch.zeros(2, 1, 2, 8, 8)
    cond_mask[:, :, 0] = 1  # only the first frame carries a condition
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[2:, 12:] = 0  # both frames of the second video
    x = dict(sample=r(2, 4, 2, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(4, 8, 32),
             controlnet_cond=r(2, 4, 2, 8, 8) * cond_mask, conditioning_mask=cond_mask, attention_mask=mask)
    return m, x


exclude("ControlNetXSAdapter", "has attention modules but cannot run by itself (its forward raises ValueError); "
        "they only run fused into a UNetControlNetXSModel (UNetControlNetXSModel.from_unet(unet, adapter)), which "
        "is tested")
exclude("T2IAdapter", "no attention modules: a convolutional adapter (full_adapter, full_adapter_xl and light_adapter "
        "all checked: 0 modules with processor/set_processor)")
exclude("MultiAdapter", "no attention modules: a container of T2IAdapters, which are convolutional")


# --- Transformer ControlNets -----------------------------------------------------------------------------------------

def _flux_controlnet(d):
    return _unzero(d.FluxControlNetModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                         num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                         guidance_embeds=True, axes_dims_rope=(4, 6, 6)))


def _flux_inputs(r):
    img_ids = torch.zeros(16, 3)  # a 4x4 grid of packed latents
    img_ids[:, 1] = torch.arange(4).repeat_interleave(4)
    img_ids[:, 2] = torch.arange(4).repeat(4)
    return dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 32), pooled_projections=r(2, 16),
                timestep=torch.tensor([0.5, 0.5]), guidance=torch.tensor([3.5, 3.5]), img_ids=img_ids,
                txt_ids=torch.zeros(8, 3))


@case("FluxControlNetModel")
def flux_controlnet(d, r):
    return _flux_controlnet(d), dict(_flux_inputs(r), controlnet_cond=r(2, 16, 16))


@case("FluxMultiControlNetModel")
def flux_multi_controlnet(d, r):
    m = d.FluxMultiControlNetModel([_flux_controlnet(d), _flux_controlnet(d)])
    no_mode = torch.tensor([-1, -1])  # what the pipeline passes for non-union nets
    x = dict(_flux_inputs(r), controlnet_cond=[r(2, 16, 16), r(2, 16, 16)], controlnet_mode=[no_mode, no_mode],
             conditioning_scale=[1.0, 0.5], return_dict=False)  # with return_dict=True it unpacks the output's keys
    return m, x


def _hunyuan_controlnet(d):
    # transformer_num_layers=4 gives one HunyuanDiTBlock (the ControlNet copies the first half, minus one).
    return _unzero(d.HunyuanDiT2DControlNetModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                                 patch_size=2, sample_size=8, hidden_size=32, transformer_num_layers=4,
                                                 cross_attention_dim=32, cross_attention_dim_t5=32,
                                                 pooled_projection_dim=16, text_len=8, text_len_t5=8))


def _hunyuan_inputs(d, r):
    # The text masks only swap padded tokens for a learned padding embedding; the attention itself is unmasked.
    rope = d.models.embeddings.get_2d_rotary_pos_embed(16, ((0, 0), (32, 32)), (4, 4), output_type="pt")
    return dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 32),
                text_embedding_mask=_padded(8, 5), encoder_hidden_states_t5=r(2, 8, 32),
                text_embedding_mask_t5=_padded(8, 6), image_meta_size=torch.tensor([[64.0, 64, 64, 64, 0, 0]] * 2),
                style=torch.zeros(2, dtype=torch.long), image_rotary_emb=rope)


@case("HunyuanDiT2DControlNetModel", mask="text_embedding_mask")
def hunyuan_controlnet(d, r):
    return _hunyuan_controlnet(d), dict(_hunyuan_inputs(d, r), controlnet_cond=r(2, 4, 8, 8))


@case("HunyuanDiT2DMultiControlNetModel", mask="text_embedding_mask")
def hunyuan_multi_controlnet(d, r):
    m = d.HunyuanDiT2DMultiControlNetModel([_hunyuan_controlnet(d), _hunyuan_controlnet(d)])
    x = dict(_hunyuan_inputs(d, r), controlnet_cond=[r(2, 4, 8, 8), r(2, 4, 8, 8)], conditioning_scale=[1.0, 0.5],
             return_dict=False)
    return m, x


def _qwen_controlnet(d):
    return _unzero(d.QwenImageControlNetModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                              axes_dims_rope=(8, 4, 4)))


def _qwen_inputs(r):
    return dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 7, 16), encoder_hidden_states_mask=_padded(7, 4),
                timestep=torch.tensor([0.5, 0.5]), img_shapes=[(1, 4, 4)] * 2)


@case("QwenImageControlNetModel", mask="encoder_hidden_states_mask")
def qwen_image_controlnet(d, r):
    return _qwen_controlnet(d), dict(_qwen_inputs(r), controlnet_cond=r(2, 16, 16))


@case("QwenImageMultiControlNetModel", mask="encoder_hidden_states_mask")
def qwen_image_multi_controlnet(d, r):
    # It only supports a single (union) net, run once per condition.
    m = d.QwenImageMultiControlNetModel([_qwen_controlnet(d)])
    x = dict(_qwen_inputs(r), controlnet_cond=[r(2, 16, 16), r(2, 16, 16)], conditioning_scale=[1.0, 0.5],
             return_dict=False)
    return m, x


def _sd3_controlnet(d):
    # Two joint blocks, the first with SD3.5's extra self-attention (dual attention), RMS qk-norm as in SD3.5.
    return _unzero(d.SD3ControlNetModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                                        dual_attention_layers=(0,), qk_norm="rms_norm"))


def _sd3_inputs(r):
    return dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 32), pooled_projections=r(2, 16),
                timestep=torch.tensor([500.0, 500.0]))


@case("SD3ControlNetModel")
def sd3_controlnet(d, r):
    return _sd3_controlnet(d), dict(_sd3_inputs(r), controlnet_cond=r(2, 4, 8, 8))


@case("SD3MultiControlNetModel")
def sd3_multi_controlnet(d, r):
    m = d.SD3MultiControlNetModel([_sd3_controlnet(d), _sd3_controlnet(d)])
    x = dict(_sd3_inputs(r), controlnet_cond=[r(2, 4, 8, 8), r(2, 4, 8, 8)], conditioning_scale=[1.0, 0.5],
             return_dict=False)
    return m, x


@case("SanaControlNetModel", mask="encoder_attention_mask")
def sana_controlnet(d, r):
    # Self-attention is Sana's linear attention (no SDPA); only the cross-attention goes through SDPA, masked.
    m = _unzero(d.SanaControlNetModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                      num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                      cross_attention_dim=32, caption_channels=32, sample_size=8, patch_size=2))
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 32), timestep=torch.tensor([999, 999]),
             controlnet_cond=r(2, 4, 8, 8), encoder_attention_mask=_padded(8, 5))
    return m, x


@case("ZImageControlNetModel")
def z_image_controlnet(d, r):
    # The ControlNet borrows its embedders and refiners from a Z-Image transformer (from_transformer). Inputs are
    # per-sample lists; the model pads every sequence to a multiple of 32 and builds its own boolean masks, so
    # captions of 12 and 40 tokens (32 and 64 after padding) make the first sample's text and joint masks padded.
    t = d.ZImageTransformer2DModel(in_channels=16, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                   cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[128, 16, 16])
    m = d.ZImageControlNetModel(control_layers_places=[0], control_refiner_layers_places=[0], control_in_dim=16,
                                add_control_noise_refiner="control_noise_refiner", dim=64, n_refiner_layers=1,
                                n_heads=2, n_kv_heads=2)
    m = _unzero(d.ZImageControlNetModel.from_transformer(m, t))
    x = dict(x=[r(16, 1, 8, 8), r(16, 1, 8, 8)], t=torch.tensor([0.5, 0.5]), cap_feats=[r(12, 32), r(40, 32)],
             control_context=r(2, 16, 1, 8, 8))
    return m, x


def _without_torchvision(d):
    # CosmosControlNetModel.forward resizes `padding_mask` with torchvision unconditionally, and no torchvision is
    # built for this torch: stand in a nearest-neighbour resize (the mask is all zeros, as the pipeline passes it).
    g = d.CosmosControlNetModel.forward.__globals__
    if "transforms" not in g:
        from types import SimpleNamespace

        def resize(x, size, interpolation=None):
            return torch.nn.functional.interpolate(x, size=size, mode="nearest")

        g["transforms"] = SimpleNamespace(functional=SimpleNamespace(resize=resize),
                                          InterpolationMode=SimpleNamespace(NEAREST="nearest"))


@case("CosmosControlNetModel", mask="attention_mask")
def cosmos_controlnet(d, r):
    # Cosmos-Transfer2.5 without the image-context branch: with img_context_dim_in set, the cross-attention processor
    # expects attention_mask as a (text, image) tuple, which the forward cannot pass (it unsqueezes a tensor). The
    # pipeline passes no attention_mask; the (B, S) boolean one here becomes (B, 1, 1, S) on the text cross-attention.
    _without_torchvision(d)
    # in_channels and latent_channels: 4 latent channels + the condition mask + the padding mask.
    m = _unzero(d.CosmosControlNetModel(n_controlnet_blocks=2, in_channels=4 + 2, latent_channels=4 + 2,
                                        model_channels=32, num_attention_heads=2, attention_head_dim=16, mlp_ratio=2.0,
                                        text_embed_dim=32, adaln_lora_dim=4, max_size=(4, 16, 16)))
    x = dict(controls_latents=r(2, 4, 2, 8, 8), latents=r(2, 4, 2, 8, 8),
             timestep=torch.full((2, 1, 2, 1, 1), 0.8),  # per-frame sigmas, (B, 1, T, 1, 1) as the pipeline passes
             encoder_hidden_states=r(2, 8, 32), condition_mask=torch.zeros(2, 1, 2, 8, 8),
             padding_mask=torch.zeros(1, 1, 64, 64), attention_mask=_padded(8, 5, torch.bool))
    return m, x
