"""Gemma 2 (``model_type: "gemma2"``: Gemma-2 2B, 9B, 27B) for lensadapters.

Quirks handled, with TransformerLens 2.x's hook names and semantics:

* Sandwich norms: ``input_layernorm`` → attention → ``post_attention_layernorm`` → residual add, and
  ``pre_feedforward_layernorm`` → MLP → ``post_feedforward_layernorm`` → residual add. The post norms are
  ``blocks.L.ln1_post.hook_scale``/``hook_normalized`` and ``ln2_post.*``; ``hook_attn_out``/``hook_mlp_out`` are
  what is added to the residual (after the post norm), ``attn.hook_result`` the per-head outputs before it;
  ``ln2`` is ``pre_feedforward_layernorm``.
* ``(1 + weight)`` RMSNorm (``NormSpec.weight_offset = 1``), computed in float32 as Gemma does.
* Embeddings scaled by ``sqrt(d_model)``: ``hook_embed`` and ``W_E`` include the factor (TransformerLens:
  ``hook_embed == W_E[tokens] == resid_pre[0]``), whether the model applies it in its embedding module
  (transformers 5.x) or after it (4.x); an edit of ``hook_embed`` is an edit of the scaled embeddings.
* Attention scale ``query_pre_attn_scalar ** -0.5``; attention-logit softcapping (``attn_logit_softcapping``):
  ``hook_attn_scores`` is after the softcap, then masked with ``-inf`` (TransformerLens), so an edit there is
  an edit of the capped scores the softmax reads. Final-logit softcapping (``final_logit_softcapping``) has no
  hook point (as in TransformerLens): ``logits = cap * tanh(ln_final_out @ W_U / cap)`` with
  ``cap = cfg.output_logits_soft_cap``.
* Alternating sliding-window and global layers from ``config.layer_types`` (layer 0 is a sliding layer in HF's
  Gemma 2; TransformerLens' hard-coded configs put the global layer first, the HF config is the truth).
* GeGLU MLP (``gelu_pytorch_tanh``): ``mlp.hook_pre`` is the gate, ``mlp.hook_pre_linear`` the up projection.

Attention implementations: eager (transformers 5.x offers Gemma 2 no sdpa, because sdpa cannot softcap). Under
transformers 4.x's sdpa, which ignores the softcap, every hook point works and ``hook_attn_scores``/
``hook_pattern`` refuse, naming ``model.set_attn_implementation("eager")``.
Refused at wrap time: rope types other than rotate-half ones, bidirectional attention
(``use_bidirectional_attention``), custom modeling code registered as ``gemma2``, a model without Gemma 2's layout.
"""

from __future__ import annotations

from typing import Any, Optional

from lensadapters import UnsupportedModelError, hf

__version__ = "0.1.0"
# Gemma's norms: x / rms * (1 + weight)
FAMILY = hf.DecoderFamily.named(
    "Gemma2", "gemma2", norm_weight_offset=1.0, block=hf.SANDWICH_BLOCK, scaled_embeddings=True
)
ARCH = FAMILY.architecture(
    "Gemma 2 (Gemma2ForCausalLM, Gemma2Model): sandwich norms, (1 + w) RMSNorm, scaled embeddings, logit softcaps, "
    "alternating sliding windows"
)


def _cap(value: Optional[float]) -> float:
    return float(value) if value else -1.0


def check(model: Any) -> None:
    if getattr(model.config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "this Gemma 2 config sets use_bidirectional_attention=True (an encoder, not a causal language model); the "
            "gemma2 plugin describes causal Gemma 2 models, whose attention masks it reproduces"
        )


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    return dict(
        act_fn=c.hidden_activation,
        attn_scores_soft_cap=_cap(c.attn_logit_softcapping),
        output_logits_soft_cap=_cap(c.final_logit_softcapping),
        **hf.window_fields(hf.layer_windows(c)),
        extra={
            "query_pre_attn_scalar": c.query_pre_attn_scalar,
            "attn_scale": float(c.query_pre_attn_scalar) ** 0.5,
            "use_normalization_before_and_after": True,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", True)),
        },
    )


def tiny_config(seed: int) -> Any:
    """A Gemma-2-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers (sliding, then global,
    as HF's Gemma 2), GQA (4 query heads, 2 kv heads), a 4-token window, softcaps 50 and 30. Other seeds vary
    depth, heads and the window."""
    from transformers import Gemma2Config

    tokens = {"bos_token_id": 2, "eos_token_id": 1}
    scores = {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_implementation": "eager"}
    return hf.sliding_toy(Gemma2Config, seed, (2, (4, 2)), rope_theta=10000.0, **scores, **tokens)


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields, check=check).export(globals())
