"""Zoo cases: audio transformers, priors and the models pipelines ship beside their denoisers."""

from __future__ import annotations

import torch

from zoo.registry import case, exclude


def _ace_step_sizes():
    # GQA (2 query heads, 1 key/value head) as in the released checkpoints (16 / 8).
    return dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@case("AceStepAudioTokenDetokenizer")
def ace_step_audio_token_detokenizer(d, r):
    m = d.AceStepAudioTokenDetokenizer(**_ace_step_sizes(), audio_acoustic_hidden_dim=8, pool_window_size=5,
                                       num_attention_pooler_hidden_layers=2, sliding_window=2)
    # Each 5 Hz token is expanded to pool_window_size=5 frames, attended over as its own 5-token sequence; a
    # sliding window of 2 (128 in the checkpoints) so that the banded mask of the first layer masks something.
    return m, dict(hidden_states=r(2, 4, 32))


@case("AceStepAudioTokenizer")
def ace_step_audio_tokenizer(d, r):
    m = d.AceStepAudioTokenizer(**_ace_step_sizes(), audio_acoustic_hidden_dim=8, pool_window_size=5, fsq_dim=32,
                                num_attention_pooler_hidden_layers=2, sliding_window=2)
    # (batch, patches, pool_window_size, acoustic dim), as `tokenize` reshapes it: each patch plus its pooling token
    # is a 6-token sequence. Sliding window 2 (128 in the checkpoints), as for the detokenizer.
    return m, dict(hidden_states=r(2, 4, 5, 8))


@case("AceStepConditionEncoder", mask="lyric_attention_mask")
def ace_step_condition_encoder(d, r):
    m = d.AceStepConditionEncoder(**_ace_step_sizes(), text_hidden_dim=24, timbre_hidden_dim=8,
                                  num_lyric_encoder_hidden_layers=2, num_timbre_encoder_hidden_layers=2,
                                  sliding_window=4)
    text_mask = torch.ones(2, 8, dtype=torch.bool)
    text_mask[1, 5:] = False
    lyric_mask = torch.ones(2, 16, dtype=torch.bool)
    lyric_mask[1, 10:] = False  # the second song's lyrics are shorter
    x = dict(text_hidden_states=r(2, 8, 24), text_attention_mask=text_mask, lyric_hidden_states=r(2, 16, 24),
             lyric_attention_mask=lyric_mask, refer_audio_acoustic_hidden_states_packed=r(2, 16, 8),
             refer_audio_order_mask=torch.arange(2))
    return m, x


@case("AceStepTransformer1DModel")
def ace_step_transformer(d, r):
    # Two layers: the first uses sliding-window self-attention (window 4 over 16 tokens), the second full attention.
    m = d.AceStepTransformer1DModel(**_ace_step_sizes(), num_hidden_layers=2, in_channels=24,
                                    audio_acoustic_hidden_dim=8, patch_size=2, sliding_window=4)
    t = torch.tensor([0.7, 0.7])
    # context_latents = cat(src_latents, chunk_mask), each of the acoustic dim; 32 frames patchify to 16 tokens.
    x = dict(hidden_states=r(2, 32, 8), timestep=t, timestep_r=t, encoder_hidden_states=r(2, 12, 32),
             context_latents=r(2, 32, 16))
    return m, x


@case("AnimaTextConditioner", mask="source_attention_mask")
def anima_text_conditioner(d, r):
    m = d.AnimaTextConditioner(source_dim=24, target_dim=32, model_dim=32, num_layers=2, num_attention_heads=2,
                               mlp_ratio=2.0, target_vocab_size=64, min_sequence_length=16)
    source_mask = torch.ones(2, 12, dtype=torch.long)  # Qwen3 tokenizer mask
    source_mask[1, 7:] = 0
    target_mask = torch.ones(2, 16, dtype=torch.long)  # T5 tokenizer mask, also padded
    target_mask[1, 9:] = 0
    ids = torch.arange(32).reshape(2, 16) % 64 * target_mask
    x = dict(source_hidden_states=r(2, 12, 24), target_input_ids=ids, target_attention_mask=target_mask,
             source_attention_mask=source_mask)
    return m, x


exclude("AudioLDM2ProjectionModel", "no attention modules: linear projections plus learned SOS/EOS embeddings")
exclude("CLIPImageProjection", "no attention modules: a single linear projection")
exclude("Ideogram4PromptEnhancerHead", "no attention modules: a single linear LM head for the Qwen3-VL text encoder")
exclude("Kandinsky6SRLatentUpscalerBank", "no attention modules: a bank of convolutional 3-D latent upscalers")


@case("LongCatAudioDiTTransformer", mask="encoder_attention_mask")
def longcat_audio_dit(d, r):
    m = d.LongCatAudioDiTTransformer(dit_dim=32, dit_depth=2, dit_heads=2, dit_text_dim=24, latent_dim=8,
                                     ff_mult=2.0)
    torch.nn.init.normal_(m.proj_out.weight, std=0.2)  # zero-initialised, which would make the output all zeros
    text_mask = torch.ones(2, 10, dtype=torch.bool)
    text_mask[1, 6:] = False
    x = dict(hidden_states=r(2, 16, 8), encoder_hidden_states=r(2, 10, 24), encoder_attention_mask=text_mask,
             timestep=torch.tensor([0.4, 0.4]), attention_mask=torch.ones(2, 16, dtype=torch.bool),
             latent_cond=torch.zeros(2, 16, 8))
    return m, x


exclude("MiniMaxMusic3ConditionEncoder", "no attention modules: softmax layer mixing, a 1-D convolution and "
        "nearest-neighbour resampling")


@case("MiniMaxMusic3RVQDepthDecoder")
def minimax_music3_rvq_depth_decoder(d, r):
    m = d.MiniMaxMusic3RVQDepthDecoder(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64,
                                       audio_vocab_size=16, num_codebooks=8, max_position_embeddings=16)
    # The depth sequence is at most 8 steps long (the global hidden state plus the seven residual codes); causal.
    return m, dict(inputs_embeds=r(2, 8, 32))


@case("MiniMaxMusic3Transformer1DModel")
def minimax_music3_transformer(d, r):
    m = d.MiniMaxMusic3Transformer1DModel(in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=2,
                                          attention_head_dim=16, ff_inner_dim=64, rotary_dim=8,
                                          fourier_embedding_dim=16)
    x = dict(hidden_states=r(2, 8, 24), timestep=torch.tensor([0.3, 0.3]), encoder_hidden_states=r(2, 24, 16))
    return m, x


@case("PriorTransformer", mask="attention_mask")
def prior_transformer(d, r):
    # num_embeddings is the text length; with the 4 additional tokens the sequence is 16.
    m = d.PriorTransformer(num_attention_heads=2, attention_head_dim=16, num_layers=2, embedding_dim=32,
                           num_embeddings=12, additional_embeddings=4)
    text_mask = torch.ones(2, 12, dtype=torch.bool)
    text_mask[1, 7:] = False
    x = dict(hidden_states=r(2, 32), timestep=torch.tensor(999), proj_embedding=r(2, 32),
             encoder_hidden_states=r(2, 12, 32), attention_mask=text_mask)
    return m, x


@case("RFD4ProteinaTransformer", mask="padding_mask")
def rfd4_proteina(d, r):
    # A reduced feature set: the default one needs a full prepared protein (atom37 tensors, bond graphs, ...).
    m = d.RFD4ProteinaTransformer(nlayers=2, token_dim=32, nheads=2, dim_cond=32, pair_repr_dim=16, latent_dim=8,
                                  t_emb_dim=32, tri_mult_c=16,
                                  feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
                                  feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
                                  feats_pair_repr=("xt_bb_ca_pair_dists",),
                                  feats_pair_cond=("time_emb_bb_ca", "time_emb_local_latents"))
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[1, 11:] = False  # the second design is shorter
    t = torch.tensor([0.2, 0.2])
    conditioning = dict(is_in_context_conditioning=torch.zeros(2, 16, dtype=torch.bool),
                        supports_local_latent=torch.ones(2, 16, dtype=torch.bool))
    x = dict(bb_ca=r(2, 16, 3) * padding[..., None], local_latents=r(2, 16, 8) * padding[..., None],
             bb_ca_time=t, local_latents_time=t, padding_mask=padding,
             token_type=torch.zeros(2, 16, dtype=torch.long), conditioning=conditioning)
    return m, x


exclude("ReduxImageEncoder", "no attention modules: a two-layer MLP projecting SigLIP image embeddings")


@case("StableAudio3DiTModel", mask="encoder_attention_mask")
def stable_audio3_dit(d, r):
    m = d.StableAudio3DiTModel(io_channels=8, embed_dim=64, depth=2, num_heads=2, cond_token_dim=16,
                               global_cond_dim=16, local_add_cond_dim=9, timestep_features_dim=16, ff_mult=2.0,
                               num_memory_tokens=4)
    # Context = 8 text tokens + 1 duration token, as `prepare_cross_attention` builds it; the mask (long, from the
    # tokenizer, with a 1 appended for the duration token) pads the second prompt's text.
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:8] = 0
    x = dict(hidden_states=r(2, 8, 16), timestep=torch.tensor([0.6, 0.6]), encoder_hidden_states=r(2, 9, 16),
             global_hidden_states=r(2, 16), encoder_attention_mask=mask)
    return m, x


exclude("StableAudio3DurationEmbedder", "no attention modules: fixed Fourier features and a linear projection")


@case("StableAudioDiTModel", mask="encoder_attention_mask")
def stable_audio_dit(d, r):
    m = d.StableAudioDiTModel(sample_size=16, in_channels=4, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, num_key_value_attention_heads=1, out_channels=4,
                              cross_attention_dim=32, time_proj_dim=16, global_states_input_dim=32,
                              cross_attention_input_dim=24)
    # The pipeline zeroes padded text embeddings and passes no mask; the forward's encoder_attention_mask must be
    # boolean, since StableAudioAttnProcessor2_0 hands it to SDPA without converting 0/1 values.
    text_mask = torch.ones(2, 10, dtype=torch.bool)
    text_mask[1, 6:] = False
    # RoPE over the 16 latent frames plus the prepended global token, on half of each head, as the pipeline builds it.
    rope = d.models.embeddings.get_1d_rotary_pos_embed(8, 17, use_real=True, repeat_interleave_real=False)
    x = dict(hidden_states=r(2, 4, 16), timestep=torch.tensor([0.8]), encoder_hidden_states=r(2, 10, 24),
             global_hidden_states=r(2, 1, 32), rotary_embedding=rope, encoder_attention_mask=text_mask)
    return m, x


exclude("StableAudioProjectionModel", "no attention modules: linear text projection and number conditioners")


@case("T5FilmDecoder")
def t5_film_decoder(d, r):
    m = d.T5FilmDecoder(input_dims=8, targets_length=16, d_model=32, num_layers=2, num_heads=2, d_kv=16, d_ff=64)
    # The masks travel inside `encodings_and_masks` (a list of (encoding, mask) pairs), so they cannot be named with
    # `mask=`; they are padded all the same: the note tokens' mask is `tokens > 0`, and the continuous context's mask
    # is all False on the first chunk of a song (no previous context).
    notes_mask = torch.ones(2, 12, dtype=torch.bool)
    notes_mask[1, 8:] = False
    context_mask = torch.ones(2, 16, dtype=torch.bool)
    context_mask[1] = False
    x = dict(encodings_and_masks=[(r(2, 12, 32), notes_mask), (r(2, 16, 32), context_mask)],
             decoder_input_tokens=r(2, 16, 8), decoder_noise_time=torch.tensor([0.5, 0.5]))
    return m, x


@case("TransformerTemporalModel")
def transformer_temporal(d, r):
    # As UNet3DConditionModel's transformer_in: attention runs over the 16 frames of each of the 2x2 positions.
    m = d.TransformerTemporalModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8,
                                   num_layers=1)
    return m, dict(hidden_states=r(2 * 16, 32, 2, 2), num_frames=16)


@case("UniDiffuserModel")
def unidiffuser(d, r):
    # 2 timestep tokens + 8 text tokens + 1 CLIP image token + 16 latent patches = 27 tokens.
    m = d.UniDiffuserModel(text_dim=24, clip_img_dim=24, num_text_tokens=8, num_attention_heads=2,
                           attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2, sample_size=8,
                           patch_size=2, activation_fn="gelu", num_embeds_ada_norm=1000, block_type="unidiffuser")
    # The text-to-image mode: the text is clean (timestep_text=0).
    x = dict(latent_image_embeds=r(2, 4, 8, 8), image_embeds=r(2, 1, 24), prompt_embeds=r(2, 8, 24),
             timestep_img=torch.tensor(999), timestep_text=0)
    return m, x


exclude("UniDiffuserTextDecoder", "no diffusers attention modules: wraps a transformers GPT2LMHeadModel, whose "
        "attention has no diffusers processor")
