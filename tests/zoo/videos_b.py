"""Zoo cases: video transformers (second half of the alphabet)."""

from __future__ import annotations

import torch

from zoo.registry import case


def _text_mask(b, s, keep, dtype=torch.bool):
    """A (b, s) text padding mask: sample 0 full, the others keep their first ``keep`` tokens."""
    m = torch.ones(b, s, dtype=dtype)
    m[1:, keep:] = 0
    return m


def _zero_padded(text, keep):
    """Text embeddings padded the Wan way (no mask; the tail rows of the shorter prompts are zeros)."""
    text[1:, keep:] = 0
    return text


def _camera(frames, height, width, batch=2):
    """SANA-WM's (B, F, 20) camera conditions: a flat 4x4 c2w (identity rotation, forward translation) then a
    pinhole [fx, fy, cx, cy] centred on the latent grid."""
    c2w = torch.eye(4).repeat(batch, frames, 1, 1)
    c2w[..., 2, 3] = torch.arange(frames, dtype=torch.float32) * 0.1
    intrinsics = torch.tensor([float(width), float(height), width / 2, height / 2]).expand(batch, frames, 4)
    return torch.cat([c2w.flatten(-2), intrinsics], dim=-1)


def _randomize(m, r, *class_names):
    """Give modules the model zero-initializes (short convs, Plucker embedder) seeded values, so their branch runs."""
    with torch.no_grad():
        for mod in m.modules():
            if type(mod).__name__ in class_names:
                for p in mod.parameters():
                    p.copy_(0.5 * r(*p.shape))


@case("Kandinsky6SRTransformer3DModel")
def kandinsky6_sr(d, r):
    # NABLA sparse attention groups 8x8 token tiles into 64-token blocks and needs the token grid divisible by 8:
    # 2 latent frames of 8x8 (patch 1) = 128 tokens, two blocks, the smallest grid with more than one block.
    m = d.Kandinsky6SRTransformer3DModel(in_visual_dim=4, out_visual_dim=4, time_dim=16, model_dim=32, ff_dim=64,
                                         num_visual_blocks=2, axes_dims=(8, 4, 4))
    # [noisy latent (4) | anchor latent (4) | anchor mask (1)], (B, T, H, W, C)
    h = torch.cat([r(2, 2, 8, 8, 4), r(2, 2, 8, 8, 4), torch.ones(2, 2, 8, 8, 1)], dim=-1)
    return m, dict(hidden_states=h, timestep=torch.tensor([900.0, 900.0]))


@case("Kandinsky6Transformer3DModel", mask="encoder_attention_mask")
def kandinsky6(d, r):
    # Text-to-video-and-audio with the released checkpoints' flags (ca_rope, cross_gates, fix_modulation); the head
    # dim is sum(axes_dims) = 16.
    m = d.Kandinsky6Transformer3DModel(in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16,
                                       model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
                                       axes_dims=(8, 4, 4), in_audio_dim=4, out_audio_dim=4, text_token_padding=True,
                                       ca_rope=True, cross_gates=True, fix_modulation=True)
    # visual_cond channels: [latent (4) | zero conditioning latent (4) | zero conditioning mask (1)], (B, T, H, W, C)
    h = torch.cat([r(2, 2, 8, 8, 4), torch.zeros(2, 2, 8, 8, 5)], dim=-1)
    x = dict(hidden_states=h, encoder_hidden_states=r(2, 8, 16), pooled_projections=r(2, 8),
             timestep=torch.tensor([900.0, 900.0]), audio_hidden_states=r(2, 8, 4),
             encoder_attention_mask=_text_mask(2, 8, 5))
    return m, x


@case("LTX2VideoTransformer3DModel", mask="encoder_attention_mask")
def ltx2_video(d, r):
    m = d.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=16,
        audio_cross_attention_dim=32, num_layers=1, caption_channels=16)
    # The pipeline gives the same (B, S) connector mask to the video and the audio text cross-attention.
    mask = _text_mask(2, 8, 5, dtype=torch.long)
    t = torch.tensor([900.0, 900.0])
    x = dict(hidden_states=r(2, 32, 8), audio_hidden_states=r(2, 8, 4), encoder_hidden_states=r(2, 8, 16),
             audio_encoder_hidden_states=r(2, 8, 16), timestep=t, sigma=t, encoder_attention_mask=mask,
             audio_encoder_attention_mask=mask, num_frames=2, height=4, width=4, fps=24.0, audio_num_frames=8)
    return m, x


@case("LTXVideoTransformer3DModel", mask="encoder_attention_mask")
def ltx_video(d, r):
    m = d.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                                     cross_attention_dim=32, num_layers=1, caption_channels=16)
    # 2 latent frames of 4x4, flattened (the pipeline packs latents to (B, F*H*W, C) with patch size 1)
    x = dict(hidden_states=r(2, 32, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([900.0, 900.0]),
             encoder_attention_mask=_text_mask(2, 8, 5), num_frames=2, height=4, width=4,
             rope_interpolation_scale=(8 / 25, 32, 32))
    return m, x


@case("LatteTransformer3DModel", mask="encoder_attention_mask")
def latte(d, r):
    m = d.LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=1, cross_attention_dim=32, sample_size=8, patch_size=2,
                                  norm_type="ada_norm_single", caption_channels=16, video_length=2)
    # The pipeline trims padded text instead of masking it; the forward passes the mask as-is to the spatial blocks,
    # which see batch*frames samples, so it is given as the (B*F, 1, S) additive bias the docstring describes.
    bias = torch.zeros(4, 1, 8)
    bias[2:, :, 5:] = -10000.0
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999, 999]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=bias)
    return m, x


@case("MiniMaxH3Transformer3DModel")
def minimax_h3(d, r):
    # One packed sequence [8 text | 8 audio rows (4 latents x 2 channels) | 2 video frames of 4x4 patches], as the
    # modular pipeline's layout step builds it; head dim 32 with rope_freq_dim 4 rotates 24 of each head's channels.
    m = d.MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=2,
                                      num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=8,
                                      text_dim=16, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16,
                                      rope_freq_dim=4)
    n_text, n_audio, n_video = 8, 8, 32
    text_indices = torch.arange(n_text)
    audio_indices = torch.arange(n_text, n_text + n_audio)
    video_indices = torch.arange(n_text + n_audio, n_text + n_audio + n_video)
    pos = torch.zeros(n_text + n_audio + n_video, 3, dtype=torch.float64)
    pos[text_indices, 0] = torch.arange(n_text, dtype=torch.float64)
    pos[audio_indices, 0] = (n_text + torch.arange(4, dtype=torch.float64)).repeat(2)
    pos[audio_indices, 2] = torch.tensor([0.0] * 4 + [3.0] * 4, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(16, 2)
    pos[video_indices, 0] = n_text + torch.tensor([0.0, 5 / 3], dtype=torch.float64).repeat_interleave(16)
    pos[video_indices, 1:] = grid.to(torch.float64).repeat(2, 1)
    tags = torch.zeros(n_text + n_audio + n_video, dtype=torch.long)  # 0 video, 1 text, 2 audio
    tags[text_indices], tags[audio_indices] = 1, 2
    # distinct timesteps [audio 0.8, video 0.9]; text rows take the video one
    t_idx = torch.ones(n_text + n_audio + n_video, dtype=torch.long)
    t_idx[audio_indices] = 0
    x = dict(hidden_states=r(2, n_video, 16), audio_hidden_states=r(2, n_audio, 8),
             encoder_hidden_states=r(2, n_text, 16), timestep=torch.tensor([0.8, 0.9]), timestep_indices=t_idx,
             token_tags=tags, position_ids=pos, video_indices=video_indices, audio_indices=audio_indices,
             text_indices=text_indices)
    return m, x


@case("MochiTransformer3DModel", mask="encoder_attention_mask")
def mochi(d, r):
    m = d.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                  pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=4)
    with torch.no_grad():  # the learned RoPE frequencies start at zero (an identity rotation): make them matter
        m.pos_frequencies.copy_(r(*m.pos_frequencies.shape))
    x = dict(hidden_states=r(2, 4, 2, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([950.0, 950.0]),
             encoder_attention_mask=_text_mask(2, 8, 5))
    return m, x


@case("MotifVideoTransformer3DModel", mask="encoder_attention_mask")
def motif_video(d, r):
    # Text cross-attention switched on in both block kinds so MotifVideoCrossAttention (which slices the text part
    # out of the joint mask) is covered too.
    m = d.MotifVideoTransformer3DModel(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                       num_layers=1, num_single_layers=1, patch_size=2, text_embed_dim=16,
                                       rope_axes_dim=(4, 6, 6), enable_text_cross_attention_dual=True,
                                       enable_text_cross_attention_single=True)
    # T2V input: [latents (4) | zero first-frame condition (4) | zero condition mask (1)]
    h = torch.cat([r(2, 4, 2, 8, 8), torch.zeros(2, 5, 2, 8, 8)], dim=1)
    x = dict(hidden_states=h, timestep=torch.tensor([1000.0, 1000.0]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=_text_mask(2, 8, 5))
    return m, x


@case("SanaVideoTransformer3DModel", mask="encoder_attention_mask")
def sana_video(d, r):
    m = d.SanaVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                      num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                      cross_attention_dim=32, caption_channels=16, sample_size=8, rope_max_seq_len=32)
    x = dict(hidden_states=r(2, 4, 2, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([999.0, 999.0]),
             encoder_attention_mask=_text_mask(2, 8, 5, dtype=torch.long))
    return m, x


@case("SanaWMLTX2RefinerTransformer3DModel", mask="encoder_attention_mask",
      cpu_only="its KV cache stand-ins are CPU tensors held outside the model's parameters")
def sana_wm_ltx2_refiner(d, r):
    # A denoising step of the chunk-causal AR refiner (kv_cache_mode="inject"): the active block (latent frames 2-3,
    # 4x4, 32 tokens) attends to [sink frame 0 | history frame 1 | itself]. The cache holds seeded stand-ins for the
    # K/V the pipeline captures (sink pre-RoPE, history post-RoPE), (B, 16 tokens, heads * head_dim) each. The
    # audio modules exist only so LTX-2 checkpoints load; the refiner forward never runs them.
    m = d.SanaWMLTX2RefinerTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=16,
        audio_cross_attention_dim=32, num_layers=2, caption_channels=16)
    cache = d.models.transformers.transformer_sana_wm_refiner.SanaWMRefinerKVCache(2)
    for i in range(2):
        cache.get(i).store_sink(r(2, 16, 32), r(2, 16, 32))
        cache.get(i).store_history(r(2, 16, 32), r(2, 16, 32))
    cache.sink_pe = m.build_rotary_emb_for_absolute_positions(2, [0], 4, 4, torch.device("cpu"), fps=24.0)
    rope = m.build_rotary_emb_for_absolute_positions(2, [2, 3], 4, 4, torch.device("cpu"), fps=24.0)
    x = dict(hidden_states=r(2, 32, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.full((2, 32), 900.0),
             video_rotary_emb=rope, encoder_attention_mask=_text_mask(2, 8, 5, dtype=torch.long), kv_cache=cache,
             kv_cache_mode="inject")
    return m, x


@case("SanaWMTransformer3DModel", mask="mask")
def sana_wm(d, r):
    # Block 0 runs the GDN (linear recurrence) camera attention, block 1 its softmax counterpart
    # (softmax_every_n=2); only the text cross-attention (MultiHeadCrossAttention) has a settable processor.
    m = d.SanaWMTransformer3DModel(in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2,
                                   softmax_every_n=2, linear_head_dim=16, caption_channels=8, mlp_ratio=2.0,
                                   chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2)
    _randomize(m, r, "SanaWMTemporalShortConvolution")
    _randomize(m.plucker_embedder, r, "SanaWMPatchEmbed")
    # The first latent frame is the image anchor: its per-frame timestep is pinned to 0.
    t = torch.tensor([[[0.0, 900.0, 900.0, 900.0]]]).repeat(2, 1, 1)
    x = dict(hidden_states=r(2, 4, 4, 4, 4), timestep=t, encoder_hidden_states=r(2, 1, 8, 8),
             mask=_text_mask(2, 8, 5, dtype=torch.long), camera_conditions=_camera(4, 4, 4),
             chunk_plucker=r(2, 8, 4, 4, 4))
    return m, x


@case("SkyReelsV2Transformer3DModel")
def skyreels_v2(d, r):
    # The diffusion-forcing path (SkyReelsV2DiffusionForcingPipeline): per-frame timesteps and causal blocks of 2
    # latent frames, which give self-attention a block-causal (1, 1, S, S) boolean mask. No fps conditioning
    # (inject_sample_info): the model's fps term only broadcasts for batch 1.
    m = d.SkyReelsV2Transformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                       in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                       num_layers=2, rope_max_seq_len=32, num_frame_per_block=2)
    x = dict(hidden_states=r(2, 4, 4, 4, 4), timestep=torch.tensor([[999, 999, 800, 800]] * 2),
             encoder_hidden_states=_zero_padded(r(2, 8, 16), 5), enable_diffusion_forcing=True)
    return m, x


@case("WanAnimate2Transformer3DModel",
      cpu_only="its flex block masks and KV cache stand-ins are CPU tensors held outside the model's parameters")
def wan_animate_2(d, r):
    # A denoising step (kv_cache_mode="cached"): generation tokens attend to themselves plus the cached reference
    # K/V of the same frame through a flex BlockMask. A 5-frame 64x64 segment: 2 reference latent frames and 3
    # generation frames (one extra reference-image slot) of 8x8 latents, 4x4 = 16 tokens each after patching. The
    # cache holds seeded stand-ins for the pre-RoPE reference K/V the extract pass writes, (B, 32, heads, head_dim).
    m = d.WanAnimate2Transformer3DModel(patch_size=(1, 2, 2), text_len=16, in_dim=9, dim=32, ffn_dim=64, freq_dim=16,
                                        text_dim=16, out_dim=4, num_heads=2, num_layers=2)
    # The model builds its BlockMask with create_block_mask(_compile=True), an inductor compile of about a minute on
    # CPU; build the same mask eagerly into the model's mask cache instead (origin: 2 latent frames of 16 tokens).
    with torch.compiler.set_stance("force_eager"):
        m.block_masks[(2, 16)] = m.create_mask(2, 16, torch.device("cpu"))
    cache = d.models.transformers.transformer_wan_animate_2.WanAnimate2KVCache(2)
    for i in range(2):
        cache.get(i).store(r(2, 32, 2, 16), r(2, 32, 2, 16))
    x = dict(hidden_states=[r(4, 3, 8, 8), r(4, 3, 8, 8)], timestep=torch.tensor([900.0, 900.0]),
             encoder_hidden_states=[r(8, 16), r(6, 16)], condition_latents=[r(5, 3, 8, 8), r(5, 3, 8, 8)],
             encoder_hidden_states_image=r(2, 4, 1280), kv_cache=cache, kv_cache_mode="cached", seq_len=48,
             reference_grid_sizes=torch.tensor([[2, 4, 4], [2, 4, 4]]), origin_len=5, origin_area=[64, 64])
    return m, x


@case("WanAnimateTransformer3DModel")
def wan_animate(d, r):
    m = d.WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, latent_channels=4, in_channels=12,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, image_dim=16, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16, motion_style_dim=8,
        motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=2,
        inject_face_latents_blocks=2)
    # 5 face frames -> 2 motion frames after the face encoder's two stride-2 convs, +1 padding frame = 3, which must
    # match the 3 latent frames (1 reference + 2 pose-conditioned) of hidden_states.
    x = dict(hidden_states=r(2, 12, 3, 8, 8), timestep=torch.tensor([999, 999]),
             encoder_hidden_states=_zero_padded(r(2, 8, 16), 5), encoder_hidden_states_image=r(2, 4, 16),
             pose_hidden_states=r(2, 4, 2, 8, 8), face_pixel_values=r(2, 3, 5, 16, 16))
    return m, x


@case("WanTransformer3DModel")
def wan(d, r):
    m = d.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999, 999]),
             encoder_hidden_states=_zero_padded(r(2, 8, 16), 5))
    return m, x


@case("WanVACETransformer3DModel")
def wan_vace(d, r):
    m = d.WanVACETransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                    out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                    rope_max_seq_len=32, vace_layers=[0], vace_in_channels=8)
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999, 999]),
             encoder_hidden_states=_zero_padded(r(2, 8, 16), 5), control_hidden_states=r(2, 8, 2, 8, 8),
             control_hidden_states_scale=torch.tensor([1.0]))
    return m, x
