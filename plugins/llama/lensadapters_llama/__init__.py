"""Llama (Llama 2, Llama 3.x, Code Llama, ...) for lensadapters.

Quirks handled:

* Grouped-query attention: ``hook_q`` has ``num_attention_heads`` heads, ``hook_k``/``hook_v`` (and
  ``hook_rot_k``) keep ``num_key_value_heads`` heads, not repeated. Patterns and scores have one
  row per query head (query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``).
  ``W_K``/``W_V`` are repeated to the query heads; ``_W_K``/``_W_V`` keep the key/value heads.
* ``head_dim`` may differ from ``hidden_size / num_attention_heads`` (read from the model's config).
* Rotary embeddings (rotate-half RoPE on the whole head) with the ``(cos, sin)`` that
  ``model.rotary_emb`` returned in this forward pass, so every rope type of transformers' Llama
  (default, linear, dynamic, llama3, yarn, longrope) is exact, including the ``attention_scaling``
  that YaRN / LongRoPE fold into ``cos``/``sin``. ``hook_rot_q``/``hook_rot_k`` edits are
  inverted back into the projection output, so the KV cache stores the edited keys.
* RMSNorm (``input_layernorm``, ``post_attention_layernorm``, ``norm``): ``hook_scale`` is
  ``sqrt(mean(x^2) + eps)`` and editable, ``hook_normalized`` is ``x / scale`` before the weight
  (TransformerLens semantics); the attention input is ``hook_normalized * ln1.weight``.
* SwiGLU MLP ``down_proj(act(gate_proj x) * up_proj x)``: ``mlp.hook_pre`` is the gate before the
  activation, ``mlp.hook_pre_linear`` the up projection, ``mlp.hook_post`` the input of
  ``down_proj``; ``W_gate`` is ``gate_proj``, ``W_in`` is ``up_proj``, ``W_out`` is ``down_proj``.
* Optional biases (``attention_bias`` on q/k/v/o, ``mlp_bias``) and tied or untied embeddings.

Refused at wrap time with an explanation: rope types outside the list above (their rotation is not
known to be rotate-half), attention implementations other than ``eager`` and ``sdpa`` (flash and
flex attention are untested; switch with ``model.set_attn_implementation("sdpa")``), and models
whose modules do not have Llama's layout (custom code registered as ``llama``).
"""

from __future__ import annotations

from typing import Any

from lensadapters import hf

__version__ = "0.1.0"
# Llama rotates the whole head; cos/sin come from model.rotary_emb (attention_scaling folded in). Its RMSNorms are
# left to the core's checked fallback.
FAMILY = hf.DecoderFamily("Llama", model_type="llama", attention=("eager", "sdpa"))
ARCH = FAMILY.architecture(
    "Llama 2 / 3.x (LlamaForCausalLM, LlamaModel; the language model of LLaVA, LLaVA-NeXT): GQA, RoPE scaling, "
    "RMSNorm, SwiGLU",
    vision_language=True,
)


def tiny_config(seed: int) -> Any:
    """A Llama-3-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), llama3 rope scaling, tied embeddings. Other seeds vary the depth (1-3), the heads (MHA, GQA,
    MQA), llama3 scaling or plain RoPE (Llama 2) and tied or untied embeddings, deterministically."""
    from transformers import LlamaConfig

    layers, (heads, kv_heads), llama3, tied = hf.toy_draw(
        seed, (2, (4, 2), True, True), [1, 2, 3], [(4, 2), (4, 4), (4, 1), (8, 2)], 0.5, 0.5
    )
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return hf.toy_config(
        LlamaConfig,
        layers,
        heads,
        kv_heads,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_theta=500000.0 if llama3 else 10000.0,
        rope_scaling=scaling if llama3 else None,
    )


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    return {
        "extra": {
            "attention_bias": bool(getattr(c, "attention_bias", False)),
            "mlp_bias": bool(getattr(c, "mlp_bias", False)),
        }
    }


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())
