"""Zoo cases: autoencoders, vocoders and decoders."""

from __future__ import annotations

import torch

from zoo.registry import case, exclude


def _reseeded_every_forward(model):
    """A generator that a forward pre-hook reseeds, for models that draw noise inside their forward (diffusion
    decoders): a plain seeded generator would give the second of two identical forwards different noise."""
    g = torch.Generator()

    def reseed(module, args):
        g.manual_seed(0)

    model.register_forward_pre_hook(reseed)
    return g


# --- Image VAEs ------------------------------------------------------------------------------------------------------
# Those built on vae.Encoder/Decoder have one attention: the mid-block `Attention` (one head, head dim = the last
# block's channels) over the latent grid. Several others have a single-head mid-block attention too, but as a plain
# nn.Module that calls F.scaled_dot_product_attention itself: no processor, nothing the plugin can swap. Those are
# `routable=False` cases (enable must refuse them, naming those modules).


@case("AutoencoderKL")
def autoencoder_kl(d, r):
    m = d.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        block_out_channels=(16, 32), norm_num_groups=8)
    return m, dict(sample=r(2, 3, 16, 16))  # 8x8 latent: 64 tokens


@case("AsymmetricAutoencoderKL")
def asymmetric_autoencoder_kl(d, r):
    m = d.AsymmetricAutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(16, 32),
                                  up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(16, 32),
                                  norm_num_groups=8)
    mask = torch.zeros(2, 1, 16, 16)
    mask[:, :, 4:12, 4:12] = 1  # an inpainting mask (the region to repaint), not an attention mask
    return m, dict(sample=r(2, 3, 16, 16), mask=mask)


@case("AutoencoderKLFlux2")
def autoencoder_kl_flux2(d, r):
    m = d.AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(16, 32), layers_per_block=1, latent_channels=8, norm_num_groups=8)
    return m, dict(sample=r(2, 3, 16, 16))


@case("VQModel")
def vq_model(d, r):
    m = d.VQModel(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(16, 32), norm_num_groups=8, num_vq_embeddings=32)
    return m, dict(sample=r(2, 3, 16, 16))


@case("AutoencoderKLTemporalDecoder")
def autoencoder_kl_temporal_decoder(d, r):
    # the temporal decoder's mid-block Attention hard-codes 32 norm groups: channels 32. It runs only after a second
    # mid-block resnet, so layers_per_block=2 (as in SVD): with 1 the decoder's attention is built but never called.
    m = d.AutoencoderKLTemporalDecoder(down_block_types=("DownEncoderBlock2D",) * 2, block_out_channels=(32, 32),
                                       layers_per_block=2)
    return m, dict(sample=r(4, 3, 16, 16), num_frames=2)  # batch 2 of 2-frame videos, frames flattened into batch


@case("ConsistencyDecoderVAE")
def consistency_decoder_vae(d, r):
    m = d.ConsistencyDecoderVAE(
        encoder_block_out_channels=(16, 32), encoder_down_block_types=("DownEncoderBlock2D",) * 2,
        encoder_layers_per_block=1, encoder_norm_num_groups=8, decoder_block_out_channels=(16, 32),
        decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2,
        decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2, decoder_layers_per_block=1, decoder_norm_num_groups=8)
    # decode() draws its starting noise and each consistency step's noise from `generator`: reseed it every forward
    g = _reseeded_every_forward(m)
    return m, dict(sample=r(2, 3, 16, 16), generator=g)


@case("AutoencoderRAE")
def autoencoder_rae(d, r):
    # The encoder is a transformers Dinov2WithRegisters model (its own attention, no diffusers processor; its head dim
    # is fixed at 64); the decoder is ViT-MAE layers built on diffusers' Attention.
    m = d.AutoencoderRAE(encoder_hidden_size=64, encoder_patch_size=14, encoder_num_hidden_layers=1,
                         decoder_hidden_size=64, decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
                         decoder_intermediate_size=128, patch_size=4, encoder_input_size=56)
    return m, dict(sample=r(2, 3, 16, 16))  # resized to 56x56: 4x4 = 16 patch tokens (+1 cls in the decoder)


@case("AutoencoderDC")
def autoencoder_dc(d, r):
    # attention only in EfficientViTBlocks (the default is all ResBlocks): SanaMultiscaleLinearAttention, whose
    # `processor` (SanaMultiscaleAttnProcessor2_0, no set_processor) is ReLU linear attention done with matmuls, no
    # SDPA: the plugin finds the modules and leaves them stock. 32 channels / head dim 8 = 4 heads, 8x8 latent: 64
    # tokens.
    m = d.AutoencoderDC(latent_channels=8, attention_head_dim=8, encoder_block_types=("ResBlock", "EfficientViTBlock"),
                        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(16, 32),
                        decoder_block_out_channels=(16, 32), encoder_layers_per_block=(1, 1),
                        decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)),
                        decoder_qkv_multiscales=((), (5,)))
    return m, dict(sample=r(2, 3, 16, 16))


@case("AutoencoderKLQwenImage", routable=False)
def autoencoder_kl_qwen_image(d, r):
    # plain QwenImageAttentionBlock in each mid block (per frame, one head, head dim 16); 8x8 latent: 64 tokens
    m = d.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    return m, dict(sample=r(2, 3, 1, 16, 16))  # one frame, as the Qwen-Image pipelines use it


@case("AutoencoderKLQwenImage21", routable=False)
def autoencoder_kl_qwen_image21(d, r):
    # image-only (its "causal 3-D" convolutions are Conv2d over a single frame), 4 input channels by default. The
    # residual down blocks' average shortcut needs channels * 4 (or * 1 at the last stage) divisible by the next
    # channels: dim_mult (1, 1). Plain QwenImage21AttentionBlock in each mid block, head dim 8, 8x8 latent: 64 tokens.
    m = d.AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1,
                                   temperal_downsample=[False])
    return m, dict(sample=r(2, 4, 1, 16, 16))


@case("AutoencoderKLHunyuanImage", routable=False)
def autoencoder_kl_hunyuan_image(d, r):
    # GroupNorm(32) everywhere: channels 32/64. Plain HunyuanImageAttentionBlock in each mid block (3-D q/k/v, one
    # head, head dim 64), 8x8 latent: 64 tokens.
    m = d.AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                                    layers_per_block=1, spatial_compression_ratio=2, sample_size=16)
    return m, dict(sample=r(2, 3, 16, 16))


@case("AutoencoderKLHunyuanImageRefiner", routable=False)
def autoencoder_kl_hunyuan_image_refiner(d, r):
    # plain HunyuanImageRefinerAttnBlock in each mid block: one head (head dim 16) over all frames x pixels, no mask.
    # Its "temporal" downsampling keeps the frame count: 3 frames of 4x4 = 48 tokens.
    m = d.AutoencoderKLHunyuanImageRefiner(latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                                           spatial_compression_ratio=2, temporal_compression_ratio=2)
    return m, dict(sample=r(2, 3, 3, 8, 8))


exclude("AutoencoderKLKVAE", "no attention modules: convolutional (its `attn` ModuleLists are always left empty)")
exclude("AutoencoderTiny", "no attention modules: convolutional EncoderTiny/DecoderTiny")
exclude("Kandinsky6SRVAE", "no attention modules: convolutional causal 3-D encoder/decoder with spatial norm")


# --- Video VAEs and decoders -----------------------------------------------------------------------------------------


@case("AutoencoderKLHunyuanVideo")
def autoencoder_kl_hunyuan_video(d, r):
    # the mid-block Attention builds its own block-causal (frame-wise) additive mask, (B, S, S) with -inf
    m = d.AutoencoderKLHunyuanVideo(latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 2,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 2, block_out_channels=(16, 32),
                                    layers_per_block=1, norm_num_groups=8, spatial_compression_ratio=4)
    return m, dict(sample=r(2, 3, 5, 16, 16))  # latent 3 frames of 4x4: 48 tokens


@case("AutoencoderKLAllegro")
def autoencoder_kl_allegro(d, r):
    # forward only runs tiled: one tile is 24 frames x sample_size^2 (the fixed 120/80-pixel overlaps never apply to a
    # single tile), and tiles are encoded one sample at a time, so batch 1. Attention is per frame over 4x4 latents.
    m = d.AutoencoderKLAllegro(down_block_types=("AllegroDownBlock3D",) * 2, up_block_types=("AllegroUpBlock3D",) * 2,
                               block_out_channels=(8, 16), temporal_downsample_blocks=(True, True),
                               temporal_upsample_blocks=(True, True), layers_per_block=1, norm_num_groups=4,
                               sample_size=8)
    m.enable_tiling()
    return m, dict(sample=r(1, 3, 24, 8, 8))


@case("AutoencoderKLMochi")
def autoencoder_kl_mochi(d, r):
    # temporal attention (tokens = frames, is_causal=True, l2 qk-norm), head dim fixed at 32: channels 64 = 2 heads.
    # temporal_expansions (1, 1, 2) keeps 16 then 8 frames at the attention levels (Mochi's own is (1, 2, 3)).
    m = d.AutoencoderKLMochi(latent_channels=4, encoder_block_out_channels=(64,) * 4,
                             decoder_block_out_channels=(64,) * 4, layers_per_block=(1,) * 5,
                             temporal_expansions=(1, 1, 2))
    return m, dict(sample=r(2, 3, 16, 8, 8))


@case("AutoencoderKLMiniMaxH3")
def autoencoder_kl_minimax_h3(d, r):
    # CNN encoder, ViT decoder (attention over latent voxels + 2 register tokens + 1 zero token, partial 3-axis rope
    # passed positionally as the attention module's `rotary_emb`). Frames are encoded in fixed 17-frame clips and
    # `17n + 5` frames round-trip: 22 is the shortest video (7 latent frames, decoded in chunks of 5 + overlap).
    m = d.AutoencoderKLMiniMaxH3(latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                                 spatial_downsample_factors=(2, 2), temporal_downsample_factors=(2, 2),
                                 norm_num_groups=8, decoder_num_layers=2, decoder_num_attention_heads=2,
                                 decoder_attention_head_dim=32, decoder_num_register_tokens=2, decoder_ffn_mult=2,
                                 latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    for block in m.decoder.transformer_blocks:  # zero-initialised residual gates would hide the attention output
        torch.nn.init.normal_(block.scale1, std=0.5)
        torch.nn.init.normal_(block.scale2, std=0.5)
    return m, dict(sample=r(2, 3, 22, 8, 8))


@case("LTX2VideoDiffusionDecoderModel")
def ltx2_video_diffusion_decoder(d, r):
    # Neighborhood attention through the "flex" backend with a FlexAttention BlockMask (no SDPA), over a 3-axis rope.
    # Upsampling only in time keeps every stage at 3x3 latents: 2 latent frames (+2 replicated border frames) become
    # 4 -> 7 -> 13 -> 9 frames, the largest grid 13x3x3 = 117 tokens with a 3x3x3 window.
    m = d.LTX2VideoDiffusionDecoderModel(
        latent_channels=8, patch_size=2, decoder_head_dim=16, decoder_stage_channels=(64, 32, 32, 32, 32),
        decoder_stage_depths=(1, 1, 1, 1, 1), decoder_stage_kernels=((3, 3, 3),) * 4,
        decoder_upsample_strides=((1, 1, 1), (2, 1, 1), (2, 1, 1), (2, 1, 1)),
        decoder_upsample_channel_reductions=(2, 1, 1, 1), decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=32,
        spatial_compression_ratio=2)
    # the forward denoises pixel noise it draws from `generator`: reseed it every forward
    g = _reseeded_every_forward(m)
    return m, dict(z=r(2, 8, 2, 3, 3), generator=g)


@case("AutoencoderKLCosmos")
def autoencoder_kl_cosmos(d, r):
    # CosmosCausalAttention modules carry a `processor` (no set_processor): spatial (per frame, one head, head dim =
    # channels 16) and temporal (per pixel over frames, with a causal (T, T) bool mask), in the mid blocks and in the
    # blocks at `attention_resolutions` (here the single down/up block: resolution 8 / patch 2 = 4). Haar patching 2:
    # 9 frames -> 5 latent frames of 4x4, so 16 tokens spatially, 5 temporally.
    m = d.AutoencoderKLCosmos(latent_channels=4, encoder_block_out_channels=(8, 16), decode_block_out_channels=(8, 16),
                              attention_resolutions=(4,), resolution=8, num_layers=1, patch_size=2,
                              spatial_compression_ratio=2, temporal_compression_ratio=2)
    return m, dict(sample=r(2, 3, 9, 8, 8))


@case("AutoencoderKLWan", routable=False)
def autoencoder_kl_wan(d, r):
    # plain WanAttentionBlock in each mid block (per frame, one head, head dim 16), 8x8 latent: 64 tokens. No temporal
    # downsampling: the encoder runs on chunks of 1 + 4 frames, the decoder frame by frame (2 + 5 attention calls).
    m = d.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    return m, dict(sample=r(2, 3, 5, 16, 16))


@case("AutoencoderKLHunyuanVideo15", routable=False)
def autoencoder_kl_hunyuan_video15(d, r):
    # plain HunyuanVideo15AttnBlock in each mid block: one head (head dim 16) over all frames x pixels with its own
    # frame-causal additive mask, (B, S, S) with -inf. Batch 1: that mask goes to SDPA against (B, 1, S, D) queries,
    # which broadcasts only for B = 1 (diffusers' own limit). 5 frames -> 3 latent frames of 4x4: 48 tokens.
    m = d.AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                                      spatial_compression_ratio=2, temporal_compression_ratio=2)
    return m, dict(sample=r(1, 3, 5, 8, 8))


@case("AutoencoderVidTok", routable=False)
def autoencoder_vidtok(d, r):
    # plain VidTokAttnBlock in each mid block: SDPA on (B, T, H*W, C), frames in the heads' place, head dim 16. The
    # causal padding makes 5 frames 6 -> 3 latent frames of 4x4: 16 tokens. forward samples the posterior by default.
    m = d.AutoencoderVidTok(ch=8, ch_mult=[1, 2], z_channels=4, num_res_blocks=1, spatial_ds=[0], spatial_us=[1],
                            tempo_ds=[0], tempo_us=[1])
    return m, dict(sample=r(2, 3, 5, 8, 8), sample_posterior=False)


exclude("AutoencoderKLCogVideoX", "no attention modules: convolutional causal 3-D VAE")
exclude("AutoencoderKLKVAEVideo", "no attention modules: convolutional cached causal 3-D VAE (its `attn` ModuleLists "
        "are always left empty)")
exclude("AutoencoderKLLTX2Video", "no attention modules: convolutional causal 3-D VAE")
exclude("AutoencoderKLLTXVideo", "no attention modules: convolutional causal 3-D VAE")
exclude("AutoencoderKLMagvit", "no attention modules: convolutional causal 3-D VAE (EasyAnimate blocks)")


# --- Audio autoencoders and vocoders ---------------------------------------------------------------------------------


@case("AutoencoderKLKVAEAudio")
def autoencoder_kl_kvae_audio(d, r):
    # one global self-attention over the encoder output frames, before the bottleneck
    m = d.AutoencoderKLKVAEAudio(encoder_dim=8, encoder_rates=[2, 2], latent_dim=64, codebook_dim=8, decoder_dim=32,
                                 decoder_rates=[2, 2], attn_num_heads=2)
    return m, dict(sample=r(2, 1, 128))  # 32 frames


@case("AutoencoderKLMiniMaxH3Audio")
def autoencoder_kl_minimax_h3_audio(d, r):
    # one causal self-attention (is_causal=True, no mask tensor) that narrows latent_dim to latent_channels
    m = d.AutoencoderKLMiniMaxH3Audio(encoder_dim=4, encoder_rates=(2, 2), latent_dim=64, latent_channels=8,
                                      num_attention_heads=2, decoder_dim=16, decoder_rates=(2, 2),
                                      decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                                      resblock_dilation_sizes=((1,),))
    return m, dict(sample=r(2, 1, 128))  # 32 frames


@case("AutoencoderSAME")
def autoencoder_same(d, r):
    # Differential attention (two SDPA calls per module) with partial rope computed inside the processor and an
    # internal additive sliding-window band mask, (S, S) with -inf, passed to the attention module as `attn_mask`.
    m = d.AutoencoderSAME(patch_size=4, encoder_channels=16, encoder_c_mults=(2,), encoder_strides=(4,),
                          encoder_transformer_depths=(1,), latent_dim=8, dim_heads=16, ff_mult=2)
    for module in m.modules():  # zero-initialised output projections would hide the attention output
        if isinstance(module, torch.nn.Linear) and not module.weight.any():
            module.reset_parameters()
    # 128 samples -> 32 patches -> 8 segments of 4 + 1 output token = 40 tokens; the decoder: 8 x (1 + 4) = 40
    return m, dict(sample=r(2, 2, 128))


@case("MMAudioVAE")
def mmaudio_vae(d, r):
    # single-head mid-block attention (head dim = channels) in encoder and decoder; the processor pins the NATIVE
    # dispatch backend. hop 16: 1024 samples -> 64 mel frames -> 32 latent frames.
    m = d.MMAudioVAE(mel_bins=16, latent_channels=8, hidden_channels=16, channel_multipliers=(1, 2),
                     layers_per_block=1, sample_rate=16000, n_fft=64, hop_length=16)
    return m, dict(sample=r(2, 1024).clamp(-1, 1))


exclude("AutoencoderKLLTX2Audio", "no attention modules: its optional LTX2AudioAttnBlock (mid block / "
        "attn_resolutions, off by default) is a plain nn.Module doing bmm + softmax (no processor/set_processor)")
exclude("AutoencoderOobleck", "no attention modules: convolutional (Snake activations, weight-normed 1-D convolutions)")
exclude("Cosmos3AVAEAudioTokenizer", "no attention modules: a spectrogram ConvNeXt encoder and an Oobleck-style "
        "convolutional decoder")
exclude("LongCatAudioDiTVae", "no attention modules: convolutional 1-D waveform VAE (Snake residual units)")
exclude("MMAudioVocoder", "no attention modules: a BigVGAN-style convolutional vocoder (anti-aliased Snake-beta AMP "
        "blocks)")
exclude("MiniMaxMusic3Vocoder", "no attention modules: a convolutional vocoder (Snake residual units, transposed "
        "convolutions)")


# --- Other -----------------------------------------------------------------------------------------------------------


@case("RFD4ProteinaAutoencoder", mask="padding_mask")
def rfd4_proteina_autoencoder(d, r):
    # forward() is decode(): only the decoder's trunk runs (the encoder's attention is built but not called). The
    # padding mask becomes a (B, heads, S, S) additive bias (-1e4) inside the processor.
    n_residue_types, num_token_types = 5, 2
    atom37_mask = [[True] * 4 + [False] * 33] * n_residue_types
    allowed = [[True] * n_residue_types] * num_token_types
    m = d.RFD4ProteinaAutoencoder(atom37_mask=atom37_mask, allowed_residue_types=allowed, latent_dim=8,
                                  n_residue_types=n_residue_types, num_token_types=num_token_types, nlayers=1,
                                  token_dim=64, nheads=2, dim_cond=16, pair_repr_dim=16, token_type_emb_dim=8,
                                  decoder_feats_seq=("ca_coors_nm", "z_latent_seq", "token_type"))
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[1, 11:] = False  # the second structure is shorter
    conditioning = dict(is_in_context_conditioning=torch.zeros(2, 16, dtype=torch.bool),
                        supports_local_latent=torch.ones(2, 16, dtype=torch.bool))
    x = dict(z_latent=r(2, 16, 8) * padding[..., None], ca_coors_nm=r(2, 16, 3) * padding[..., None],
             padding_mask=padding, token_type=torch.zeros(2, 16, dtype=torch.long), conditioning=conditioning)
    return m, x
