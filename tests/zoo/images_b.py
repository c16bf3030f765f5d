"""Zoo cases: image transformers (second half of the alphabet)."""

from __future__ import annotations

import torch

from zoo.registry import case


@case("QwenImageTransformer2DModel", mask="encoder_hidden_states_mask")
def qwen_image(d, r):
    m = d.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                      num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0  # the second prompt is shorter: its last 3 text tokens are padding
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 7, 16), encoder_hidden_states_mask=mask,
             timestep=torch.tensor([0.5, 0.5]), img_shapes=[[(1, 4, 4)], [(1, 4, 4)]])
    return m, x


@case("HunyuanImageTransformer2DModel", mask="encoder_attention_mask")
def hunyuan_image(d, r):
    # text_embed_2_dim adds the ByT5 (glyph) stream that the default pipeline always passes
    m = d.HunyuanImageTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1),
                                        text_embed_dim=16, text_embed_2_dim=8, rope_axes_dim=(8, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    mask_2 = torch.ones(2, 4, dtype=torch.long)
    mask_2[0, 2:] = 0
    x = dict(hidden_states=r(2, 4, 4, 4), timestep=torch.tensor([900.0, 900.0]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=mask, encoder_hidden_states_2=r(2, 4, 8), encoder_attention_mask_2=mask_2)
    return m, x


@case("Ideogram4Transformer2DModel", mask="indicator")
def ideogram4(d, r):
    # Packed [left-pad | text | image] sequence as Ideogram4Pipeline._prepare_ids builds it. The attention mask comes
    # from segment_ids (-1 on padding); `indicator` is 0 exactly on the padding, so it is the declared mask input.
    m = d.Ideogram4Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
                                     intermediate_size=128, adaln_dim=32, llm_features_dim=24, mrope_section=(4, 2, 2))
    max_text, gh, gw = 8, 4, 4
    img = torch.stack([torch.zeros(gh * gw, dtype=torch.long), torch.arange(gh).repeat_interleave(gw),
                       torch.arange(gw).repeat(gh)], dim=1) + 65536
    position_ids = torch.zeros(2, max_text + gh * gw, 3, dtype=torch.long)
    segment_ids = torch.full((2, max_text + gh * gw), -1, dtype=torch.long)
    indicator = torch.zeros(2, max_text + gh * gw, dtype=torch.long)
    for b, n in enumerate([8, 5]):
        off = max_text - n
        position_ids[b, off:max_text] = torch.arange(n)[:, None].expand(n, 3)
        position_ids[b, max_text:] = img
        indicator[b, off:max_text] = 3
        indicator[b, max_text:] = 2
        segment_ids[b, off:] = 1
    llm = r(2, max_text + gh * gw, 24) * (indicator == 3).unsqueeze(-1)
    hidden = torch.cat([torch.zeros(2, max_text, 16), r(2, gh * gw, 16)], dim=1)
    x = dict(hidden_states=hidden, timestep=torch.tensor([0.3, 0.3]), encoder_hidden_states=llm,
             position_ids=position_ids, segment_ids=segment_ids, indicator=indicator)
    return m, x


@case("Krea2Transformer2DModel", mask="encoder_attention_mask")
def krea2(d, r):
    # 2 query heads over 1 key/value head: exercises the processor's GQA repeat
    m = d.Krea2Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64, timestep_embed_dim=32,
                                 text_hidden_dim=32, num_text_layers=3, text_num_attention_heads=2,
                                 text_num_key_value_heads=2, text_intermediate_size=64, num_layerwise_text_blocks=1,
                                 num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
    # Krea2Pipeline pads in the middle of its template: [prompt | PAD | suffix]
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 4:6] = False
    gh, gw = 4, 4
    ids = torch.zeros(8 + gh * gw, 3)
    ids[8:, 1] = torch.arange(gh).repeat_interleave(gw).float()
    ids[8:, 2] = torch.arange(gw).repeat(gh).float()
    x = dict(hidden_states=r(2, gh * gw, 16), encoder_hidden_states=r(2, 8, 3, 32), timestep=torch.tensor([0.7, 0.7]),
             position_ids=ids, encoder_attention_mask=mask)
    return m, x


@case("LongCatImageTransformer2DModel")
def longcat_image(d, r):
    m = d.LongCatImageTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])
    txt_ids = torch.zeros(8, 3)
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(8).float()
    img_ids = torch.ones(16, 3)  # modality 1, image grid starts at tokenizer_max_length (512)
    img_ids[:, 1] = torch.arange(4).repeat_interleave(4).float() + 512
    img_ids[:, 2] = torch.arange(4).repeat(4).float() + 512
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 32), timestep=torch.tensor([0.8, 0.8]),
             txt_ids=txt_ids, img_ids=img_ids)
    return m, x


@case("Lumina2Transformer2DModel", mask="encoder_attention_mask")
def lumina2(d, r):
    m = d.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=1,
                                   num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                   axes_dim_rope=(4, 6, 6), axes_lens=(64, 64, 64), cap_feat_dim=16)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([0.4, 0.4]), encoder_hidden_states=r(2, 8, 16),
             encoder_attention_mask=mask)
    return m, x


@case("LuminaNextDiT2DModel", mask="encoder_mask")
def lumina_next(d, r):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    m = d.LuminaNextDiT2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
                              num_attention_heads=2, num_kv_heads=1, multiple_of=16, cross_attention_dim=16)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    # LuminaPipeline: rope over a 384x384 grid; proportional attention with base_sequence_length (1024 // 16) ** 2
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([0.4, 0.4]), encoder_hidden_states=r(2, 8, 16),
             encoder_mask=mask, image_rotary_emb=get_2d_rotary_pos_embed_lumina(16, 384, 384),
             cross_attention_kwargs={"base_sequence_length": 4096})
    return m, x


@case("NucleusMoEImageTransformer2DModel", mask="encoder_hidden_states_mask")
def nucleus_moe_image(d, r):
    # head dim 32 so the dense block's SwiGLU width (int(dim * 8 / 3) // 128 * 128) is not 0; block 0 dense, block 1
    # MoE with 4 experts; capacity 2 keeps expert-choice top-k within the 16 image tokens
    m = d.NucleusMoEImageTransformer2DModel(patch_size=2, in_channels=16, num_layers=2, attention_head_dim=32,
                                           num_attention_heads=2, num_key_value_heads=1, joint_attention_dim=32,
                                           axes_dims_rope=(8, 12, 12), dense_moe_strategy="leave_first_block_dense",
                                           num_experts=4, moe_intermediate_dim=32, capacity_factors=2.0)
    for name, p in m.named_parameters():  # the packed expert weights are torch.empty, never initialised
        if ".experts." in name:
            torch.nn.init.normal_(p, std=0.1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 16, 16), img_shapes=[(1, 4, 4)] * 2, encoder_hidden_states=r(2, 8, 32),
             encoder_hidden_states_mask=mask, timestep=torch.tensor([0.6, 0.6]))
    return m, x


@case("OmniGenTransformer2DModel", mask="attention_mask")
def omnigen(d, r):
    hd = 16
    m = d.OmniGenTransformer2DModel(in_channels=4, patch_size=2, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=64, num_layers=2, pad_token_id=2,
                                   vocab_size=64, rope_scaling={"short_factor": [1.0] * (hd // 2),
                                                                "long_factor": [1.0] * (hd // 2)},
                                   pos_embed_max_size=16, time_step_dim=32)
    # OmniGenCollator, text-to-image with CFG: [prompt, empty negative prompt], left-padded; a (B, S, S) 0/1 mask,
    # causal over text + time token, bidirectional over the 16 output-image tokens
    lens, text_len, img_len = [6, 3], 6, 16
    seq = text_len + 1 + img_len
    ids = torch.full((2, text_len), 2, dtype=torch.long)
    mask = torch.zeros(2, seq, seq)
    pos = torch.zeros(2, seq, dtype=torch.long)
    for b, n in enumerate(lens):
        pad = text_len - n
        ids[b, pad:] = torch.arange(5, 5 + n)
        mask[b, :pad] = 1
        mask[b, pad:, pad:] = torch.tril(torch.ones(seq - pad, seq - pad))
        mask[b, pad + n + 1:, pad:] = 1
        pos[b, pad:] = torch.arange(seq - pad)
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([0.3, 0.3]), input_ids=ids, input_img_latents=[],
             input_image_sizes={}, attention_mask=mask, position_ids=pos)
    return m, x


@case("OvisImageTransformer2DModel")
def ovis_image(d, r):
    m = d.OvisImageTransformer2DModel(patch_size=1, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     axes_dims_rope=(4, 6, 6))
    txt_ids = torch.zeros(8, 3)
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(8).float()
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1] = torch.arange(4).repeat_interleave(4).float()
    img_ids[:, 2] = torch.arange(4).repeat(4).float()
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 32), timestep=torch.tensor([0.8, 0.8]),
             txt_ids=txt_ids, img_ids=img_ids)
    return m, x


@case("PRXTransformer2DModel", mask="attention_mask")
def prx(d, r):
    m = d.PRXTransformer2DModel(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
                               num_heads=2, depth=2, axes_dim=[8, 8])
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    # PRXPipeline passes one timestep of shape (1,) for the whole (CFG) batch
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([0.6]), encoder_hidden_states=r(2, 8, 16),
             attention_mask=mask)
    return m, x


@case("PixArtTransformer2DModel", mask="encoder_attention_mask")
def pixart(d, r):
    m = d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2,
                                  caption_channels=16)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([500, 500]),
             added_cond_kwargs={"resolution": None, "aspect_ratio": None}, encoder_attention_mask=mask)
    return m, x


@case("QwenImage21Transformer2DModel", mask="encoder_hidden_states_mask")
def qwen_image21(d, r):
    m = d.QwenImage21Transformer2DModel(patch_size=1, in_channels=16, out_channels=16, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, context_in_dim=32, mlp_ratio=2,
                                       axes_dims_rope=(4, 6, 6))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    # text-to-image: no image slots in the prompt, then one slot per 2x2 group of the 4x4 target latents
    img_mask = torch.cat([torch.zeros(2, 8, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)], dim=1)
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 32), timestep=torch.tensor([0.7, 0.7]),
             img_shapes=[[(1, 4, 4)]] * 2, img_mask=img_mask, encoder_hidden_states_mask=mask)
    return m, x


@case("SD3Transformer2DModel")
def sd3(d, r):
    # dual_attention_layers=(0,) and qk_norm as in SD3.5: block 0 also has the second (image-only) attention
    m = d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                               pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
                               dual_attention_layers=(0,), qk_norm="rms_norm")
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 32), pooled_projections=r(2, 16),
             timestep=torch.tensor([800.0, 800.0]))
    return m, x


@case("SanaTransformer2DModel", mask="encoder_attention_mask")
def sana(d, r):
    m = d.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                cross_attention_dim=32, caption_channels=16, sample_size=8, patch_size=1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 4, 4, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([700.0, 700.0]),
             encoder_attention_mask=mask)
    return m, x


@case("Transformer2DModel", mask="encoder_attention_mask")
def transformer_2d(d, r):
    # continuous input, as the spatial transformer inside UNet2DConditionModel
    m = d.Transformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=1,
                            cross_attention_dim=16, norm_num_groups=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    x = dict(hidden_states=r(2, 32, 4, 8), encoder_hidden_states=r(2, 8, 16), encoder_attention_mask=mask)
    return m, x


@case("ZImageTransformer2DModel")
def z_image(d, r):
    # No mask input: ZImagePipeline passes unpadded per-prompt embeddings. Caption lengths 40 and 7 round up to 64
    # and 32 tokens (SEQ_MULTI_OF), so the model builds its own (B, S) padding mask for the unified sequence.
    m = d.ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1,
                                  n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                                  axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])
    x = dict(x=[r(4, 1, 8, 8), r(4, 1, 8, 8)], t=torch.tensor([0.5, 0.5]), cap_feats=[r(40, 16), r(7, 16)])
    return m, x
