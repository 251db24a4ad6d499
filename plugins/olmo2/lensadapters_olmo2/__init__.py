"""OLMo 2 (``model_type: "olmo2"``: OLMo-2 1B, 7B, 13B, 32B) for lensadapters.

TransformerLens has no OLMo 2; the hook names follow its names for the same pieces elsewhere:

* No pre-norms: the block is ``x + post_attention_layernorm(attn(x))`` then ``h + post_feedforward_layernorm(mlp(h))``.
  So there are no ``ln1``/``ln2`` points; the norms after attention and MLP are ``blocks.L.ln1_post.hook_scale``/
  ``hook_normalized`` and ``ln2_post.*`` (Gemma 2's names in TransformerLens). ``hook_attn_out``/``hook_mlp_out``
  are what is added to the residual (the post norm's output); ``attn.hook_result`` the per-head outputs before
  it; attention reads ``hook_resid_pre`` and the MLP reads ``hook_mlp_in`` (= ``hook_resid_mid``) directly.
* RMSNorm on queries and keys over the whole projection width (``q_norm`` over ``n_heads * d_head``, ``k_norm``
  over ``n_kv_heads * d_head``), between projection and RoPE: ``attn.q_norm.hook_scale`` is ``[b, p, 1]`` and
  ``attn.q_norm.hook_normalized`` ``[b, p, n_heads * d_head]`` (one scale per position, as the model computes;
  Qwen3's and Gemma 3's per-head norms are ``[b, p, h, 1]``). ``hook_q``/``hook_k`` are the projection output,
  ``hook_rot_q``/``hook_rot_k`` the normed and rotated values attention uses.
* RoPE computed in float32 and cast back to the queries' dtype, as OLMo 2 does.

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half, custom modeling code
registered as ``olmo2``, a model without OLMo 2's layout. Flash and flex attention: every hook point but
``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import Any

import torch

from lensadapters import BlockLayout, RotarySpec, hf
from lensadapters.rotary import apply_rotate_half, invert_rotate_half

__version__ = "0.1.0"
Tensor = torch.Tensor


def rotary_spec(rotary_dim: int) -> RotarySpec:
    """Rotate-half RoPE with OLMo 2's float32 ``(cos, sin)``, cast back to the input's dtype as the model does."""

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotate_half(x, cos, sin, rotary_dim).to(x.dtype)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, cos, sin, rotary_dim)

    return RotarySpec(rotary_dim, apply, invert)


# q_proj -> q_norm (whole width) -> k_proj -> k_norm -> v_proj, then RoPE on the normed queries and keys
FAMILY = hf.DecoderFamily.named(
    "Olmo2",
    "olmo2",
    block=BlockLayout(
        ln1=None,
        attn="self_attn",
        o_proj="self_attn.o_proj",
        ln2=None,
        mlp="mlp",
        ln1_post="post_attention_layernorm",
        ln2_post="post_feedforward_layernorm",
    ),
    qk_norms=hf.qk_norms("bpf"),
    rotary=rotary_spec,
)
ARCH = FAMILY.architecture(
    "OLMo 2 (Olmo2ForCausalLM, Olmo2Model): norms after attention and MLP only, q/k norms over the projection width"
)


def tiny_config(seed: int) -> Any:
    """An OLMo-2-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, 4 heads (OLMo 2 1B-13B
    use full multi-head attention). Other seeds vary depth and heads (GQA as OLMo-2 32B)."""
    from transformers import Olmo2Config

    layers, (heads, kv) = hf.toy_draw(seed, (2, (4, 4)), [1, 2, 3], [(4, 2), (4, 4), (8, 2)])
    return hf.toy_config(Olmo2Config, layers, heads, kv, rope_theta=500000.0)


def config_fields(model: Any) -> dict[str, Any]:
    extra = {"use_qk_norm": True, "qk_norm_over_heads": True, "pre_norms": False}
    return {"extra": {**extra, "attention_bias": bool(getattr(model.config, "attention_bias", False))}}


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())
