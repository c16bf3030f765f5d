"""Tiny random-weight diffusers denoisers, one per attention family, with matching inputs."""

from __future__ import annotations

import torch


def build(family: str):
    """(model, forward kwargs) for ``family`` in FAMILIES; fp32, eval mode, seeded weights."""
    import diffusers as d

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if family == "unet":
        m = d.UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8,
        )
        x = dict(sample=r(2, 4, 16, 16), timestep=torch.tensor(10), encoder_hidden_states=r(2, 7, 32))
    elif family == "dit":
        m = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=2,
                                    sample_size=16, patch_size=2, num_embeds_ada_norm=10)
        x = dict(hidden_states=r(2, 4, 16, 16), timestep=torch.tensor([10, 10]), class_labels=torch.tensor([1, 3]))
    elif family == "pixart":
        m = d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                       num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=32, caption_channels=32)
        x = dict(hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([10]), encoder_hidden_states=r(1, 7, 32),
                 added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    elif family == "sd3":
        m = d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                    pooled_projection_dim=16, out_channels=4)
        x = dict(hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([10]), encoder_hidden_states=r(1, 7, 32),
                 pooled_projections=r(1, 16))
    elif family == "flux":
        m = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                     num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
        x = dict(hidden_states=r(1, 16, 16), timestep=torch.tensor([0.5]), encoder_hidden_states=r(1, 7, 32),
                 pooled_projections=r(1, 16), img_ids=r(16, 3), txt_ids=r(7, 3))
    elif family == "cogvideox":
        m = d.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                          time_embed_dim=8, text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8,
                                          sample_frames=5, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8)
        x = dict(hidden_states=r(1, 2, 4, 8, 8), timestep=torch.tensor([10]), encoder_hidden_states=r(1, 8, 32))
    elif family == "wan":
        m = d.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                    out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True,
                                    qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        x = dict(hidden_states=r(1, 4, 2, 8, 8), timestep=torch.tensor([10]), encoder_hidden_states=r(1, 7, 32))
    else:
        raise ValueError(family)
    return m.eval(), x


FAMILIES = ["unet", "dit", "pixart", "sd3", "flux", "cogvideox", "wan"]


def identity_attention(H: int, D: int):
    """A diffusers cross-attention module whose projections are identities: ``run_identity`` gives it (B, H, S, D)
    Q, K and V and gets attention(Q, K, V) back, as a model's attention module runs it (fp32)."""
    from diffusers.models.attention_processor import Attention

    attn = Attention(query_dim=H * D, cross_attention_dim=2 * H * D, heads=H, dim_head=D, bias=False, out_bias=False)
    eye = torch.eye(H * D)
    with torch.no_grad():
        attn.to_q.weight.copy_(eye)
        attn.to_k.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], 1))
        attn.to_v.weight.copy_(torch.cat([torch.zeros_like(eye), eye], 1))
        attn.to_out[0].weight.copy_(eye)
    return attn.eval()


def run_identity(attn, q, k, v):
    tokens = lambda t: t.float().transpose(1, 2).flatten(2)  # noqa: E731  (B, H, S, D) -> (B, S, H·D)
    with torch.no_grad():
        out = attn(tokens(q), encoder_hidden_states=torch.cat([tokens(k), tokens(v)], -1))
    return out.unflatten(2, (q.shape[1], q.shape[3])).transpose(1, 2)
