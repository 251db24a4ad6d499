"""Qwen2 and Qwen2.5 (``model_type: "qwen2"``: Qwen1.5, Qwen2, Qwen2.5, Qwen2.5-Coder/Math...) for lensadapters.

Quirks handled (otherwise Llama's layout: GQA, rotate-half RoPE, RMSNorm, SwiGLU):

* Biases on the query, key and value projections only (``b_Q``/``b_K``/``b_V``; ``b_O`` and the MLP biases are
  zero): ``hook_q`` includes the bias, as TransformerLens has it.
* Per-layer sliding windows (``use_sliding_window``: layers from ``max_window_layers`` on use
  ``sliding_window``; ``config.layer_types`` says which): ``hook_attn_scores``/``hook_pattern`` show each layer's
  own mask. ``cfg.window_size``/``cfg.attn_types`` (TransformerLens' names) describe them.
* Tied (small Qwen2.5 checkpoints) or untied embeddings.

Refused (``hf.DecoderFamily.validate``): rope types that are not rotate-half, custom modeling code, another layout.
"""

from __future__ import annotations

from typing import Any

from lensadapters import hf

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily.named(
    "Qwen2",
    "qwen2",
    packages=("qwen2", "qwen2_vl", "qwen2_5_vl"),
    norms=("Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm"),
    multimodal_rotary=True,  # the language models of Qwen2-VL and Qwen2.5-VL
)
ARCH = FAMILY.architecture(
    "Qwen2 / Qwen2.5 (Qwen2ForCausalLM, Qwen2Model): q/k/v biases, per-layer sliding windows, GQA, RoPE; the "
    "language model of Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration (multimodal RoPE)",
    model_types=("qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_vl", "qwen2_5_vl"),
    vision_language=True,
)


def tiny_config(seed: int) -> Any:
    """A Qwen2.5-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), tied embeddings, a 4-token sliding window from layer 1 on. Other seeds vary depth, heads, the
    windowed layers and the embedding tie."""
    from transformers import Qwen2Config

    layers, (heads, kv), window_from, tied = hf.toy_draw(
        seed, (2, (4, 2), 1, True), [1, 2, 3], [(4, 2), (4, 4), (4, 1), (8, 2)], [0, 1, 9], 0.5
    )
    windows = hf.window_from_fields(4, window_from, layers)
    return hf.toy_config(Qwen2Config, layers, heads, kv, **windows, tie_word_embeddings=tied, rope_theta=10000.0)


def config_fields(model: Any) -> dict[str, Any]:
    return hf.window_fields(hf.layer_windows(hf.text_config(model)))


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())
