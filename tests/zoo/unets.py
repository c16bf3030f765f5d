"""Zoo cases: UNets."""

from __future__ import annotations

import torch

from zoo.registry import case, exclude


def _text_mask(batch: int, length: int, keep: int) -> torch.Tensor:
    """A tokenizer-style (B, S) long mask: the last sample keeps only its first `keep` tokens."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, keep:] = 0
    return mask


@case("AudioLDM2UNet2DConditionModel", mask="encoder_attention_mask_1")
def audioldm2_unet(d, r):
    # per block: a self-attention-only transformer (None), one over the GPT-2 states (16), one over the T5 states (32);
    # attention_head_dim is the head count here (2 heads of 16 / 32 at 32 / 64 channels)
    m = d.AudioLDM2UNet2DConditionModel(
        in_channels=8, out_channels=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=([None, 16, 32], [None, 16, 32]), attention_head_dim=2)
    # mel-spectrogram latents: (B, 8, time frames, mel bins / 4); GPT-2 generated states; T5 states with their mask
    x = dict(sample=r(2, 8, 16, 4), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 16),
             encoder_hidden_states_1=r(2, 12, 32), encoder_attention_mask_1=_text_mask(2, 12, 7))
    return m, x


@case("DreamLiteUNetModel", mask="encoder_attention_mask")
def dreamlite_unet(d, r):
    # attention_head_dim is the head count here; the default num_kv_heads=1 makes every attention GQA (2 q heads, 1 kv)
    m = d.DreamLiteUNetModel(
        in_channels=4, out_channels=4,
        down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
        mid_block_type="DreamLiteUNetMidBlock2DCrossAttn",
        up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteCrossAttnNoSelfAttnUpBlock2D"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=2, ff_mult=2, addition_embed_type="time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16)
    # the pipeline concatenates the condition-image latents along the width: 8x(4+4) latents
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor([750.0, 750.0]), encoder_hidden_states=r(2, 10, 32),
             encoder_attention_mask=_text_mask(2, 10, 6),
             added_cond_kwargs={"time_ids": torch.tensor([[512.0, 512.0], [512.0, 512.0]])})
    return m, x


@case("I2VGenXLUNet")
def i2vgen_xl_unet(d, r):
    # attention_head_dim is the real head dim in the 3-D blocks (2 heads of 16 at 32 channels); transformer_in
    # hard-codes 8 heads of it, and the image-latent temporal encoder 2 heads of in_channels (4: the VAE's latents)
    m = d.I2VGenXLUNet(
        in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(32, 32), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=16)
    # image_latents: the first frame's VAE latents, then one position-mask frame per later frame (1/3, 2/3, 1)
    position = torch.arange(1, 4).div(3).view(1, 1, 3, 1, 1).expand(2, 4, 3, 8, 8)
    image_latents = torch.cat([r(2, 4, 1, 8, 8), position], dim=2)
    x = dict(sample=r(2, 4, 4, 8, 8), timestep=torch.tensor(999), fps=torch.tensor([16, 16]),
             image_latents=image_latents, image_embeddings=r(2, 1, 32), encoder_hidden_states=r(2, 8, 32))
    return m, x


@case("Kandinsky3UNet", mask="encoder_attention_mask")
def kandinsky3_unet(d, r):
    # every Attention has channels / attention_head_dim heads of 16 (1 to 4 here); the first down level has no
    # attention, while (a quirk of the fixed 4-level attention plan) both up levels do
    # (layers_per_block must be >= 2: with 1 the up blocks' channel plan does not line up)
    m = d.Kandinsky3UNet(in_channels=4, time_embedding_dim=32, groups=8, attention_head_dim=16, layers_per_block=2,
                         block_out_channels=(32, 64), cross_attention_dim=32, encoder_hid_dim=32)
    # as the pipeline passes it with guidance and no negative prompt: a bool mask, the unconditional row all False,
    # the text cut to its longest prompt plus one padding token
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0] = False
    mask[1, 8:] = False
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 9, 32) * mask[..., None],
             encoder_attention_mask=mask)
    return m, x


exclude("MotionAdapter", "has attention modules (its motion modules) but cannot run by itself: its forward is a no-op "
                         "returning None; they run inside UNetMotionModel, whose case is built from a "
                         "UNet2DConditionModel plus a MotionAdapter (UNetMotionModel.from_unet2d), as AnimateDiff does")


@case("StableCascadeUNet")
def stable_cascade_unet(d, r):
    # the prior (stage C) layout: res/timestep/attention blocks at two levels of one resolution (switch_level False),
    # text + pooled text + image conditioning; each attention block is self + cross at once (keys: its own 64
    # tokens, then 16 clip tokens: 8 text, 4 pooled, 4 image)
    m = d.StableCascadeUNet(
        in_channels=16, out_channels=16, timestep_ratio_embedding_dim=32, patch_size=1, conditioning_dim=32,
        block_out_channels=(32, 64), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
        block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
                               ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock")),
        clip_text_in_channels=32, clip_text_pooled_in_channels=32, clip_image_in_channels=16, clip_seq=4,
        kernel_size=3, dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca", "crp"),
        switch_level=(False,))
    x = dict(sample=r(2, 16, 8, 8), timestep_ratio=torch.tensor([0.8, 0.8]), clip_text_pooled=r(2, 1, 32),
             clip_text=r(2, 8, 32), clip_img=r(2, 1, 16))
    return m, x


exclude("UNet1DModel", "no attention modules: a convolutional 1-D UNet; the attention of its AttnDownBlock1D/"
                       "UNetMidBlock1D/AttnUpBlock1D (SelfAttention1d) is a plain matmul + softmax nn.Module without "
                       "processor/set_processor (0 such modules on instantiation)")


@case("UNet2DConditionModel", mask="encoder_attention_mask")
def unet_2d_condition(d, r):
    # attention_head_dim is the head count here: 2 heads of 16 / 32 at 32 / 64 channels
    m = d.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=2)
    x = dict(sample=r(2, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 10, 32),
             encoder_attention_mask=_text_mask(2, 10, 6))
    return m, x


@case("UNet2DModel")
def unet_2d(d, r):
    # attention_head_dim is the real head dim here: 2 heads of 16 at 32 channels, attention at 4x4 (down, mid, up)
    m = d.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), block_out_channels=(32, 32), layers_per_block=1,
        norm_num_groups=8, attention_head_dim=16)
    x = dict(sample=r(2, 3, 8, 8), timestep=torch.tensor(999))
    return m, x


@case("UNet3DConditionModel")
def unet_3d_condition(d, r):
    # attention_head_dim is the real head dim in the 3-D blocks (2 heads of 16 at 32 channels); transformer_in
    # hard-codes 8 heads of it. No mask: the forward's attention_mask never reaches an attention (the 3-D blocks
    # drop it), and the text-to-video pipeline passes none.
    m = d.UNet3DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(32, 32), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=16)
    x = dict(sample=r(2, 4, 4, 8, 8), timestep=torch.tensor(999), encoder_hidden_states=r(2, 8, 32))
    return m, x


@case("UNetMotionModel")
def unet_motion(d, r):
    # built as AnimateDiffPipeline does: UNetMotionModel.from_unet2d(UNet2DConditionModel, MotionAdapter).
    # No text mask: the forward's attention_mask is a spatial self-attention mask the pipeline never passes.
    unet = d.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=2)
    adapter = d.MotionAdapter(block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2,
                              motion_norm_num_groups=8, motion_max_seq_length=8)
    m = d.UNetMotionModel.from_unet2d(unet, adapter)
    # the pipeline repeats the prompt embeddings per frame: (B * F, S, D)
    x = dict(sample=r(2, 4, 4, 8, 8), timestep=torch.tensor(999),
             encoder_hidden_states=r(2, 8, 32).repeat_interleave(4, dim=0))
    return m, x


@case("UNetSpatioTemporalConditionModel")
def unet_spatio_temporal(d, r):
    # num_attention_heads is the real head count: 2 / 4 heads of 16 at 32 / 64 channels; 4 frames
    m = d.UNetSpatioTemporalConditionModel(
        sample_size=8, in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), block_out_channels=(32, 64),
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=24, layers_per_block=1,
        cross_attention_dim=32, num_attention_heads=(2, 4), num_frames=4)
    # SVD: (B, F, C, H, W) latents with the image latents concatenated on C; one CLIP image embedding token;
    # added_time_ids = (fps - 1, motion_bucket_id, noise_aug_strength); a Karras-sigma (float) timestep
    x = dict(sample=r(2, 4, 8, 8, 8), timestep=torch.tensor(1.5), encoder_hidden_states=r(2, 1, 32),
             added_time_ids=torch.tensor([[6.0, 127.0, 0.02], [6.0, 127.0, 0.02]]))
    return m, x


@case("UVit2DModel")
def uvit_2d(d, r):
    # aMUSEd: 2 heads of 16 in the conv-stage blocks (32 channels; both their attentions attend to the text) and 2
    # heads of 32 in the transformer (hidden 64); 8x8 token ids, 4x4 = 16 tokens after the downsample
    m = d.UVit2DModel(
        hidden_size=64, use_bias=False, cond_embed_dim=32, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
        encoder_hidden_size=32, vocab_size=33, codebook_size=32, in_channels=16, block_out_channels=32,
        num_res_blocks=1, downsample=True, upsample=True, block_num_heads=2, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, sample_size=8)
    # the pipeline starts from all-mask tokens (id vocab_size - 1); here half of them are already unmasked
    ids = torch.full((2, 8, 8), 32, dtype=torch.long)
    ids[:, :4] = torch.arange(2 * 4 * 8).reshape(2, 4, 8) % 32
    # micro_conds = (width, height, crop top, crop left, aesthetic score)
    micro_conds = torch.tensor([[512.0, 512.0, 0.0, 0.0, 6.0], [512.0, 512.0, 0.0, 0.0, 6.0]])
    x = dict(input_ids=ids, encoder_hidden_states=r(2, 8, 32), pooled_text_emb=r(2, 32), micro_conds=micro_conds)
    return m, x
