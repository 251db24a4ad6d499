"""Mistral (Mistral 7B, Mistral NeMo, Ministral and other ``model_type: "mistral"`` checkpoints) for lensadapters.

Quirks handled (everything else is Llama's layout: GQA, rotate-half RoPE, RMSNorm, SwiGLU):

* Sliding-window attention (``config.sliding_window``, every layer): ``hook_attn_scores``/``hook_pattern``
  show exactly the window mask the model applies (a query at ``i`` sees keys ``i - window < j <= i``), also
  when the window is shorter than the input, during generation and with left padding. ``cfg.window_size``
  and ``cfg.attn_types`` (TransformerLens' names) say which layers are windowed.
* ``head_dim`` may differ from ``hidden_size / num_attention_heads`` (Mistral NeMo).

Refused (``hf.DecoderFamily.validate``): rope types that are not rotate-half, custom modeling code, another layout.
"""

from __future__ import annotations

from typing import Any, Optional

from lensadapters import hf

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily.named("Mistral", "mistral")
ARCH = FAMILY.architecture(
    "Mistral (MistralForCausalLM, MistralModel; the language model of Mistral 3): sliding-window attention, GQA, "
    "RoPE, RMSNorm, SwiGLU",
    vision_language=True,
)


def window(config: Any) -> Optional[int]:
    """The sliding window of every layer, or ``None``."""
    return getattr(config, "sliding_window", None) or None


def tiny_config(seed: int) -> Any:
    """A Mistral-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), a 4-token sliding window. Other seeds vary depth, heads and the window (or none)."""
    from transformers import MistralConfig

    layers, (heads, kv), sliding = hf.toy_draw(
        seed, (2, (4, 2), 4), [1, 2, 3], [(4, 2), (4, 4), (4, 1), (8, 2)], [None, 3, 8]
    )
    return hf.toy_config(MistralConfig, layers, heads, kv, sliding_window=sliding, rope_theta=10000.0)


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    w = window(c)
    return {"window_size": w, "attn_types": ("local",) * c.num_hidden_layers if w else None}


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields).export(globals())
