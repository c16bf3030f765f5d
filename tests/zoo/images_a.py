"""Zoo cases: image transformers (first half of the alphabet)."""

from __future__ import annotations

import torch

from zoo.registry import case


def _text_mask(lengths, total, dtype=torch.long):
    """A tokenizer-style padding mask (B, total): ones for the first `lengths[i]` tokens, zeros after."""
    return (torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)


def _grid_ids(h, w, axes=3, hw_at=(1, 2)):
    """Flux-style image position ids (h * w, axes): zeros except the row and column at positions `hw_at`."""
    ids = torch.zeros(h, w, axes)
    ids[..., hw_at[0]] = torch.arange(h)[:, None]
    ids[..., hw_at[1]] = torch.arange(w)[None, :]
    return ids.reshape(h * w, axes)


@case("AuraFlowTransformer2DModel")
def auraflow(d, r):
    # caption_projection_dim must equal the inner dim (text is concatenated with register tokens of that width);
    # pos_embed_max_size 64 is an 8x8 grid, the 4x4 patch grid is cut from its centre
    m = d.AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                     num_single_dit_layers=1, attention_head_dim=16, num_attention_heads=2,
                                     joint_attention_dim=16, caption_projection_dim=32, out_channels=4,
                                     pos_embed_max_size=64)
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([0.5, 0.5]))
    return m, x


@case("BriaFibo2Transformer2DModel", mask="encoder_attention_mask")
def bria_fibo2(d, r):
    # Gist sizing: 8 and 4 text tokens map to 8 and 6 gist tokens, so the batch also pads the gist tokens and the
    # model builds its own self-attention mask on top of the text mask
    m = d.BriaFibo2Transformer2DModel(in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                                      cap_feat_dim=16, injection_layer_ids=(1,), perceiver_num_layers=1,
                                      min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=2, gist_min_text_len=2,
                                      gist_max_text_len=8, axes_dims=(4, 6, 6), axes_lens=(16, 8, 8))
    with torch.no_grad():  # the injection gate starts at 0 (tanh(0) silences the cross-attention); open it
        m.layers[1].cross_attn_gate.fill_(0.5)
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=r(2, 2, 8, 16),
             encoder_attention_mask=_text_mask([8, 4], 8, torch.bool))
    return m, x


@case("BriaFiboTransformer2DModel")
def bria_fibo(d, r):
    m = d.BriaFiboTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                     axes_dims_rope=[4, 6, 6], text_encoder_dim=16)
    # The pipeline has no mask argument to pass: it hands a bool key-padding mask (B, 1, 1, text + image) to the
    # attention modules through joint_attention_kwargs["attention_mask"]
    mask = torch.cat([_text_mask([8, 5], 8, torch.bool), torch.ones(2, 16, dtype=torch.bool)], dim=1)
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16),
             text_encoder_layers=[r(2, 8, 16), r(2, 8, 16)], timestep=torch.tensor([500.0, 500.0]),
             img_ids=_grid_ids(4, 4), txt_ids=torch.zeros(8, 3),
             joint_attention_kwargs={"attention_mask": mask[:, None, None, :]})
    return m, x


@case("BriaTransformer2DModel")
def bria(d, r):
    m = d.BriaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                 axes_dims_rope=[4, 6, 6])
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([500.0, 500.0]),
             img_ids=_grid_ids(4, 4)[None].repeat(2, 1, 1), txt_ids=torch.zeros(2, 8, 3))
    return m, x


@case("ChromaTransformer2DModel", mask="attention_mask")
def chroma(d, r):
    m = d.ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                   axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
                                   approximator_layers=1)
    # As the pipeline builds it: float (B, text + image), a prompt of 4 tokens keeps one padding token (index 4)
    mask = torch.cat([_text_mask([8, 5], 8, torch.float32), torch.ones(2, 16)], dim=1)
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([0.5, 0.5]),
             img_ids=_grid_ids(4, 4), txt_ids=torch.zeros(8, 3), attention_mask=mask)
    return m, x


@case("CogView3PlusTransformer2DModel")
def cogview3plus(d, r):
    m = d.CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16,
                                         num_attention_heads=2, out_channels=4, text_embed_dim=16, time_embed_dim=32,
                                         condition_dim=8, pos_embed_max_size=8, sample_size=8)
    sizes = torch.tensor([[64.0, 64.0], [64.0, 64.0]])
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([500, 500]),
             original_size=sizes, target_size=sizes, crop_coords=torch.zeros(2, 2))
    return m, x


@case("CogView4Transformer2DModel", mask="attention_mask")
def cogview4(d, r):
    m = d.CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=16,
                                     num_attention_heads=2, text_embed_dim=16, time_embed_dim=32, condition_dim=8,
                                     pos_embed_max_size=8, sample_size=8, rope_axes_dim=(8, 8))
    sizes = torch.tensor([[64.0, 64.0], [64.0, 64.0]])
    # The pipeline passes no mask (it pads prompts to a multiple of 16 with pad tokens); the forward takes a
    # (B, text) 1/0 mask, as its processor documents
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 16, 16), timestep=torch.tensor([500.0, 500.0]),
             original_size=sizes, target_size=sizes, crop_coords=torch.zeros(2, 2),
             attention_mask=_text_mask([16, 11], 16))
    return m, x


@case("DiTTransformer2DModel")
def dit(d, r):
    m = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([500, 500]), class_labels=torch.tensor([1, 3]))
    return m, x


@case("DreamLiteTransformer2DModel", mask="encoder_attention_mask")
def dreamlite(d, r):
    # No GQA (num_kv_heads=None): the stock AttnProcessor2_0 this class gets standalone can't reshape fewer K/V
    # heads; only DreamLiteUNetModel installs its GQA-aware processor
    m = d.DreamLiteTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=1,
                                      norm_num_groups=8, cross_attention_dim=16, qk_norm="rms_norm")
    # DreamLiteUNetModel (UNet2DConditionModel's forward) hands its blocks the text mask as an additive bias (B, 1, T)
    bias = (1 - _text_mask([8, 5], 8, torch.float32)) * -10000.0
    x = dict(hidden_states=r(2, 32, 4, 4), encoder_hidden_states=r(2, 8, 16), encoder_attention_mask=bias[:, None, :])
    return m, x


@case("ErnieImageTransformer2DModel")
def ernie_image(d, r):
    m = d.ErnieImageTransformer2DModel(hidden_size=32, num_attention_heads=2, num_layers=1, ffn_hidden_size=64,
                                       in_channels=16, out_channels=16, patch_size=1, text_in_dim=16,
                                       rope_axes_dim=(4, 6, 6))
    with torch.no_grad():  # the modulation and output layers start at zero: the output would not see attention
        for p in [*m.adaLN_modulation[-1].parameters(), *m.final_linear.parameters()]:
            p.normal_(0, 0.1)
    # Padding comes as per-prompt lengths (text_lens), not a 0/1 mask; the pipeline zero-pads text_bth past them
    lens = torch.tensor([8, 5])
    text = r(2, 8, 16) * _text_mask(lens.tolist(), 8, torch.float32)[..., None]
    x = dict(hidden_states=r(2, 16, 4, 4), timestep=torch.tensor([500.0, 500.0]), text_bth=text, text_lens=lens)
    return m, x


@case("Flux2Transformer2DModel")
def flux2(d, r):
    m = d.Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                  timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
    txt_ids = torch.zeros(8, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(8)
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([0.5, 0.5]),
             img_ids=_grid_ids(4, 4, axes=4).long()[None].repeat(2, 1, 1), txt_ids=txt_ids[None].repeat(2, 1, 1),
             guidance=torch.tensor([4.0, 4.0]))
    return m, x


@case("Flux3Transformer2DModel")
def flux3(d, r):
    m = d.Flux3Transformer2DModel(in_channels=16, cond_in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                  timestep_channels=32, axes_dims_rope=(4, 4, 4, 4))
    txt_ids = torch.zeros(8, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(8)
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16), timestep=torch.tensor([0.5, 0.5]),
             img_ids=_grid_ids(4, 4, axes=4).long(), txt_ids=txt_ids)
    return m, x


@case("FluxTransformer2DModel")
def flux(d, r):
    m = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                 pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    x = dict(hidden_states=r(2, 16, 16), encoder_hidden_states=r(2, 8, 16), pooled_projections=r(2, 16),
             timestep=torch.tensor([0.5, 0.5]), img_ids=_grid_ids(4, 4), txt_ids=torch.zeros(8, 3),
             guidance=torch.tensor([3.5, 3.5]))
    return m, x


@case("GlmImageTransformer2DModel", mask="attention_mask")
def glm_image(d, r):
    m = d.GlmImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=16,
                                     num_attention_heads=2, text_embed_dim=16, time_embed_dim=32, condition_dim=8,
                                     prior_vq_quantizer_codebook_size=64)
    # The pipeline passes no mask (one glyph prompt per sample); the forward takes a (B, text) 1/0 mask
    x = dict(hidden_states=r(2, 4, 8, 8), encoder_hidden_states=r(2, 8, 16),
             prior_token_id=(torch.arange(32).reshape(2, 16) * 7) % 64,
             prior_token_drop=torch.zeros(2, 16, dtype=torch.bool), timestep=torch.tensor([499.0, 499.0]),
             target_size=torch.tensor([[64.0, 64.0], [64.0, 64.0]]), crop_coords=torch.zeros(2, 2),
             attention_mask=_text_mask([8, 5], 8))
    return m, x


@case("HiDreamImageTransformer2DModel", mask="hidden_states_masks")
def hidream_image(d, r):
    m = d.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=32, num_attention_heads=2, caption_channels=[16, 16],
                                         text_emb_dim=16, num_routed_experts=2, num_activated_experts=2,
                                         axes_dims_rope=(16, 8, 8), max_resolution=(8, 8), llama_layers=[0, 1])
    # A non-square latent (2x4 patches) is padded to max_seq = 16 image tokens with a float mask over them: the
    # model's own patchify builds exactly these inputs when the pipeline hands it a non-square latent
    hidden_states, masks, sizes, img_ids = m.patchify(r(2, 4, 4, 8))
    x = dict(hidden_states=hidden_states, timesteps=torch.tensor([500.0, 500.0]), encoder_hidden_states_t5=r(2, 8, 16),
             encoder_hidden_states_llama3=r(2, 2, 8, 16), pooled_embeds=r(2, 16), img_ids=img_ids, img_sizes=sizes,
             hidden_states_masks=masks)
    return m, x


@case("HunyuanDiT2DModel", mask="text_embedding_mask")
def hunyuan_dit(d, r):
    # text_len / text_len_t5 fix the two prompt lengths (a learned padding table and the T5 pooler's positions)
    m = d.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=8,
                            hidden_size=32, num_layers=2, cross_attention_dim=16, cross_attention_dim_t5=16,
                            pooled_projection_dim=16, text_len=8, text_len_t5=8)
    # As the pipeline computes it for a 4x4 patch grid (base size 512 // 8 // 2 = 32)
    rope = d.models.embeddings.get_2d_rotary_pos_embed(16, ((0, 0), (32, 32)), (4, 4), output_type="pt")
    meta = torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]] * 2)
    x = dict(hidden_states=r(2, 4, 8, 8), timestep=torch.tensor([500.0, 500.0]), encoder_hidden_states=r(2, 8, 16),
             text_embedding_mask=_text_mask([8, 5], 8), encoder_hidden_states_t5=r(2, 8, 16),
             text_embedding_mask_t5=_text_mask([8, 3], 8), image_meta_size=meta, style=torch.zeros(2, dtype=torch.long),
             image_rotary_emb=rope)
    return m, x
