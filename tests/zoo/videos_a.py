"""Zoo cases: video transformers (first half of the alphabet)."""

from __future__ import annotations

import torch

from zoo.registry import case


@case("AllegroTransformer3DModel", mask="encoder_attention_mask")
def allegro(d, r):
    # head dim 48: the 3-D rope splits the head dim in three equal even parts
    m = d.AllegroTransformer3DModel(patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=48,
                                    in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=96,
                                    sample_height=8, sample_width=8, sample_frames=2, caption_channels=16)
    # the pipeline's rope: 2 latent frames of 4x4 patches
    rope = d.models.embeddings.get_3d_rotary_pos_embed_allegro
    ft, fh, fw, gt, gh, gw = rope(48, ((0, 0), (4, 4)), (4, 4), 2, (2.2, 2.0, 2.0))
    pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    x = dict(hidden_states=r(2, 4, 2, 8, 8), encoder_hidden_states=r(2, 7, 16), encoder_attention_mask=mask,
             timestep=torch.tensor([999, 999]), image_rotary_emb=((ft, fh, fw), tuple(pos)))
    return m, x


@case("AnyFlowFARTransformer3DModel")
def anyflow_far(d, r):
    # full_chunk_limit 2 so that the third chunk sees one compressed and one full chunk in the KV cache
    m = d.AnyFlowFARTransformer3DModel(patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=2,
                                       num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                       text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
                                       chunk_partition=(1, 1, 1))
    # the pipeline's denoising call for the third 1-frame chunk, with the KV cache of the first two prefilled
    # (per layer: [k, v] x batch x heads x tokens x head dim): the causal self-attention (flex backend, no mask)
    # reads 4 compressed + 16 full cached tokens before the chunk's own 16
    cache = {0: {"full_cache": r(2, 2, 2, 2 * 16, 16), "compressed_cache": r(2, 2, 2, 2 * 4, 16)}}
    t = torch.full((2, 1), 500.0)
    x = dict(hidden_states=r(2, 1, 4, 8, 8), timestep=t, r_timestep=t.clone(), encoder_hidden_states=r(2, 8, 16),
             chunk_partition=[1, 1, 1], kv_cache=cache, kv_cache_flag={"num_cached_chunks": 2, "is_cache_step": False})
    return m, x


@case("AnyFlowTransformer3DModel")
def anyflow(d, r):
    # no text mask: the pipeline passes zero-padded UMT5 embeddings
    m = d.AnyFlowTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                    out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                    rope_max_seq_len=32)
    # timesteps are per latent frame: (batch, frames)
    x = dict(hidden_states=r(2, 2, 4, 8, 8), timestep=torch.full((2, 2), 800.0), r_timestep=torch.full((2, 2), 600.0),
             encoder_hidden_states=r(2, 8, 16))
    return m, x


@case("ChronoEditTransformer3DModel")
def chronoedit(d, r):
    # image-conditioned (the pipeline's only path): the processor splits the context as [image tokens, 512 text
    # tokens] (512 is hard-coded), so the text sequence must be 512 long; no text mask (zero-padded embeddings)
    m = d.ChronoEditTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                       in_channels=8, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                       num_layers=1, image_dim=16, added_kv_proj_dim=32, rope_max_seq_len=32)
    # 2 latent frames (the pipeline's default 5 video frames): the rope's temporal-skip branch (positions 0 and 7)
    x = dict(hidden_states=r(2, 8, 2, 8, 8), timestep=torch.tensor([999, 999]), encoder_hidden_states=r(2, 512, 16),
             encoder_hidden_states_image=r(2, 5, 16))
    return m, x


@case("CogVideoXTransformer3DModel")
def cogvideox(d, r):
    # CogVideoX-5b style: rotary embeddings, joint text+video attention without a mask (the pipeline pads the T5
    # embeddings to 226 tokens and attends to all of them)
    m = d.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                                      time_embed_dim=16, text_embed_dim=16, num_layers=1, sample_width=8,
                                      sample_height=8, sample_frames=5, patch_size=2, max_text_seq_length=8,
                                      use_rotary_positional_embeddings=True)
    # the pipeline's rope for 2 latent frames of 4x4 patches (the grid equals the base size: no crop)
    cos, sin = d.models.embeddings.get_3d_rotary_pos_embed(32, ((0, 0), (4, 4)), (4, 4), 2)
    x = dict(hidden_states=r(2, 2, 4, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([999, 999]),
             image_rotary_emb=(cos, sin))
    return m, x


@case("ConsisIDTransformer3DModel")
def consisid(d, r):
    # the released config: rotary embeddings and the face branch (a local facial extractor and perceiver
    # cross-attention, both plain matmul-softmax attention outside the processor system); the face tokens' width
    # (LFE_output_dim) must be int(inner dim * 2 / 3) = 42
    m = d.ConsisIDTransformer3DModel(num_attention_heads=2, attention_head_dim=32, in_channels=8, out_channels=4,
                                     time_embed_dim=16, text_embed_dim=16, num_layers=1, sample_width=8,
                                     sample_height=8, sample_frames=5, patch_size=2, max_text_seq_length=8,
                                     use_rotary_positional_embeddings=True, is_train_face=True, cross_attn_interval=1,
                                     cross_attn_dim_head=16, cross_attn_num_heads=2, LFE_id_dim=16, LFE_vit_dim=16,
                                     LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2,
                                     LFE_num_querie=4, LFE_output_dim=42, LFE_ff_mult=2, LFE_num_scale=2)
    cos, sin = d.models.embeddings.get_3d_rotary_pos_embed(32, ((0, 0), (4, 4)), (4, 4), 2)
    # latents and image latents concatenated on channels; with CFG the pipeline doubles the latents but passes the
    # face embeddings of the one reference image (batch 1, broadcast)
    x = dict(hidden_states=r(2, 2, 8, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([999, 999]),
             image_rotary_emb=(cos, sin), id_cond=r(1, 16), id_vit_hidden=[r(1, 6, 16), r(1, 6, 16)])
    return m, x


@case("Cosmos3OmniTransformer")
def cosmos3_omni(d, r):
    # a packed (batch-free) sequence: a causal text prefix ("und") and the video tokens ("gen"), which attend to
    # both; grouped-query attention (2 query heads, 1 KV head) as in the released model; mRoPE sections (6, 5, 5)
    # cover head_dim / 2 = 16 frequencies
    m = d.Cosmos3OmniTransformer(head_dim=32, hidden_size=64, intermediate_size=64, latent_channel=4,
                                 latent_patch_size=2, num_attention_heads=2, num_hidden_layers=1,
                                 num_key_value_heads=1, patch_latent_dim=16, vocab_size=64, rope_axes_dim=(6, 5, 5))
    # text-to-video as the pipeline packs it: 8 text tokens, then 2 latent frames of 4x4 patches, all noisy;
    # fps modulation on (float positions), video positions start after the 15000 temporal modality margin
    und, gen = 8, 2 * 4 * 4
    text_pos = torch.arange(und, dtype=torch.float32).expand(3, -1)
    t = torch.arange(2.0).view(-1, 1).expand(-1, 16).flatten() + und + 15000
    h = torch.arange(4.0).view(1, -1, 1).expand(2, -1, 4).flatten()
    w = torch.arange(4.0).view(1, 1, -1).expand(2, 4, -1).flatten()
    x = dict(input_ids=torch.arange(3, 3 + und),
             text_indexes=torch.arange(und), position_ids=torch.cat([text_pos, torch.stack([t, h, w])], dim=1),
             und_len=und, sequence_length=und + gen, vision_tokens=[r(1, 4, 2, 8, 8)],
             vision_token_shapes=[(2, 4, 4)], vision_sequence_indexes=torch.arange(und, und + gen),
             vision_mse_loss_indexes=torch.arange(und, und + gen), vision_timesteps=torch.full((gen,), 999.0),
             vision_noisy_frame_indexes=[torch.arange(2)])
    return m, x


@case("CosmosTransformer3DModel", mask="attention_mask")
def cosmos(d, r):
    # Cosmos-1.0 text-to-world with the learnable extra positional embedding, but without the padding-mask input
    # channel: concatenating it resizes the mask with torchvision, which is not installed here
    m = d.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
                                   num_layers=1, mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8,
                                   max_size=(4, 16, 16), patch_size=(1, 2, 2), concat_padding_mask=False)
    # the pipelines zero the T5 embeddings past each prompt's length instead of passing a mask; the forward's
    # attention_mask is the tokenizer's boolean mask, which it turns into a (B, 1, 1, S) cross-attention mask
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=r(2, 8, 16),
             attention_mask=mask, fps=30)
    return m, x


@case("EasyAnimateTransformer3DModel")
def easyanimate(d, r):
    # one MMDiT block (separate text projections) and one plain block; no mask input: the text padding mask only
    # goes to the text encoder. Head dim 32: the 3-D rope needs a multiple of 16
    m = d.EasyAnimateTransformer3DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                                        patch_size=2, sample_width=8, sample_height=8, num_layers=2, mmdit_layers=1,
                                        time_embed_dim=16, text_embed_dim=16)
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16))
    return m, x


@case("HeliosTransformer3DModel")
def helios(d, r):
    # rope_dim splits the head dim 32 over (t, y, x); no text mask (zero-padded UMT5 embeddings)
    m = d.HeliosTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                   out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                   rope_dim=(12, 10, 10))
    # the pipeline's chunk with keep_first_frame and history sizes (4, 2, 1): frame indices 0 (prefix),
    # 1-4 (long), 5-6 (mid), 7 (1x), 8-9 (the 2 noisy frames); the short history is prefix + 1x
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16),
             indices_hidden_states=torch.tensor([[8, 9]]),
             indices_latents_history_short=torch.tensor([[0, 7]]), latents_history_short=r(2, 4, 2, 8, 8),
             indices_latents_history_mid=torch.tensor([[5, 6]]), latents_history_mid=r(2, 4, 2, 8, 8),
             indices_latents_history_long=torch.tensor([[1, 2, 3, 4]]), latents_history_long=r(2, 4, 4, 8, 8))
    return m, x


@case("HunyuanVideo15Transformer3DModel", mask="encoder_attention_mask")
def hunyuan_video15(d, r):
    # rope axes (8, 12, 12) cover head dim 32; patch size 1 as released
    m = d.HunyuanVideo15Transformer3DModel(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=32,
                                           num_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
                                           text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=16,
                                           rope_axes_dim=(8, 12, 12), task_type="t2v")
    # text-to-video as the pipeline runs it: latents + zero condition latents + zero mask channel, zero image
    # embeddings (the model then masks the image tokens out), int64 tokenizer masks for the MLLM prompt and for the
    # ByT5 glyph text (all zeros when the prompt quotes no text, as in the second sample); the model reorders the
    # valid tokens first and each attention builds a (B, 1, S, S) mask from the padding
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    mask_2 = torch.zeros(2, 6, dtype=torch.long)
    mask_2[0, :3] = 1
    x = dict(hidden_states=torch.cat([r(2, 4, 2, 4, 4), torch.zeros(2, 5, 2, 4, 4)], dim=1),
             timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16), encoder_attention_mask=mask,
             encoder_hidden_states_2=r(2, 6, 16), encoder_attention_mask_2=mask_2, image_embeds=torch.zeros(2, 4, 16))
    return m, x


@case("HunyuanVideoTransformer3DModel", mask="encoder_attention_mask")
def hunyuan_video(d, r):
    # one double-stream and one single-stream block; rope axes (8, 12, 12) cover head dim 32
    m = d.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
                                         num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                                         patch_size=2, text_embed_dim=16, pooled_projection_dim=8,
                                         rope_axes_dim=(8, 12, 12))
    # the pipeline casts the Llama tokenizer mask to the transformer dtype (float 1/0); guidance is scale * 1000
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=mask, pooled_projections=r(2, 8), guidance=torch.tensor([6000.0, 6000.0]))
    return m, x


@case("HunyuanVideoFramepackTransformer3DModel", mask="encoder_attention_mask")
def hunyuan_video_framepack(d, r):
    # one double-stream and one single-stream block, with the SigLIP image projection and the history patch embedders
    # of the released model
    m = d.HunyuanVideoFramepackTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                  attention_head_dim=32, num_layers=1, num_single_layers=1,
                                                  num_refiner_layers=1, mlp_ratio=2.0, patch_size=2,
                                                  text_embed_dim=16, pooled_projection_dim=8,
                                                  rope_axes_dim=(8, 12, 12), has_image_proj=True, image_proj_dim=16,
                                                  has_clean_x_embedder=True)
    # the pipeline's first section of inverted anti-drifting sampling with a 2-frame window and history sizes
    # (1, 2, 4): frame indices 0 (prefix), 1-2 (padding), 3-4 (the noisy window), 5 (1x), 6-7 (2x), 8-11 (4x).
    # Batch 2 (batch 1 drops the mask and trims the text instead); float 1/0 text mask, as the pipeline casts it
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 4, 2, 8, 8), timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=mask, pooled_projections=r(2, 8), image_embeds=r(2, 4, 16),
             indices_latents=torch.tensor([3, 4]), guidance=torch.tensor([10000.0, 10000.0]),
             latents_clean=r(2, 4, 2, 8, 8), indices_latents_clean=torch.tensor([0, 5]),
             latents_history_2x=r(2, 4, 2, 8, 8), indices_latents_history_2x=torch.tensor([6, 7]),
             latents_history_4x=r(2, 4, 4, 8, 8), indices_latents_history_4x=torch.tensor([8, 9, 10, 11]))
    return m, x


@case("JoyImageEditTransformer3DModel")
def joyimage_edit(d, r):
    # hidden 64 over 2 heads: head dim 32, which rope_dim_list covers; no mask: the joint attention is unmasked
    m = d.JoyImageEditTransformer3DModel(patch_size=[1, 2, 2], in_channels=4, out_channels=4, hidden_size=64,
                                         num_attention_heads=2, text_dim=16, mlp_width_ratio=2.0, num_layers=1,
                                         rope_dim_list=[8, 12, 12])
    # reference-image editing as the pipeline packs it: (batch, items, C, T, H, W) with the reference latents first
    # and the noisy target last, 1 frame each (the model moves the target first and stacks items along time)
    x = dict(hidden_states=r(2, 2, 4, 1, 8, 8), timestep=torch.tensor([999.0, 999.0]),
             encoder_hidden_states=r(2, 8, 16))
    return m, x


@case("JoyImageEditPlusTransformer3DModel", mask="encoder_hidden_states_mask")
def joyimage_edit_plus(d, r):
    m = d.JoyImageEditPlusTransformer3DModel(patch_size=[1, 2, 2], in_channels=4, out_channels=4, hidden_size=64,
                                             num_attention_heads=2, text_dim=16, mlp_width_ratio=2.0, num_layers=1,
                                             rope_dim_list=[8, 12, 12])
    # the pipeline's padded patch sequences (B, patches, C, pt, ph, pw): a 4x4-patch target, then one reference of
    # 4x4 patches (first sample) or 2x4 patches (second sample, padded from 24 to 32 patches); the model masks the
    # padded patches and the padded text (int64 tokenizer mask) in one (B, 1, 1, S) mask
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    patches = r(2, 32, 4, 1, 2, 2)
    patches[1, 24:] = 0
    x = dict(hidden_states=patches, timestep=torch.tensor([999.0, 999.0]), encoder_hidden_states=r(2, 8, 16),
             encoder_hidden_states_mask=mask, shape_list=[[(1, 4, 4), (1, 4, 4)], [(1, 4, 4), (1, 2, 4)]])
    return m, x


@case("Kandinsky5Transformer3DModel")
def kandinsky5(d, r):
    # regular (dense) attention, as the 5 s models; head dim = sum(axes_dims) = 32. No mask input: the text stream
    # has its own 1-D rope over positions 0..L-1
    m = d.Kandinsky5Transformer3DModel(in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4,
                                       patch_size=(1, 2, 2), model_dim=64, ff_dim=64, num_text_blocks=1,
                                       num_visual_blocks=1, axes_dims=(8, 12, 12), visual_cond=True)
    # channels-last latents (B, T, H, W, C) with the zero visual condition and zero condition mask appended, as the
    # text-to-video pipeline builds them; below 480p the pipeline uses rope scale (1, 3.16, 3.16)
    latents = torch.cat([r(2, 2, 8, 8, 4), torch.zeros(2, 2, 8, 8, 5)], dim=-1)
    x = dict(hidden_states=latents, encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([999.0, 999.0]),
             pooled_projections=r(2, 8), visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
             text_rope_pos=torch.arange(8), scale_factor=(1, 3.16, 3.16))
    return m, x
