"""Phi-3, Phi-3.5 and Phi-4-mini (``model_type: "phi3"``) for lensadapters.

Quirks handled:

* One fused ``qkv_proj`` with grouped heads: its output is ``[q (n_heads * d) | k (n_kv * d) | v (n_kv * d)]``
  (unequal widths under GQA); ``hook_q``/``hook_k``/``hook_v``, ``W_Q``/``_W_K``/``_W_V`` and a LoRA adapter's
  ``hook_q_lora``/``hook_k_lora``/``hook_v_lora`` are split with that layout (``FusedQKV``).
* One fused ``gate_up_proj``: its output is ``[gate | up]``; ``mlp.hook_pre`` is the gate before the activation
  (``W_gate``), ``mlp.hook_pre_linear`` the up projection (``W_in``), ``mlp.hook_post`` ``up * act(gate)``
  (``FusedGateUp``). A LoRA on ``gate_up_proj`` gets one delta point per half (``mlp.hook_pre_lora``,
  ``mlp.hook_pre_linear_lora``); ``lora_factors(hm, layer, "gate")``/``"in"`` split B the same way.
* Partial rotary (``partial_rotary_factor``, Phi-4-mini: 0.75): only the first ``cfg.rotary_dim`` dimensions of
  each head rotate; ``hook_rot_q``/``hook_rot_k`` pass the rest through.
* LongRoPE (Phi-3/3.5 128k, Phi-4-mini): the short or long factors and the attention factor are in the
  ``(cos, sin)`` the model computes, so ``hook_rot_q/k`` are exact and inverting an edit divides the factor out.
* Sliding window (``config.sliding_window``, every layer): ``hook_attn_scores``/``hook_pattern`` show the
  model's window mask.
* Dropout after the attention and MLP outputs (``resid_attn_dropout``/``resid_mlp_dropout``, identity in eval):
  ``hook_attn_out``/``hook_mlp_out`` are before it, as the outputs of the attention and MLP modules.

Refused at wrap time with an explanation: rope types other than ``default`` and ``longrope``, custom modeling code
registered as ``phi3`` (the Phi-3 checkpoints' own ``modeling_phi3.py`` with ``trust_remote_code=True``: load
with transformers' implementation instead), a model without Phi-3's layout.
Flash and flex attention: every hook point but ``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lensadapters import FusedGateUp, UnsupportedModelError, hf
from lensadapters.specs import cat_gate_up, chunk_gate_up

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily.named(
    "Phi3",
    "phi3",
    block=replace(hf.DECODER_BLOCK, mlp_residual="resid_mlp_dropout"),
    fused_qkv="self_attn.qkv_proj",
    mlp=FusedGateUp(module="mlp.gate_up_proj", out="mlp.down_proj", split=chunk_gate_up, merge=cat_gate_up),
    # the first rotary_dim dims of each head rotate (the rest pass through); cos/sin come from model.rotary_emb
    partial_rotary=True,
    rope_types=("default", "longrope"),
)
ARCH = FAMILY.architecture(
    "Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM, Phi3Model): fused qkv_proj and gate_up_proj, partial rotary, "
    "LongRoPE, sliding window"
)


def check(model: Any) -> None:
    gate_up = getattr(FAMILY.layers(model)[0].get_submodule("mlp.gate_up_proj"), "out_features", None)
    if isinstance(gate_up, int) and gate_up != 2 * model.config.intermediate_size:
        raise UnsupportedModelError(f"gate_up_proj has {gate_up} output features, not 2 * intermediate_size")


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    window = getattr(c, "sliding_window", None) or None
    return dict(
        window_size=window,
        attn_types=("local",) * c.num_hidden_layers if window else None,
        extra={
            "partial_rotary_factor": hf.partial_rotary_factor(c),
            "original_max_position_embeddings": getattr(c, "original_max_position_embeddings", None),
        },
    )


def tiny_config(seed: int) -> Any:
    """A Phi-4-mini-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), partial rotary 0.75, tied embeddings. Other seeds vary depth, heads, the rotary fraction, a sliding
    window and the embedding tie."""
    from transformers import Phi3Config

    layers, (heads, kv), partial, sliding, tied = hf.toy_draw(
        seed, (2, (4, 2), 0.75, None, True), [1, 2, 3], [(4, 2), (4, 4), (4, 1)], [0.5, 0.75, 1.0], [None, 4], 0.5
    )
    return hf.toy_config(
        Phi3Config,
        layers,
        heads,
        kv,
        original_max_position_embeddings=128,
        partial_rotary_factor=partial,
        sliding_window=sliding,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
    )


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields, check=check).export(globals())
